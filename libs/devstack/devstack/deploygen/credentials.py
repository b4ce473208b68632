"""Every secret the deployment reads, made with new random values: the k8s Secrets
(`agentbus deploy-config --secrets`) and docker-compose's .env (`agentbus secrets`).

A running deployment's Secrets are filled in, never rotated (`--keep`): given the
Secrets the cluster holds, every value there is kept and only what is missing — a new
service's NATS password or database role, a Secret not created yet — is made, so one
`kubectl apply` after adding a service is the whole secrets step."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping
from typing import Any

import yaml

from devstack.deploygen.model import GATEWAY_SECRET, NAMESPACE, NATS_SECRET, PART_OF, Deployed
from devstack.deploygen.postgres import BACKUP_KEYS, BACKUP_SECRET
from servicekit.natsconf import password_variable
from servicekit.permissions import ADMIN, USERS


def secrets_manifest(
    services: list[Deployed], keep: Mapping[str, Mapping[str, str]] | None = None
) -> str:
    """Every Secret the deployment reads, with new random values (`--secrets`); with
    `keep` (each Secret's `data` as the cluster holds it, `cluster_secrets`), those
    values are kept and only the missing ones are new."""
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
    if keep is not None:
        docs = [_filled(doc, keep.get(doc["metadata"]["name"], {})) for doc in docs]
    return yaml.safe_dump_all(docs, sort_keys=False)


def _filled(doc: dict[str, Any], held: Mapping[str, str]) -> dict[str, Any]:
    """The Secret as `data` (what `kubectl get` shows): the values the cluster holds, kept
    (keys of its own included), and a new one for each key it lacks. Whole, so that
    `kubectl apply` of it, again and again, changes nothing once nothing is missing."""
    made = {key: _b64(value) for key, value in doc.pop("stringData").items()}
    return {**doc, "data": {**made, **held}}


def _b64(value: str) -> str:
    return base64.b64encode(value.encode()).decode()


def cluster_secrets(text: str) -> dict[str, dict[str, str]]:
    """Each Secret's `data` from `kubectl get secrets -o yaml` (a `List`) or a stream of
    Secret documents; anything else is refused, so a wrong file rotates nothing."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"not YAML: {exc}") from None
    items = [i for d in docs for i in (d.get("items", []) if d.get("kind") == "List" else [d])]
    held: dict[str, dict[str, str]] = {}
    for item in items:
        if not isinstance(item, dict) or item.get("kind") != "Secret":
            found = item.get("kind") if isinstance(item, dict) else type(item).__name__
            raise ValueError(f"expected Secrets (kubectl get secrets -o yaml), found {found}")
        held[item["metadata"]["name"]] = dict(item.get("data") or {})
    return held


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
