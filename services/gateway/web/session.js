// Event types are the wire contract's (contracts/contracts/events.py, contracts/asyncapi.json).
// The session page: chat streaming token by token, rule cards, readiness, the brief
// and the handoff divider, agent errors, and the event log (?highlightEvent=<id>).
import { el, header, params, token } from "/common.js";

const sessionId = params.get("id");
const highlight = params.get("highlightEvent");
const chat = document.getElementById("chat");
const problem = document.getElementById("problem");
let lastSeq = 0;
let ws;
const streaming = new Map(); // message id -> the bubble its deltas fill

document.getElementById("session-id").textContent = sessionId.slice(0, 8);
await header();

function send(frame) { ws.send(JSON.stringify(frame)); }
function bubble(kind, text, id) {
  const node = el("div", { class: `msg ${kind}` }, text);
  if (id) node.dataset.id = id;
  chat.append(node);
  chat.scrollTop = chat.scrollHeight;
  return node;
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

function onEvent(e) {
  lastSeq = e.seq;
  logEvent(e);
  const p = e.payload;
  switch (e.type) {
    case "chat.message": bubble("user", p.text, e.id); break;
    case "agent.response": {
      const live = streaming.get(e.causation_id);
      if (live) { live.textContent = p.text; live.classList.remove("streaming"); streaming.delete(e.causation_id); }
      else if (p.text) bubble("agent", p.text, e.id);
      break;
    }
    case "agent.error": bubble("agent-error", `${p.agent}: ${p.reason}`, e.id); break;
    case "artifact.business_rule":
      document.getElementById("rules").append(
        el("div", { class: "rule-card", "data-id": e.id }, el("strong", {}, p.title), el("p", {}, p.statement)));
      break;
    case "artifact.product_brief":
      chat.append(el("div", { class: "brief", "data-id": e.id }, el("strong", {}, `Brief: ${p.title}`), el("p", {}, p.summary)));
      break;
    case "handoff.offered": {
      const accept = el("button", { onclick: () => send({ type: "accept_handoff", handoff_id: p.handoff_id }) }, "Accept");
      const reject = el("button", { onclick: () => send({ type: "reject_handoff", handoff_id: p.handoff_id }) }, "Reject");
      chat.append(el("div", { class: "divider", id: `handoff-${p.handoff_id}` },
        `Handoff: ${p.from_agent} → ${p.to_agent} `, accept, " ", reject));
      break;
    }
    case "handoff.accepted": case "handoff.rejected": case "handoff.superseded": {
      const id = p.handoff_id || p.handoffId;
      const divider = document.getElementById(`handoff-${id}`);
      if (divider) divider.querySelectorAll("button").forEach((b) => b.remove());
      if (divider) divider.append(` (${e.type.split(".")[1]})`);
      break;
    }
    case "session.closed": case "session.closed_abnormally":
      document.getElementById("status").textContent = e.type === "session.closed" ? "closed" : `closed: ${p.reason}`;
      // Nothing is accepted in a closed session (RN-581): its offers are no longer actionable.
      chat.querySelectorAll(".divider button").forEach((b) => b.remove());
      break;
  }
}

function onDelta(d) {
  let live = streaming.get(d.message_id);
  if (!live) { live = bubble("agent streaming", ""); streaming.set(d.message_id, live); }
  live.textContent += d.text;
  chat.scrollTop = chat.scrollHeight;
}

function connect() {
  ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws?token=${encodeURIComponent(token)}`);
  ws.onopen = () => send({ type: "join", session_id: sessionId, after_seq: lastSeq });
  ws.onmessage = (m) => {
    const f = JSON.parse(m.data);
    if (f.type === "event") onEvent(f.event);
    else if (f.type === "delta") onDelta(f);
    else if (f.type === "error") problem.textContent = `${f.code}: ${f.message}`;
    else if (f.type === "ack") problem.textContent = "";
  };
  ws.onclose = (c) => { if (c.code !== 4401) setTimeout(connect, 1000); };
}
connect();

document.getElementById("start-criativo").onclick = () => send({ type: "start_agent", agent: "criativo" });
document.getElementById("ready").onclick = () => send({ type: "confirm_readiness" });
document.getElementById("close").onclick = () => send({ type: "close_session" });
document.getElementById("say").onsubmit = (ev) => {
  ev.preventDefault();
  const input = document.getElementById("text");
  if (!input.value.trim()) return;
  send({ type: "chat", text: input.value, client_msg_id: crypto.randomUUID() });
  input.value = "";
};
