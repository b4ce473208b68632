"""The psychologist's commands and its consumer of session closings: thin, by design.

Each loads, calls one use case (an analysis, a decision) and replies; the rules are in
`domain.psychologist`, the analysis in `psychologist.analysis`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import groupby

from nats.aio.client import Client

from contracts import catalog, streams
from contracts.catalog import SESSION_CLOSINGS_FILTER
from contracts.common import ErrorCode, person_of
from contracts.events import SESSION_CLOSINGS, Event
from contracts.metering import LimitsStatusRequest
from contracts.psychologist import (
    AnalysisOutcome,
    HypothesesReply,
    HypothesisDecision,
    HypothesisGroup,
    HypothesisReply,
    ListHypotheses,
    Reanalyze,
)
from domain.errors import DomainError
from domain.metering import limit_refusal
from domain.psychologist import HypothesisStatus
from psychologist import lifecycle
from psychologist.analysis import Analyst, Retry
from psychologist.repository import PsychologistRepository
from psychologist.settings import PsychologistSettings
from servicekit.client import call
from servicekit.consumer import ConsumerSpec
from servicekit.logs import get_logger
from servicekit.provenance import confirm
from servicekit.service import Attempt, Service
from servicekit.sessionlog import SessionLogClient

log = get_logger(__name__)

SERVICE = "psychologist"
VERSION = "0.1.0"
svc = Service(
    SERVICE,
    VERSION,
    "The Psicólogo: closed sessions analysed into hypotheses.",
    schema="psychologist",
    migrations=["psychologist.migrations"],
)
# ADR 0015 decision 1: the original ran as a job with max_attempts 5.
MAX_DELIVER = 5


async def refuse_when_over(nc: Client, project_id: str, person: str | None) -> None:
    """Refuse a reanalysis up front when a limit it would run under is used up: the person
    is told now, not by an analysis that fails later."""
    status = await call(
        nc, catalog.LIMITS_STATUS, LimitsStatusRequest(project_id=project_id, person=person)
    )
    for use in status.exhausted:
        raise limit_refusal(use, datetime.now(UTC))


@svc.command(catalog.PSYCHOLOGIST_REANALYZE)
async def reanalyze(
    cmd: Reanalyze, session_log: SessionLogClient, analyst: Analyst, nc: Client
) -> AnalysisOutcome:
    session = await session_log.session(cmd.session_id)
    if session.project_id != cmd.project_id:
        raise DomainError(
            ErrorCode.SESSION_NOT_IN_PROJECT,
            f"session {cmd.session_id} belongs to project {session.project_id}, "
            f"not {cmd.project_id}",
            session_id=str(cmd.session_id),
        )
    if session.status == "open":
        raise DomainError(
            ErrorCode.SESSION_NOT_CLOSED,
            f"session {cmd.session_id} is still open; a session is analysed once it ended",
            session_id=str(cmd.session_id),
        )
    person = person_of(cmd.requested_by or session.opened_by)
    await refuse_when_over(nc, cmd.project_id, person)
    prepared = await analyst.prepare(cmd.session_id, "manual", cmd.requested_by)
    # A manual run has no later delivery: any failure is announced now.
    return await analyst.analyse(prepared, last_attempt=True)


@svc.command(catalog.HYPOTHESES_ACCEPT)
async def accept(cmd: HypothesisDecision, repo: PsychologistRepository) -> HypothesisReply:
    async with repo.transaction() as tx:
        return HypothesisReply(
            hypothesis=await lifecycle.decide(tx, cmd, HypothesisStatus.ACCEPTED)
        )


@svc.command(catalog.HYPOTHESES_DISMISS)
async def dismiss(cmd: HypothesisDecision, repo: PsychologistRepository) -> HypothesisReply:
    async with repo.transaction() as tx:
        return HypothesisReply(
            hypothesis=await lifecycle.decide(tx, cmd, HypothesisStatus.DISMISSED)
        )


@svc.command(catalog.HYPOTHESES_LIST)
async def list_hypotheses(cmd: ListHypotheses, repo: PsychologistRepository) -> HypothesesReply:
    found = await repo.list_hypotheses(cmd.project_id, cmd.status, cmd.include_superseded)
    return HypothesesReply(
        groups=[
            HypothesisGroup(target_agent=agent, hypotheses=list(group))
            for agent, group in groupby(found, key=lambda h: h.target_agent)
        ]
    )


CONSUMER = "psychologist-session-closings"


def closings_spec(settings: PsychologistSettings) -> ConsumerSpec:
    """The durable consumer of closings, `analysis_workers` pullers per replica."""
    return ConsumerSpec(
        durable=CONSUMER,
        stream=streams.EVENTS.name,
        filter_subjects=list(SESSION_CLOSINGS_FILTER),
        max_deliver=MAX_DELIVER,
        backoff=list(settings.redelivery_backoff),
        batch=1,
        workers=settings.analysis_workers,
    )


@svc.subscribe(closings_spec)
async def session_closed(
    event: Event,
    attempt: Attempt,
    repo: PsychologistRepository,
    analyst: Analyst,
    nc: Client,
) -> None:
    """The consumer of `session.closed*`: every closed session analysed once (decision 1).

    Money is spent only on a closing the log confirms: a forged `session.closed` on the
    bus (a session still open, one that does not exist, another actor) is acked and
    ignored as `forged_event_ignored`. The kit keeps the message in progress while a long
    tool loop runs, so it is not redelivered (and counted against MaxDeliver) meanwhile.
    """
    # Decision 5: the cheap short-circuit, before any read of the log or the model.
    if await repo.already_analyzed(event.session_id):
        log.info("already_analyzed", session_id=str(event.session_id))
        return
    if event.type not in SESSION_CLOSINGS or await confirm(nc, event, consumer=CONSUMER) is None:
        return
    prepared = await analyst.prepare(event.session_id, "auto")
    try:
        await analyst.analyse(prepared, attempt.last)
    except Retry:
        raise
    except Exception as exc:
        if not attempt.last:
            raise
        # Never no outcome: the last delivery announces why it gave up.
        await analyst.give_up(prepared, f"gave up after {attempt.number} deliveries: {exc!r}")
