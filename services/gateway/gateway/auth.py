"""Tokens: signed, expiring, scoped to one project (HS256 JWTs).

A token names a project (`prj`) and a person (`sub`); it opens that project's sessions
and nothing else. The secret comes from `AGENTBUS_GATEWAY_SECRET` or, on a developer's
machine, from a file created once in the state folder.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import time
from dataclasses import dataclass

import jwt

from contracts.common import ErrorCode
from domain.errors import DomainError
from gateway.settings import GatewaySettings
from servicekit.embedded import state_dir

ALGORITHM = "HS256"
AUDIENCE = "agentbus-gateway"
USER_PATTERN = re.compile(r"^[A-Za-z0-9_.@-]{1,128}$")


@dataclass(frozen=True)
class Principal:
    """Who a verified token speaks for."""

    project_id: str
    user: str
    # When the token stops opening anything (seconds since the epoch): an open socket is
    # closed then.
    expires_at: float = math.inf

    @property
    def actor(self) -> str:
        return f"user:{self.user}"


def load_secret(configured: str | None) -> str:
    """The signing secret: the configured one, else the state folder's (created once)."""
    if configured:
        return configured
    path = state_dir() / "gateway.secret"
    try:
        return path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process created it first
        return path.read_text().strip()
    except OSError as exc:  # a read-only filesystem (a pod): replicas must share one anyway
        raise RuntimeError(
            f"no AGENTBUS_GATEWAY_SECRET and cannot create {path} ({exc.strerror}): "
            "set AGENTBUS_GATEWAY_SECRET, the same for every replica"
        ) from exc
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    return path.read_text().strip()


def dev_link(project_id: str = "demo", user: str = "dev") -> str:
    """A ready link to the web client for a local project (what `make up` prints)."""
    settings = GatewaySettings()
    token = mint(load_secret(settings.gateway_secret), project_id, user, settings.token_ttl_seconds)
    # After `#`: a fragment never leaves the browser, so no access log records the token.
    return f"http://{settings.gateway_host}:{settings.gateway_port}/#token={token}"


def mint(secret: str, project_id: str, user: str = "dev", ttl_seconds: float = 12 * 3600) -> str:
    """A token for `user` in `project_id`, valid for `ttl_seconds`."""
    if not USER_PATTERN.match(user):
        raise ValueError(f"user {user!r} must match {USER_PATTERN.pattern}")
    now = int(time.time())
    claims = {
        "prj": project_id,
        "sub": user,
        "aud": AUDIENCE,
        "iat": now,
        "exp": now + int(ttl_seconds),
    }
    return jwt.encode(claims, secret, algorithm=ALGORITHM)


def verify(secret: str, token: str | None) -> Principal:
    """The token's principal, or `unauthorized` (missing, forged, expired or malformed)."""
    if not token:
        raise DomainError(ErrorCode.UNAUTHORIZED, "a token is required (agentbus token <project>)")
    try:
        claims = jwt.decode(
            token,
            secret,
            algorithms=[ALGORITHM],
            audience=AUDIENCE,
            options={"require": ["exp", "prj", "sub"]},
        )
    except jwt.ExpiredSignatureError:
        raise DomainError(ErrorCode.UNAUTHORIZED, "the token has expired; mint a new one") from None
    except jwt.InvalidTokenError as exc:
        raise DomainError(ErrorCode.UNAUTHORIZED, f"the token is not valid: {exc}") from None
    project, user = claims.get("prj"), claims.get("sub")
    if not isinstance(project, str) or not isinstance(user, str) or not USER_PATTERN.match(user):
        raise DomainError(ErrorCode.UNAUTHORIZED, "the token names no project or user")
    return Principal(project, user, float(claims["exp"]))


def require_project(principal: Principal, project_id: str) -> None:
    """A token for one project can do nothing in another."""
    if principal.project_id != project_id:
        raise DomainError(
            ErrorCode.FORBIDDEN, f"this token is for project {principal.project_id!r} only"
        )
