"""deploy/k8s/monitoring/: what Prometheus scrapes, its rules, Grafana's dashboard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from devstack.deploygen.k8s import metadata, pod_selector
from devstack.deploygen.model import K8S, NAMESPACE, PART_OF, PG_CLUSTER, PG_POOLER, Deployed
from devstack.deploygen.render import dump, dump_blocks

# The Prometheus Operator's objects (kube-prometheus-stack), apart from the base so a
# cluster without its CRDs can leave them out of its overlay (deploy/k8s/README.md).
MONITORING = K8S / "monitoring"
# The one source of the rules and the dashboard; rule_files and Grafana's import read
# them as they are, the PrometheusRule and the dashboard's ConfigMap are derived here.
ALERTS = Path("deploy/monitoring/alerts.yaml")
DASHBOARD = Path("deploy/monitoring/agentbus-dashboard.json")
SCRAPE_INTERVAL = "30s"
# Prometheus keeps this pod label on every series it scrapes from agentbus' own pods
# (`app_kubernetes_io_part_of="agentbus"`): what the target-down alerts select on.
TARGET_LABELS = list(PART_OF)
# The NATS servers' exporter sidecar (nats.yaml) and CloudNativePG's: their metrics ports.
NATS_EXPORTER_PORT = "prom-metrics"
CNPG_METRICS_PORT = "metrics"


def service_monitor(s: Deployed) -> dict[str, Any]:
    """Prometheus scrapes every replica of `s` through its Service's metrics port."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata(s.dns, "service"),
        "spec": {
            "selector": pod_selector(s),
            "endpoints": [{"port": "metrics", "path": "/metrics", "interval": SCRAPE_INTERVAL}],
            "podTargetLabels": TARGET_LABELS,
        },
    }


def _pod_monitor(name: str, selector: dict[str, str], port: str) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": metadata(name, "monitoring"),
        "spec": {
            "selector": {"matchLabels": selector},
            "podMetricsEndpoints": [{"port": port, "interval": SCRAPE_INTERVAL}],
            "podTargetLabels": TARGET_LABELS,
        },
    }


def pod_monitors() -> list[dict[str, Any]]:
    """NATS (its exporter sidecar), the Postgres instances and the pooler.

    CloudNativePG's own `spec.monitoring.enablePodMonitor` is deprecated (1.30's CRD:
    "create a PodMonitor manually"), so the cluster's and the pooler's are written here,
    selecting the labels the operator gives their pods.
    """
    return [
        _pod_monitor("nats", {"app.kubernetes.io/name": "nats"}, NATS_EXPORTER_PORT),
        _pod_monitor(PG_CLUSTER, {"cnpg.io/cluster": PG_CLUSTER}, CNPG_METRICS_PORT),
        _pod_monitor(PG_POOLER, {"cnpg.io/poolerName": PG_POOLER}, CNPG_METRICS_PORT),
    ]


def prometheus_rule(alerts: dict[str, Any]) -> dict[str, Any]:
    """deploy/monitoring/alerts.yaml as the Prometheus Operator loads it."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": metadata("agentbus", "monitoring"),
        "spec": {"groups": alerts["groups"]},
    }


def dashboard_config(dashboard: str) -> dict[str, Any]:
    """The Grafana dashboard, for the Grafana sidecar that loads labelled ConfigMaps."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata("agentbus-dashboard", "monitoring", grafana_dashboard="1"),
        "data": {DASHBOARD.name: dashboard},
    }


def monitoring_files(root: Path, services: list[Deployed]) -> dict[Path, str]:
    """deploy/k8s/monitoring/: what Prometheus scrapes, its rules, Grafana's dashboard."""
    alerts = yaml.safe_load((root / ALERTS).read_text())
    dashboard = dashboard_config((root / DASHBOARD).read_text())
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": NAMESPACE,
        "resources": ["monitors.yaml", "prometheus-rule.yaml", "dashboard.yaml"],
    }
    monitors = [*(service_monitor(s) for s in services), *pod_monitors()]
    return {
        MONITORING / "kustomization.yaml": dump([kustomization]),
        MONITORING / "monitors.yaml": dump(monitors),
        MONITORING / "prometheus-rule.yaml": dump_blocks(prometheus_rule(alerts), RULE_HEADER),
        MONITORING / "dashboard.yaml": dump_blocks(dashboard, DASHBOARD_HEADER),
    }


RULE_HEADER = """\
# deploy/monitoring/alerts.yaml (the rules' one source: edit it, then
# `make deploy-config`) as a PrometheusRule.
"""
DASHBOARD_HEADER = """\
# deploy/monitoring/agentbus-dashboard.json (edit it, then `make deploy-config`) for
# Grafana's dashboard sidecar, which loads every ConfigMap labelled grafana_dashboard: "1".
"""
