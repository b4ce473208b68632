"""The gateway's knobs (`AGENTBUS_GATEWAY_PORT`, `AGENTBUS_GATEWAY_SECRET`, …)."""

from __future__ import annotations

from servicekit.settings import ServiceSettings

# A fixed dev port, so the link `make up` prints stays the same between runs.
DEFAULT_PORT = 8480


class GatewaySettings(ServiceSettings):
    """Where the gateway listens, how it signs tokens and how it treats a connection."""

    gateway_host: str = "127.0.0.1"
    gateway_port: int = DEFAULT_PORT  # 0: any free port
    # Unset: a secret is created once in the state folder (`.agentbus/gateway.secret`),
    # so the gateway and `agentbus token` agree without configuration on one machine.
    gateway_secret: str | None = None
    token_ttl_seconds: float = 12 * 3600
    # While a client follows a session the gateway keeps it alive at this pace; the
    # log reaps a session after `AGENTBUS_HEARTBEAT_TIMEOUT_SECONDS` (default 60).
    heartbeat_interval_seconds: float = 10.0
    max_frame_bytes: int = 64 * 1024
    # An HTTP request's body: the largest the API takes (a binding) is well under 1 KiB.
    # Past it: 413 `payload_too_large`, before the body is read.
    max_body_bytes: int = 64 * 1024
    # Frames waiting to be written to one client. A client that falls this far behind
    # (a stalled tab, a dead network) is disconnected with 1013 and resumes with
    # `after_seq` when it comes back, rather than making the gateway hold its backlog.
    max_queued_frames: int = 2000
    # Frames a connection may send: `rate_burst` at once, refilled at `rate_per_second`.
    rate_per_second: float = 20.0
    rate_burst: int = 40
    command_timeout_seconds: float = 10.0
    # How long metering's answer to "which provider?" is kept for the "offline model"
    # notice (gateway.model): a restarted metering is noticed within this time.
    model_notice_seconds: float = 30.0
