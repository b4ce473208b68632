"""deploy/monitoring, offline: the Prometheus alert rules and the Grafana dashboard parse,
have the shape their tools load, every PromQL expression is valid (promql-parser), and
every series they name is one the services export (servicekit.metrics, metering's LLM
series, Criativo's actors, the gateway's WebSocket and HTTP series), one the rules
record, or Prometheus' own `up` — so a renamed metric cannot leave a silent alert
behind. Every alert names its runbook, docs/runbooks/<alert>.md, and the runbook exists."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import promql_parser
import yaml
from prometheus_client import REGISTRY

import criativo.actors
import gateway.metrics
import metering.metrics
import servicekit.metrics

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "deploy" / "monitoring"
# The services' series, the recorded ones (`agentbus:…`) and the one Prometheus writes for
# every target it scrapes.
SERIES = re.compile(r"\bagentbus_[a-z0-9_]+|\bagentbus:[a-z0-9_:]+|\bup\b")
PROMETHEUS_SERIES = {"up"}
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "gauge": ("",),
}
# What the issue asks the alerts to catch.
REQUIRED_ALERTS = {
    "AgentbusOutboxStale",
    "AgentbusDeadLetter",
    "AgentbusConsumerLagGrowing",
    "AgentbusProviderErrorRate",
    "AgentbusBudgetExhaustion",
    "AgentbusSlowClientClosesRising",
    "AgentbusTargetDown",
    "AgentbusTargetAbsent",
    "AgentbusCommandErrorBudgetBurn",
    "AgentbusCommandErrorBudgetSlowBurn",
    "AgentbusCommandLatencyBudgetBurn",
    "AgentbusCommandLatencyBudgetSlowBurn",
    "AgentbusProjectBudget80",
}


def exported() -> set[str]:
    """Every series name the services' code registers (labelled or not)."""
    assert (
        servicekit.metrics and metering.metrics and criativo.actors and gateway.metrics
    )  # registered
    names: set[str] = set()
    for family in REGISTRY.collect():
        if family.name.startswith("agentbus_"):
            names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
    return names


def check_expression(expr: str, known: set[str]) -> None:
    promql_parser.parse(expr)  # raises ValueError on a syntax error
    named = set(SERIES.findall(expr))
    assert named, f"names no agentbus series: {expr}"
    assert named <= known, f"unknown series {sorted(named - known)} in: {expr}"


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((MONITORING / "alerts.yaml").read_text())["groups"]
    assert all(isinstance(g["name"], str) for g in groups)
    return [r for g in groups for r in g["rules"]]


def test_the_alert_rules_load_and_name_exported_series() -> None:
    recorded = [r for r in rules() if "record" in r]
    alerts = [r for r in rules() if "alert" in r]
    known = exported() | {r["record"] for r in recorded} | PROMETHEUS_SERIES
    assert len(recorded) + len(alerts) == len(rules())
    assert {a["alert"] for a in alerts} >= REQUIRED_ALERTS
    for rule in recorded:
        assert set(rule) <= {"record", "expr", "labels"}
        check_expression(rule["expr"], exported())
    for alert in alerts:
        assert set(alert) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
        assert alert["labels"]["severity"] in {"warning", "critical"}
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]
        if "for" in alert:
            promql_parser.parse_duration(alert["for"])
        check_expression(alert["expr"], known)


def test_every_alert_has_its_runbook() -> None:
    for alert in [r for r in rules() if "alert" in r]:
        runbook = f"docs/runbooks/{alert['alert']}.md"
        assert alert["annotations"].get("runbook_url") == runbook, alert["alert"]
        text = (ROOT / runbook).read_text()
        # what it means, how to look, what to do
        assert text.startswith(f"# {alert['alert']}\n"), runbook
        for heading in ("## What it means", "## How to look", "## What to do"):
            assert f"\n{heading}\n" in text, (runbook, heading)


def test_the_dashboard_loads_and_names_exported_series() -> None:
    dashboard = json.loads((MONITORING / "agentbus-dashboard.json").read_text())
    known = exported()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    graphs = [p for p in panels if p["type"] != "row"]
    assert graphs
    for panel in graphs:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            check_expression(target["expr"], known)
    covered = {name for p in graphs for t in p["targets"] for name in SERIES.findall(t["expr"])}
    # every exported family appears on some panel
    families = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in known}
    shown = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in covered}
    assert families <= shown, f"not on the dashboard: {sorted(families - shown)}"


def test_an_unknown_series_or_bad_promql_is_caught() -> None:
    known = exported()
    for broken in ("rate(agentbus_no_such_total[5m])", "sum(rate(agentbus_llm_calls_total[5m])"):
        try:
            check_expression(broken, known)
        except (AssertionError, ValueError):
            continue
        raise AssertionError(f"accepted: {broken}")
