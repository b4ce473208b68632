"""The gateway's own series, beside the kit's in `servicekit.metrics`.

The per-token path pays one counter increment per frame: frames are labelled by their
type only (never by session or user, which would grow without bound), and a label's
child is looked up once per type, not per frame.
"""

from __future__ import annotations

from servicekit.metrics import SECONDS, Counter, Gauge, Histogram

WS_CONNECTIONS = Gauge(
    "agentbus_gateway_ws_connections", "Authenticated WebSocket connections open now."
)
WS_JOINED_SESSIONS = Gauge(
    "agentbus_gateway_ws_joined_sessions", "WebSocket connections that have joined a session."
)
FOLLOWED_SESSIONS = Gauge(
    "agentbus_gateway_followed_sessions",
    "Sessions the gateway subscribes to: one NATS subscription each, shared by the "
    "connections following it.",
)
WS_FRAMES_RECEIVED = Counter(
    "agentbus_gateway_ws_frames_received_total",
    "Frames received from clients, by type (`rejected`: too large, not JSON, limited, invalid).",
    ["type"],
)
WS_FRAMES_SENT = Counter(
    "agentbus_gateway_ws_frames_sent_total",
    "Frames queued for clients, by frame type (ack, error, event, delta, ...).",
    ["type"],
)
WS_ERROR_FRAMES = Counter(
    "agentbus_gateway_ws_error_frames_total",
    "Error frames sent to clients, by error code.",
    ["code"],
)
WS_SLOW_CLIENT_CLOSES = Counter(
    "agentbus_gateway_ws_slow_client_closes_total",
    "Connections closed with 1013 because the client let its frame queue fill up.",
)
HTTP_SECONDS = Histogram(
    "agentbus_gateway_http_request_duration_seconds",
    "Time to answer an HTTP API request, by route template, method and status.",
    ["route", "method", "status"],
    buckets=SECONDS,
)

_sent: dict[str, Counter] = {}
_received: dict[str, Counter] = {}


def frame_sent(kind: str) -> None:
    """Count one frame queued for a client."""
    child = _sent.get(kind)
    if child is None:
        child = _sent[kind] = WS_FRAMES_SENT.labels(kind)
    child.inc()


def frame_received(kind: str) -> None:
    """Count one frame read from a client."""
    child = _received.get(kind)
    if child is None:
        child = _received[kind] = WS_FRAMES_RECEIVED.labels(kind)
    child.inc()
