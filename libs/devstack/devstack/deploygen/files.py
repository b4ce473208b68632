"""Every generated file and where it goes: writing them, and finding the committed ones
that differ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from devstack.deploygen.compose import compose_file
from devstack.deploygen.jobs import PROVISION_HEADER, migration_job, provision_job
from devstack.deploygen.model import BASE, NAMESPACE, Deployed, deployed_services
from devstack.deploygen.monitoring import monitoring_files
from devstack.deploygen.postgres import postgres
from devstack.deploygen.pyproject import PYPROJECT, pyproject_file
from devstack.deploygen.render import dump
from devstack.deploygen.telemetry import TELEMETRY_HEADER, telemetry_config
from devstack.deploygen.workloads import deployment, disruption_budget, ingress, service

COMPOSE = Path("docker-compose.yml")


STATIC_RESOURCES = ["namespace.yaml", "nats.yaml"]
GENERATED_RESOURCES = ["provision-job.yaml", "telemetry.yaml"]


def kustomization(services: list[Deployed]) -> dict[str, Any]:
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": NAMESPACE,
        "resources": [
            *STATIC_RESOURCES,
            *GENERATED_RESOURCES,
            "network-policies.yaml",
            "postgres.yaml",
            *(f"services/{s.dns}.yaml" for s in services),
        ],
    }


def service_manifest(s: Deployed) -> list[dict[str, Any]]:
    docs = [deployment(s), disruption_budget(s), service(s)]
    if s.web:
        docs.append(ingress(s))
    if s.schema is not None:
        docs.append(migration_job(s))
    return docs


def k8s_files(services: list[Deployed]) -> dict[Path, str]:
    """Every generated file under deploy/k8s, by path relative to the repository."""
    files = {
        BASE / "kustomization.yaml": dump([kustomization(services)]),
        BASE / "postgres.yaml": dump(postgres(services)),
        BASE / "provision-job.yaml": dump([provision_job()], PROVISION_HEADER),
        BASE / "telemetry.yaml": dump([telemetry_config()], TELEMETRY_HEADER),
    }
    for s in services:
        why = f"# {s.dns}: requests {s.sizing.cpu} CPU, from {s.sizing.why}.\n"
        files[BASE / "services" / f"{s.dns}.yaml"] = dump(service_manifest(s), why)
    return files


def generated_files(root: Path, services: list[Deployed] | None = None) -> dict[Path, str]:
    """Every generated file, by path relative to the repository root."""
    services = deployed_services() if services is None else services
    files = k8s_files(services)
    files.update(monitoring_files(root, services))
    files[COMPOSE] = compose_file((root / COMPOSE).read_text(), services)
    files[PYPROJECT] = pyproject_file((root / PYPROJECT).read_text(), services)
    return files


def write(root: Path) -> list[Path]:
    """Write every generated file under `root`; remove stale per-service manifests."""
    files = generated_files(root)
    stale = set((root / BASE / "services").glob("*.yaml")) - {root / p for p in files}
    for path in stale:
        path.unlink()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return sorted(root / p for p in files)


def stale(root: Path) -> list[Path]:
    """The generated files that differ from what is committed under `root` (or are extra)."""
    files = generated_files(root)
    differ = [rel for rel, text in files.items() if _read(root / rel) != text]
    extra = [
        p.relative_to(root)
        for p in (root / BASE / "services").glob("*.yaml")
        if p.relative_to(root) not in files
    ]
    return differ + extra


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None
