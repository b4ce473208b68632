"""The tracing settings every service reads, in k8s (a ConfigMap) and in compose."""

from __future__ import annotations

from typing import Any

from devstack.deploygen.k8s import metadata

TELEMETRY_CONFIG = "agentbus-telemetry"
# Tracing as servicekit.telemetry reads it: off (`none`) until an operator names an
# exporter; an empty endpoint is OpenTelemetry's default (http://localhost:4318).
TELEMETRY_DEFAULTS = {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": ""}


def telemetry_config() -> dict[str, Any]:
    """The tracing settings every service reads (envFrom): off by default."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(TELEMETRY_CONFIG, "telemetry"),
        "data": dict(TELEMETRY_DEFAULTS),
    }


TELEMETRY_HEADER = """\
# Tracing for every service (servicekit/telemetry.py), read through `envFrom`: off
# (`none`). To send spans to an OpenTelemetry collector over OTLP/HTTP, set in an
# overlay (overlays/dev has the patch, commented), then restart the Deployments:
#   OTEL_TRACES_EXPORTER: otlp
#   OTEL_EXPORTER_OTLP_ENDPOINT: http://otel-collector.monitoring:4318
# Any other OTEL_* variable added here (OTEL_TRACES_SAMPLER, …) reaches every service.
"""
