"""The deployment's defaults are safe (offline).

No secret of docker-compose.yml falls back to a value committed in it: every one is
required (`${NAME:?…}`) and `agentbus secrets --write .env` makes them all, in a file
only its owner can read. The gateway, the most exposed process, gets neither a model
provider's key nor a database, in compose or on Kubernetes: only metering reaches a
provider, only a service that keeps a schema reaches Postgres.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack.cli import main
from devstack.deploycheck import build
from devstack.deploygen import deployed_services

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
# `${NAME}`, `${NAME:-default}`, `${NAME-default}`, `${NAME:?error}`, `${NAME?error}`
VARIABLE = re.compile(r"\$\{(?P<name>[A-Z0-9_]+)(?:(?P<op>:?[-?])(?P<rest>[^}]*))?\}")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|_KEY$")
PROVIDER_ENV = {"ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "OPENAI_API_KEY", "OPENAI_BASE_URL"}
DATABASE_ENV = {"DATABASE_URL", "PGUSER", "PGPASSWORD", "PGHOST", "PGDATABASE"}


def compose_variables() -> list[re.Match[str]]:
    return list(VARIABLE.finditer(COMPOSE.read_text()))


def required_by_compose() -> set[str]:
    return {m["name"] for m in compose_variables() if m["op"] in (":?", "?")}


def compose_env(service: str) -> dict[str, Any]:
    # PyYAML resolves the `<<: *service-env` merge keys as compose does.
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    env: dict[str, Any] = services[service]["environment"]
    return env


def k8s_env(overlay: str, deployment: str) -> set[str]:
    """The variables a Deployment's containers get: an `envFrom` ConfigMap's keys as the
    overlay applies it, an `envFrom` Secret (whose keys nothing here shows) as `secret:*`."""
    docs = build(ROOT / "deploy" / "k8s" / "overlays" / overlay)
    [doc] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == deployment]
    configs = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    names = set()
    for container in doc["spec"]["template"]["spec"]["containers"]:
        names |= {e["name"] for e in container.get("env", [])}
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                names |= set(configs[source["configMapRef"]["name"]])
            else:
                names.add(f"{source['secretRef']['name']}:*")
    return names


def test_no_secret_in_compose_falls_back_to_a_committed_value() -> None:
    secrets = [m for m in compose_variables() if SECRET_NAME.search(m["name"])]

    fallbacks = [m[0] for m in secrets if m["op"] in (":-", "-") and m["rest"]]
    assert fallbacks == []
    # what every service and server needs is required, not merely allowed to be empty
    required = required_by_compose()
    assert {"AGENTBUS_GATEWAY_SECRET", "POSTGRES_PASSWORD"} <= required
    assert {m["name"] for m in secrets if m["name"].startswith("NATS_PASSWORD")} <= required
    # the provider keys alone may be left out (metering then runs its offline script)
    optional = {m["name"] for m in secrets} - required
    assert optional <= PROVIDER_ENV, optional


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_only_metering_gets_a_provider_key_and_only_a_schema_a_database(overlay: str) -> None:
    for s in deployed_services():
        in_compose = set(compose_env(s.dns))
        in_k8s = k8s_env(overlay, s.dns)
        for env in (in_compose, in_k8s):
            assert bool(env & PROVIDER_ENV) is s.provider, (s.name, env & PROVIDER_ENV)
            assert bool(env & {"DATABASE_URL"}) is (s.schema is not None), s.name
        assert not [name for name in in_k8s if name.endswith(":*")], s.name


def test_the_gateway_gets_no_provider_key_and_no_database() -> None:
    gateway = [s for s in deployed_services() if s.web]
    assert [s.dns for s in gateway] == ["gateway"]
    for env in (set(compose_env("gateway")), k8s_env("prod", "gateway"), k8s_env("dev", "gateway")):
        assert env & (PROVIDER_ENV | DATABASE_ENV) == set()
        assert "AGENTBUS_GATEWAY_SECRET" in env


def env_lines(text: str) -> dict[str, str]:
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def env_file(path: Path) -> dict[str, str]:
    return env_lines(path.read_text())


def test_secrets_writes_every_required_variable_to_a_file_only_its_owner_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / ".env"

    assert main(["secrets", "--write", str(path)]) == 0

    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    written = env_file(path)
    # every variable compose requires, and nothing it does not read
    assert set(written) == required_by_compose()
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{32,}", v) for v in written.values()), written
    assert len(set(written.values())) == len(written)  # none shared
    capsys.readouterr()
    # the old name prints the same variables, new values
    assert main(["nats-passwords"]) == 0
    printed = env_lines(capsys.readouterr().out)
    assert set(printed) == set(written)
    assert not set(printed.values()) & set(written.values())


def test_an_existing_secrets_file_is_kept_unless_replacing_is_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / ".env"
    path.write_text("NATS_PASSWORD_OPS=the-one-the-volumes-know\n")
    path.chmod(0o644)

    assert main(["secrets", "--write", str(path)]) == 1
    assert "--replace" in capsys.readouterr().err
    assert path.read_text() == "NATS_PASSWORD_OPS=the-one-the-volumes-know\n"

    assert main(["secrets", "--write", str(path), "--replace"]) == 0
    assert set(env_file(path)) == required_by_compose()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_link_in_place_of_the_file_is_not_written_through(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("kept\n")
    link = tmp_path / ".env"
    link.symlink_to(target)

    assert main(["secrets", "--write", str(link)]) == 1
    assert main(["secrets", "--write", str(link), "--replace"]) == 1
    assert target.read_text() == "kept\n"
