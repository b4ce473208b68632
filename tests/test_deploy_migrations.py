"""Migrations as a Job per service; services that do not migrate (issue 14).

In a deployment each service starts with AGENTBUS_MIGRATE=false: it applies nothing,
answers /livez, and is not ready (/readyz `schema: false`) until its migration Job
(`python -m devstack.migrate <service>`) has brought the schema to the version its code
expects. The Job runs as the service's own Postgres role, which owns its schema and may
not create one (deploy/k8s/base/postgres.yaml). Real processes, real NATS and Postgres.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx

from testkit.probes import wait_for


def logged(log_path: Path, event: str) -> dict[str, Any] | None:
    """The first JSON log line of `event` the process wrote, if any yet."""
    for line in log_path.read_text().splitlines():
        try:
            entry: dict[str, Any] = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == event:
            return entry
    return None


def run_migration_job(env: dict[str, str], service: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devstack.migrate", service],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def tables(database_url: str, schema: str) -> int:
    conn = await asyncpg.connect(database_url)
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1", schema
        )
        return count
    finally:
        await conn.close()


async def test_a_service_that_does_not_migrate_is_alive_but_not_ready_until_its_job_ran(
    spawn: Any, service_env: dict[str, str], database_url: str
) -> None:
    proc = spawn("handoff", AGENTBUS_MIGRATE="false", AGENTBUS_SCHEMA_POLL_SECONDS="0.2")
    waiting = await wait_for(
        lambda: logged(proc.log_path, "schema_not_migrated"), timeout=60, what="the schema wait"
    )
    served = logged(proc.log_path, "metrics_serving")
    assert served is not None
    url = served["url"]

    async with httpx.AsyncClient(timeout=5) as http:
        assert (await http.get(f"{url}/livez")).status_code == 200
        before = await http.get(f"{url}/readyz")
        assert before.status_code == 503
        assert "schema FAIL" in before.text
        # it applied nothing itself
        assert await tables(database_url, "handoff") == 0
        assert "handoff.migrations:0001" in " ".join(waiting["pending"])

        job = run_migration_job(service_env, "handoff")
        assert job.returncode == 0, job.stderr

        async def ready() -> bool:
            return (await http.get(f"{url}/readyz")).status_code == 200

        await wait_for(ready, timeout=60, what="handoff ready once migrated")
    assert await tables(database_url, "handoff") > 0
    assert logged(proc.log_path, "schema_current") is not None


async def test_the_job_migrates_as_a_role_that_owns_only_its_schema(
    service_env: dict[str, str], database_url: str
) -> None:
    # As CloudNativePG sets it up: the role owns its schema, has no CREATE on the
    # database, and runs the job twice (every apply re-creates the Job).
    role = f"r_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(database_url)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
        await admin.execute(f"CREATE SCHEMA handoff AUTHORIZATION {role}")
        may_create: bool = await admin.fetchval(
            "SELECT has_database_privilege($1, current_database(), 'CREATE')", role
        )
        assert not may_create
        parts = urlsplit(database_url)
        server = parts.netloc.rsplit("@", 1)[-1]  # host:port, or empty with ?host=<socket>
        as_role = urlunsplit(parts._replace(netloc=f"{role}:pw@{server}"))
        env = {**service_env, "DATABASE_URL": as_role}

        first, again = run_migration_job(env, "handoff"), run_migration_job(env, "handoff")

        assert first.returncode == 0, first.stderr
        assert again.returncode == 0, again.stderr
        assert await tables(database_url, "handoff") > 0
        applied = await admin.fetchval("SELECT count(*) FROM handoff.schema_migrations")
        assert applied > 0
    finally:
        await admin.execute("DROP SCHEMA IF EXISTS handoff CASCADE")
        await admin.execute(f"DROP OWNED BY {role}")
        await admin.execute(f"DROP ROLE {role}")
        await admin.close()
