"""The psychologist service's SQL: analyses, hypotheses, and its outbox."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import asyncpg

from contracts.common import ErrorCode
from contracts.events import EventType
from contracts.psychologist import Hypothesis
from contracts.session_events import AppendEvent
from domain.errors import DomainError
from domain.psychologist import HypothesisStatus, TriagePlan, ValidHypothesis
from servicekit.db import Connection, returned
from servicekit.outbox import Outbox, Wake, with_outbox

HYPOTHESIS_SELECT = """
SELECT h.id, h.analysis_id, h.project_id, h.session_id, h.target_agent, h.statement,
       h.confidence, h.evidence_event_ids, h.termination_analysis, h.status,
       NOT a.superseded AS current, h.created_at, h.decided_at, h.decided_by
  FROM psychologist_hypotheses h
  JOIN psychologist_analyses a ON a.id = h.analysis_id
"""


def hypothesis_not_found(hypothesis_id: UUID) -> DomainError:
    return DomainError(
        ErrorCode.HYPOTHESIS_NOT_FOUND,
        f"hypothesis {hypothesis_id} does not exist",
        hypothesis_id=str(hypothesis_id),
    )


@dataclass(frozen=True)
class AnalysisRow:
    """What the success transaction records about a completed analysis."""

    id: UUID
    project_id: str
    session_id: UUID
    plan: TriagePlan
    run_id: str
    triggered_by: str
    termination_class: str
    termination_reason: str | None
    event_count: int
    iterations: int
    cost_micros: int


class PsychologistTransaction:
    """The statements of one analysis outcome or one decision, in one transaction."""

    def __init__(self, conn: Connection, outbox: Outbox) -> None:
        self._conn = conn
        self._outbox = outbox

    async def lock_session(self, session_id: UUID) -> None:
        """Serialise the outcomes of one session's analyses (auto, redelivered, manual)."""
        await self._conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", f"psychologist:{session_id}"
        )

    async def current_analysis(self, session_id: UUID) -> UUID | None:
        value: UUID | None = await self._conn.fetchval(
            "SELECT id FROM psychologist_analyses WHERE session_id = $1 AND NOT superseded",
            session_id,
        )
        return value

    async def supersede(self, analysis_id: UUID, by: UUID) -> None:
        """Decision 5: the old analysis stays, no longer current (the new one is inserted
        after this statement, so the partial unique index never sees two)."""
        await self._conn.execute(
            "UPDATE psychologist_analyses SET superseded = true, superseded_by = $2 WHERE id = $1",
            analysis_id,
            by,
        )

    async def insert_analysis(self, row: AnalysisRow) -> None:
        await self._conn.execute(
            """INSERT INTO psychologist_analyses
                   (id, project_id, session_id, tier, agent_slug, run_id, triggered_by,
                    termination_class, termination_reason, event_count, iterations, cost_micros)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)""",
            row.id,
            row.project_id,
            row.session_id,
            row.plan.tier.value,
            row.plan.agent_slug,
            row.run_id,
            row.triggered_by,
            row.termination_class,
            row.termination_reason,
            row.event_count,
            row.iterations,
            row.cost_micros,
        )

    async def insert_hypothesis(
        self, hypothesis_id: UUID, analysis: AnalysisRow, position: int, valid: ValidHypothesis
    ) -> Hypothesis:
        await self._conn.execute(
            """INSERT INTO psychologist_hypotheses
                   (id, analysis_id, position, project_id, session_id, target_agent, statement,
                    confidence, evidence_event_ids, termination_analysis)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)""",
            hypothesis_id,
            analysis.id,
            position,
            analysis.project_id,
            analysis.session_id,
            valid.target_agent,
            valid.statement,
            valid.confidence,
            list(valid.evidence_event_ids),
            valid.termination_analysis,
        )
        return await self.hypothesis(hypothesis_id)

    async def hypothesis(self, hypothesis_id: UUID, for_update: bool = False) -> Hypothesis:
        """A hypothesis as it is now; `for_update` serialises decisions on it."""
        row = await self._conn.fetchrow(
            HYPOTHESIS_SELECT + " WHERE h.id = $1" + (" FOR UPDATE OF h" if for_update else ""),
            hypothesis_id,
        )
        if row is None:
            raise hypothesis_not_found(hypothesis_id)
        return Hypothesis.model_validate(dict(row))

    async def set_status(
        self, hypothesis_id: UUID, status: HypothesisStatus, actor: str
    ) -> Hypothesis:
        row = await self._conn.fetchrow(
            """UPDATE psychologist_hypotheses
                  SET status = $2, decided_at = now(), decided_by = $3
                WHERE id = $1 RETURNING id""",
            hypothesis_id,
            status.value,
            actor,
        )
        returned(row)
        return await self.hypothesis(hypothesis_id)

    async def emit(
        self,
        session_id: UUID,
        event_type: EventType,
        actor: str,
        payload: dict[str, Any],
        idempotency_key: str,
        causation_id: UUID | None = None,
    ) -> None:
        """Append an event to the analysed session's log once this transaction commits.

        The key is derived from what the event announces, so a retried outcome appends
        nothing twice."""
        await self._outbox.append(
            AppendEvent(
                session_id=session_id,
                type=event_type.value,
                actor=actor,
                payload=payload,
                causation_id=causation_id,
                idempotency_key=idempotency_key,
            ),
        )


class PsychologistRepository:
    """Transactions and reads over the `psychologist` schema."""

    def __init__(self, pool: asyncpg.Pool, wake: Wake | None = None) -> None:
        """`wake`: wakes the outbox relay of this process once an outcome's events are
        committed, instead of a NOTIFY (`servicekit.outbox.with_outbox`)."""
        self._pool = pool
        self._wake = wake

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[PsychologistTransaction]:
        async with with_outbox(self._pool, self._wake) as (conn, outbox):
            yield PsychologistTransaction(conn, outbox)

    async def already_analyzed(self, session_id: UUID) -> bool:
        """Decision 5's cheap short-circuit: a current analysis exists, spend nothing."""
        return bool(
            await self._pool.fetchval(
                "SELECT 1 FROM psychologist_analyses WHERE session_id = $1 AND NOT superseded",
                session_id,
            )
        )

    async def earlier_hypotheses(self, project_id: str, excluding: UUID) -> list[Hypothesis]:
        """The project's non-dismissed hypotheses of current analyses of other sessions."""
        rows = await self._pool.fetch(
            HYPOTHESIS_SELECT
            + """ WHERE h.project_id = $1 AND h.session_id <> $2 AND NOT a.superseded
                    AND h.status <> 'dismissed'
                  ORDER BY h.created_at, h.position LIMIT 200""",
            project_id,
            excluding,
        )
        return [Hypothesis.model_validate(dict(r)) for r in rows]

    async def list_hypotheses(
        self, project_id: str, status: str | None, include_superseded: bool
    ) -> list[Hypothesis]:
        rows = await self._pool.fetch(
            HYPOTHESIS_SELECT
            + """ WHERE h.project_id = $1
                    AND ($2::text IS NULL OR h.status = $2)
                    AND ($3 OR NOT a.superseded)
                  ORDER BY h.target_agent, h.created_at DESC, h.position""",
            project_id,
            status,
            include_superseded,
        )
        return [Hypothesis.model_validate(dict(r)) for r in rows]
