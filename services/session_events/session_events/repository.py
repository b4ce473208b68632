"""The log's SQL. Every statement is parameterised; nothing is built from strings."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID, uuid4

import asyncpg

from contracts import subjects
from contracts.events import Event, EventType
from contracts.session_events import (
    TITLE_MAX_CHARS,
    TITLE_SEARCH_EVENTS,
    ListedSession,
    SessionView,
)
from domain.log_rules import CausationFacts, session_not_found
from servicekit.db import Connection
from servicekit.outbox import Outbox, Queued

EVENT_COLUMNS = "id, session_id, project_id, seq, type, actor, payload, causation_id, created_at"
_EVENT_FIELDS = tuple(c.strip() for c in EVENT_COLUMNS.split(","))
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


@dataclass(frozen=True)
class NewEvent:
    """An event to write, and the idempotency key its append carried."""

    event: Event
    idempotency_key: str | None = None


def next_event(
    session: LockedSession,
    event_type: EventType,
    actor: str,
    payload: dict[str, Any],
    causation_id: UUID | None = None,
) -> Event:
    """The event that takes the session's next seq (the caller advances `last_seq`)."""
    # Built, not validated: every field is already valid (the append's request was, the
    # session row was when it was opened, the seq follows it), and validating the Event
    # again cost each append as much as the request's own validation.
    return Event.model_construct(
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


def _event(row: asyncpg.Record) -> Event:
    return Event.model_validate({k: row[k] for k in _EVENT_FIELDS})


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

    async def lock_sessions(self, session_ids: Iterable[UUID]) -> dict[UUID, LockedSession]:
        """The sessions that exist among `session_ids`, locked in id order (so replicas
        locking overlapping sets wait for each other instead of deadlocking)."""
        rows = await self._conn.fetch(
            """SELECT id, project_id, status, last_seq, now() AS now
                 FROM sessions WHERE id = ANY($1::uuid[]) ORDER BY id FOR UPDATE""",
            sorted(set(session_ids)),
        )
        return {r["id"]: LockedSession(**dict(r)) for r in rows}

    async def events_by_keys(
        self, keys: Iterable[tuple[UUID, str]]
    ) -> dict[tuple[UUID, str], Event]:
        """The events earlier appends wrote with these (session, idempotency key) pairs."""
        pairs = list(keys)
        if not pairs:
            return {}
        rows = await self._conn.fetch(
            f"""SELECT {EVENT_COLUMNS}, idempotency_key FROM events
                 WHERE (session_id, idempotency_key) IN
                       (SELECT * FROM unnest($1::uuid[], $2::text[]))""",
            [s for s, _ in pairs],
            [k for _, k in pairs],
        )
        return {(r["session_id"], r["idempotency_key"]): _event(r) for r in rows}

    async def causations(self, event_ids: Iterable[UUID]) -> dict[UUID, CausationFacts]:
        """What the rules need to know of each event named as cause that exists."""
        ids = list(set(event_ids))
        if not ids:
            return {}
        rows = await self._conn.fetch(
            "SELECT id AS event_id, session_id, type, actor FROM events WHERE id = ANY($1::uuid[])",
            ids,
        )
        return {r["event_id"]: CausationFacts(**dict(r)) for r in rows}

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
        event = next_event(session, event_type, actor, payload, causation_id)
        await self.write([NewEvent(event, idempotency_key)])
        # Later appends in the same transaction (close = status + event) see the new seq.
        session.last_seq = event.seq
        return event

    async def write(self, new: Sequence[NewEvent], trace: Sequence[Mapping[str, str]] = ()) -> None:
        """Write events (seqs already assigned, in order), bump their sessions' `last_seq`
        and queue one outbox row each, in one statement: one round trip for a whole batch
        while the sessions' row locks are held (bench/append.py measures why). `trace`:
        each event's trace headers, when it came from another request than the caller's."""
        events = [n.event for n in new]
        last_seq = {e.session_id: e.seq for e in events}  # in order, so the last one wins
        await Outbox(self._conn).send_many_with(
            """bump AS (UPDATE sessions s SET last_seq = b.last_seq
                          FROM unnest($1::uuid[], $2::bigint[]) AS b(id, last_seq)
                         WHERE s.id = b.id),
               event AS (
                  INSERT INTO events (id, session_id, project_id, seq, type, actor,
                                      payload, causation_id, idempotency_key, created_at)
                  SELECT * FROM unnest($3::uuid[], $4::uuid[], $5::text[], $6::bigint[],
                                       $7::text[], $8::text[], $9::jsonb[], $10::uuid[],
                                       $11::text[], $12::timestamptz[]))""",
            [
                list(last_seq),
                list(last_seq.values()),
                [e.id for e in events],
                [e.session_id for e in events],
                [e.project_id for e in events],
                [e.seq for e in events],
                [e.type.value for e in events],
                [e.actor for e in events],
                [e.payload for e in events],
                [e.causation_id for e in events],
                [n.idempotency_key for n in new],
                [e.created_at for e in events],
            ],
            [
                Queued(
                    subjects.event_subject(e.type, e.project_id, e.session_id),
                    str(e.id),
                    e.model_dump_json().encode(),
                    ordering_key=str(e.session_id),
                    headers=trace[i] if trace else None,
                )
                for i, e in enumerate(events)
            ],
        )

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

    async def sessions_of_project(self, project_id: str, limit: int) -> list[ListedSession]:
        """A project's sessions, newest first, each with its title and latest event's time:
        one query, two index reads per session (events' `(session_id, seq)` key)."""
        rows = await self._pool.fetch(
            f"""SELECT {SESSION_COLUMNS},
                       left(first_message.payload->>'text', $3) AS title,
                       coalesce(latest.created_at, sessions.opened_at) AS last_event_at
                  FROM sessions
                  LEFT JOIN LATERAL (
                       SELECT payload FROM events
                        WHERE events.session_id = sessions.id AND events.seq <= $4
                          AND events.type = 'chat.message'
                        ORDER BY events.seq LIMIT 1) AS first_message ON true
                  LEFT JOIN LATERAL (
                       SELECT created_at FROM events
                        WHERE events.session_id = sessions.id
                          AND events.seq = sessions.last_seq) AS latest ON true
                 WHERE sessions.project_id = $1
                 ORDER BY sessions.opened_at DESC, sessions.id LIMIT $2""",
            project_id,
            limit,
            TITLE_MAX_CHARS,
            TITLE_SEARCH_EVENTS,
        )
        return [ListedSession.model_validate(dict(r)) for r in rows]

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
