"""WebSocket tickets: what the page puts in `/ws?ticket=…` instead of its token.

A browser cannot set a header on a WebSocket, so whatever proves who opens one rides in
its URL, and URLs get written down (an ingress's or a proxy's access log, the server's
own, the browser's tools). The token, valid for hours, never goes there: the page trades
it (`POST /api/projects/{p}/ws-ticket`, the token in the Authorization header) for a
ticket that opens one socket within `TICKET_TTL_SECONDS`.

A ticket is a JWT signed with the gateway's secret rather than a random key kept in the
process that issued it: replicas behind a load balancer share the secret and nothing
else, and the ticket's request and the socket may well reach different replicas. Each
replica remembers the tickets it let in (by `jti`) until they expire, so a ticket opens
at most one socket per replica, and none after its half minute: someone who copied one
from a log in that window could open a socket on a replica the page did not use.
Single use across every replica would need state they all share (a create-only key per
ticket in a KV bucket), a round trip on each connection to close a window this short.

A ticket carries the token's project, person and `exp`: the socket it opens is closed
when the token expires, not when the ticket does. Its audience is not the token's, so
neither is accepted in place of the other.
"""

from __future__ import annotations

import secrets
import time

import jwt

from contracts.common import ErrorCode
from contracts.gateway import WsTicket
from domain.errors import DomainError
from gateway.auth import ALGORITHM, USER_PATTERN, Principal

TICKET_AUDIENCE = "agentbus-gateway-ws"
# Long enough for a page to ask for a ticket and open the socket on a slow network.
TICKET_TTL_SECONDS = 30


class Tickets:
    """Issues tickets, and lets each in once on this replica."""

    def __init__(self, secret: str, ttl_seconds: int = TICKET_TTL_SECONDS) -> None:
        self._secret = secret
        self._ttl = ttl_seconds
        # Tickets let in, by `jti`, with their `exp`, in the order they were used: the
        # oldest are forgotten as they expire.
        self._used: dict[str, int] = {}

    def issue(self, principal: Principal) -> WsTicket:
        """A ticket for `principal`'s next socket (never outliving its token)."""
        now = int(time.time())
        token_exp = int(principal.expires_at)
        exp = min(now + self._ttl, token_exp)
        claims = {
            "prj": principal.project_id,
            "sub": principal.user,
            "aud": TICKET_AUDIENCE,
            "iat": now,
            "exp": exp,
            "jti": secrets.token_urlsafe(16),
            "token_exp": token_exp,
        }
        ticket = jwt.encode(claims, self._secret, algorithm=ALGORITHM)
        return WsTicket(ticket=ticket, expires_in=max(0, exp - now))

    def redeem(self, ticket: str | None) -> Principal:
        """The principal of a ticket used for the first time here; `unauthorized` for a
        missing, forged, expired or used one."""
        if not ticket:
            raise DomainError(
                ErrorCode.UNAUTHORIZED,
                "a ticket is required: POST /api/projects/{project}/ws-ticket with the token "
                "in the Authorization header, then open /ws?ticket=…",
            )
        try:
            claims = jwt.decode(
                ticket,
                self._secret,
                algorithms=[ALGORITHM],
                audience=TICKET_AUDIENCE,
                options={"require": ["exp", "jti", "prj", "sub", "token_exp"]},
            )
        except jwt.ExpiredSignatureError:
            raise DomainError(
                ErrorCode.UNAUTHORIZED, "the ticket has expired; get a new one"
            ) from None
        except jwt.InvalidTokenError as exc:
            raise DomainError(ErrorCode.UNAUTHORIZED, f"the ticket is not valid: {exc}") from None
        project, user, jti = claims["prj"], claims["sub"], claims["jti"]
        if not (isinstance(project, str) and isinstance(user, str) and isinstance(jti, str)):
            raise DomainError(ErrorCode.UNAUTHORIZED, "the ticket names no project or user")
        if not USER_PATTERN.match(user) or not isinstance(claims["token_exp"], int):
            raise DomainError(ErrorCode.UNAUTHORIZED, "the ticket is not valid")
        self._forget_expired()
        if jti in self._used:
            raise DomainError(ErrorCode.UNAUTHORIZED, "the ticket was used already; get a new one")
        self._used[jti] = int(claims["exp"])
        return Principal(project, user, float(claims["token_exp"]))

    def _forget_expired(self) -> None:
        now = time.time()
        used = self._used
        while used:
            oldest = next(iter(used))
            if used[oldest] >= now:
                return
            del used[oldest]
