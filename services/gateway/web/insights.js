// Insights: the psychologist's hypotheses by target agent, filtered, accepted or dismissed.
import { api, el, header, timeEl, token } from "/common.js";
await header();
const TIERS = { leve: "light", pesada: "heavy" };
const $ = (id) => document.getElementById(id);
let groups = [];
const tierOf = new Map(); // analysis id -> tier, from each session's `psychologist.analysis_completed`
const titleOf = new Map(); // session id -> its first message

// The hypotheses list carries no tier: each analysed session's log says which analysis ran at which tier.
async function readSessions(ids) {
  await Promise.all([...ids].filter((id) => !titleOf.has(id)).map(async (id) => {
    const { events } = await api(`/sessions/${id}/events?limit=500`).catch(() => ({ events: [] }));
    const said = events.find((e) => e.type === "chat.message");
    titleOf.set(id, said ? said.payload.text.slice(0, 50) : id.slice(0, 8));
    for (const e of events) if (e.type === "psychologist.analysis_completed") tierOf.set(e.payload.analysis_id, e.payload.tier);
  }));
}

function sessionOptions() {
  const select = $("f-session");
  const chosen = select.value;
  const ids = new Set(groups.flatMap((g) => g.hypotheses.map((h) => h.session_id)));
  select.replaceChildren(el("option", { value: "" }, "all"),
    ...[...ids].map((id) => el("option", { value: id }, titleOf.get(id) || id.slice(0, 8))));
  select.value = ids.has(chosen) ? chosen : "";
}

function card(h) {
  const tier = tierOf.get(h.analysis_id);
  return el("article", { class: "card hypothesis", "data-id": h.id, "data-status": h.status, "data-tier": tier || "" },
    el("p", {}, h.statement),
    el("p", {}, `confidence ${h.confidence}% · ${h.status.replaceAll("_", " ")}${tier ? ` · ${TIERS[tier]} analysis` : ""} · `, timeEl(h.created_at, true)),
    h.termination_analysis ? el("p", { class: "termination" }, `termination: ${h.termination_analysis}`) : "",
    el("div", {}, "evidence: ", ...h.evidence_event_ids.map((id) => el("a", {
      class: "chip evidence", href: `/session.html?id=${h.session_id}&highlightEvent=${id}`,
      "aria-label": `evidence event ${id.slice(0, 8)} in its session` }, id.slice(0, 8)))),
    h.status === "proposed" ? el("button", { onclick: () => decide(h.id, "accept") }, "Accept") : "",
    h.status === "proposed" ? " " : "",
    h.status === "proposed" ? el("button", { onclick: () => decide(h.id, "dismiss") }, "Dismiss") : "",
  );
}

function render() {
  const status = $("f-status").value, tier = $("f-tier").value, session = $("f-session").value;
  const keep = (h) => (!status || h.status === status) && (!tier || tierOf.get(h.analysis_id) === tier)
    && (!session || h.session_id === session);
  const shown = groups.map((g) => ({ ...g, hypotheses: g.hypotheses.filter(keep) })).filter((g) => g.hypotheses.length);
  $("groups").replaceChildren(...shown.map((g) => el("section", { class: "agent-group", "aria-labelledby": `agent-${g.target_agent}` },
    el("h2", { id: `agent-${g.target_agent}` }, g.target_agent), ...g.hypotheses.map(card))));
  const n = shown.reduce((sum, g) => sum + g.hypotheses.length, 0);
  $("count").textContent = groups.length ? `${n} hypothes${n === 1 ? "is" : "es"} shown` : "";
  if (!groups.length) $("groups").append(el("p", {}, "No hypotheses yet: they appear once a session ends."));
  else if (!n) $("groups").append(el("p", {}, "No hypothesis matches these filters."));
}

async function load() {
  ({ groups } = await api("/insights"));
  await readSessions(new Set(groups.flatMap((g) => g.hypotheses.map((h) => h.session_id))));
  sessionOptions();
  render();
}
async function decide(id, decision) {
  try { await api(`/hypotheses/${id}/${decision}`, { method: "POST" }); await load(); }
  catch (err) { $("problem").textContent = err.message; }
}
for (const id of ["f-status", "f-tier", "f-session"]) $(id).addEventListener("change", render);
if (token) await load();
$("groups").dataset.loaded = "true";
