"""`python -m devstack.migrate <service>`: apply one service's migrations, then exit.

What the migration Job of each service runs in a deployment (deploy/k8s), where the
services themselves start with AGENTBUS_MIGRATE=false and only wait for their schema.
It connects as the service's own Postgres role, which owns the service's schema.
"""

from __future__ import annotations

import asyncio
import sys

from devstack.services import declared, discover
from servicekit.db import KIT_MIGRATIONS, create_pool, migrate
from servicekit.logs import configure_logging, get_logger
from servicekit.settings import ServiceSettings

log = get_logger(__name__)


async def migrate_service(name: str, settings: ServiceSettings | None = None) -> list[str]:
    """Apply the pending migrations of service `name`; return the names applied."""
    settings = settings or ServiceSettings()
    specs = {s.name: s for s in discover()}
    if name not in specs:
        raise SystemExit(f"{name}: no such service (agentbus.services entry points)")
    svc = declared(specs[name])
    if svc.schema is None:
        return []  # a service that keeps nothing durable has nothing to migrate
    pool = await create_pool(settings.database_url, svc.schema, 1, 1)
    try:
        return await migrate(pool, svc.schema, [KIT_MIGRATIONS, *svc.migrations])
    finally:
        await pool.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m devstack.migrate <service>", file=sys.stderr)
        return 2
    settings = ServiceSettings()
    configure_logging("migrate", settings.log_level, settings.log_format)
    applied = asyncio.run(migrate_service(args[0], settings))
    log.info("migrations_done", service=args[0], applied=applied)
    return 0


if __name__ == "__main__":
    sys.exit(main())
