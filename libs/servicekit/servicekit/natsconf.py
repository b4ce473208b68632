"""The nats-server authorization, generated from the contracts: users, passwords, accounts.

One application account (`AGENTBUS`, JetStream on) holds one user per service plus
`ops`, `provision` and (where wanted) `admin`; the system account `SYS` holds `sys`,
so `nats server report` works. No anonymous connection is accepted: there is no
`no_auth_user`. Passwords are either generated and kept in a file beside the embedded
server's data (never in the repository), or referenced as environment variables
(`$NATS_PASSWORD_GATEWAY`…) that docker-compose or a Kubernetes Secret fill in.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servicekit.permissions import ADMIN, APP_USERS, SYSTEM, USERS, permissions_of

APP_ACCOUNT = "AGENTBUS"
SYSTEM_ACCOUNT = "SYS"


@dataclass(frozen=True)
class Env:
    """A value nats-server reads from its environment when it loads the config."""

    name: str


def password_variable(user: str) -> str:
    """The environment variable holding `user`'s password (compose, k8s)."""
    return f"NATS_PASSWORD_{user.upper()}"


def load_or_create_secrets(path: Path, users: list[str] = USERS) -> dict[str, str]:
    """The users' passwords kept at `path` (mode 0600), generating any that is missing."""
    try:
        known: dict[str, str] = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    missing = [u for u in users if not known.get(u)]
    if missing:
        for user in missing:
            known[user] = secrets.token_urlsafe(24)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(known, f, indent=2)
        tmp.replace(path)
    return known


def read_secrets(path: Path) -> dict[str, str]:
    """The passwords at `path`; empty when there is no such file."""
    try:
        found: dict[str, str] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found


def _user(user: str, password: str | Env) -> dict[str, Any]:
    entry: dict[str, Any] = {"user": user, "password": password}
    perms = permissions_of(user)
    if perms is not None:
        entry["permissions"] = perms.as_config()
    return entry


def accounts_block(passwords: Mapping[str, str | Env], with_admin: bool = True) -> dict[str, Any]:
    """The `accounts` and `system_account` settings for every user of the bus."""
    app = [u for u in APP_USERS if with_admin or u != ADMIN]
    return {
        "accounts": {
            APP_ACCOUNT: {
                "jetstream": "enabled",
                "users": [_user(u, passwords[u]) for u in app],
            },
            SYSTEM_ACCOUNT: {"users": [_user(SYSTEM, passwords[SYSTEM])]},
        },
        "system_account": SYSTEM_ACCOUNT,
    }


def env_passwords() -> dict[str, str | Env]:
    """Every password as an environment reference, for configs that hold no secret."""
    return {u: Env(password_variable(u)) for u in USERS}


def render(settings: Mapping[str, Any]) -> str:
    """nats-server configuration text for `settings` (top level, one key a line)."""
    return "".join(f"{key}: {_value(value, 0)}\n" for key, value in settings.items())


def _value(value: Any, depth: int) -> str:
    pad = "  " * (depth + 1)
    if isinstance(value, Env):
        return f"${value.name}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        if not value:
            return "[]"
        items = "".join(f"{pad}{_value(v, depth + 1)}\n" for v in value)
        return f"[\n{items}{'  ' * depth}]"
    if isinstance(value, dict):
        items = "".join(f"{pad}{k}: {_value(v, depth + 1)}\n" for k, v in value.items())
        return f"{{\n{items}{'  ' * depth}}}"
    raise TypeError(f"cannot render {value!r} in a nats-server config")
