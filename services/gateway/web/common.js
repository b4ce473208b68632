// Shared by every page: the token, the API, the offline notice. No build step.
export const params = new URLSearchParams(location.search);
if (params.get("token")) sessionStorage.setItem("agentbus.token", params.get("token"));
export const token = sessionStorage.getItem("agentbus.token") || "";

function claims() {
  try { return JSON.parse(atob(token.split(".")[1].replace(/-/g, "+").replace(/_/g, "/"))); }
  catch { return {}; }
}
export const project = claims().prj || "";

export async function api(path, options = {}) {
  const r = await fetch(`/api/projects/${project}${path}`, {
    ...options,
    headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
  });
  const body = await r.json();
  if (!r.ok) throw new Error(`${body.error.code}: ${body.error.message}`);
  return body;
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

export async function header() {
  const nav = document.querySelector("header");
  nav.append(
    el("a", { href: "/" }, "Sessions"), " · ",
    el("a", { href: "/insights.html" }, "Insights"), " · ",
    el("a", { href: "/usage.html" }, "Usage"),
    el("span", { class: "project" }, ` project ${project}`),
  );
  if (!token) { nav.append(el("p", { class: "error" }, "No token: open the link `make up` printed.")); return; }
  const me = await api("");
  if (me.offline_model) {
    nav.append(el("p", { class: "offline", id: "offline" },
      "Offline model: replies come from the scripted provider (no ANTHROPIC_API_KEY)."));
  }
}
