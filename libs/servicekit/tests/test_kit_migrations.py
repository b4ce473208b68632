"""`db.migrate` against real Postgres: once, recorded, serialised between replicas, no drift."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from servicekit.db import MigrationDrift, create_pool, migrate

SCHEMA = "mig_test"

# 0002 depends on 0001 (order matters), inserts a row (so a re-run would show) and
# sleeps, so two concurrent `migrate` calls really overlap.
MIGRATIONS = {
    "0001_items.sql": "CREATE TABLE items (id int PRIMARY KEY, label text NOT NULL);",
    "0002_seed.sql": "SELECT pg_sleep(0.2); INSERT INTO items VALUES (1, 'seed');",
    "0010_index.sql": "CREATE INDEX items_label_idx ON items (label);",
}

# Writes the migration files into a fresh importable package; returns its name.
MakePackage = Callable[[dict[str, str]], str]


@pytest.fixture
def migrations_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MakePackage:
    """A package of `.sql` files that `importlib.resources.files(name)` finds."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(files: dict[str, str]) -> str:
        name = f"migs_{uuid.uuid4().hex[:10]}"  # unique: modules stay cached in sys.modules
        package = tmp_path / name
        package.mkdir()
        (package / "__init__.py").write_text("")
        (package / "README.txt").write_text("not a migration")
        for file_name, sql in files.items():
            (package / file_name).write_text(sql)
        return name

    return make


@pytest_asyncio.fixture(loop_scope="session")
async def schema_pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool whose schema does not exist yet: `migrate` creates it."""
    db_pool = await create_pool(database_url, SCHEMA, min_size=1, max_size=2)
    yield db_pool
    await db_pool.close()


async def recorded(pool: asyncpg.Pool) -> dict[str, str]:
    rows = await pool.fetch(f"SELECT name, checksum FROM {SCHEMA}.schema_migrations")
    return {r["name"]: r["checksum"] for r in rows}


async def test_applies_files_in_order_once_and_records_them(
    schema_pool: asyncpg.Pool, migrations_package: MakePackage
) -> None:
    package = migrations_package(MIGRATIONS)

    applied = await migrate(schema_pool, SCHEMA, [package])

    names = [f"{package}:{file_name}" for file_name in sorted(MIGRATIONS)]
    assert applied == names
    assert await recorded(schema_pool) == {
        f"{package}:{file_name}": hashlib.sha256(sql.encode()).hexdigest()
        for file_name, sql in MIGRATIONS.items()
    }
    # created in the service's schema, whatever the connection's search_path
    assert await schema_pool.fetchval("SELECT to_regclass($1)::text", f"{SCHEMA}.items") is not None
    rows = await schema_pool.fetch(f"SELECT id, label FROM {SCHEMA}.items")
    assert [tuple(r) for r in rows] == [(1, "seed")]


async def test_a_second_run_applies_nothing(
    schema_pool: asyncpg.Pool, migrations_package: MakePackage
) -> None:
    package = migrations_package(MIGRATIONS)
    await migrate(schema_pool, SCHEMA, [package])
    query = f"SELECT name, applied_at FROM {SCHEMA}.schema_migrations ORDER BY name"
    before = [tuple(r) for r in await schema_pool.fetch(query)]

    assert await migrate(schema_pool, SCHEMA, [package]) == []

    assert [tuple(r) for r in await schema_pool.fetch(query)] == before
    assert await schema_pool.fetchval(f"SELECT count(*) FROM {SCHEMA}.items") == 1


async def test_a_new_file_is_applied_after_the_old_ones(
    schema_pool: asyncpg.Pool, migrations_package: MakePackage, tmp_path: Path
) -> None:
    package = migrations_package(MIGRATIONS)
    await migrate(schema_pool, SCHEMA, [package])
    (tmp_path / package / "0011_more.sql").write_text("INSERT INTO items VALUES (2, 'more');")

    assert await migrate(schema_pool, SCHEMA, [package]) == [f"{package}:0011_more.sql"]
    assert await schema_pool.fetchval(f"SELECT count(*) FROM {SCHEMA}.items") == 2


async def test_concurrent_runs_apply_each_file_exactly_once(
    database_url: str, migrations_package: MakePackage
) -> None:
    package = migrations_package(MIGRATIONS)
    replicas = [await create_pool(database_url, SCHEMA, min_size=1, max_size=1) for _ in range(3)]
    try:
        results = await asyncio.gather(*(migrate(p, SCHEMA, [package]) for p in replicas))

        applied = [name for result in results for name in result]
        assert sorted(applied) == sorted(f"{package}:{file_name}" for file_name in MIGRATIONS)
        # one replica did the work; the others waited on the lock and found it done
        assert sorted(len(result) for result in results) == [0, 0, len(MIGRATIONS)]
        assert len(await recorded(replicas[0])) == len(MIGRATIONS)
        assert await replicas[0].fetchval(f"SELECT count(*) FROM {SCHEMA}.items") == 1
    finally:
        for p in replicas:
            await p.close()


async def test_an_applied_file_that_changed_stops_the_start(
    schema_pool: asyncpg.Pool, migrations_package: MakePackage, tmp_path: Path, database_url: str
) -> None:
    package = migrations_package(MIGRATIONS)
    await migrate(schema_pool, SCHEMA, [package])
    (tmp_path / package / "0001_items.sql").write_text(
        "CREATE TABLE items (id bigint PRIMARY KEY, label text NOT NULL);"
    )

    with pytest.raises(MigrationDrift, match=f"{package}:0001_items.sql"):
        await migrate(schema_pool, SCHEMA, [package])

    # the lock was released (checked from another session: advisory locks are re-entrant)
    (tmp_path / package / "0001_items.sql").write_text(MIGRATIONS["0001_items.sql"])
    other = await create_pool(database_url, SCHEMA, min_size=1, max_size=1)
    try:
        assert await asyncio.wait_for(migrate(other, SCHEMA, [package]), 5) == []
    finally:
        await other.close()


async def test_a_failing_file_is_rolled_back_and_not_recorded(
    schema_pool: asyncpg.Pool, migrations_package: MakePackage, tmp_path: Path
) -> None:
    package = migrations_package(
        {
            **MIGRATIONS,
            "0020_broken.sql": "CREATE TABLE half (id int); SELECT * FROM no_such_table;",
        }
    )

    with pytest.raises(asyncpg.UndefinedTableError):
        await migrate(schema_pool, SCHEMA, [package])

    assert f"{package}:0020_broken.sql" not in await recorded(schema_pool)
    assert len(await recorded(schema_pool)) == len(MIGRATIONS)  # the good ones before it stay
    assert await schema_pool.fetchval("SELECT to_regclass($1)::text", f"{SCHEMA}.half") is None

    (tmp_path / package / "0020_broken.sql").write_text("CREATE TABLE half (id int);")
    assert await migrate(schema_pool, SCHEMA, [package]) == [f"{package}:0020_broken.sql"]


async def test_packages_are_applied_in_the_order_given(
    schema_pool: asyncpg.Pool, migrations_package: MakePackage
) -> None:
    base = migrations_package({"0001_base.sql": "CREATE TABLE base (id int PRIMARY KEY);"})
    service = migrations_package(
        {"0001_service.sql": "CREATE TABLE service (id int REFERENCES base (id));"}
    )

    applied = await migrate(schema_pool, SCHEMA, [base, service])

    assert applied == [f"{base}:0001_base.sql", f"{service}:0001_service.sql"]
