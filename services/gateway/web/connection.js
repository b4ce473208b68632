// The page's WebSocket to the gateway, kept open: reconnects with a capped, jittered
// exponential backoff (a fixed 1 s retry made every client of a restarted gateway come
// back in the same second), says which state it is in, and re-joins the session from the
// last `seq` the page holds, so nothing is missed and nothing is repeated.
const CLOSE_UNAUTHORIZED = 4401; // the token was refused: retrying cannot help
const FIRST_RETRY_MS = 500;
const MAX_RETRY_MS = 10_000;

export class Connection {
  // onFrame(frame): every frame; onState(state, detail): "connecting" | "live" |
  // "reconnecting" (detail: seconds until the next try) | "refused";
  // onJoined(): the session is followed again (send what waited for the connection).
  constructor({ url, join, onFrame, onState, onJoined }) {
    Object.assign(this, { url, join, onFrame, onState, onJoined });
    this.failures = 0;
    this.joined = false;
    this.ws = null;
  }

  open() {
    this.onState("connecting");
    const ws = new WebSocket(this.url);
    this.ws = ws;
    ws.onopen = () => ws.send(JSON.stringify({ ...this.join(), ref: "join" }));
    ws.onmessage = (m) => {
      const frame = JSON.parse(m.data);
      if (frame.type === "ack" && frame.of === "join") {
        this.joined = true;
        this.failures = 0;
        this.onState("live");
        this.onJoined();
      }
      this.onFrame(frame);
    };
    ws.onclose = (c) => {
      if (this.ws !== ws) return; // an old socket closing late
      this.joined = false;
      if (c.code === CLOSE_UNAUTHORIZED) { this.onState("refused"); return; }
      const ceiling = Math.min(MAX_RETRY_MS, FIRST_RETRY_MS * 2 ** this.failures);
      const wait = ceiling / 2 + Math.random() * (ceiling / 2);
      this.failures += 1;
      this.onState("reconnecting", Math.ceil(wait / 1000));
      setTimeout(() => this.open(), wait);
    };
  }

  // Whether a frame can go now; a caller with something that must not be lost queues it.
  get live() { return this.joined && this.ws && this.ws.readyState === WebSocket.OPEN; }

  send(frame) {
    if (!this.live) return false;
    this.ws.send(JSON.stringify(frame));
    return true;
  }

  // Drop the socket as a network would (tests, and a "reconnect now" for the person).
  drop() { if (this.ws) this.ws.close(); }
}
