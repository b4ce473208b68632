"""The handoff service's SQL: handoffs, activations, closed sessions, and its outbox."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from secrets import token_hex
from typing import Any
from uuid import UUID

import asyncpg

from contracts.common import ErrorCode, Message
from contracts.events import EventType
from contracts.handoff import Activation, Handoff
from contracts.session_events import AppendEnvelope
from domain.errors import DomainError
from domain.handoff import Status
from servicekit.db import Connection
from servicekit.outbox import Announcement, Outbox, Wake, with_outbox

HANDOFF_COLUMNS = (
    "id, project_id, session_id, from_agent, to_agent, artifact_id, status, "
    "created_at, updated_at, superseded_by"
)
ACTIVATION_COLUMNS = "project_id, session_id, agent, via, handoff_id, activated_at"


@dataclass
class NewOffer:
    """An offer decided in the current transaction and not yet written: its row is
    inserted with the status the transaction's later decisions leave it in."""

    id: UUID
    project_id: str
    session_id: UUID
    from_agent: str
    to_agent: str
    artifact_id: UUID | None
    status: str = Status.OFFERED.value
    superseded_by: UUID | None = None


@dataclass(frozen=True)
class TargetState:
    """A target as its lock holder reads it: the agent's activation in an open session of
    the project, if any, and its `offered` handoffs, oldest first."""

    active: Activation | None
    pending: list[Handoff]


def handoff_not_found(handoff_id: UUID) -> DomainError:
    return DomainError(
        ErrorCode.HANDOFF_NOT_FOUND,
        f"handoff {handoff_id} does not exist",
        handoff_id=str(handoff_id),
    )


class HandoffTransaction:
    """The statements of one handoff decision, all in one transaction."""

    def __init__(self, conn: Connection, outbox: Outbox) -> None:
        self._conn = conn
        self._outbox = outbox

    async def lock_target(self, project_id: str, agent: str) -> None:
        """Serialise every decision about one (project, target); other targets never wait."""
        await self._conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
            f"handoff:{project_id}:{agent}",
        )

    async def lock_session(self, session_id: UUID) -> None:
        """Serialise activations in a session with the session's closing."""
        await self._conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", f"session:{session_id}"
        )

    async def pending(self, project_id: str, agent: str) -> list[Handoff]:
        """The target's `offered` handoffs in the project, oldest first (whole rows, so a
        decision never reads one again)."""
        rows = await self._conn.fetch(
            f"""SELECT {HANDOFF_COLUMNS} FROM handoffs
                 WHERE project_id = $1 AND to_agent = $2 AND status = 'offered'
                 ORDER BY created_at, id""",
            project_id,
            agent,
        )
        return [Handoff.model_validate(dict(r)) for r in rows]

    async def lock_targets_state(
        self, targets: Sequence[tuple[str, str]], wait: bool = True
    ) -> dict[tuple[str, str], TargetState | None]:
        """`lock_target` for each (project, agent) in the order given (sort them), then
        the agent's activation in an open session of the project, if any, and `pending`:
        one round trip, each read after its lock was granted (migration 0002 says why it
        is a function). With `wait` false a target whose lock is held elsewhere is not
        waited for: it maps to None."""
        rows = await self._conn.fetch(
            "SELECT * FROM lock_targets_state($1::text[], $2::text[], $3)",
            [project for project, _ in targets],
            [agent for _, agent in targets],
            wait,
        )
        return {
            (r["project"], r["target"]): TargetState(
                Activation.model_validate(r["active"]) if r["active"] else None,
                [Handoff.model_validate(h) for h in r["pending"]],
            )
            if r["locked"]
            else None
            for r in rows
        }

    async def activation_in(self, session_id: UUID, agent: str) -> Activation | None:
        """The agent's activation in this session, if it is still active."""
        row = await self._conn.fetchrow(
            f"""SELECT {ACTIVATION_COLUMNS} FROM activations
                 WHERE session_id = $1 AND agent = $2 AND ended_at IS NULL""",
            session_id,
            agent,
        )
        return Activation.model_validate(dict(row)) if row else None

    async def handoff(self, handoff_id: UUID) -> Handoff:
        """A handoff as it is now (its changes are serialised by its target's lock)."""
        row = await self._conn.fetchrow(
            f"SELECT {HANDOFF_COLUMNS} FROM handoffs WHERE id = $1", handoff_id
        )
        if row is None:
            raise handoff_not_found(handoff_id)
        return Handoff.model_validate(dict(row))

    async def has_accepted(self, session_id: UUID, agent: str) -> bool:
        """Whether the session holds an accepted (or since completed) handoff to the agent."""
        return bool(
            await self._conn.fetchval(
                """SELECT 1 FROM handoffs WHERE session_id = $1 AND to_agent = $2
                      AND status IN ('accepted', 'completed') LIMIT 1""",
                session_id,
                agent,
            )
        )

    async def is_closed(self, session_id: UUID) -> bool:
        """Whether the log announced this session's end."""
        return bool(
            await self._conn.fetchval(
                "SELECT 1 FROM closed_sessions WHERE session_id = $1", session_id
            )
        )

    async def write_offers(
        self,
        new: Sequence[NewOffer],
        superseded: Sequence[tuple[UUID, UUID]],
        events: Sequence[Announcement],
    ) -> dict[UUID, dict[str, Any]]:
        """Insert the new offers (each with the status the transaction's decisions left it
        in), supersede the pending offers given (`(id, by)`), and queue their events in
        the order given: one statement, one round trip under the locks. Returns the
        inserted rows by id."""
        rows = await self._outbox.append_many_with(
            f"""h AS (
                    INSERT INTO handoffs (id, project_id, session_id, from_agent, to_agent,
                                          artifact_id, status, superseded_by)
                    SELECT * FROM unnest($1::uuid[], $2::text[], $3::uuid[], $4::text[],
                                         $5::text[], $6::uuid[], $7::text[], $8::uuid[])
                    RETURNING {HANDOFF_COLUMNS}),
                old AS (
                    UPDATE handoffs o SET status = 'superseded', superseded_by = s.by,
                                          updated_at = now()
                      FROM unnest($9::uuid[], $10::uuid[]) AS s(id, by)
                     WHERE o.id = s.id AND o.status = 'offered' RETURNING o.id)""",
            [
                [n.id for n in new],
                [n.project_id for n in new],
                [n.session_id for n in new],
                [n.from_agent for n in new],
                [n.to_agent for n in new],
                [n.artifact_id for n in new],
                [n.status for n in new],
                [n.superseded_by for n in new],
                [old for old, _ in superseded],
                [by for _, by in superseded],
            ],
            events,
            # Without a new row, `h` is empty and a tail reading it would skip the wake-up.
            returning="h" if new else "",
        )
        return {row["id"]: row for row in rows}

    async def set_status(
        self,
        handoff_id: UUID,
        status: Status,
        announce: Announcement,
        superseded_by: UUID | None = None,
    ) -> Handoff:
        """Change a handoff's status and record its event's outbox row, in one statement."""
        row = await self._outbox.append_with(
            f"""h AS (
                    UPDATE handoffs SET status = $2, superseded_by = $3, updated_at = now()
                     WHERE id = $1 RETURNING {HANDOFF_COLUMNS})""",
            [handoff_id, status.value, superseded_by],
            announce,
            returning="h",
        )
        return Handoff.model_validate(_fields(row))

    async def insert_activation(
        self,
        project_id: str,
        session_id: UUID,
        agent: str,
        via: str,
        handoff_id: UUID | None,
        announce: Announcement,
    ) -> Activation:
        """Record the activation and its `agent.activated` outbox row, in one statement."""
        row = await self._outbox.append_with(
            f"""a AS (
                    INSERT INTO activations (project_id, session_id, agent, via, handoff_id)
                    VALUES ($1, $2, $3, $4, $5) RETURNING {ACTIVATION_COLUMNS})""",
            [project_id, session_id, agent, via, handoff_id],
            announce,
            returning="a",
        )
        return Activation.model_validate(_fields(row))

    async def end_session(self, session_id: UUID) -> int:
        """Record the session's close and end its activations; return how many ended."""
        await self._conn.execute(
            "INSERT INTO closed_sessions (session_id) VALUES ($1) ON CONFLICT DO NOTHING",
            session_id,
        )
        status: str = await self._conn.execute(
            "UPDATE activations SET ended_at = now() WHERE session_id = $1 AND ended_at IS NULL",
            session_id,
        )
        return int(status.split()[-1])


def announcement(
    session_id: UUID,
    event_type: EventType,
    actor: str,
    payload: Message,
    causation_id: UUID | None = None,
) -> Announcement:
    """An event for the session log, to be appended through the outbox exactly once; its
    payload is the contract model of `event_type`, validated as it was built."""
    envelope = AppendEnvelope(
        session_id=session_id,
        type=event_type.value,
        actor=actor,
        causation_id=causation_id,
        # 128 random bits (a uuid4 has 122), at a quarter of uuid4's cost.
        idempotency_key=f"handoff:{token_hex(16)}",
    )
    return Announcement(envelope, payload)


def _fields(row: dict[str, Any] | None) -> dict[str, Any]:
    """The `RETURNING` row of an effect written with its outbox row."""
    if row is None:
        raise LookupError("the statement returned no row")
    return row


class HandoffRepository:
    """Transactions and reads over the `handoff` schema."""

    def __init__(self, pool: asyncpg.Pool, wake: Wake | None = None) -> None:
        """`wake`: wakes the outbox relay of this process once a decision's events are
        committed, instead of a NOTIFY (`servicekit.outbox.with_outbox`)."""
        self._pool = pool
        self._wake = wake

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[HandoffTransaction]:
        async with with_outbox(self._pool, self._wake) as (conn, outbox):
            yield HandoffTransaction(conn, outbox)

    async def list_handoffs(
        self, project_id: str, session_id: UUID | None, status: str | None
    ) -> list[Handoff]:
        rows = await self._pool.fetch(
            f"""SELECT {HANDOFF_COLUMNS} FROM handoffs
                 WHERE project_id = $1
                   AND ($2::uuid IS NULL OR session_id = $2)
                   AND ($3::text IS NULL OR status = $3)
                 ORDER BY created_at, id""",
            project_id,
            session_id,
            status,
        )
        return [Handoff.model_validate(dict(r)) for r in rows]

    async def active_in_project(self, project_id: str) -> list[Activation]:
        rows = await self._pool.fetch(
            f"""SELECT {ACTIVATION_COLUMNS} FROM activations
                 WHERE project_id = $1 AND ended_at IS NULL ORDER BY activated_at""",
            project_id,
        )
        return [Activation.model_validate(dict(r)) for r in rows]

    async def handoffs_by_ids(self, ids: Sequence[UUID]) -> list[Handoff]:
        rows = await self._pool.fetch(
            f"SELECT {HANDOFF_COLUMNS} FROM handoffs WHERE id = ANY($1::uuid[])", list(ids)
        )
        return [Handoff.model_validate(dict(r)) for r in rows]
