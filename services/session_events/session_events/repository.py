"""The log's SQL. Every statement is parameterised; nothing is built from strings."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple
from uuid import UUID, uuid4

import asyncpg

from contracts import subjects
from contracts.events import SESSION_CLOSINGS, Event, EventType
from contracts.session_events import (
    TITLE_MAX_CHARS,
    TITLE_SEARCH_EVENTS,
    ListedSession,
    SessionView,
)
from domain.log_rules import CausationFacts, ForkFacts, RuleFacts, session_not_found
from servicekit.db import Connection
from servicekit.outbox import Outbox, Queued, Wake, with_outbox

EVENT_COLUMNS = (
    "id, session_id, project_id, seq, type, actor, payload, causation_id, created_at, copied_from"
)
_EVENT_FIELDS = tuple(c.strip() for c in EVENT_COLUMNS.split(","))
SESSION_COLUMNS = (
    "id AS session_id, project_id, opened_by, status, termination_reason, "
    "opened_at, closed_at, last_heartbeat_at, last_seq AS event_count, "
    "parent_session_id, forked_at_seq"
)


@dataclass
class SessionState:
    """A session row as a statement read it: under `FOR UPDATE` for the rest of the
    transaction (close, the reaper, a batch decided again), or unlocked for a batch whose
    write then checks that `last_seq` has not moved (`LogTransaction.write`)."""

    id: UUID
    project_id: str
    status: str
    last_seq: int
    now: datetime

    @property
    def is_open(self) -> bool:
        return self.status == "open"


class Written(NamedTuple):
    """An event in the log, as the answer to a repeated append names it."""

    id: UUID
    seq: int


@dataclass(frozen=True)
class BatchFacts:
    """What the log's rules need to decide a batch of appends, read in one statement."""

    sessions: dict[UUID, SessionState]
    earlier: dict[tuple[UUID, str], Written]  # by (session, idempotency key)
    causes: dict[UUID, CausationFacts]
    # the business rules named by retractions and corrections, by id
    rules: dict[UUID, RuleFacts] = field(default_factory=dict)


# The index that lets a rule be retired once (migration 0004): a write that breaks it
# lost a race with another session's retraction of the same rule.
RETIRED_RULE_INDEX = "events_retired_rule_idx"


@dataclass(frozen=True)
class NewEvent:
    """An event to write, and the idempotency key its append carried."""

    event: Event
    idempotency_key: str | None = None


def next_event(
    session: SessionState,
    event_type: EventType,
    actor: str,
    payload: dict[str, Any],
    causation_id: UUID | None = None,
    *,
    event_id: UUID | None = None,
    copied_from: UUID | None = None,
) -> Event:
    """The event that takes the session's next seq (the caller advances `last_seq`)."""
    # Built, not validated: every field is already valid (the append's request was, the
    # session row was when it was opened, the seq follows it), and validating the Event
    # again cost each append as much as the request's own validation.
    return Event.model_construct(
        id=event_id or uuid4(),
        session_id=session.id,
        project_id=session.project_id,
        seq=session.last_seq + 1,
        type=event_type,
        actor=actor,
        payload=payload,
        causation_id=causation_id,
        created_at=session.now,
        copied_from=copied_from,
    )


def _event(row: asyncpg.Record) -> Event:
    return Event.model_validate({k: row[k] for k in _EVENT_FIELDS})


@dataclass(frozen=True)
class BranchOf:
    """Where a branch comes from: its parent, the parent's last event it keeps, and the
    client's fork id."""

    parent: UUID
    at_seq: int
    fork_id: str


@dataclass(frozen=True)
class ExistingBranch:
    """A branch an earlier fork request made, as a repeat of it is answered."""

    session_id: UUID
    at_seq: int
    forked_event_id: UUID
    message_event_id: UUID
    text: str


class LogTransaction:
    """The statements that run inside one append or close transaction (or, for a batch
    of appends, each on its own: `LogRepository.autocommit`)."""

    def __init__(self, conn: Connection, outbox: Outbox) -> None:
        self._conn = conn
        self._outbox = outbox

    async def lock_session(self, session_id: UUID) -> SessionState:
        """The session, locked so appends to it serialise; refused when it does not exist."""
        row = await self._conn.fetchrow(
            """SELECT id, project_id, status, last_seq, now() AS now
                 FROM sessions WHERE id = $1 FOR UPDATE""",
            session_id,
        )
        if row is None:
            raise session_not_found(session_id)
        return SessionState(**dict(row))

    async def lock_sessions(self, session_ids: Iterable[UUID]) -> None:
        """Lock the sessions among `session_ids` that exist, in id order (so replicas
        locking overlapping sets wait for each other instead of deadlocking)."""
        await self._conn.execute(
            "SELECT FROM sessions WHERE id = ANY($1::uuid[]) ORDER BY id FOR UPDATE",
            sorted(set(session_ids)),
        )

    async def batch_facts(
        self,
        session_ids: Iterable[UUID],
        keys: Iterable[tuple[UUID, str]],
        causation_ids: Iterable[UUID],
        rule_ids: Iterable[UUID] = (),
    ) -> BatchFacts:
        """The sessions among `session_ids` that exist, the events earlier appends wrote
        with these (session, idempotency key) pairs, the events named as causes that
        exist, and the events named as rules to retire, each with the event that already
        retired it: one statement, so one round trip and one snapshot for all four."""
        pairs = list(keys)
        row = await self._conn.fetchrow(
            """SELECT now() AS now,
                      ARRAY(SELECT ROW(id, project_id, status, last_seq) FROM sessions
                             WHERE id = ANY($1::uuid[])) AS sessions,
                      ARRAY(SELECT ROW(session_id, idempotency_key, id, seq) FROM events
                             WHERE (session_id, idempotency_key) IN
                                   (SELECT * FROM unnest($2::uuid[], $3::text[]))) AS earlier,
                      ARRAY(SELECT ROW(id, session_id, type, actor) FROM events
                             WHERE id = ANY($4::uuid[])) AS causes,
                      ARRAY(SELECT ROW(r.id, r.project_id, r.type,
                                       (SELECT w.id FROM events w
                                         WHERE (CASE w.type
                                                WHEN 'artifact.business_rule_retracted'
                                                THEN w.payload->>'rule_id'
                                                ELSE w.payload->>'replaces' END) = r.id::text
                                           AND (w.type = 'artifact.business_rule_retracted'
                                                OR (w.type = 'artifact.business_rule'
                                                    AND w.payload->>'replaces' IS NOT NULL))
                                         ORDER BY w.copied_from IS NOT NULL LIMIT 1))
                              FROM events r WHERE r.id = ANY($5::uuid[])) AS rules""",
            list(set(session_ids)),
            [s for s, _ in pairs],
            [k for _, k in pairs],
            list(set(causation_ids)),
            list(set(rule_ids)),
        )
        assert row is not None
        now = row["now"]
        return BatchFacts(
            sessions={
                id_: SessionState(id_, project_id, status, last_seq, now)
                for id_, project_id, status, last_seq in row["sessions"]
            },
            earlier={(r[0], r[1]): Written(r[2], r[3]) for r in row["earlier"]},
            causes={r[0]: CausationFacts(*r) for r in row["causes"]},
            rules={r[0]: RuleFacts(*r) for r in row["rules"]},
        )

    async def append(
        self,
        session: SessionState,
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
        """Write events (seqs already assigned, in order), move their sessions' `last_seq`
        on and queue one outbox row each, in one statement: one round trip for a whole
        batch (bench/append.py measures why). `trace`: each event's trace headers, when
        it came from another request than the caller's.

        Guarded: each session moves on only from the `last_seq` its first event follows,
        and when one has moved since it was read the statement raises `SerializationError`
        and writes nothing (migration 0002). A session's status changes only together
        with its closing event (`close_session`), so `last_seq` alone tells that it moved.
        Under a row lock the guard always holds; unlocked, it makes the write of a batch
        decided on what one statement read a compare-and-set."""
        events = [n.event for n in new]
        read_seq: dict[UUID, int] = {}
        last_seq: dict[UUID, int] = {}
        for e in events:  # in order: the first seq follows the one read, the last one wins
            read_seq.setdefault(e.session_id, e.seq - 1)
            last_seq[e.session_id] = e.seq
        # Each event serialised once: its outbox row's body, and its columns, which
        # Postgres reads back out of the same JSON. Values, not an array per column:
        # asyncpg's array encoding cost more than the statement (`_queue_many_args`).
        bodies = [e.model_dump_json().encode() for e in events]
        await self._outbox.send_many_with(
            """bump AS (UPDATE sessions s SET last_seq = b.last_seq
                          FROM json_to_recordset($1::json)
                               AS b(id uuid, read_seq bigint, last_seq bigint)
                         WHERE s.id = b.id AND s.last_seq = b.read_seq
                     RETURNING s.id),
               event AS (
                  INSERT INTO events (id, session_id, project_id, seq, type, actor, payload,
                                      causation_id, idempotency_key, created_at, copied_from)
                  SELECT id, session_id, project_id, seq, type, actor,
                         payload, causation_id, idempotency_key, created_at, copied_from
                    FROM ROWS FROM (
                           json_to_recordset(convert_from($2::bytea, 'UTF8')::json)
                             AS (id uuid, session_id uuid, project_id text, seq bigint,
                                 type text, actor text, payload jsonb, causation_id uuid,
                                 created_at timestamptz, copied_from uuid),
                           json_array_elements_text($3::json))
                      AS e(id, session_id, project_id, seq, type, actor, payload,
                           causation_id, created_at, copied_from, idempotency_key)
                   WHERE (SELECT sessions_unmoved(count(*), json_array_length($1::json))
                            FROM bump))""",
            [
                [  # id order, as `lock_sessions`: concurrent writers queue, not deadlock
                    {"id": str(i), "read_seq": read_seq[i], "last_seq": last_seq[i]}
                    for i in sorted(last_seq)
                ],
                b"[" + b",".join(bodies) + b"]",
                [n.idempotency_key for n in new],
            ],
            [
                Queued(
                    subjects.event_subject(e.type, e.project_id, e.session_id),
                    str(e.id),
                    body,
                    ordering_key=str(e.session_id),
                    headers=trace[i] if trace else None,
                )
                for i, (e, body) in enumerate(zip(events, bodies, strict=True))
            ],
        )

    async def create_session(
        self, project_id: str, opened_by: str, branch: BranchOf | None = None
    ) -> SessionState:
        """Insert a new open session (a branch of `branch.parent`, when given), locked
        for the rest of the transaction."""
        row = await self._conn.fetchrow(
            """INSERT INTO sessions (id, project_id, opened_by,
                                     parent_session_id, forked_at_seq, fork_id)
               VALUES ($1, $2, $3, $4, $5, $6)
               RETURNING id, project_id, status, last_seq, now() AS now""",
            uuid4(),
            project_id,
            opened_by,
            branch.parent if branch else None,
            branch.at_seq if branch else None,
            branch.fork_id if branch else None,
        )
        assert row is not None
        return SessionState(**dict(row))

    async def fork_facts(self, session_id: UUID) -> ForkFacts | None:
        """The session to fork, locked (its prefix is read as of the fork), with the
        seq of its closing event; None when it does not exist."""
        row = await self._conn.fetchrow(
            """SELECT s.id AS session_id, s.project_id, s.last_seq,
                      (SELECT min(seq) FROM events e
                        WHERE e.session_id = s.id AND e.type = ANY($2::text[])) AS closing_seq
                 FROM sessions s WHERE s.id = $1 FOR UPDATE""",
            session_id,
            [t.value for t in SESSION_CLOSINGS],
        )
        return ForkFacts(**dict(row)) if row else None

    async def branch(self, parent: UUID, fork_id: str) -> ExistingBranch | None:
        """The branch of `parent` an earlier request with `fork_id` made, if any."""
        row = await self._conn.fetchrow(
            """SELECT s.id AS session_id, s.forked_at_seq AS at_seq,
                      f.id AS forked_event_id, m.id AS message_event_id,
                      m.payload->>'text' AS text
                 FROM sessions s
                 JOIN events f ON f.session_id = s.id AND f.seq = 1
                 JOIN events m ON m.session_id = s.id AND m.seq = s.forked_at_seq + 2
                WHERE s.parent_session_id = $1 AND s.fork_id = $2""",
            parent,
            fork_id,
        )
        return ExistingBranch(**dict(row)) if row else None

    async def events_up_to(self, session_id: UUID, seq: int) -> list[Event]:
        """The session's events from its first to `seq`, in order."""
        rows = await self._conn.fetch(
            f"""SELECT {EVENT_COLUMNS} FROM events
                 WHERE session_id = $1 AND seq <= $2 ORDER BY seq""",
            session_id,
            seq,
        )
        return [_event(r) for r in rows]

    async def close(self, session: SessionState, status: str, reason: str | None) -> None:
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

    def __init__(self, pool: asyncpg.Pool, wake: Wake | None = None) -> None:
        """`wake`: wakes the outbox relay of this process once events are committed,
        instead of a NOTIFY (`servicekit.outbox.with_outbox`)."""
        self._pool = pool
        self._wake = wake

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[LogTransaction]:
        """One unit of work: everything inside commits together or not at all."""
        async with with_outbox(self._pool, self._wake) as (conn, outbox):
            yield LogTransaction(conn, outbox)

    @asynccontextmanager
    async def autocommit(self) -> AsyncIterator[LogTransaction]:
        """The same statements outside a transaction: each one commits on its own (one
        round trip each, no BEGIN and COMMIT), for work a single statement keeps whole."""
        async with with_outbox(self._pool, self._wake, transaction=False) as (conn, outbox):
            yield LogTransaction(conn, outbox)

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

    async def sessions_of_project(
        self, project_id: str, limit: int, forked_from: UUID | None = None
    ) -> list[ListedSession]:
        """A project's sessions (only the branches of `forked_from`, when given), newest
        first, each with its title and latest event's time: one query, two index reads per
        session (events' `(session_id, seq)` key)."""
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
                   AND ($5::uuid IS NULL OR sessions.parent_session_id = $5)
                 ORDER BY sessions.opened_at DESC, sessions.id LIMIT $2""",
            project_id,
            limit,
            TITLE_MAX_CHARS,
            TITLE_SEARCH_EVENTS,
            forked_from,
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
    ) -> AsyncIterator[tuple[LogTransaction, list[SessionState]]]:
        """Open sessions whose heartbeats stopped, locked; another replica skips them."""
        async with with_outbox(self._pool, self._wake) as (conn, outbox):
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
            yield LogTransaction(conn, outbox), [SessionState(**dict(r)) for r in rows]
