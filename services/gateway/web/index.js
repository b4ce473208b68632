// The sessions page: the project's sessions, newest first, and a new one.
import { api, el, header, timeEl, token } from "/common.js";
await header();
// One request: each listed session carries its title (its first message) and the time
// of its latest event.
function row(s) {
  const text = s.title ? (s.title.length > 80 ? `${s.title.slice(0, 79)}…` : s.title) : `Session ${s.session_id.slice(0, 8)}`;
  const status = s.status === "open" ? "open" : s.reason ? `${s.status}: ${s.reason}` : s.status;
  return el("li", { "data-id": s.session_id },
    el("a", { class: "title", href: `/session.html?id=${s.session_id}` }, text),
    el("span", { class: "status" }, status),
    el("span", { class: "meta" }, "last activity ", timeEl(s.last_event_at, true)),
    el("span", { class: "meta" }, "opened ", timeEl(s.opened_at, true)));
}
async function load() {
  const { sessions } = await api("/sessions");
  const list = document.getElementById("sessions");
  list.replaceChildren(...sessions.map(row));
  if (!sessions.length) list.append(el("li", {}, "No sessions yet: start one."));
}
document.getElementById("new-session").addEventListener("click", async () => {
  try {
    const { session_id } = await api("/sessions", { method: "POST" });
    location.href = `/session.html?id=${session_id}`;
  } catch (err) { document.getElementById("problem").textContent = err.message; }
});
if (token) await load();
document.getElementById("sessions").dataset.loaded = "true";
