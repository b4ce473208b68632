// Event types are the wire contract's (contracts/contracts/events.py, contracts/asyncapi.json).
// The session page: chat streaming token by token, rule cards (each removed or edited by
// the person; only standing rules shown), readiness, the brief
// being written then its card, the handoff divider, agent errors, Stop, and the event
// log (?highlightEvent=<id>). Under real use: a reconnect replays the deltas
// of the turn in flight, so deltas are kept by (turn_id, seq) and each shown once; a
// message typed while disconnected waits, shown as pending, and is sent on reconnect
// with its `client_msg_id` (the gateway appends it once however often it is sent).
// Answers, rules and the brief are markdown rendered safely (common.js `markdown`); the chat
// follows new text only while the reader is at its end, and says who is writing. Each brief
// says its version and whether a later one replaced it, and leaves the page as markdown
// (copied, or downloaded as a file). "Edit" on a message and "Retry" on an answer open a
// branch (a new session forked just before that message) and go to it; the branch
// switcher links a session to its parent and its branches.
import { api, el, header, longTime, markdown, params, project, shortTime, timeEl, token, tokenExpired } from "/common.js";
import { Connection, Refused } from "/connection.js";

const sessionId = params.get("id");
const highlight = params.get("highlightEvent");
const chat = document.getElementById("chat");
const problem = document.getElementById("problem");
const stopButton = document.getElementById("stop");
const startButton = document.getElementById("start-criativo");
const PENDING_KEY = `agentbus.pending.${sessionId}`;
let lastSeq = 0;
const kinds = new Map(); // event id -> type, for what a delta's `message_id` points at
const said = new Map(); // a person's message id -> { seq, text }: what Edit and Retry fork from
const answered = new Set(); // causes whose outcome arrived: no delta of theirs is shown
const streaming = new Map(); // cause id -> { node, body, turns: Map<turn_id, Map<seq, text>> }
let lastTurn = null; // the turn that streamed last: what Stop stops
// Messages not yet acknowledged, in the order typed; kept across a reload.
const pending = JSON.parse(sessionStorage.getItem(PENDING_KEY) || "[]");

document.getElementById("session-id").textContent = sessionId.slice(0, 8);
await header();

// --- following the conversation --------------------------------------------------

// The chat follows new text while the reader is at its end; one who scrolled up to read
// is left where they are.
let following = true;
chat.addEventListener("scroll", () => {
  following = chat.scrollHeight - chat.scrollTop - chat.clientHeight < 48;
});
function follow() { if (following) chat.scrollTop = chat.scrollHeight; }

function stamp(node, e) {
  node.dataset.time = shortTime(e.created_at);
  node.title = longTime(e.created_at);
}

function bubble(kind, text, e) {
  const node = el("div", { class: `msg ${kind}` }, text);
  if (e) {
    node.dataset.id = e.id;
    node.id = `msg-${e.id}`;
    stamp(node, e);
  }
  chat.append(node);
  follow();
  return node;
}

// The session's title is its first message, as on the sessions page.
let titled = false;
function title(text) {
  if (titled) return;
  titled = true;
  const short = text.length > 60 ? `${text.slice(0, 59)}…` : text;
  document.getElementById("title").textContent = short;
  document.title = `${short} · agentbus`;
}

// "Criativo is writing…": from a message (or the readiness) until its outcome is in the log.
const writing = document.getElementById("writing");
const awaiting = new Set();
let writer = "The assistant"; // a session without Criativo: the plain chat answers
let closed = false;
function showWriting() {
  const on = awaiting.size > 0 && !closed;
  if (on) writing.textContent = `${writer} is writing…`;
  writing.hidden = !on;
}
function awaitOutcome(cause) { if (!answered.has(cause)) awaiting.add(cause); showWriting(); }
function outcome(cause) { awaiting.delete(cause); showWriting(); }

// A link that brings an element of the page into view and marks it for a moment.
function jumpTo(target) {
  target.scrollIntoView({ block: "center", behavior: "smooth" });
  target.classList.add("flash");
  setTimeout(() => target.classList.remove("flash"), 2000);
}

function logEvent(e) {
  const item = el("li", { id: `event-${e.id}`, "data-type": e.type },
    `#${e.seq} ${e.type} ${e.actor} ${JSON.stringify(e.payload).slice(0, 160)}`);
  document.getElementById("events").append(item);
  if (e.id === highlight) {
    item.classList.add("highlight");
    document.getElementById("log").open = true;
    item.scrollIntoView({ block: "center" });
  }
}

// --- messages typed by the person: sent now, or when the connection is back ---------

function savePending() {
  sessionStorage.setItem(PENDING_KEY, JSON.stringify(pending.map(({ text, client_msg_id }) => ({ text, client_msg_id }))));
}

// Below the conversation, not in it: a pending message takes its place in the chat
// when the log has it (it may come after answers the person has not seen yet).
function showPending(item) {
  item.node = el("div", { class: "msg user pending", title: "waiting to be sent" }, item.text);
  item.node.dataset.clientMsgId = item.client_msg_id;
  document.getElementById("outbox").append(item.node);
}

function flushPending() {
  for (const item of pending) {
    if (!item.sent) item.sent = conn.send({ type: "chat", text: item.text, client_msg_id: item.client_msg_id, ref: `chat:${item.client_msg_id}` });
  }
}

function settlePending(clientMsgId) {
  const i = pending.findIndex((p) => p.client_msg_id === clientMsgId);
  if (i < 0) return;
  pending[i].node.remove();
  pending.splice(i, 1);
  savePending();
}

// --- the turn in flight ----------------------------------------------------------

function streamText(live) {
  let text = "";
  for (const deltas of live.turns.values()) {
    for (const seq of [...deltas.keys()].sort((a, b) => a - b)) text += deltas.get(seq);
  }
  return text;
}

function liveBubble(cause) {
  let live = streaming.get(cause);
  if (live) return live;
  // The consolidation turn after readiness is the brief being written.
  const brief = kinds.get(cause) === "criativo.readiness_confirmed";
  const body = el("span", { class: "text" });
  const node = brief
    ? el("div", { class: "brief-writing" }, el("strong", {}, "Writing the brief…"), el("p", {}, body))
    : el("div", { class: "msg agent streaming", "aria-busy": "true" }, body);
  chat.append(node);
  live = { node, body, turns: new Map(), top: new Map() }; // top: highest seq per turn
  streaming.set(cause, live);
  return live;
}

function resetStop() {
  Object.assign(stopButton, { hidden: true, disabled: false, textContent: "Stop" });
}

function endStream(cause) {
  const live = streaming.get(cause);
  streaming.delete(cause);
  answered.add(cause);
  if (streaming.size === 0) resetStop();
  return live;
}

function onDelta(d) {
  if (answered.has(d.message_id)) return;
  const live = liveBubble(d.message_id);
  const deltas = live.turns.get(d.turn_id) || new Map();
  live.turns.set(d.turn_id, deltas);
  if (deltas.has(d.seq)) return; // replayed after a reconnect
  deltas.set(d.seq, d.text);
  // The usual case, the next piece of the turn, costs one text node; a piece that fills
  // a gap (missed while disconnected) has the whole text laid out again in order.
  const top = live.top.get(d.turn_id) || 0;
  live.top.set(d.turn_id, Math.max(top, d.seq));
  const atEnd = [...live.turns.keys()].pop() === d.turn_id && d.seq === top + 1;
  if (atEnd && deltas.size === d.seq) live.body.append(d.text);
  else live.body.textContent = streamText(live);
  lastTurn = d.turn_id;
  stopButton.hidden = false;
  awaitOutcome(d.message_id);
  follow();
}

// --- the log's events ------------------------------------------------------------

function onEvent(e) {
  if (e.seq <= lastSeq) return;
  lastSeq = e.seq;
  kinds.set(e.id, e.type);
  logEvent(e);
  onContent(e);
  // An evidence chip points at a message or an answer: marked in the chat too.
  const said = e.id === highlight && document.getElementById(`msg-${e.id}`);
  if (said) { said.classList.add("highlight"); said.scrollIntoView({ block: "center" }); }
}

function onContent(e) {
  const p = e.payload;
  switch (e.type) {
    case "chat.message":
      if (p.client_msg_id) settlePending(p.client_msg_id);
      said.set(e.id, { seq: e.seq, text: p.text });
      editable(bubble("user", p.text, e), e.id);
      title(p.text);
      awaitOutcome(e.id);
      break;
    case "agent.activated":
      if (p.agent === "criativo") {
        writer = "Criativo";
        // Criativo joins a session once: the button says it is there rather than offer a refusal.
        startButton.disabled = true;
        startButton.textContent = "Criativo started";
      }
      break;
    case "criativo.readiness_confirmed":
      awaitOutcome(e.id);
      break;
    case "agent.response": {
      const live = endStream(e.causation_id);
      outcome(e.causation_id);
      const node = live ? live.node : bubble("agent", "", e);
      node.classList.remove("streaming");
      node.removeAttribute("aria-busy");
      node.dataset.id = e.id;
      node.id = `msg-${e.id}`;
      stamp(node, e);
      // A stopped answer is shown as it was cut, not as markdown it never finished.
      node.replaceChildren(el("span", { class: "text" }, p.stopped ? p.text : markdown(p.text)));
      if (p.stopped) {
        node.classList.add("stopped");
        node.append(el("span", { class: "stopped-note" }, " (stopped)"));
      }
      if (!p.text && !p.stopped) node.remove();
      else retriable(node, e.causation_id);
      follow();
      break;
    }
    case "agent.error": {
      const live = endStream(e.causation_id);
      outcome(e.causation_id);
      if (live) live.node.remove();
      bubble("agent-error", `${p.agent}: ${p.reason}`, e);
      break;
    }
    case "artifact.business_rule":
      ruleCard(e);
      break;
    case "artifact.business_rule_retracted":
      document.querySelector(`#rules .rule-card[data-id="${p.rule_id}"]`)?.remove();
      break;
    case "artifact.product_brief": {
      const card = briefCard(e);
      const live = endStream(e.causation_id);
      outcome(e.causation_id);
      if (live) live.node.replaceWith(card);
      else chat.append(card);
      follow();
      break;
    }
    case "handoff.offered": {
      const divider = el("div", { class: "divider", id: `handoff-${p.handoff_id}`, role: "group", "aria-label": "Handoff offer" },
        `Handoff: ${p.from_agent} → ${p.to_agent} `);
      if (e.copied_from) {
        // A branch's copy of its parent's offer: the offer is the parent's to decide.
        divider.append("(offered in the parent session)");
      } else {
        const accept = el("button", { onclick: () => decide("accept_handoff", p.handoff_id) }, "Accept");
        const reject = el("button", { onclick: () => decide("reject_handoff", p.handoff_id) }, "Reject");
        divider.append(accept, " ", reject);
      }
      chat.append(divider);
      break;
    }
    case "handoff.accepted": case "handoff.rejected": case "handoff.superseded": {
      const id = p.handoff_id || p.handoffId;
      decisionButtons(id).forEach((b) => b.remove());
      document.getElementById(`handoff-${id}`)?.append(` (${e.type.split(".")[1]})`);
      break;
    }
    case "session.closed": case "session.closed_abnormally":
      document.getElementById("status").textContent = e.type === "session.closed" ? "closed" : `closed: ${p.reason}`;
      closed = true;
      showWriting();
      // Nothing is accepted in a closed session (RN-581): its offers are no longer actionable.
      chat.querySelectorAll(".divider button").forEach((b) => b.remove());
      // Nor are its rules changed: Remove and Edit would only be refused.
      document.querySelectorAll("#rules .rule-actions, #rules .rule-form").forEach((n) => n.remove());
      break;
  }
}

// --- the business rules: only the standing ones -------------------------------------
//
// A card per rule the log holds as standing: a retraction removes its card, a correction
// takes the place of the card it replaces. The person removes a rule (after a confirm)
// or edits it (the corrected text replaces it) from its card; the log decides, and a
// refusal is said on the card.

function ruleCard(e) {
  const p = e.payload;
  const said = el("p", { class: "rule-said", role: "status" });
  const card = el("div", { class: "rule-card", "data-id": e.id },
    el("h3", {}, markdown(p.title, { inline: true })),
    el("div", { class: "statement" }, markdown(p.statement)));
  // Linked to the message it came from (its last `origin`), shown in the chat.
  const origin = (p.origin || []).at(-1);
  if (origin) {
    card.append(el("a", {
      class: "from", href: `#msg-${origin}`,
      onclick: (ev) => {
        const said = document.getElementById(`msg-${origin}`);
        if (!said) return;
        ev.preventDefault();
        jumpTo(said);
      },
    }, "From the message"));
  }
  const actions = el("p", { class: "rule-actions" },
    el("button", { type: "button", class: "edit", onclick: () => editRule(card, e) }, "Edit"), " ",
    el("button", { type: "button", class: "remove", onclick: () => confirmRemove(card, e) }, "Remove"));
  card.append(actions, said);
  const replaced = p.replaces && document.querySelector(`#rules .rule-card[data-id="${p.replaces}"]`);
  if (replaced) replaced.replaceWith(card);
  else document.getElementById("rules").append(card);
}

// The card's question, in place of its buttons until answered.
function ask(card, form) {
  card.querySelector(".rule-actions").hidden = true;
  card.querySelector(".rule-said").textContent = "";
  card.querySelector(".rule-form")?.remove();
  card.querySelector(".rule-said").before(form);
  form.querySelector("input, textarea, button")?.focus();
}

function stopAsking(card) {
  card.querySelector(".rule-form")?.remove();
  card.querySelector(".rule-actions").hidden = false;
}

function ruleFrame(card, frame, busy) {
  if (!act({ ...frame, ref: `rule:${frame.rule_id}` })) return;
  card.querySelectorAll(".rule-form button").forEach((b) => { b.disabled = true; });
  card.querySelector(".rule-said").textContent = busy;
}

function confirmRemove(card, e) {
  const reason = el("input", { type: "text", class: "reason", maxlength: "500", "aria-label": "Why (optional)", placeholder: "Why (optional)" });
  const form = el("form", { class: "rule-form", "aria-label": "Remove this rule" },
    el("p", {}, "Remove this rule? Criativo will no longer build on it."), reason, " ",
    el("button", { type: "submit", class: "confirm-remove" }, "Remove"), " ",
    el("button", { type: "button", class: "cancel", onclick: () => stopAsking(card) }, "Cancel"));
  form.onsubmit = (ev) => {
    ev.preventDefault();
    const why = reason.value.trim();
    ruleFrame(card, { type: "retract_rule", rule_id: e.id, ...(why ? { reason: why } : {}) }, "Removing…");
  };
  ask(card, form);
}

function editRule(card, e) {
  const p = e.payload;
  const title = el("input", { type: "text", class: "title", required: "", "aria-label": "Rule title" });
  const statement = el("textarea", { class: "statement-text", rows: "3", required: "", "aria-label": "Rule statement" });
  title.value = p.title;
  statement.value = p.statement;
  const form = el("form", { class: "rule-form", "aria-label": "Edit this rule" }, title, statement,
    el("button", { type: "submit", class: "save" }, "Save"), " ",
    el("button", { type: "button", class: "cancel", onclick: () => stopAsking(card) }, "Cancel"));
  form.onsubmit = (ev) => {
    ev.preventDefault();
    if (!title.value.trim() || !statement.value.trim()) return;
    ruleFrame(card, {
      type: "correct_rule", rule_id: e.id, title: title.value, statement: statement.value, origin: p.origin,
    }, "Saving…");
  };
  ask(card, form);
}

// What a refused Remove or Edit says on its card.
const RULE_REFUSALS = {
  rule_not_standing: "This rule was already removed or replaced (in another tab?): reload to see the rules that stand.",
  rule_not_found: "This rule is not one of this project's.",
  session_closed: "The session is closed: its rules can no longer change.",
};

function ruleRefused(ruleId, f) {
  const card = document.querySelector(`#rules .rule-card[data-id="${ruleId}"]`);
  if (!card) return;
  card.querySelectorAll(".rule-form button").forEach((b) => { b.disabled = false; });
  card.querySelector(".rule-said").textContent = RULE_REFUSALS[f.code] || `Not changed: ${f.message}`;
}

// --- branches: Edit and Retry fork the session; the switcher goes between them -------

// A branch keeps the log up to `atSeq` and continues with `text`; the page goes there.
// One fork id per click: a request repeated by the network makes one branch.
async function fork(atSeq, text, button) {
  button.disabled = true;
  try {
    const body = JSON.stringify({ at_seq: atSeq, text, fork_id: crypto.randomUUID() });
    const branch = await api(`/sessions/${sessionId}/fork`, { method: "POST", body });
    location.href = `/session.html?id=${branch.session_id}`;
  } catch (err) {
    problem.textContent = String(err.message || err);
    button.disabled = false;
  }
}

// Beside a person's message: "Edit" opens a box with its text; sending it makes a
// branch just before the message, with the edited text in its place.
function editable(node, messageId) {
  const edit = el("button", { type: "button", class: "edit" }, "Edit");
  const actions = el("div", { class: "msg-actions" }, edit);
  node.after(actions);
  edit.onclick = () => {
    const { seq, text } = said.get(messageId);
    const box = el("textarea", { rows: "2", "aria-label": "Edited message" });
    box.value = text;
    const send = el("button", { type: "submit" }, "Send in a new branch");
    const cancel = el("button", { type: "button" }, "Cancel");
    const form = el("form", { class: "edit-form" }, box, " ", send, " ", cancel);
    form.onsubmit = (ev) => {
      ev.preventDefault();
      if (box.value.trim()) fork(seq - 1, box.value, send);
    };
    cancel.onclick = () => { form.remove(); edit.hidden = false; };
    edit.hidden = true;
    actions.append(form);
    box.focus();
  };
}

// Beside an answer: "Retry" makes a branch just before the message it answered, with
// the same text, so it is answered afresh.
function retriable(node, messageId) {
  const asked = said.get(messageId);
  if (!asked) return;
  const retry = el("button", { type: "button", class: "retry" }, "Retry");
  retry.onclick = () => fork(asked.seq - 1, asked.text, retry);
  node.after(el("div", { class: "msg-actions" }, retry));
}

function sessionLink(s, label) {
  return el("a", { href: `/session.html?id=${s}` }, label);
}

// The parent this session was forked from, and the branches forked from it.
async function showBranches() {
  const nav = document.getElementById("branches");
  const [view, listed] = await Promise.all([
    api(`/sessions/${sessionId}`),
    api(`/sessions/${sessionId}/branches`),
  ]);
  if (view.parent_session_id) {
    nav.append(el("p", { class: "parent" }, "Branch of ",
      sessionLink(view.parent_session_id, `session ${view.parent_session_id.slice(0, 8)}`),
      ` (after event #${view.forked_at_seq})`));
  }
  if (listed.sessions.length) {
    const items = listed.sessions.map((b) => el("li", {},
      sessionLink(b.session_id, b.title || b.session_id.slice(0, 8)),
      ` · after event #${b.forked_at_seq}`));
    nav.append(el("p", {}, "Branches:"), el("ul", { class: "branch-list" }, ...items));
  }
  nav.hidden = !nav.childElementCount;
}
showBranches().catch((err) => { problem.textContent = String(err.message || err); });

// --- the briefs: each a version, the last one current -------------------------------

const briefs = []; // the session's brief cards, oldest first

// The brief as the document a person takes elsewhere: its title, summary and details.
function briefMarkdown(p) {
  return `${[`# ${p.title}`, p.summary, p.details].filter(Boolean).join("\n\n")}\n`;
}

function markBrief(card, current) {
  card.classList.toggle("current", current);
  card.classList.toggle("superseded", !current);
  card.querySelector(".brief-state").textContent = current ? "current" : "superseded";
  card.setAttribute("aria-label", `Brief v${card.dataset.version} (${current ? "current" : "superseded"}): ${card.dataset.title}`);
}

async function copyBrief(text, said) {
  try {
    await navigator.clipboard.writeText(text);
    said.textContent = "Copied";
  } catch {
    said.textContent = "Could not copy: select the text instead";
  }
}

function downloadBrief(text, version) {
  const url = URL.createObjectURL(new Blob([text], { type: "text/markdown;charset=utf-8" }));
  const link = el("a", { href: url, download: `brief-${sessionId}-v${version}.md`, hidden: "" });
  document.body.append(link);
  link.click();
  link.remove();
  // The download reads the blob after the click returns: it is let go a while later.
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}

// The brief as a document: its version and state, its title, its summary, its details,
// and Copy / Download as Markdown. A new brief makes the ones before it superseded.
function briefCard(e) {
  const p = e.payload;
  const version = briefs.length + 1;
  const text = briefMarkdown(p);
  const said = el("span", { class: "brief-said", role: "status" });
  const card = el("article", { class: "brief", "data-id": e.id, "data-version": version, "data-title": p.title },
    el("p", { class: "brief-meta" },
      el("span", { class: "brief-version" }, `Brief v${version}`), " · ",
      el("span", { class: "brief-state" }), " · ", timeEl(e.created_at, true)),
    el("h3", {}, p.title),
    el("div", { class: "summary" }, markdown(p.summary)));
  if (p.details) card.append(el("div", { class: "details" }, markdown(p.details)));
  card.append(el("p", { class: "brief-actions" },
    el("button", { type: "button", class: "copy", onclick: () => copyBrief(text, said) }, "Copy"), " ",
    el("button", { type: "button", class: "download", onclick: () => downloadBrief(text, version) }, "Download as Markdown"),
    " ", said));
  for (const earlier of briefs) markBrief(earlier, false);
  briefs.push(card);
  markBrief(card, true);
  return card;
}

// --- the connection ----------------------------------------------------------------

const STATES = {
  connecting: "connecting…",
  live: "live",
  refused: "not allowed: open the link `make up` printed",
  expired: "this link has expired: open a new one (`make up` prints it)",
};
const connState = document.getElementById("connection");

function onFrame(f) {
  if (f.type === "event") onEvent(f.event);
  else if (f.type === "delta") onDelta(f);
  else if (f.type === "ack") {
    problem.textContent = "";
    if (f.of === "chat" && f.client_msg_id && f.result && f.result.duplicate) settlePending(f.client_msg_id);
  } else if (f.type === "error") {
    const rule = refOf(f, "rule:");
    if (rule) { ruleRefused(rule, f); return; }
    const decided = refOf(f, "decide:");
    // Decided already (another tab, another person): its event tells how, in the divider.
    if (decided && f.code === "invalid_transition") return;
    if (decided) decisionButtons(decided).forEach((b) => { b.disabled = false; });
    const chatRef = refOf(f, "chat:");
    const item = chatRef && pending.find((p) => p.client_msg_id === chatRef);
    // A refusal that a later try can pass (a flood, a service restarting): try again on
    // the next connection; anything else is shown on the message, which stays visible.
    if (item && ["rate_limited", "unavailable", "internal"].includes(f.code)) item.sent = false;
    else if (item) {
      item.node.classList.replace("pending", "failed");
      item.node.title = `${f.code}: ${f.message}`;
      pending.splice(pending.indexOf(item), 1);
      savePending();
    }
    problem.textContent = `${f.code}: ${f.message}`;
    stopButton.disabled = false; // a refused stop can be pressed again
    stopButton.textContent = "Stop";
  }
}

const scheme = location.protocol === "https:" ? "wss" : "ws";

// A socket's URL carries a ticket for it, traded for the token (which stays in a header).
async function socketAddress() {
  const r = await fetch(`/api/projects/${project}/ws-ticket`, {
    method: "POST",
    headers: { authorization: `Bearer ${token}` },
  });
  if (r.status === 401 || r.status === 403) throw new Refused((await r.json()).error.message);
  if (!r.ok) throw new Error(`no ticket: HTTP ${r.status}`);
  const { ticket } = await r.json();
  return `${scheme}://${location.host}/ws?ticket=${encodeURIComponent(ticket)}`;
}

const conn = new Connection({
  address: socketAddress,
  join: () => ({ type: "join", session_id: sessionId, after_seq: lastSeq }),
  onFrame,
  onState: (state, detail) => {
    // The person's token came from a link and nothing renews it: once it expired, say so.
    const expired = state === "refused" && (detail === "token expired" || tokenExpired());
    const shown = expired ? "expired" : state;
    connState.dataset.state = shown;
    connState.textContent = shown === "reconnecting" ? `reconnecting in ${detail} s…` : STATES[shown];
  },
  onOpen: flushPending,
  // Unacknowledged messages are sent again on the next socket: harmless, the gateway
  // appends a `client_msg_id` once.
  onLost: () => { for (const item of pending) item.sent = false; },
});
window.agentbusConnection = conn; // for the browser tests, which drop it as a network would
pending.forEach(showPending);
conn.open();

// Frames other than chat act on the state of the moment: not sent later, but never silently dropped.
function act(frame) {
  const sent = conn.send(frame);
  if (!sent) problem.textContent = "not connected: try again once the connection is live";
  return sent;
}

// What a frame's `ref` names after `prefix` (the kind of frame it answers), or null.
function refOf(frame, prefix) {
  return (frame.ref || "").startsWith(prefix) ? frame.ref.slice(prefix.length) : null;
}

function decisionButtons(handoffId) {
  const divider = document.getElementById(`handoff-${handoffId}`);
  return divider ? [...divider.querySelectorAll("button")] : [];
}

// An offer is decided once: its buttons wait, disabled, for the decision's event (which
// removes them) or its refusal (which gives them back), so a double click sends one frame.
function decide(type, handoffId) {
  const buttons = decisionButtons(handoffId);
  buttons.forEach((b) => { b.disabled = true; });
  if (!act({ type, handoff_id: handoffId, ref: `decide:${handoffId}` })) {
    buttons.forEach((b) => { b.disabled = false; });
  }
}

startButton.onclick = () => act({ type: "start_agent", agent: "criativo" });
document.getElementById("ready").onclick = () => act({ type: "confirm_readiness" });
document.getElementById("close").onclick = () => act({ type: "close_session" });
stopButton.onclick = () => {
  if (!lastTurn) return;
  // One press is enough: the stopped answer arrives as the turn's outcome and hides the button.
  if (!act({ type: "stop_turn", turn_id: lastTurn })) return;
  stopButton.disabled = true;
  stopButton.textContent = "Stopping…";
};
// Enter sends, Shift+Enter starts a new line (and Enter while composing text is left alone).
document.getElementById("text").addEventListener("keydown", (ev) => {
  if (ev.key !== "Enter" || ev.shiftKey || ev.isComposing) return;
  ev.preventDefault();
  document.getElementById("say").requestSubmit();
});
document.getElementById("say").onsubmit = (ev) => {
  ev.preventDefault();
  const input = document.getElementById("text");
  if (!input.value.trim()) return;
  const item = { text: input.value, client_msg_id: crypto.randomUUID(), sent: false };
  pending.push(item);
  savePending();
  showPending(item);
  input.value = "";
  flushPending();
  following = true; // what the person just said is where they want to be
  follow();
};
