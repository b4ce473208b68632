"""The log's SQL. Every statement is parameterised; nothing is built from strings."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID, uuid4

import asyncpg

from contracts import subjects
from contracts.events import Event, EventType
from contracts.session_events import SessionView
from domain.log_rules import CausationFacts, session_not_found
from servicekit.db import Connection
from servicekit.outbox import Outbox

EVENT_COLUMNS = "id, session_id, project_id, seq, type, actor, payload, causation_id, created_at"
SESSION_COLUMNS = (
    "id AS session_id, project_id, opened_by, status, termination_reason, "
    "opened_at, closed_at, last_heartbeat_at, last_seq AS event_count"
)


@dataclass
class LockedSession:
    """A session row held under `FOR UPDATE` for the rest of the transaction."""

    id: UUID
    project_id: str
    status: str
    last_seq: int
    now: datetime

    @property
    def is_open(self) -> bool:
        return self.status == "open"


def _event(row: asyncpg.Record) -> Event:
    return Event.model_validate(dict(row))


class LogTransaction:
    """The statements that run inside one append or close transaction."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    async def lock_session(self, session_id: UUID) -> LockedSession:
        """The session, locked so appends to it serialise; refused when it does not exist."""
        row = await self._conn.fetchrow(
            """SELECT id, project_id, status, last_seq, now() AS now
                 FROM sessions WHERE id = $1 FOR UPDATE""",
            session_id,
        )
        if row is None:
            raise session_not_found(session_id)
        return LockedSession(**dict(row))

    async def event_by_key(self, session_id: UUID, key: str) -> Event | None:
        """The event an earlier append with this idempotency key wrote, if any."""
        row = await self._conn.fetchrow(
            f"SELECT {EVENT_COLUMNS} FROM events WHERE session_id = $1 AND idempotency_key = $2",
            session_id,
            key,
        )
        return _event(row) if row else None

    async def causation(self, event_id: UUID | None) -> CausationFacts | None:
        """What the rules need to know of the event named as cause."""
        if event_id is None:
            return None
        row = await self._conn.fetchrow(
            "SELECT id AS event_id, session_id, type, actor FROM events WHERE id = $1", event_id
        )
        return CausationFacts(**dict(row)) if row else None

    async def append(
        self,
        session: LockedSession,
        event_type: EventType,
        actor: str,
        payload: dict[str, Any],
        causation_id: UUID | None = None,
        idempotency_key: str | None = None,
    ) -> Event:
        """Write the next event of the session and its outbox row (published after commit)."""
        event = Event(
            id=uuid4(),
            session_id=session.id,
            project_id=session.project_id,
            seq=session.last_seq + 1,
            type=event_type,
            actor=actor,
            payload=payload,
            causation_id=causation_id,
            created_at=session.now,
        )
        # The seq bump, the event and its outbox row in one statement: one round trip
        # while the session's row lock is held (bench/append.py measures why).
        await Outbox(self._conn).send_with(
            """bump AS (UPDATE sessions SET last_seq = $4 WHERE id = $2),
               event AS (
                  INSERT INTO events (id, session_id, project_id, seq, type, actor,
                                      payload, causation_id, idempotency_key, created_at)
                  VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10))""",
            [
                event.id,
                event.session_id,
                event.project_id,
                event.seq,
                event.type.value,
                event.actor,
                event.payload,
                event.causation_id,
                idempotency_key,
                event.created_at,
            ],
            subjects.event_subject(event.type, event.project_id, event.session_id),
            str(event.id),
            event.model_dump_json().encode(),
            ordering_key=str(event.session_id),
        )
        # Later appends in the same transaction (close = status + event) see the new seq.
        session.last_seq = event.seq
        return event

    async def create_session(self, project_id: str, opened_by: str) -> LockedSession:
        """Insert a new open session, locked for the rest of the transaction."""
        row = await self._conn.fetchrow(
            """INSERT INTO sessions (id, project_id, opened_by) VALUES ($1, $2, $3)
               RETURNING id, project_id, status, last_seq, now() AS now""",
            uuid4(),
            project_id,
            opened_by,
        )
        assert row is not None
        return LockedSession(**dict(row))

    async def close(self, session: LockedSession, status: str, reason: str | None) -> None:
        """Mark the session ended; the caller appends the closing event."""
        await self._conn.execute(
            """UPDATE sessions SET status = $2, termination_reason = $3, closed_at = now()
                WHERE id = $1""",
            session.id,
            status,
            reason,
        )


class LogRepository:
    """Reads and transactions over the `session_events` schema."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[LogTransaction]:
        """One unit of work: everything inside commits together or not at all."""
        async with self._pool.acquire() as conn, conn.transaction():
            yield LogTransaction(conn)

    async def heartbeat(self, session_id: UUID) -> datetime | None:
        """Record a heartbeat on an open session; None when it is not open."""
        at: datetime | None = await self._pool.fetchval(
            """UPDATE sessions SET last_heartbeat_at = now()
                WHERE id = $1 AND status = 'open' RETURNING last_heartbeat_at""",
            session_id,
        )
        return at

    async def session(self, session_id: UUID) -> SessionView | None:
        """The session's state and how many events it holds."""
        row = await self._pool.fetchrow(
            f"SELECT {SESSION_COLUMNS} FROM sessions WHERE id = $1",
            session_id,
        )
        return SessionView.model_validate(dict(row)) if row else None

    async def sessions_of_project(self, project_id: str, limit: int) -> list[SessionView]:
        """A project's sessions, newest first."""
        rows = await self._pool.fetch(
            f"""SELECT {SESSION_COLUMNS} FROM sessions
                 WHERE project_id = $1 ORDER BY opened_at DESC, id LIMIT $2""",
            project_id,
            limit,
        )
        return [SessionView.model_validate(dict(r)) for r in rows]

    async def events_by_id(self, event_ids: Sequence[UUID]) -> list[Event]:
        rows = await self._pool.fetch(
            f"""SELECT {EVENT_COLUMNS} FROM events
                 WHERE id = ANY($1::uuid[]) ORDER BY session_id, seq""",
            list(event_ids),
        )
        return [_event(r) for r in rows]

    async def events_after(self, session_id: UUID, after_seq: int, limit: int) -> list[Event]:
        rows = await self._pool.fetch(
            f"""SELECT {EVENT_COLUMNS} FROM events
                 WHERE session_id = $1 AND seq > $2 ORDER BY seq LIMIT $3""",
            session_id,
            after_seq,
            limit,
        )
        return [_event(r) for r in rows]

    async def events_of_project(
        self, project_id: str, types: Sequence[str], limit: int
    ) -> list[Event]:
        rows = await self._pool.fetch(
            f"""SELECT {EVENT_COLUMNS} FROM events
                 WHERE project_id = $1 AND type = ANY($2::text[])
                 ORDER BY created_at, session_id, seq LIMIT $3""",
            project_id,
            list(types),
            limit,
        )
        return [_event(r) for r in rows]

    async def session_exists(self, session_id: UUID) -> bool:
        return bool(await self._pool.fetchval("SELECT 1 FROM sessions WHERE id = $1", session_id))

    @asynccontextmanager
    async def silent_sessions(
        self, timeout_seconds: float, limit: int = 100
    ) -> AsyncIterator[tuple[LogTransaction, list[LockedSession]]]:
        """Open sessions whose heartbeats stopped, locked; another replica skips them."""
        async with self._pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                """SELECT id, project_id, status, last_seq, now() AS now FROM sessions
                    WHERE status = 'open' AND last_heartbeat_at IS NOT NULL
                      AND last_heartbeat_at < now() - make_interval(secs => $1)
                    ORDER BY last_heartbeat_at
                    LIMIT $2
                    FOR UPDATE SKIP LOCKED""",
                timeout_seconds,
                limit,
            )
            yield LogTransaction(conn), [LockedSession(**dict(r)) for r in rows]
