"""docker-compose and deploy/k8s run NATS with the users the contracts declare (offline).

The auth block committed for compose and k8s is what `agentbus nats-config` generates
now (no drift from the catalog), it holds no secret (nats-server refuses it without
the passwords in its environment and accepts it with them), and every service is
given its own user and only its own password.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from servicekit.embedded import nats_server_binary
from servicekit.natsconf import password_variable
from servicekit.permissions import ADMIN, SERVICES, USERS

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s" / "base"
DEPLOYED_USERS = [u for u in USERS if u != ADMIN]  # no unrestricted user outside a laptop


def generated_auth() -> str:
    return subprocess.run(
        [sys.executable, "-m", "devstack", "nats-config"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def k8s_documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def nats_configmap() -> dict[str, str]:
    [config] = [d for d in k8s_documents("nats.yaml") if d["kind"] == "ConfigMap"]
    data: dict[str, str] = config["data"]
    return data


def server_accepts(config_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [nats_server_binary(), "-t", "-c", str(config_dir / "nats.conf")],
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", ""), **env},
    )


def passwords() -> dict[str, str]:
    return {password_variable(u): f"pw-{u}" for u in DEPLOYED_USERS}


def test_the_committed_auth_blocks_are_what_the_catalog_generates() -> None:
    # after a change to the catalog: `make nats-config`
    expected = generated_auth()

    assert (ROOT / "deploy" / "nats" / "auth.conf").read_text() == expected
    assert nats_configmap()["auth.conf"] == expected


def test_no_password_is_written_in_the_auth_block() -> None:
    auth = generated_auth()
    values = re.findall(r"password: (\S+)", auth)

    assert len(values) == len(DEPLOYED_USERS)
    assert all(v.startswith("$NATS_PASSWORD_") for v in values)
    assert '"admin"' not in auth


def test_the_compose_nats_config_needs_and_takes_the_passwords() -> None:
    config_dir = ROOT / "deploy" / "nats"

    refused = server_accepts(config_dir, {})
    accepted = server_accepts(config_dir, passwords())

    assert refused.returncode != 0 and "NATS_PASSWORD_" in refused.stderr
    assert accepted.returncode == 0, accepted.stderr


def test_the_k8s_nats_config_needs_and_takes_the_passwords(tmp_path: Path) -> None:
    for name, text in nats_configmap().items():
        (tmp_path / name).write_text(text)
    env = {"POD_NAME": "nats-0"}

    assert server_accepts(tmp_path, env).returncode != 0
    accepted = server_accepts(tmp_path, {**env, **passwords()})
    assert accepted.returncode == 0, accepted.stderr
    [server] = [d for d in k8s_documents("nats.yaml") if d["kind"] == "StatefulSet"]
    containers = server["spec"]["template"]["spec"]["containers"]
    [container] = [c for c in containers if c["name"] == "nats"]
    assert {"secretRef": {"name": "agentbus-nats"}} in container["envFrom"]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def own_secret(user: str) -> dict[str, Any]:
    return {"secretKeyRef": {"name": "agentbus-nats", "key": password_variable(user)}}


@pytest.mark.parametrize("service", SERVICES)
def test_each_k8s_service_connects_as_itself(service: str) -> None:
    [deployment] = [
        d
        for d in k8s_documents(f"services/{service.replace('_', '-')}.yaml")
        if d["kind"] == "Deployment"
    ]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    env = env_of(container)

    assert container["args"] == [service]
    assert env["NATS_USER"] == service
    assert env["NATS_PASSWORD"] == own_secret(service)


def test_k8s_provisions_the_streams_in_a_job_as_the_provision_user() -> None:
    [job] = k8s_documents("provision-job.yaml")
    [container] = job["spec"]["template"]["spec"]["containers"]
    env = env_of(container)
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())

    assert job["kind"] == "Job"
    assert container["args"] == ["devstack", "provision"]
    assert env["NATS_USER"] == "provision"
    assert env["NATS_PASSWORD"] == own_secret("provision")
    assert env["AGENTBUS_STREAM_REPLICAS"] == "3"
    assert "provision-job.yaml" in kustomization["resources"]
    # no Secret is applied with the manifests: `agentbus deploy-config --secrets` makes them
    applied = [d for r in kustomization["resources"] for d in k8s_documents(r)]
    assert not [d for d in applied if d["kind"] == "Secret"]


def test_compose_gives_each_service_its_own_user_and_provisions_first() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    by_command = {s["command"][0]: (name, s) for name, s in services.items() if "command" in s}

    for service in SERVICES:
        name, spec = by_command[service]
        env = spec["environment"]
        assert env["NATS_USER"] == service, name
        assert env["NATS_PASSWORD"].startswith(f"${{{password_variable(service)}:?"), name
        assert spec["depends_on"]["provision"]["condition"] == "service_completed_successfully"
    provision = services["provision"]
    assert provision["command"] == ["devstack", "provision"]
    assert provision["environment"]["NATS_USER"] == "provision"
    for server in ("nats", "nats-2", "nats-3"):
        nats_env = set(services[server]["environment"]) - {"NATS_SERVER_NAME"}
        assert nats_env == {password_variable(u) for u in DEPLOYED_USERS}, server
        assert "./deploy/nats:/etc/nats:ro" in services[server]["volumes"], server


def test_make_nats_config_rewrites_both_blocks_in_place(tmp_path: Path) -> None:
    from devstack.deployed import COMPOSE_AUTH, K8S_NATS, write_deployed_auth

    for rel in (COMPOSE_AUTH, K8S_NATS):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text().replace("gateway", "stale"))

    write_deployed_auth(tmp_path)

    assert (tmp_path / COMPOSE_AUTH).read_text() == (ROOT / COMPOSE_AUTH).read_text()
    rewritten = (tmp_path / K8S_NATS).read_text()
    # the auth block is back; the rest of the manifest is left as it was
    assert rewritten.count('user: "gateway"') == 1
    assert rewritten.replace("stale", "gateway") == (ROOT / K8S_NATS).read_text()


def test_the_compose_cluster_config_needs_and_takes_the_passwords(tmp_path: Path) -> None:
    config_dir = ROOT / "deploy" / "nats"
    named = {"NATS_SERVER_NAME": "nats-2"}

    def accepts(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [nats_server_binary(), "-t", "-c", str(config_dir / "cluster.conf")],
            capture_output=True,
            text=True,
            env={"PATH": os.environ.get("PATH", ""), **env},
        )

    assert accepts(named).returncode != 0
    accepted = accepts({**named, **passwords()})
    assert accepted.returncode == 0, accepted.stderr


def test_the_compose_cluster_profile_runs_three_servers_and_r3_streams() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    profile = dict(
        line.split("=", 1)
        for line in (ROOT / "deploy" / "nats" / "cluster.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    servers = [name for name, s in services.items() if s.get("image", "").startswith("nats:")]

    assert servers == ["nats", "nats-2", "nats-3"]
    assert [services[s].get("profiles") for s in servers] == [None, ["cluster"], ["cluster"]]
    names = [services[s]["environment"]["NATS_SERVER_NAME"] for s in servers]
    assert names == servers  # each its own JetStream server name
    assert profile == {
        "COMPOSE_PROFILES": "cluster",
        "NATS_CONFIG": "cluster.conf",
        "AGENTBUS_STREAM_REPLICAS": "3",
    }
    routes = (ROOT / "deploy" / "nats" / "cluster.conf").read_text()
    assert all(f"nats://{s}:6222" in routes for s in servers)
    # provisioning waits for all three servers when they run (R3 needs them)
    waits = services["provision"]["depends_on"]
    assert {s for s in waits if s.startswith("nats")} == set(servers)


def secret_refs(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """Every (Secret, key) a container reads without `optional: true`."""
    refs = set()
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    refs.add((ref["name"], ref["key"]))
            for source in container.get("envFrom", []):
                if "secretRef" in source:
                    refs.add((source["secretRef"]["name"], "*"))
    return refs


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_the_generated_secrets_hold_every_key_the_pods_read(overlay: str) -> None:
    from devstack.deploycheck import build, validate
    from devstack.deploygen import deployed_services, secrets_manifest

    generated = [d for d in yaml.safe_load_all(secrets_manifest(deployed_services())) if d]
    for secret in generated:
        validate(secret)
    keys = {s["metadata"]["name"]: set(s["stringData"]) for s in generated}
    docs = build(ROOT / "deploy" / "k8s" / "overlays" / overlay)
    [cluster] = [d for d in docs if d["kind"] == "Cluster"]

    for name, key in secret_refs(docs):
        assert name in keys, name
        assert key == "*" or key in keys[name], (name, key)
    for role in cluster["spec"]["managed"]["roles"]:
        [secret] = [s for s in generated if s["metadata"]["name"] == role["passwordSecret"]["name"]]
        assert secret["type"] == "kubernetes.io/basic-auth"
        assert secret["stringData"]["username"] == role["name"]
    # fresh values each time, none shared between two users
    again = [d for d in yaml.safe_load_all(secrets_manifest(deployed_services())) if d]
    values = [v for s in generated for k, v in s["stringData"].items() if k != "username"]
    assert len(set(values)) == len(values)
    assert again[0]["stringData"] != generated[0]["stringData"]


def test_secrets_kept_from_the_cluster_are_filled_in_never_rotated() -> None:
    from devstack.deploygen import cluster_secrets, deployed_services, secrets_manifest

    services = deployed_services()
    first = [d for d in yaml.safe_load_all(secrets_manifest(services)) if d]
    # The cluster as `kubectl get secrets -o yaml` shows it, before a service was added:
    # one NATS password and one role's Secret missing, and a key of the operator's own.
    held = {
        s["metadata"]["name"]: {
            k: base64.b64encode(v.encode()).decode() for k, v in s["stringData"].items()
        }
        for s in first
    }
    nats_user = sorted(held["agentbus-nats"])[0]
    del held["agentbus-nats"][nats_user]
    role = next(name for name in held if name.startswith("agentbus-pg-"))
    del held[role]
    held["agentbus-gateway"]["OPERATORS_OWN"] = "a2VwdA=="
    listed = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [{"kind": "Secret", "metadata": {"name": n}, "data": d} for n, d in held.items()],
    }

    kept = cluster_secrets(yaml.safe_dump(listed))
    filled = [d for d in yaml.safe_load_all(secrets_manifest(services, kept)) if d]
    by_name = {s["metadata"]["name"]: s for s in filled}
    assert set(by_name) == {s["metadata"]["name"] for s in first}
    for name, data in held.items():
        assert by_name[name]["data"].items() >= data.items(), name  # every value kept
    assert nats_user in by_name["agentbus-nats"]["data"]  # the missing one made
    assert set(by_name[role]["data"]) == {"username", "password"}
    assert "stringData" not in by_name[role]

    # Applied, then filled again from what the cluster then holds: nothing changes.
    again = secrets_manifest(
        services,
        {s["metadata"]["name"]: s["data"] for s in filled},
    )
    assert [d for d in yaml.safe_load_all(again) if d] == filled


def test_keep_refuses_what_is_not_secrets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from devstack.cli import main

    configmap = tmp_path / "current.yaml"
    configmap.write_text("kind: ConfigMap\nmetadata: {name: x}\n")
    assert main(["deploy-config", "--secrets", "--keep", str(configmap)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "expected Secrets" in err and "ConfigMap" in err


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions In) matches."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def peer_name(peer: dict[str, Any], pods: dict[str, dict[str, str]]) -> str:
    """A policy peer, named by the pods it selects, its namespace or its address block."""
    if "ipBlock" in peer:
        return "internet"
    if "namespaceSelector" in peer:
        return str(peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"])
    return "+".join(sorted(n for n, labels in pods.items() if selects(peer["podSelector"], labels)))


def allowed(direction: str, labels: dict[str, str], docs: list[dict[str, Any]]) -> set[str]:
    """`peer:port` a pod with `labels` may reach (egress) or be reached from (ingress);
    `*:port` for a rule without peers (anyone)."""
    pods = pod_labels(docs)
    found = set()
    key, peers_key = direction.lower(), "to" if direction == "Egress" else "from"
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        spec = policy["spec"]
        if direction not in spec["policyTypes"] or not selects(spec["podSelector"], labels):
            continue
        for rule in spec.get(key, []):
            names = [peer_name(p, pods) for p in rule.get(peers_key, [])] or ["*"]
            ports = [str(p["port"]) for p in rule.get("ports", [])] or ["*"]
            found |= {f"{n}:{p}" for n in names for p in ports}
    return found


def pod_labels(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The pods of the deployment by their name label (a Job's name also carries a hash
    of what it runs), with their labels (the CNPG pods as the operator labels them)."""
    pods = {
        d["metadata"]["labels"]["app.kubernetes.io/name"]: d["spec"]["template"]["metadata"][
            "labels"
        ]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet", "Job")
    }
    pods["postgres"] = {
        "cnpg.io/cluster": "agentbus-db",
        "cnpg.io/podRole": "instance",
        "app.kubernetes.io/managed-by": "cloudnative-pg",
        "app.kubernetes.io/component": "database",
    }
    pods["pooler"] = {"cnpg.io/poolerName": "agentbus-pooler"}
    return pods


def test_the_network_policies_open_only_the_paths_the_deployment_needs() -> None:
    from devstack.deploycheck import build
    from devstack.deploygen import deployed_services

    docs = build(ROOT / "deploy" / "k8s" / "overlays" / "prod")
    pods = pod_labels(docs)
    dns = {"kube-system:53"}
    services = {s.dns: s for s in deployed_services()}

    for name, s in services.items():
        egress = allowed("Egress", pods[name], docs)
        # the trace collector, in `monitoring` like Prometheus (OTLP/HTTP)
        expected = dns | {"nats:4222", "monitoring:4318"}
        if s.schema is not None:
            expected.add("pooler:5432")  # the pooler, never the instances
        if s.provider:
            expected.add("internet:443")
        assert egress == expected, name
        ingress = allowed("Ingress", pods[name], docs)
        # only the web service is reachable from outside; Prometheus scrapes the rest
        assert ingress == ({"*:8480"} if s.web else set()) | {"monitoring:9090"}, name
    nats = allowed("Ingress", pods["nats"], docs)
    clients = {n for n in pods if n in services or n == "agentbus-provision"}
    assert {p.split(":")[0] for p in nats if p.endswith(":4222")} == {"+".join(sorted(clients))}
    assert "nats:6222" in nats and "nats:6222" in allowed("Egress", pods["nats"], docs)
    for job in (n for n in pods if n.startswith("migrate-")):
        assert allowed("Egress", pods[job], docs) == dns | {"postgres:5432"}, job
    assert "*:5432" not in allowed("Ingress", pods["postgres"], docs)
