"""Postgres is backed up and can be recovered to a point in time (offline).

Both overlays archive the cluster's WAL and take a daily base backup through the Barman
Cloud plugin, with a retention, the keys from a Secret; dev stores them in its own
MinIO, which the Postgres pods may reach; the restore manifest validates against the
vendored schemas and recovers to a target time from the same store.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack.deploycheck import build, validate
from devstack.deploygen import deployed_services, secrets_manifest

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = ROOT / "deploy" / "k8s" / "overlays"
RESTORE = ROOT / "deploy" / "k8s" / "restore" / "cluster-restore.yaml"
PLUGIN = "barman-cloud.cloudnative-pg.io"

Docs = list[dict[str, Any]]


def one(docs: Docs, kind: str, name: str | None = None) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return doc


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# How CloudNativePG 1.30 labels an instance pod of agentbus-db (pkg/specs/pods.go).
POSTGRES_POD = {
    "cnpg.io/cluster": "agentbus-db",
    "cnpg.io/podRole": "instance",
    "app.kubernetes.io/name": "postgresql",
    "app.kubernetes.io/component": "database",
    "app.kubernetes.io/managed-by": "cloudnative-pg",
}


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_the_cluster_archives_its_wal_and_is_backed_up_daily_with_a_retention(
    overlay: str,
) -> None:
    docs = build(OVERLAYS / overlay)
    cluster = one(docs, "Cluster", "agentbus-db")
    [archiver] = [p for p in cluster["spec"].get("plugins", []) if p.get("isWALArchiver")]
    assert archiver["name"] == PLUGIN
    assert "barmanObjectStore" not in cluster["spec"].get("backup", {})  # deprecated in 1.26
    store = one(docs, "ObjectStore", archiver["parameters"]["barmanObjectName"])
    configuration = store["spec"]["configuration"]
    assert configuration["destinationPath"].startswith("s3://")
    assert store["spec"]["retentionPolicy"].endswith("d")

    scheduled = one(docs, "ScheduledBackup")
    spec = scheduled["spec"]
    assert spec["cluster"]["name"] == cluster["metadata"]["name"]
    assert spec["method"] == "plugin" and spec["pluginConfiguration"]["name"] == PLUGIN
    assert spec["backupOwnerReference"] == "self"
    # once a day: an hour, every day of every month (CloudNativePG's cron has seconds)
    *_, hour, day, month, weekday = spec["schedule"].split()
    assert (day, month, weekday) == ("*", "*", "*") and hour.isdigit(), spec["schedule"]

    # The keys come from a Secret that `deploy-config --secrets` generates, never inline.
    generated = {
        s["metadata"]["name"]: s["stringData"]
        for s in yaml.safe_load_all(secrets_manifest(deployed_services()))
    }
    for ref in configuration["s3Credentials"].values():
        assert set(ref) == {"name", "key"} and ref["key"] in generated[ref["name"]]
    for doc in docs:
        validate(doc)


def test_dev_backs_up_to_its_own_minio_which_postgres_may_reach() -> None:
    docs = build(OVERLAYS / "dev")
    store = one(docs, "ObjectStore")
    assert store["spec"]["configuration"]["endpointURL"] == "http://minio:9000"
    minio = one(docs, "Deployment", "minio")
    service = one(docs, "Service", "minio")
    assert service["spec"]["ports"][0]["port"] == 9000
    pod = minio["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], pod)
    # MinIO's root user is the ObjectStore's keys, from the same Secret.
    env = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in minio["spec"]["template"]["spec"]["containers"][0]["env"]
        if "valueFrom" in e
    }
    keys = store["spec"]["configuration"]["s3Credentials"]
    assert env["MINIO_ROOT_USER"] == keys["accessKeyId"]
    assert env["MINIO_ROOT_PASSWORD"] == keys["secretAccessKey"]

    policies = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy"]
    egress = [
        rule
        for p in policies
        if "Egress" in p["policyTypes"]
        and selects(p["podSelector"].get("matchLabels", {}), POSTGRES_POD)
        for rule in p.get("egress", [])
    ]
    assert any(
        any(
            selects(peer.get("podSelector", {}).get("matchLabels", {"-": "-"}), pod)
            for peer in r.get("to", [])
        )
        and {"protocol": "TCP", "port": 9000} in r["ports"]
        for r in egress
    )
    ingress = [
        rule
        for p in policies
        if "Ingress" in p["policyTypes"] and selects(p["podSelector"].get("matchLabels", {}), pod)
        for rule in p.get("ingress", [])
    ]
    assert any(
        any(selects(peer["podSelector"]["matchLabels"], POSTGRES_POD) for peer in r["from"])
        and {"protocol": "TCP", "port": 9000} in r["ports"]
        for r in ingress
    )
    # prod has no MinIO: its bucket is the operator's, reached over HTTPS.
    assert not [d for d in build(OVERLAYS / "prod") if d["metadata"]["name"] == "minio"]


def test_the_restore_manifest_recovers_to_a_time_from_the_backups() -> None:
    [restore] = [d for d in yaml.safe_load_all(RESTORE.read_text()) if d]
    validate(restore)
    docs = build(OVERLAYS / "prod")
    cluster = one(docs, "Cluster", "agentbus-db")
    spec = restore["spec"]
    recovery = spec["bootstrap"]["recovery"]
    datetime.fromisoformat(recovery["recoveryTarget"]["targetTime"].replace("Z", "+00:00"))
    [source] = [c for c in spec["externalClusters"] if c["name"] == recovery["source"]]
    assert source["plugin"]["name"] == PLUGIN
    assert source["plugin"]["parameters"] == {
        "barmanObjectName": one(docs, "ObjectStore")["metadata"]["name"],
        "serverName": cluster["metadata"]["name"],
    }
    # It archives again, under its own name, never into the archive it recovers from.
    [archiver] = spec["plugins"]
    assert archiver["isWALArchiver"]
    assert archiver["parameters"]["serverName"] == restore["metadata"]["name"]
    assert restore["metadata"]["name"] != cluster["metadata"]["name"]
    # The services' roles and Secrets, as the generated cluster has them.
    assert spec["managed"] == cluster["spec"]["managed"]
    assert (recovery["database"], recovery["owner"]) == (
        cluster["spec"]["bootstrap"]["initdb"]["database"],
        cluster["spec"]["bootstrap"]["initdb"]["owner"],
    )
    # Its pods have the same network paths as the old cluster's (the policies select
    # every CloudNativePG cluster's pods, not one by name).
    restored_pod = {**POSTGRES_POD, "cnpg.io/cluster": restore["metadata"]["name"]}
    postgres = one(docs, "NetworkPolicy", "postgres")
    assert selects(postgres["spec"]["podSelector"]["matchLabels"], restored_pod)
    pooler = one(docs, "NetworkPolicy", "pooler")
    assert any(
        selects(peer["podSelector"]["matchLabels"], restored_pod)
        for rule in pooler["spec"]["egress"]
        for peer in rule.get("to", [])
    )
