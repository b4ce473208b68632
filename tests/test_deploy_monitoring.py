"""deploy/k8s/monitoring, offline: what kube-prometheus-stack scrapes, alerts on and shows.

Every service has a ServiceMonitor (generated, so a new service gets one), NATS and
Postgres have PodMonitors, and each scrape is one the NetworkPolicies let through from
the `monitoring` namespace. The PrometheusRule and the dashboard's ConfigMap are
derived from deploy/monitoring/ and go stale with it. The NATS servers run the Helm
chart's reloader and exporter sidecars, and a new NATS user rolls the servers.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from devstack import deploygen
from devstack.deploycheck import build, validate
from devstack.deployed import users_digest
from servicekit.permissions import USERS

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
MONITORING_NAMESPACE = {"kubernetes.io/metadata.name": "monitoring"}
# Pods the CloudNativePG operator makes (no manifest here): the labels it gives them,
# which the NetworkPolicies and the PodMonitors select on, and their exporters' ports.
OPERATOR_PODS = [
    (
        {
            "cnpg.io/cluster": deploygen.PG_CLUSTER,
            "app.kubernetes.io/managed-by": "cloudnative-pg",
            "app.kubernetes.io/component": "database",
        },
        {"metrics": 9187},
    ),
    ({"cnpg.io/poolerName": deploygen.PG_POOLER}, {"metrics": 9127}),
]

Doc = dict[str, Any]


def built(overlay: str = "prod") -> list[Doc]:
    return build(K8S / "overlays" / overlay)


def of_kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions with In) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def pods(docs: list[Doc]) -> list[tuple[dict[str, str], dict[str, int]]]:
    """Every kind of pod the deployment runs: its labels and its named container ports."""
    result = list(OPERATOR_PODS)
    for doc in docs:
        if doc["kind"] in {"Deployment", "StatefulSet"}:
            template = doc["spec"]["template"]
            ports = {
                p["name"]: p["containerPort"]
                for c in template["spec"]["containers"]
                for p in c.get("ports", [])
            }
            result.append((template["metadata"]["labels"], ports))
    return result


def scrapes(docs: list[Doc]) -> list[tuple[str, dict[str, str], int]]:
    """(monitor, pod labels, port number) for every pod a monitor scrapes."""
    services = of_kind(docs, "Service")
    found = []
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            targets = [
                s
                for s in services.values()
                if selects(doc["spec"]["selector"], s["metadata"]["labels"])
            ]
            assert targets, doc["metadata"]["name"]
            for service in targets:
                for endpoint in doc["spec"]["endpoints"]:
                    [port] = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
                    for labels, ports in pods(docs):
                        if selects({"matchLabels": service["spec"]["selector"]}, labels):
                            found.append(
                                (doc["metadata"]["name"], labels, ports[port["targetPort"]])
                            )
        elif doc["kind"] == "PodMonitor":
            matched = [(lb, p) for lb, p in pods(docs) if selects(doc["spec"]["selector"], lb)]
            assert matched, doc["metadata"]["name"]
            for labels, ports in matched:
                for endpoint in doc["spec"]["podMetricsEndpoints"]:
                    found.append((doc["metadata"]["name"], labels, ports[endpoint["port"]]))
    return found


def allowed_from_monitoring(docs: list[Doc], labels: dict[str, str], port: int) -> bool:
    """Some NetworkPolicy admits the `monitoring` namespace to this pod on this port."""
    for policy in of_kind(docs, "NetworkPolicy").values():
        if not selects(policy["spec"]["podSelector"], labels):
            continue
        for rule in policy["spec"].get("ingress", []):
            sources = rule.get("from", [])
            from_monitoring = not sources or any(
                "namespaceSelector" in s
                and "podSelector" not in s
                and selects(s["namespaceSelector"], MONITORING_NAMESPACE)
                for s in sources
            )
            if from_monitoring and any(p["port"] == port for p in rule.get("ports", [])):
                return True
    return False


def test_every_service_has_a_service_monitor_on_its_metrics_port() -> None:
    docs = built()
    monitors = of_kind(docs, "ServiceMonitor")

    assert set(monitors) == set(of_kind(docs, "Deployment"))
    scraped = {name for name, _, port in scrapes(docs) if port == deploygen.METRICS_PORT}
    assert scraped == set(monitors)


def test_a_new_service_gets_its_service_monitor_from_the_generator() -> None:
    [first, *_] = deploygen.deployed_services()
    newcomer = dataclasses.replace(first, name="new_service", module="new_service")
    files = deploygen.monitoring_files(ROOT, [*deploygen.deployed_services(), newcomer])
    monitors = yaml.safe_load_all(files[deploygen.MONITORING / "monitors.yaml"])

    [monitor] = [m for m in monitors if m["metadata"]["name"] == "new-service"]
    assert monitor["spec"]["selector"] == {"matchLabels": {"app.kubernetes.io/name": "new-service"}}


def test_nats_and_postgres_are_scraped_by_pod_monitors() -> None:
    docs = built()
    scraped = {(name, port) for name, _, port in scrapes(docs)}

    assert {("nats", 7777), ("agentbus-db", 9187), ("agentbus-pooler", 9127)} <= scraped
    # the operator's own PodMonitor is deprecated (1.30): the one above replaces it
    [cluster] = of_kind(docs, "Cluster").values()
    assert "enablePodMonitor" not in cluster["spec"].get("monitoring", {})


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_the_network_policies_let_prometheus_scrape_every_target(overlay: str) -> None:
    docs = built(overlay)
    found = scrapes(docs)

    assert found
    for name, labels, port in found:
        assert allowed_from_monitoring(docs, labels, port), (name, port)


def test_a_scrape_the_policies_refuse_is_found() -> None:
    docs = built()
    [policy] = [d for d in docs if d["metadata"]["name"] == "metrics-from-monitoring"]
    docs.remove(policy)

    refused = [
        n for n, labels, port in scrapes(docs) if not allowed_from_monitoring(docs, labels, port)
    ]
    assert set(refused) == set(of_kind(docs, "ServiceMonitor"))


def test_the_prometheus_rule_and_the_dashboard_come_from_deploy_monitoring() -> None:
    docs = built()
    [rule] = of_kind(docs, "PrometheusRule").values()
    dashboard = of_kind(docs, "ConfigMap")["agentbus-dashboard"]
    alerts = yaml.safe_load((ROOT / deploygen.ALERTS).read_text())

    assert rule["spec"]["groups"] == alerts["groups"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    [(name, text)] = dashboard["data"].items()
    assert name.endswith(".json")
    assert json.loads(text) == json.loads((ROOT / deploygen.DASHBOARD).read_text())


def test_an_edited_alert_or_dashboard_leaves_the_derived_files_stale(tmp_path: Path) -> None:
    for folder in ("deploy", "docker-compose.yml", "pyproject.toml"):
        source = ROOT / folder
        if source.is_dir():
            shutil.copytree(source, tmp_path / folder)
        else:
            shutil.copy(source, tmp_path / folder)
    assert deploygen.stale(tmp_path) == []
    alerts = tmp_path / deploygen.ALERTS
    alerts.write_text(alerts.read_text().replace("> 30", "> 60", 1))
    dashboard = tmp_path / deploygen.DASHBOARD
    dashboard.write_text(dashboard.read_text().replace('"agentbus"', '"agentbus-x"', 1))

    assert set(deploygen.stale(tmp_path)) == {
        deploygen.MONITORING / "prometheus-rule.yaml",
        deploygen.MONITORING / "dashboard.yaml",
    }


def test_a_wrong_field_in_a_monitoring_object_is_caught() -> None:
    docs = built()
    monitor = next(iter(of_kind(docs, "ServiceMonitor").values()))
    validate(monitor)
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)
    [rule] = of_kind(docs, "PrometheusRule").values()
    rule["spec"]["groups"][0]["rules"][0]["for"] = "one minute"
    with pytest.raises(jsonschema.ValidationError):
        validate(rule)


def test_nats_reloads_its_config_and_restarts_for_a_new_user() -> None:
    docs = built()
    [server] = of_kind(docs, "StatefulSet").values()
    template = server["spec"]["template"]
    containers = {c["name"]: c for c in template["spec"]["containers"]}
    [config] = [v for v in template["spec"]["volumes"] if v["name"] == "config"]
    files = of_kind(docs, "ConfigMap")[config["configMap"]["name"]]["data"]
    reloader = containers["reloader"]
    watched = [a for i, a in enumerate(reloader["args"]) if reloader["args"][i - 1] == "-config"]

    # the reloader signals the server's process, so they share the pod's process namespace
    assert template["spec"]["shareProcessNamespace"] is True
    assert {"-pid", "/var/run/nats/nats.pid"} <= set(reloader["args"])
    assert "pid_file: /var/run/nats/nats.pid" in files["nats.conf"]
    assert sorted(watched) == sorted(f"/etc/nats/{name}" for name in files)
    assert "http://localhost:8222/" in containers["prom-exporter"]["args"]
    # a password comes from the environment, read at start: a new user rolls the servers
    assert template["metadata"]["annotations"]["agentbus.io/nats-users"] == users_digest()
    assert users_digest([*USERS, "new_service"]) != users_digest()
    assert users_digest(reversed(USERS)) == users_digest()
