"""Every secret the deployment reads, made with new random values: the k8s Secrets
(`agentbus deploy-config --secrets`) and docker-compose's .env (`agentbus secrets`)."""

from __future__ import annotations

import secrets
from typing import Any

import yaml

from devstack.deploygen.model import GATEWAY_SECRET, NAMESPACE, NATS_SECRET, PART_OF, Deployed
from devstack.deploygen.postgres import BACKUP_KEYS, BACKUP_SECRET
from servicekit.natsconf import password_variable
from servicekit.permissions import ADMIN, USERS


def secrets_manifest(services: list[Deployed]) -> str:
    """Every Secret the deployment reads, with new random values (`--secrets`)."""
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": NATS_SECRET, "namespace": NAMESPACE, "labels": PART_OF},
            "type": "Opaque",
            "stringData": {
                password_variable(u): secrets.token_urlsafe(24) for u in USERS if u != ADMIN
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": GATEWAY_SECRET, "namespace": NAMESPACE, "labels": PART_OF},
            "type": "Opaque",
            "stringData": {"AGENTBUS_GATEWAY_SECRET": secrets.token_urlsafe(32)},
        },
    ]
    # The object store's keys. In dev they are MinIO's own root user (overlays/dev);
    # in production, replace them with the keys of your bucket (deploy/k8s/README.md).
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": BACKUP_SECRET, "namespace": NAMESPACE, "labels": PART_OF},
            "type": "Opaque",
            "stringData": {key: secrets.token_urlsafe(24) for key in BACKUP_KEYS},
        }
    )
    for s in services:
        if s.schema is None:
            continue
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": s.role_secret,
                    "namespace": NAMESPACE,
                    # CloudNativePG reconciles the role's password from it.
                    "labels": {**PART_OF, "cnpg.io/reload": "true"},
                },
                "type": "kubernetes.io/basic-auth",
                "stringData": {"username": s.name, "password": secrets.token_urlsafe(24)},
            }
        )
    return yaml.safe_dump_all(docs, sort_keys=False)


def compose_secrets() -> str:
    """Every secret docker-compose.yml requires, with new random values, as .env lines
    (`agentbus secrets`). URL-safe: POSTGRES_PASSWORD goes into DATABASE_URL."""
    values = {password_variable(u): secrets.token_urlsafe(24) for u in USERS if u != ADMIN}
    values["POSTGRES_PASSWORD"] = secrets.token_urlsafe(24)
    values["AGENTBUS_GATEWAY_SECRET"] = secrets.token_urlsafe(32)
    lines = [
        "# docker-compose's secrets, from `agentbus secrets`: keep this file to yourself.",
        *(f"{name}={value}" for name, value in values.items()),
    ]
    return "".join(f"{line}\n" for line in lines)
