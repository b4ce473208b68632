"""The asyncpg pool and SQL migrations per service schema.

Migrations are `NNNN_name.sql` files applied in order at start, each in its own
transaction, recorded in `<schema>.schema_migrations` with a checksum. Two replicas
starting at once serialise on an advisory lock, so each file runs exactly once; an
applied file that was edited afterwards stops the start-up rather than drifting.
"""

from __future__ import annotations

import hashlib
import json
from importlib.resources import files
from importlib.resources.abc import Traversable
from typing import Any

import asyncpg
import asyncpg.pool
import orjson

from servicekit.logs import get_logger

log = get_logger(__name__)

# A connection of our own or one lent by the pool: repositories accept either.
Connection = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy

# servicekit's own tables (outbox, dead letters, processed messages), created in
# every service schema before the service's migrations.
KIT_MIGRATIONS = "servicekit.migrations"


def _json_bytes(value: Any) -> bytes:
    """`value` as JSON: orjson's (a tenth of `json.dumps`'s time, which the log would pay for
    every payload and outbox header of a batch: bench/append.py), or `json.dumps`'s for
    what orjson refuses and Postgres takes (an int beyond 64 bits, a non-str key)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value).encode()


def _jsonb_bytes(value: Any) -> bytes:
    return b"\x01" + _json_bytes(value)  # jsonb's binary format: a version byte, then text


def _jsonb_value(data: bytes) -> Any:
    # json.loads, not orjson's: orjson reads an int beyond 64 bits as a float.
    return json.loads(data[1:])


async def _init_connection(conn: asyncpg.Connection) -> None:
    # json and jsonb in and out as Python objects, so repositories never call json.*
    # themselves; in the binary format, which spares Postgres and asyncpg a text pass.
    await conn.set_type_codec(
        "json", encoder=_json_bytes, decoder=json.loads, schema="pg_catalog", format="binary"
    )
    await conn.set_type_codec(
        "jsonb", encoder=_jsonb_bytes, decoder=_jsonb_value, schema="pg_catalog", format="binary"
    )


async def _keep_session_state(conn: asyncpg.Connection) -> None:
    """No reset query on release: it costs a round trip per transaction, and nothing here
    leaves session state behind — advisory locks are transaction-scoped or released
    explicitly (`migrate`), settings are `SET LOCAL`, listeners remove themselves."""


async def create_pool(url: str, schema: str, min_size: int = 2, max_size: int = 10) -> asyncpg.Pool:
    """A pool whose connections search the service's schema first."""
    pool = await asyncpg.create_pool(
        url,
        min_size=min_size,
        max_size=max_size,
        init=_init_connection,
        reset=_keep_session_state,
        server_settings={"search_path": f"{schema},public", "application_name": schema},
    )
    assert pool is not None
    return pool


def returned(row: asyncpg.Record | None) -> dict[str, Any]:
    """The row an `INSERT/UPDATE … RETURNING` must have produced, as a dict."""
    if row is None:
        raise LookupError("the statement returned no row")
    return dict(row)


class MigrationDrift(RuntimeError):
    """An applied migration file no longer has the content it had when applied."""


def _migration_files(package: str) -> list[Traversable]:
    return sorted(
        (f for f in files(package).iterdir() if f.name.endswith(".sql")), key=lambda f: f.name
    )


def migration_set(packages: list[str]) -> dict[str, str]:
    """Every migration of `packages` in the order `migrate` applies them: its recorded
    name (`package:file`) → the sha256 of its text, the checksum `migrate` keeps."""
    return {
        f"{package}:{file.name}": hashlib.sha256(file.read_text().encode()).hexdigest()
        for package in packages
        for file in _migration_files(package)
    }


async def pending_migrations(pool: asyncpg.Pool, schema: str, packages: list[str]) -> list[str]:
    """The migrations of `packages` not yet applied to `schema` (all of them while the
    schema does not exist); an applied file that changed since raises MigrationDrift."""
    async with pool.acquire() as conn:
        table = await conn.fetchval("SELECT to_regclass($1)", f'"{schema}".schema_migrations')
        done: dict[str, str] = {}
        if table is not None:
            rows = await conn.fetch(f'SELECT name, checksum FROM "{schema}".schema_migrations')
            done = {r["name"]: r["checksum"] for r in rows}
    pending = []
    for name, checksum in migration_set(packages).items():
        if name not in done:
            pending.append(name)
        elif done[name] != checksum:
            raise MigrationDrift(f"{name} changed after it was applied to {schema}")
    return pending


async def migrate(pool: asyncpg.Pool, schema: str, packages: list[str]) -> list[str]:
    """Apply every pending migration of `packages` to `schema`; return the names applied."""
    applied_now: list[str] = []
    async with pool.acquire() as conn:
        # Session-level lock: held across the per-file transactions below.
        await conn.execute("SELECT pg_advisory_lock(hashtextextended($1, 0))", f"migrate:{schema}")
        try:
            # Only when missing: a deployed role owns its schema but may not create one
            # (CREATE on the database), and Postgres checks that right even for IF NOT EXISTS.
            if await conn.fetchval("SELECT to_regnamespace($1)", f'"{schema}"') is None:
                await conn.execute(f'CREATE SCHEMA "{schema}"')
            await conn.execute(
                f"""CREATE TABLE IF NOT EXISTS "{schema}".schema_migrations (
                        name text PRIMARY KEY,
                        checksum text NOT NULL,
                        applied_at timestamptz NOT NULL DEFAULT now())"""
            )
            done = {
                r["name"]: r["checksum"]
                for r in await conn.fetch(
                    f'SELECT name, checksum FROM "{schema}".schema_migrations'
                )
            }
            for package in packages:
                for file in _migration_files(package):
                    name = f"{package}:{file.name}"
                    sql = file.read_text()
                    checksum = hashlib.sha256(sql.encode()).hexdigest()
                    if name in done:
                        if done[name] != checksum:
                            raise MigrationDrift(f"{name} changed after it was applied to {schema}")
                        continue
                    async with conn.transaction():
                        await conn.execute(f'SET LOCAL search_path TO "{schema}", public')
                        await conn.execute(sql)
                        await conn.execute(
                            f'INSERT INTO "{schema}".schema_migrations (name, checksum) '
                            "VALUES ($1, $2)",
                            name,
                            checksum,
                        )
                    applied_now.append(name)
                    log.info("migration_applied", schema=schema, migration=name)
        finally:
            await conn.execute(
                "SELECT pg_advisory_unlock(hashtextextended($1, 0))", f"migrate:{schema}"
            )
    return applied_now
