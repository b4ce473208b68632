"""What every generated Kubernetes object shares: its labels and metadata, the
security contexts of its pods, the environment that reaches NATS and Postgres."""

from __future__ import annotations

from typing import Any

from devstack.deploygen.model import NATS_SECRET, PART_OF, PG_DATABASE, Deployed
from servicekit.natsconf import password_variable


def app_labels(name: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/component": component, **PART_OF}


def metadata(name: str, component: str, **extra: str) -> dict[str, Any]:
    return {"name": name, "labels": {**app_labels(name, component), **extra}}


def secret_env(name: str, secret: str, key: str, optional: bool = False) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def postgres_env(s: Deployed, host: str) -> list[dict[str, Any]]:
    """Its own role (asyncpg reads PGUSER/PGPASSWORD), on its database."""
    return [
        {"name": "DATABASE_URL", "value": f"postgresql://{host}:5432/{PG_DATABASE}"},
        secret_env("PGUSER", s.role_secret, "username"),
        secret_env("PGPASSWORD", s.role_secret, "password"),
    ]


def nats_env(user: str) -> list[dict[str, Any]]:
    return [
        {"name": "NATS_URL", "value": "nats://nats:4222"},
        {"name": "NATS_USER", "value": user},
        secret_env("NATS_PASSWORD", NATS_SECRET, password_variable(user)),
    ]


def container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_selector(s: Deployed) -> dict[str, Any]:
    """What selects the service's pods, or its Service (the same name label)."""
    return {"matchLabels": {"app.kubernetes.io/name": s.dns}}
