"""The launcher finds services through entry points, and only those the catalog knows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from contracts import catalog
from devstack.services import SERVICES_GROUP, discover


def installed_with(tmp_path: Path, name: str) -> dict[str, str]:
    """An environment where one more distribution declares service `name`."""
    dist = tmp_path / "extra_service-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: extra-service\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{SERVICES_GROUP}]\n{name} = {name}\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def run_discover(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from devstack.services import discover; print(discover())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_installed_services_are_the_catalogs_in_its_order() -> None:
    assert [s.name for s in discover()] == [a.service for a in catalog.ACCESS]


def test_a_service_without_a_nats_user_is_refused_with_what_to_do(tmp_path: Path) -> None:
    result = run_discover(installed_with(tmp_path, "billing"))

    assert result.returncode != 0
    assert "UnknownService" in result.stderr
    assert "billing" in result.stderr and "catalog.py" in result.stderr


def test_the_same_process_without_the_extra_distribution_is_accepted(tmp_path: Path) -> None:
    result = run_discover({**os.environ})

    assert result.returncode == 0, result.stderr
    assert "session_events" in result.stdout


def test_token_links_to_the_web_service_found_by_its_entry_point(tmp_path: Path) -> None:
    import jwt

    secret = "a-test-secret-for-the-token-command-0123456789"
    env = {
        **os.environ,
        "AGENTBUS_STATE_DIR": str(tmp_path),
        "AGENTBUS_GATEWAY_SECRET": secret,
        "AGENTBUS_GATEWAY_PORT": "18480",
    }
    result = subprocess.run(
        [sys.executable, "-m", "devstack", "token", "demo", "--user", "alice"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 0, result.stderr
    link = result.stdout.strip()
    assert link.startswith("http://127.0.0.1:18480/#token=")
    claims = jwt.decode(
        link.split("token=", 1)[1], secret, algorithms=["HS256"], audience="agentbus-gateway"
    )
    assert (claims["prj"], claims["sub"]) == ("demo", "alice")
