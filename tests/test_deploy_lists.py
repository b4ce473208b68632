"""The services run by `make up`, docker-compose and deploy/k8s are one list (offline).

The catalog (`contracts.catalog.ACCESS`) gives every service its NATS user; each service
declares itself with an `agentbus.services` entry point in its own pyproject, which is
how the launcher finds it. docker-compose and the k8s manifests are written by hand, so
these tests fail on any drift between them: a service missing from one place, a stale
one left in another, a container running another module than the entry point names.
"""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path
from typing import Any

import yaml

from contracts import catalog
from devstack.services import discover, web_links

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
# Containers of docker-compose that are not agentbus services.
COMPOSE_INFRASTRUCTURE = {"nats", "postgres", "provision"}

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
    resources: list[str] = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    return resources


def k8s_deployments() -> dict[str, dict[str, Any]]:
    """Every Deployment kustomize applies, by name."""
    deployments = {}
    for resource in k8s_resources():
        for doc in yaml.safe_load_all((K8S / resource).read_text()):
            if doc and doc["kind"] == "Deployment":
                deployments[doc["metadata"]["name"]] = doc
    return deployments


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
        assert f"{dns_name(name)}.yaml" in k8s_resources()
        [container] = deployments[dns_name(name)]["spec"]["template"]["spec"]["containers"]
        assert container["args"] == [module], name
        assert {"name": "NATS_USER", "value": name} in container["env"]


def test_every_service_manifest_is_applied() -> None:
    # a manifest written for a service but left out of kustomization (the gateway was)
    applied = set(k8s_resources())
    for service in CATALOG:
        assert f"{dns_name(service)}.yaml" in applied, service
    for manifest in K8S.glob("*.yaml"):
        if manifest.name.endswith(".example.yaml") or manifest.name == "kustomization.yaml":
            continue
        assert manifest.name in applied, manifest.name


def test_the_web_services_have_a_k8s_service_for_their_port() -> None:
    for name in web_links():
        docs = yaml.safe_load_all((K8S / f"{dns_name(name)}.yaml").read_text())
        services = [d for d in docs if d and d["kind"] == "Service"]
        assert [s["metadata"]["name"] for s in services] == [dns_name(name)]


def test_the_root_tooling_covers_every_service_package() -> None:
    # The workspace root installs, type-checks and layer-checks the services by name;
    # a service package left out of one of those lists would escape that check.
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    modules = entry_modules()
    packages = {
        tomllib.loads(p.read_text())["project"]["name"]: p.parent
        for p in (ROOT / "services").glob("*/pyproject.toml")
    }
    layers, independent, forbidden = root["tool"]["importlinter"]["contracts"]
    services_layer = {name.strip() for name in layers["layers"][1].split("|")}

    assert {path.name for path in packages.values()} == set(modules.values())
    assert set(packages) <= set(root["project"]["dependencies"])
    assert set(packages) <= set(root["tool"]["uv"]["sources"])
    for module in modules.values():
        assert f"services/{module}" in root["tool"]["mypy"]["mypy_path"], module
        assert module in root["tool"]["ruff"]["lint"]["isort"]["known-first-party"], module
        assert module in root["tool"]["importlinter"]["root_packages"], module
        assert module in services_layer, module
    assert set(independent["modules"]) == set(modules.values())
    assert set(forbidden["forbidden_modules"]) == set(modules.values())
