// The page's WebSocket to the gateway, kept open: reconnects with a capped, jittered
// exponential backoff (`retryDelay`), says which state it is in, and re-joins the session
// from the last `seq` the page holds, so nothing is missed and nothing is repeated. Each
// socket is opened with a fresh single-use ticket (`address()`): the token never goes in
// its URL. 4401: the ticket was refused or the token expired (the reason says which):
// retrying cannot help, the person needs a new link.
const CLOSE_UNAUTHORIZED = 4401;
const FIRST_RETRY_MS = 500;
const MAX_RETRY_MS = 10_000;
// A socket that opens but never answers the join (a half-dead network or proxy) is
// dropped and tried again, rather than left "connecting" for ever.
const JOIN_TIMEOUT_MS = 10_000;

// What `address()` throws when the token is refused: no socket can be opened with it.
export class Refused extends Error {}

// How long to wait before the next try, after `failures` tries since the socket was last
// live (0: it was just lost): in the upper half of a ceiling that doubles from
// FIRST_RETRY_MS to MAX_RETRY_MS. Jittered, so the clients of a gateway that died come
// back spread out (a fixed 1 s retry made them all come back in the same second); the
// ceiling is what spreads a long outage's returns: a lower one gets people back sooner
// but brings them to a starting gateway faster (bench/chaos.py --storm measures both).
// `random()`: in [0, 1).
export function retryDelay(failures, random = Math.random) {
  const ceiling = Math.min(MAX_RETRY_MS, FIRST_RETRY_MS * 2 ** failures);
  return ceiling / 2 + random() * (ceiling / 2);
}

export class Connection {
  // address(): the URL of the next socket (a promise; `Refused` when the token is);
  // onFrame(frame): every frame; onState(state, detail): "connecting" | "live" |
  // "reconnecting" (detail: seconds until the next try) | "refused" (detail: why);
  // onOpen(): a new socket is open and its join sent (send what waited for it);
  // onLost(): the socket is gone (what was sent on it and not answered may be lost).
  constructor({ address, join, onFrame, onState, onOpen, onLost }) {
    Object.assign(this, { address, join, onFrame, onState, onOpen, onLost });
    this.failures = 0;
    this.ws = null;
    this.nextTry = null; // the timer of the next try, while one waits
  }

  async open() {
    this.nextTry = null;
    this.onState("connecting");
    let url;
    try {
      url = await this.address();
    } catch (e) {
      if (e instanceof Refused) this.onState("refused", e.message);
      else this.retry(); // the gateway unreachable or restarting: as a lost socket
      return;
    }
    const ws = new WebSocket(url);
    this.ws = ws;
    // The gateway carries out one connection's frames in order, so whatever is sent
    // after the join acts in the joined session, even before the join's ack arrives.
    let joinTimer = null;
    ws.onopen = () => {
      ws.send(JSON.stringify({ ...this.join(), ref: "join" }));
      joinTimer = setTimeout(() => ws.close(), JOIN_TIMEOUT_MS);
      this.onOpen();
    };
    ws.onmessage = (m) => {
      if (this.ws !== ws) return; // dropped: the next join resumes after the page's last seq
      const frame = JSON.parse(m.data);
      if (frame.type === "ack" && frame.of === "join") {
        clearTimeout(joinTimer);
        this.failures = 0;
        this.onState("live");
      } else if (frame.type === "error" && frame.ref === "join") {
        // Refused (the log restarting: `unavailable`): a failed try, closed now and tried
        // again on the back-off, not left open until JOIN_TIMEOUT_MS.
        clearTimeout(joinTimer);
        ws.close();
      }
      this.onFrame(frame);
    };
    ws.onclose = (c) => {
      clearTimeout(joinTimer);
      this.lost(ws, c.code, c.reason);
    };
  }

  // `ws` is gone: say so and try again later (unless it was refused).
  lost(ws, code, reason = "") {
    if (this.ws !== ws) return; // an old socket closing late, or already given up
    this.ws = null;
    this.onLost();
    if (code === CLOSE_UNAUTHORIZED) { this.onState("refused", reason); return; }
    this.retry();
  }

  retry() {
    const wait = retryDelay(this.failures);
    this.failures += 1;
    this.onState("reconnecting", Math.ceil(wait / 1000));
    this.nextTry = setTimeout(() => this.open(), wait);
  }

  // Whether a frame can go now; a caller with something that must not be lost queues it.
  get live() { return this.ws !== null && this.ws.readyState === WebSocket.OPEN; }

  send(frame) {
    if (!this.live) return false;
    this.ws.send(JSON.stringify(frame));
    return true;
  }

  // Drop the socket as a network would (tests, and a "reconnect now" for the person).
  // Given up at once: on a dead network the close handshake, and so `onclose`, can take
  // a minute (the browser test's offline drop waited for it half the time).
  drop() {
    const ws = this.ws;
    if (!ws) return;
    ws.close();
    this.lost(ws, 1006);
  }
}
