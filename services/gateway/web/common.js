// Shared by every page: the token, the API, the header, markdown, times. No build step.
import { marked } from "/vendor/marked.esm.js";
import DOMPurify from "/vendor/purify.es.mjs";

export const params = new URLSearchParams(location.search);
// The token arrives once in the link `make up` prints, after the `#` (a fragment is never
// sent to a server, so no access log sees it; a `?token=` link is taken too); it moves
// into session storage and out of the address bar (and so out of the history, bookmarks
// and screenshots).
const fragment = new URLSearchParams(location.hash.slice(1));
const given = fragment.get("token") || params.get("token");
if (given) {
  sessionStorage.setItem("agentbus.token", given);
  params.delete("token");
  fragment.delete("token");
  const rest = params.toString();
  const hash = fragment.toString();
  history.replaceState(history.state, "", `${location.pathname}${rest ? `?${rest}` : ""}${hash ? `#${hash}` : ""}`);
}
export const token = sessionStorage.getItem("agentbus.token") || "";

function claims() {
  try { return JSON.parse(atob(token.split(".")[1].replace(/-/g, "+").replace(/_/g, "/"))); }
  catch { return {}; }
}
export const project = claims().prj || "";
// Whether the token's `exp` has passed (the link must be opened anew: there is no refresh).
export function tokenExpired() {
  const exp = claims().exp;
  return typeof exp === "number" && exp * 1000 <= Date.now();
}

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

// Markdown written by a model or a person, as inert DOM: marked renders it, DOMPurify keeps
// only the elements markdown makes that load nothing and cover nothing. None of: a style,
// id or class attribute (a box drawn over the page, a fetch from a CSS url()), images or
// other media, srcset, frames, objects, forms, dialogs, details (text hidden from the
// reader), SVG or MathML. A link keeps an http(s) or mailto address only. The page's
// Content-Security-Policy would block what slipped through; this keeps it from trying.
// Never innerHTML of anything.
const PURIFY = {
  ALLOWED_TAGS: [
    "p", "br", "hr", "strong", "b", "em", "i", "del", "s", "code", "pre", "kbd", "sub", "sup",
    "blockquote", "ul", "ol", "li", "h1", "h2", "h3", "h4", "h5", "h6", "a",
    "table", "thead", "tbody", "tr", "th", "td",
  ],
  // `start`: where an ordered list begins; `align`: a table column's (both inert values)
  ALLOWED_ATTR: ["href", "title", "start", "align"],
  ADD_URI_SAFE_ATTR: ["start", "align"],
  ALLOWED_URI_REGEXP: /^(?:https?|mailto):/i,
  ALLOW_DATA_ATTR: false,
  ALLOW_ARIA_ATTR: false,
  RETURN_DOM_FRAGMENT: true,
};
marked.use({ gfm: true, breaks: true });
const LINKABLE = new Set(["http:", "https:", "mailto:"]);
const SCHEME = /^[a-z][a-z0-9+.-]*:/i;
// Text a reader takes for an address: "example.com", "www.example.com/x", "https://…".
const ADDRESS_LIKE = /^(?:[a-z][a-z0-9+.-]*:\/\/)?(?:[\w-]+\.)+[a-z][\w-]+(?::\d+)?(?:[/?#]\S*)?$/i;

function named(text) {
  try { return new URL(SCHEME.test(text) ? text : `http://${text}`); } catch { return null; }
}

// A link says where it goes: its whole address as its title, its host (or mail address)
// beside its text; a text that reads as another address is replaced by the real one,
// so "[https://your-bank.example](https://elsewhere.example)" shows elsewhere.example.
function showWhereItGoes(a) {
  const url = named(a.getAttribute("href") || "");
  if (!url || !LINKABLE.has(url.protocol)) { a.removeAttribute("href"); a.removeAttribute("title"); return; }
  a.setAttribute("target", "_blank");
  a.setAttribute("rel", "noopener noreferrer");
  a.title = url.href;
  const text = a.textContent.trim();
  if (url.protocol === "mailto:") {
    let address = url.pathname;
    try { address = decodeURIComponent(address); } catch { /* shown as written */ }
    if (!text || (text.includes("@") && text !== address)) a.textContent = address;
    else if (text !== address) a.after(el("span", { class: "link-host" }, ` (${address})`));
    return;
  }
  const said = ADDRESS_LIKE.test(text) ? named(text) : null;
  if (!text || (said && said.host !== url.host)) a.textContent = url.href;
  else if (!said) a.after(el("span", { class: "link-host" }, ` (${url.host})`));
}

// `inline`: a line such as a title, its markdown without the paragraph around it.
export function markdown(text, { inline = false } = {}) {
  const html = inline ? marked.parseInline(text || "") : marked.parse(text || "");
  const fragment = DOMPurify.sanitize(html, PURIFY);
  for (const a of fragment.querySelectorAll("a")) showWhereItGoes(a);
  // marked puts a newline between blocks: not part of what was said
  for (const node of [...fragment.childNodes]) {
    if (node.nodeType === Node.TEXT_NODE && !node.textContent.trim()) node.remove();
  }
  return fragment;
}

const TIME = new Intl.DateTimeFormat(undefined, { hour: "2-digit", minute: "2-digit" });
const DATE_TIME = new Intl.DateTimeFormat(undefined, { dateStyle: "medium", timeStyle: "short" });
export function shortTime(iso) { return TIME.format(new Date(iso)); }
export function longTime(iso) { return DATE_TIME.format(new Date(iso)); }
export function timeEl(iso, long = false) {
  return el("time", { datetime: iso, title: longTime(iso) }, long ? longTime(iso) : shortTime(iso));
}

export async function header() {
  const bar = document.querySelector("header");
  const here = location.pathname === "/index.html" ? "/" : location.pathname;
  const link = (href, label) => el("a", href === here ? { href, "aria-current": "page" } : { href }, label);
  bar.prepend(el("a", { class: "skip", href: "#main" }, "Skip to content"));
  bar.append(
    el("nav", { "aria-label": "Main" }, link("/", "Sessions"), link("/insights.html", "Insights"), link("/usage.html", "Usage")),
    el("span", { class: "project" }, `project ${project}`),
  );
  if (!token) { bar.append(el("p", { class: "error", role: "alert" }, "No token: open the link `make up` printed.")); return; }
  if (tokenExpired()) { bar.append(el("p", { class: "error", role: "alert" }, "This link has expired: open a new one (`make up` prints it).")); return; }
  const me = await api("");
  if (me.offline_model) {
    bar.append(el("p", { class: "offline", id: "offline" },
      "Offline model: replies come from the scripted provider (no ANTHROPIC_API_KEY)."));
  }
}
