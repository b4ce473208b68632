"""Recovery after a stream loss: publish the log's events again from Postgres.

Postgres is the store of record; EVENTS is its copy on the bus. After EVENTS was lost
(deleted, or a JetStream store gone), `agentbus provision` re-creates it empty and this
puts the log's events back, each exactly as the log's outbox published it: same
subject, same body, `Nats-Msg-Id` = event id. Within the stream's duplicate window the
server drops a copy it already holds; beyond it, consumers' idempotency does (every
consumer records what it handled with its effect), so running it twice is safe either
way (docs/operations.md, "Recover").

It reads `session_events.events` directly, a table otherwise only the log's service
touches (each service owns its schema, docs/architecture.md): an operator's recovery
must work when the bus is the broken part, and pages of thousands of events through
`cmd.events.list` would make the log service carry a bulk export it has no other use
for. Only this command does it, read-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import asyncpg
from nats.js import JetStreamContext

from contracts import subjects
from contracts.events import Event, EventType
from servicekit.db import create_pool

# The log service's schema (services/session_events): a shared library does not import
# a service, so its name is written here, beside the one query that uses it.
LOG_SCHEMA = "session_events"
PAGE = 500
COLUMNS = (
    "id, session_id, project_id, seq, type, actor, payload, causation_id, created_at, copied_from"
)


@dataclass
class Republished:
    """How many events were sent, and how many the stream did not hold already."""

    published: int = 0
    stored: int = 0


def _event(row: asyncpg.Record) -> Event:
    return Event(
        id=row["id"],
        session_id=row["session_id"],
        project_id=row["project_id"],
        seq=row["seq"],
        type=EventType(row["type"]),
        actor=row["actor"],
        payload=row["payload"],
        causation_id=row["causation_id"],
        created_at=row["created_at"],
        copied_from=row["copied_from"],
    )


async def republish(
    js: JetStreamContext,
    database_url: str,
    *,
    session: str | None = None,
    since: str | None = None,
) -> Republished:
    """Publish one session's events (`session`), or every event created since `since`
    (ISO 8601), in the log's order."""
    if (session is None) == (since is None):
        raise ValueError("give exactly one of session and since")
    pool = await create_pool(database_url, LOG_SCHEMA, 1, 1)
    done = Republished()
    try:
        # keyset pagination over the log's order; each page is its own short query
        last: tuple[datetime, UUID, int] | None = None
        while True:
            rows = await _page(pool, session, since, last)
            for row in rows:
                event = _event(row)
                ack = await js.publish(
                    subjects.event_subject(event.type, event.project_id, event.session_id),
                    event.model_dump_json().encode(),
                    headers={"Nats-Msg-Id": str(event.id)},
                )
                done.published += 1
                done.stored += 0 if ack.duplicate else 1
            if len(rows) < PAGE:
                return done
            tail = rows[-1]
            last = (tail["created_at"], tail["session_id"], tail["seq"])
    finally:
        await pool.close()


async def _page(
    pool: asyncpg.Pool,
    session: str | None,
    since: str | None,
    last: tuple[datetime, UUID, int] | None,
) -> list[asyncpg.Record]:
    after = last or (datetime.min, UUID(int=0), 0)
    if session is not None:
        rows: list[asyncpg.Record] = await pool.fetch(
            f"SELECT {COLUMNS} FROM events WHERE session_id = $1 AND seq > $2 "
            "ORDER BY seq LIMIT $3",
            UUID(session),
            after[2],
            PAGE,
        )
        return rows
    assert since is not None
    start = datetime.fromisoformat(since)
    rows = await pool.fetch(
        f"SELECT {COLUMNS} FROM events WHERE created_at >= $1 "
        "AND (created_at, session_id, seq) > ($2, $3, $4) "
        "ORDER BY created_at, session_id, seq LIMIT $5",
        start,
        after[0] if last else start,
        after[1],
        after[2],
        PAGE,
    )
    return rows
