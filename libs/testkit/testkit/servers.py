"""The servers of a test run and the NATS identities that reach them."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit


@dataclass
class Servers:
    """Where the test servers listen, and the NATS users' passwords when it is secured."""

    nats_url: str
    database_url: str
    nats_secrets: dict[str, str] = field(default_factory=dict)
    nats_secrets_file: str | None = None


def with_credentials(url: str, user: str, password: str) -> str:
    """`url` carrying `user`'s credentials (what nats-py reads when given no others)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}"))


def without_credentials(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{parts.hostname}:{parts.port}"))


def identity_env(servers: Servers, service: str) -> dict[str, str]:
    """`NATS_USER`/`NATS_PASSWORD` of `service` on the secured server (none otherwise)."""
    password = servers.nats_secrets.get(service)
    if password is None:
        return {}
    return {"NATS_USER": service, "NATS_PASSWORD": password}
