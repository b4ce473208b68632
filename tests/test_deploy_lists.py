"""The services run by `make up`, docker-compose and deploy/k8s are one list (offline).

The catalog (`contracts.catalog.ACCESS`) gives every service its NATS user; each service
declares itself with an `agentbus.services` entry point in its own pyproject, which is
how the launcher finds it. The per-service deploy files are generated from those
(`agentbus deploy-config --write`); these tests fail when a committed file is stale, and
on any drift between the lists: a service missing from one place, a stale one left in
another, a container running another module than the entry point names.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from contracts import catalog
from devstack import deploygen
from devstack.deploycheck import build, check, validate
from devstack.services import declared, discover, web_links

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
# Containers of docker-compose that are not agentbus services.
COMPOSE_INFRASTRUCTURE = {"nats", "nats-2", "nats-3", "postgres", "provision"}

CATALOG = [access.service for access in catalog.ACCESS]


def dns_name(service: str) -> str:
    """A service's name in compose and k8s (`session_events` → `session-events`)."""
    return service.replace("_", "-")


def entry_modules() -> dict[str, str]:
    return {spec.name: spec.module for spec in discover()}


def compose_services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    return {name: s for name, s in services.items() if name not in COMPOSE_INFRASTRUCTURE}


def k8s_resources() -> list[str]:
    resources: list[str] = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    return resources


def k8s_built(overlay: str = "prod") -> list[dict[str, Any]]:
    """What `kubectl apply -k deploy/k8s/overlays/<overlay>` applies."""
    return build(K8S / "overlays" / overlay)


def k8s_of_kind(kind: str, overlay: str = "prod") -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in k8s_built(overlay) if d["kind"] == kind}


def k8s_deployments() -> dict[str, dict[str, Any]]:
    """Every Deployment kustomize applies, by name."""
    return k8s_of_kind("Deployment")


def test_the_committed_deploy_files_are_what_the_generator_writes() -> None:
    # after adding a service or changing its declaration: `make deploy-config`
    assert deploygen.stale(ROOT) == []


def test_every_catalog_service_is_installed_with_an_entry_point_in_start_order() -> None:
    modules = entry_modules()

    assert list(modules) == CATALOG
    for name, module in modules.items():
        assert importlib.util.find_spec(f"{module}.__main__") is not None, name


def test_web_links_come_from_installed_services() -> None:
    assert set(web_links()) <= set(CATALOG)
    assert web_links(), "no service serves the web client"


def test_docker_compose_runs_each_service_once_under_its_name() -> None:
    modules = entry_modules()
    services = compose_services()

    assert set(services) == {dns_name(s) for s in modules}
    for name, module in modules.items():
        spec = services[dns_name(name)]
        assert spec["command"] == [module], name
        assert spec["environment"]["NATS_USER"] == name


def test_docker_compose_publishes_the_web_services_port() -> None:
    services = compose_services()

    for name in web_links():
        assert services[dns_name(name)].get("ports"), name


def test_kustomize_applies_a_deployment_for_each_service_and_no_other() -> None:
    modules = entry_modules()
    deployments = k8s_deployments()

    assert set(deployments) == {dns_name(s) for s in modules}
    for name, module in modules.items():
        assert f"services/{dns_name(name)}.yaml" in k8s_resources()
        [container] = deployments[dns_name(name)]["spec"]["template"]["spec"]["containers"]
        assert container["args"] == [module], name
        assert {"name": "NATS_USER", "value": name} in container["env"]


def test_every_service_manifest_is_applied() -> None:
    # a manifest written for a service but left out of kustomization (the gateway was)
    applied = set(k8s_resources())
    for service in CATALOG:
        assert f"services/{dns_name(service)}.yaml" in applied, service
    for manifest in BASE.rglob("*.yaml"):
        if manifest.name == "kustomization.yaml":
            continue
        assert str(manifest.relative_to(BASE)) in applied, manifest.name


def test_the_web_services_have_a_k8s_service_and_ingress_for_their_port() -> None:
    services, ingresses = k8s_of_kind("Service"), k8s_of_kind("Ingress")

    assert set(ingresses) == {dns_name(name) for name in web_links()}
    for name in web_links():
        ports = {p["name"] for p in services[dns_name(name)]["spec"]["ports"]}
        assert "http" in ports, name
        backend = ingresses[dns_name(name)]["spec"]["rules"][0]["http"]["paths"][0]["backend"]
        assert backend["service"] == {"name": dns_name(name), "port": {"name": "http"}}


def test_every_service_has_a_disruption_budget_and_a_migration_job_with_a_schema() -> None:
    budgets = k8s_of_kind("PodDisruptionBudget")
    # a Job's name carries a hash of what it runs; its name label does not
    jobs = {j["metadata"]["labels"]["app.kubernetes.io/name"] for j in k8s_of_kind("Job").values()}
    [cluster] = k8s_of_kind("Cluster").values()
    [database] = k8s_of_kind("Database").values()
    roles = {r["name"]: r for r in cluster["spec"]["managed"]["roles"]}
    schemas = {s["name"]: s["owner"] for s in database["spec"]["schemas"]}

    for spec in discover():
        schema = declared(spec).schema
        assert dns_name(spec.name) in budgets, spec.name
        assert (f"migrate-{dns_name(spec.name)}" in jobs) == (schema is not None), spec.name
        if schema is not None:
            # its own role, owning its own schema and nothing else
            assert roles[spec.name]["passwordSecret"] == {
                "name": f"agentbus-pg-{dns_name(spec.name)}"
            }
            assert schemas[schema] == spec.name
    assert set(roles) == set(schemas.values())


def test_the_root_tooling_covers_every_service_package() -> None:
    # The workspace installs every member by its glob (`uv sync --all-packages`); the
    # root's type-check and layer lists are generated (`make deploy-config`). A service
    # package left out of one of them would escape that check.
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    modules = entry_modules()
    packages = {
        tomllib.loads(p.read_text())["project"]["name"]: p.parent
        for p in (ROOT / "services").glob("*/pyproject.toml")
    }
    # The generated contracts come first; those written by hand below the block follow.
    layers, independent, forbidden, no_testkit, *_ = root["tool"]["importlinter"]["contracts"]
    services_layer = {name.strip() for name in layers["layers"][1].split("|")}

    assert {path.name for path in packages.values()} == set(modules.values())
    assert "services/*" in root["tool"]["uv"]["workspace"]["members"]
    assert not set(packages) & set(root["project"]["dependencies"])
    assert "sync --frozen --all-packages" in (ROOT / "Makefile").read_text()
    assert (ROOT / "Dockerfile").read_text().count("uv sync --frozen --no-dev --all-packages") == 2
    assert "services/*" in root["tool"]["ruff"]["src"]  # first-party for isort
    for module in modules.values():
        assert f"services/{module}" in root["tool"]["mypy"]["mypy_path"], module
        assert module in root["tool"]["importlinter"]["root_packages"], module
        assert module in services_layer, module
    assert set(independent["modules"]) == set(modules.values())
    assert set(forbidden["forbidden_modules"]) == set(modules.values())
    assert set(modules.values()) <= set(no_testkit["source_modules"])
    assert no_testkit["forbidden_modules"] == ["testkit"]


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_the_overlays_build_as_kubectl_kustomize_builds_them(overlay: str) -> None:
    # make lint renders the overlays in Python (no kustomize on PyPI for 3.11); where
    # kubectl is installed, its kustomize must give the same objects.
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    built = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout

    def by_name(docs: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
        return {(d["kind"], d["metadata"]["name"]): d for d in docs if d}

    assert by_name(k8s_built(overlay)) == by_name(yaml.safe_load_all(built))


def test_the_overlays_and_compose_validate_and_a_wrong_field_is_caught() -> None:
    assert check(ROOT) == []
    [cluster] = k8s_of_kind("Cluster").values()
    cluster["spec"]["instancez"] = 3
    with pytest.raises(jsonschema.ValidationError):
        validate(cluster)


def test_a_stale_or_extra_generated_file_is_found_and_rewritten(tmp_path: Path) -> None:
    shutil.copytree(BASE, tmp_path / "deploy" / "k8s" / "base")
    shutil.copytree(K8S / "monitoring", tmp_path / "deploy" / "k8s" / "monitoring")
    shutil.copytree(ROOT / "deploy" / "monitoring", tmp_path / "deploy" / "monitoring")
    compose = (ROOT / "docker-compose.yml").read_text()
    (tmp_path / "docker-compose.yml").write_text(compose.replace("NATS_USER: handoff", "X: y"))
    gone = tmp_path / "deploy" / "k8s" / "base" / "services" / "gone.yaml"
    gone.write_text("{}\n")
    (tmp_path / "deploy" / "k8s" / "base" / "services" / "metering.yaml").unlink()

    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())

    assert set(map(str, deploygen.stale(tmp_path))) == {
        "docker-compose.yml",
        "deploy/k8s/base/services/metering.yaml",
        "deploy/k8s/base/services/gone.yaml",
    }
    deploygen.write(tmp_path)
    assert deploygen.stale(tmp_path) == []
    assert (tmp_path / "docker-compose.yml").read_text() == compose
    assert not gone.exists()
