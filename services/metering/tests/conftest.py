"""What metering's repository tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from servicekit.db import KIT_MIGRATIONS, create_pool, migrate


@asynccontextmanager
async def migrated_pool(database_url: str, size: int = 10) -> AsyncIterator[asyncpg.Pool]:
    """A pool of up to `size` connections on the metering schema, migrated as the service
    migrates it."""
    pool: asyncpg.Pool = await create_pool(
        database_url, "metering", min_size=min(2, size), max_size=size
    )
    try:
        await migrate(pool, "metering", [KIT_MIGRATIONS, "metering.migrations"])
        yield pool
    finally:
        await pool.close()
