"""One analysis of one closed session: pre-check, triage, context, tool loop, outcome.

ADR 0015 decisions 1, 2 and 5. The tool loop runs directly in the caller (the closing
consumer or the reanalysis command): no per-session actor, because an analysis runs once
and is never addressed again. "At most M attempts" is the loop's `max_iterations`: the
tool validates, a post-tool hook halts only when validation passed.

Outcomes: a completed analysis writes its row, its hypotheses and their events in one
transaction; a failed one (iterations or budget exhausted, the model giving up) writes
no row, only `psychologist.analysis_failed` — never no outcome. A failure a later
delivery may cure (metering or the log unreachable) raises `Retry`, unless this was the
last delivery, which is then announced as failed too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from uuid import UUID, uuid4

from contracts.common import ErrorCode, person_of
from contracts.events import AnalysisCompleted, AnalysisFailed, EventType, HypothesisProposed
from contracts.metering import ChatMessage, TokenUsage, ToolUseBlock
from contracts.psychologist import (
    MAX_EVIDENCE_PER_HYPOTHESIS,
    MAX_HYPOTHESES_PER_BATCH,
    AnalysisOutcome,
    Hypothesis,
)
from domain.errors import DomainError
from domain.psychologist import (
    Termination,
    TriagePlan,
    ValidHypothesis,
    cited_event_ids,
    classify_termination,
    triage,
    validate_hypothesis_batch,
)
from harness import Halt, LoopContext, LoopResult, MeteringClient, Tool, ToolLoop, ToolResult
from harness.client import TURN_LOST
from psychologist.context import AnalysisContext, render, system_prompt
from psychologist.repository import AnalysisRow, PsychologistRepository
from servicekit.faults import crash_point
from servicekit.logs import get_logger
from servicekit.sessionlog import SessionLogClient

log = get_logger(__name__)

EMIT_HYPOTHESES = "emit_hypotheses"
TriggeredBy = Literal["auto", "manual"]
# Metering refusals a later delivery may not get: the run goes on under the same ids
# (a failed provider turn is tried again under a retry id by the ToolLoop).
RETRYABLE_CODES = frozenset(
    {
        ErrorCode.UNAVAILABLE.value,
        ErrorCode.INTERNAL.value,
        ErrorCode.TURN_IN_PROGRESS.value,
        ErrorCode.PROVIDER_ERROR.value,
        ErrorCode.PROVIDER_OVERLOADED.value,
        TURN_LOST,  # its metering replica died on every retry id: metering is away
    }
)
MAX_REASON_CHARS = 3000
CLOSINGS = frozenset({EventType.SESSION_CLOSED, EventType.SESSION_CLOSED_ABNORMALLY})

EMIT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "hypotheses": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_HYPOTHESES_PER_BATCH,
            "items": {
                "type": "object",
                "properties": {
                    "target_agent": {"type": "string", "description": "the agent's slug"},
                    "statement": {"type": "string"},
                    "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
                    "evidence_event_ids": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_EVIDENCE_PER_HYPOTHESIS,
                        "items": {"type": "string", "format": "uuid"},
                    },
                    "termination_analysis": {"type": "string"},
                },
                "required": ["target_agent", "statement", "confidence", "evidence_event_ids"],
            },
        }
    },
    "required": ["hypotheses"],
}


class Retry(Exception):
    """The analysis could not run now; a later delivery may succeed (nothing was written)."""


def run_id_for(session_id: UUID, triggered_by: TriggeredBy) -> str:
    """The automatic analysis of a session always runs under the same id, so a delivery
    after a kill replays the turns metering already billed instead of paying twice; each
    manual reanalysis is a new run (it always runs, decision 5)."""
    if triggered_by == "auto":
        return f"psychologist.{session_id}.auto"
    return f"psychologist.{session_id}.manual.{uuid4().hex}"


def emit_hypotheses_tool(
    log_: SessionLogClient, session_id: UUID, termination: Termination
) -> Tool:
    """Decision 3: resolve every cited id in the log, let the domain judge the whole batch;
    a refusal goes back to the model verbatim for its next iteration."""

    async def handler(call: ToolUseBlock) -> ToolResult:
        batch = call.input
        owners = {e.id: e.session_id for e in await log_.get(cited_event_ids(batch))}
        try:
            accepted = validate_hypothesis_batch(batch, session_id, owners, termination)
        except DomainError as exc:
            return ToolResult.error(exc.message)
        return ToolResult.ok(
            f"Accepted {len(accepted)} hypotheses; they are recorded with the analysis.",
            data=accepted,
        )

    return Tool(
        EMIT_HYPOTHESES,
        "Record the batch of hypotheses about the agents' behaviour in this session, each "
        "citing events of this session's log as evidence. Validated as a whole.",
        EMIT_SCHEMA,
        handler,
    )


async def halt_when_accepted(call: ToolUseBlock, outcome: ToolResult) -> Halt | None:
    """Decision 2: the tool validates, the hook terminates — only on a valid batch."""
    if call.name == EMIT_HYPOTHESES and not outcome.is_error:
        return Halt("hypotheses_accepted", outcome.data)
    return None


@dataclass(frozen=True)
class Prepared:
    """An analysis ready to run: its context, triage plan and run id."""

    ctx: AnalysisContext
    plan: TriagePlan
    run_id: str
    triggered_by: TriggeredBy
    closing_event_id: UUID | None
    # Whom its model calls are for: who asked for it, else the person who opened the session.
    person: str | None = None


class Analyst:
    """Runs analyses with the harness; the only path from this service to a model."""

    def __init__(
        self,
        repo: PsychologistRepository,
        log_: SessionLogClient,
        client: MeteringClient,
        max_tokens: int = 4096,
        in_progress_wait_seconds: float | None = None,
    ) -> None:
        self._repo = repo
        self._log = log_
        self._client = client
        self._max_tokens = max_tokens
        self._in_progress_wait = in_progress_wait_seconds
        self._system = system_prompt()

    async def prepare(
        self, session_id: UUID, triggered_by: TriggeredBy, requested_by: str | None = None
    ) -> Prepared:
        """Read everything the analysis is given and decide its tier."""
        session = await self._log.session(session_id)
        events = await self._log.events(session_id)
        rules = await self._log.query(
            session.project_id,
            [EventType.ARTIFACT_BUSINESS_RULE, EventType.ARTIFACT_BUSINESS_RULE_RETRACTED],
        )
        earlier = await self._repo.earlier_hypotheses(session.project_id, session_id)
        termination = classify_termination(session.termination_reason)
        # The psychologist's own events (a reanalysed session holds the last analysis's)
        # are not behaviour of the session: they never move it to another tier.
        own = sum(1 for e in events if e.type.domain == "psychologist")
        closing = next((e.id for e in events if e.type in CLOSINGS), None)
        return Prepared(
            AnalysisContext(session, events, rules, earlier, termination),
            triage(len(events) - own),
            run_id_for(session_id, triggered_by),
            triggered_by,
            closing,
            person_of(requested_by or session.opened_by),
        )

    async def analyse(self, prepared: Prepared, last_attempt: bool) -> AnalysisOutcome:
        """Run the tool loop and record its outcome."""
        ctx, plan = prepared.ctx, prepared.plan
        # The harness's one ToolLoop, whole-reply: nobody watches an analysis being
        # written. A turn still running in metering (a killed delivery's) is waited for
        # and replayed; past the wait its metering replica died too, and it is tried
        # again under its retry id. (Not waiting, every redelivery met the same dead
        # turn until the deliveries ran out: a failed analysis of a healthy session.)
        loop = ToolLoop(
            self._client,
            [emit_hypotheses_tool(self._log, ctx.session.session_id, ctx.termination)],
            max_iterations=plan.max_iterations,
            max_tokens=self._max_tokens,
            post_tool_hooks=[halt_when_accepted],
            in_progress_wait_seconds=self._in_progress_wait,
        )
        result = await loop.run(
            LoopContext(
                run_id=prepared.run_id,
                agent_slug=plan.agent_slug,
                project_id=ctx.session.project_id,
                system=self._system,
                messages=[ChatMessage(role="user", content=render(ctx))],
                session_id=ctx.session.session_id,
                budget_micros=plan.budget_micros,
                person=prepared.person,
            )
        )
        # The reliability tests kill the process here: turns billed, nothing recorded.
        crash_point("psychologist.before_outcome")
        if result.status == "halted" and result.halt is not None:
            return await self._completed(prepared, result, result.halt.output)
        if result.status == "error" and result.error_code in RETRYABLE_CODES and not last_attempt:
            raise Retry(f"{result.error_code}: {result.error_message}")
        return await self._failed(prepared, result, _failure_reason(result))

    async def give_up(self, prepared: Prepared, reason: str) -> AnalysisOutcome:
        """Announce a failure that happened outside the loop (the last delivery failed)."""
        empty = LoopResult("error", 0, TokenUsage(), 0, [])
        return await self._failed(prepared, empty, reason)

    async def _completed(
        self, prepared: Prepared, result: LoopResult, accepted: tuple[ValidHypothesis, ...]
    ) -> AnalysisOutcome:
        ctx, plan = prepared.ctx, prepared.plan
        session_id = ctx.session.session_id
        row = AnalysisRow(
            id=uuid4(),
            project_id=ctx.session.project_id,
            session_id=session_id,
            plan=plan,
            run_id=prepared.run_id,
            triggered_by=prepared.triggered_by,
            termination_class=ctx.termination.kind.value,
            termination_reason=ctx.termination.reason,
            event_count=len(ctx.events),
            iterations=result.iterations,
            cost_micros=result.cost_micros,
        )
        actor = f"agent:{plan.agent_slug}"
        async with self._repo.transaction() as tx:
            await tx.lock_session(session_id)
            current = await tx.current_analysis(session_id)
            if current is not None and prepared.triggered_by == "auto":
                # Another delivery or a manual reanalysis completed first: keep theirs.
                return self._outcome(prepared, "already_analyzed", result, analysis_id=current)
            if current is not None:
                await tx.supersede(current, row.id)
            await tx.insert_analysis(row)
            hypotheses: list[Hypothesis] = []
            for position, valid in enumerate(accepted):
                hypothesis = await tx.insert_hypothesis(uuid4(), row, position, valid)
                hypotheses.append(hypothesis)
                payload = HypothesisProposed(
                    hypothesis_id=hypothesis.id,
                    analysis_id=row.id,
                    target_agent=hypothesis.target_agent,
                    statement=hypothesis.statement,
                    confidence=hypothesis.confidence,
                    evidence_event_ids=hypothesis.evidence_event_ids,
                    termination_analysis=hypothesis.termination_analysis,
                )
                await tx.emit(
                    session_id,
                    EventType.HYPOTHESIS_PROPOSED,
                    actor,
                    payload.model_dump(mode="json"),
                    f"psychologist:{hypothesis.id}:proposed",
                    prepared.closing_event_id,
                )
            completed = AnalysisCompleted(
                analysis_id=row.id,
                tier=plan.tier.value,
                agent_slug=plan.agent_slug,
                hypothesis_ids=[h.id for h in hypotheses],
                triggered_by=prepared.triggered_by,
                termination_class=ctx.termination.kind.value,
                superseded_analysis_id=current,
            )
            await tx.emit(
                session_id,
                EventType.ANALYSIS_COMPLETED,
                actor,
                completed.model_dump(mode="json"),
                f"psychologist:{row.id}:completed",
                prepared.closing_event_id,
            )
        log.info(
            "analysis_completed",
            session_id=str(session_id),
            tier=plan.tier.value,
            hypotheses=len(hypotheses),
            iterations=result.iterations,
            cost_micros=result.cost_micros,
        )
        return self._outcome(
            prepared,
            "completed",
            result,
            analysis_id=row.id,
            superseded=current,
            hypotheses=hypotheses,
        )

    async def _failed(self, prepared: Prepared, result: LoopResult, reason: str) -> AnalysisOutcome:
        plan, session_id = prepared.plan, prepared.ctx.session.session_id
        failed = AnalysisFailed(
            tier=plan.tier.value,
            reason=reason,
            triggered_by=prepared.triggered_by,
            agent_slug=plan.agent_slug,
            iterations=result.iterations,
            cost_micros=result.cost_micros,
        )
        async with self._repo.transaction() as tx:
            # Keyed by the run: a redelivered failure of the same run is announced once.
            await tx.emit(
                session_id,
                EventType.ANALYSIS_FAILED,
                f"agent:{plan.agent_slug}",
                failed.model_dump(mode="json"),
                f"psychologist:{prepared.run_id}:failed",
                prepared.closing_event_id,
            )
        log.warning("analysis_failed", session_id=str(session_id), reason=reason[:300])
        return self._outcome(prepared, "failed", result, reason=reason)

    @staticmethod
    def _outcome(
        prepared: Prepared,
        status: Literal["completed", "failed", "already_analyzed"],
        result: LoopResult,
        analysis_id: UUID | None = None,
        superseded: UUID | None = None,
        hypotheses: list[Hypothesis] | None = None,
        reason: str | None = None,
    ) -> AnalysisOutcome:
        return AnalysisOutcome(
            session_id=prepared.ctx.session.session_id,
            status=status,
            analysis_id=analysis_id,
            superseded_analysis_id=superseded,
            tier=prepared.plan.tier.value,
            agent_slug=prepared.plan.agent_slug,
            hypotheses=hypotheses or [],
            reason=reason,
            iterations=result.iterations,
            cost_micros=result.cost_micros,
        )


def _failure_reason(result: LoopResult) -> str:
    """Why the loop ended without a valid batch, with the model's last refusal if any."""
    if result.status == "max_iterations":
        reason = f"max_iterations: {result.iterations} iterations without a valid batch"
    elif result.status == "budget_exceeded":
        reason = f"budget_exceeded: {result.error_message}"
    elif result.status == "completed":
        reason = "no_hypotheses: the model ended its turn without a valid emit_hypotheses call"
    else:
        reason = f"{result.error_code or 'error'}: {result.error_message}"
    refusals = [o.content for c, o in result.tool_calls if c.name == EMIT_HYPOTHESES and o.is_error]
    if refusals:
        reason += f"; last refusal: {refusals[-1]}"
    return reason[:MAX_REASON_CHARS]
