"""Traces can be switched on in every deployment, and are off by default (offline).

servicekit.telemetry reads the standard OpenTelemetry variables: `OTEL_TRACES_EXPORTER`
(`none` unless set), `OTEL_EXPORTER_OTLP_ENDPOINT` (the collector, OTLP/HTTP) and
`OTEL_SERVICE_NAME`. Every service gets the same ones in docker-compose (from `.env` or
the shell, empty by default) and in both Kubernetes overlays (the `agentbus-telemetry`
ConfigMap every Deployment reads), its own name aside.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack.deploycheck import build
from devstack.deploygen import deployed_services
from servicekit.telemetry import exporter_choice

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_INFRASTRUCTURE = {"nats", "nats-2", "nats-3", "postgres", "provision"}
# `${NAME}` or `${NAME:-default}`, as compose reads them
VARIABLE = re.compile(r"\$\{(?P<name>[A-Z0-9_]+)(?::-(?P<default>[^}]*))?\}")
OFF = {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": ""}


def interpolate(value: str, environment: Mapping[str, str]) -> str:
    """A compose value with its variables resolved from `environment`."""
    return VARIABLE.sub(lambda m: environment.get(m["name"]) or (m["default"] or ""), str(value))


def tracing(env: Mapping[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in env.items() if k.startswith("OTEL_")}


def assert_off(settings: Mapping[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The process servicekit would configure with these settings records nothing."""
    with monkeypatch.context() as m:
        for key, value in settings.items():
            m.setenv(key, value)
        assert exporter_choice() == "none"


def test_every_compose_service_has_the_same_tracing_settings_off_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    deployed = deployed_services()
    assert {n for n in services if n not in COMPOSE_INFRASTRUCTURE} == {s.dns for s in deployed}

    for s in deployed:
        settings = tracing(services[s.dns]["environment"])
        assert settings == {
            "OTEL_SERVICE_NAME": s.name,
            "OTEL_TRACES_EXPORTER": "${OTEL_TRACES_EXPORTER:-none}",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "${OTEL_EXPORTER_OTLP_ENDPOINT:-}",
        }, s.name
        unset = {k: interpolate(v, {}) for k, v in settings.items()}
        assert unset == {**OFF, "OTEL_SERVICE_NAME": s.name}
        assert_off(unset, monkeypatch)
        # and switched on from .env or the shell
        on = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318"}
        assert {k: interpolate(v, on) for k, v in settings.items()} == {
            **on,
            "OTEL_SERVICE_NAME": s.name,
        }


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_every_k8s_service_reads_the_same_tracing_settings_off_by_default(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = build(ROOT / "deploy" / "k8s" / "overlays" / overlay)
    configs = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    # The services' Deployments (dev also runs MinIO, which sends no traces).
    deployments = {
        d["metadata"]["name"]: d
        for d in docs
        if d["kind"] == "Deployment"
        and d["metadata"]["labels"].get("app.kubernetes.io/component") == "service"
    }
    deployed = deployed_services()
    assert set(deployments) == {s.dns for s in deployed}

    for s in deployed:
        [container] = deployments[s.dns]["spec"]["template"]["spec"]["containers"]
        settings: dict[str, str] = {}
        for source in container.get("envFrom", []):
            settings |= tracing(configs[source["configMapRef"]["name"]])
        # a variable of `env` wins over the same one from `envFrom`
        settings |= tracing({e["name"]: e.get("value") for e in container["env"]})
        assert settings == {**OFF, "OTEL_SERVICE_NAME": s.name}, s.name
        assert_off(settings, monkeypatch)
