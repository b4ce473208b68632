"""The psychologist's commands and its consumer of session closings: thin, by design.

Each loads, calls one use case (an analysis, a decision) and replies; the rules are in
`domain.psychologist`, the analysis in `psychologist.analysis`.
"""

from __future__ import annotations

import asyncio
import contextlib
from itertools import groupby

from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from contracts.common import ErrorCode
from contracts.events import Event, EventType
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
from domain.psychologist import HypothesisStatus
from psychologist import lifecycle
from psychologist.analysis import Analyst, Retry
from psychologist.repository import PsychologistRepository
from servicekit.consumer import Handler, Permanent
from servicekit.endpoint import Endpoints
from servicekit.logs import get_logger
from servicekit.provenance import confirm
from servicekit.sessionlog import SessionLogClient

log = get_logger(__name__)

SERVICE = "psychologist"
VERSION = "0.1.0"


def build_endpoints(
    repo: PsychologistRepository, log_: SessionLogClient, analyst: Analyst
) -> Endpoints:
    """Every command of the psychologist service."""
    api = Endpoints(SERVICE, VERSION, "The Psicólogo: closed sessions analysed into hypotheses.")

    @api.command(subjects.PSYCHOLOGIST_REANALYZE, Reanalyze)
    async def reanalyze(cmd: Reanalyze) -> AnalysisOutcome:
        session = await log_.session(cmd.session_id)
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
        prepared = await analyst.prepare(cmd.session_id, "manual")
        # A manual run has no later delivery: any failure is announced now.
        return await analyst.analyse(prepared, last_attempt=True)

    @api.command(subjects.HYPOTHESES_ACCEPT, HypothesisDecision)
    async def accept(cmd: HypothesisDecision) -> HypothesisReply:
        async with repo.transaction() as tx:
            return HypothesisReply(
                hypothesis=await lifecycle.decide(tx, cmd, HypothesisStatus.ACCEPTED)
            )

    @api.command(subjects.HYPOTHESES_DISMISS, HypothesisDecision)
    async def dismiss(cmd: HypothesisDecision) -> HypothesisReply:
        async with repo.transaction() as tx:
            return HypothesisReply(
                hypothesis=await lifecycle.decide(tx, cmd, HypothesisStatus.DISMISSED)
            )

    @api.command(subjects.HYPOTHESES_LIST, ListHypotheses)
    async def list_hypotheses(cmd: ListHypotheses) -> HypothesesReply:
        found = await repo.list_hypotheses(cmd.project_id, cmd.status, cmd.include_superseded)
        return HypothesesReply(
            groups=[
                HypothesisGroup(target_agent=agent, hypotheses=list(group))
                for agent, group in groupby(found, key=lambda h: h.target_agent)
            ]
        )

    return api


async def _keep_alive(msg: Msg, every: float) -> None:
    """Tell JetStream the analysis is still running, so a long tool loop is not
    redelivered (and counted against MaxDeliver) while it works."""
    while True:
        await asyncio.sleep(every)
        with contextlib.suppress(Exception):
            await msg.in_progress()


CLOSINGS = frozenset({EventType.SESSION_CLOSED, EventType.SESSION_CLOSED_ABNORMALLY})
CONSUMER = "psychologist-session-closings"


def session_closings(
    repo: PsychologistRepository,
    analyst: Analyst,
    nc: Client,
    max_deliver: int,
    keep_alive: float,
) -> Handler:
    """The consumer of `session.closed*`: every closed session analysed once (decision 1).

    Money is spent only on a closing the log confirms: a forged `session.closed` on the
    bus (a session still open, one that does not exist, another actor) is acked and
    ignored as `forged_event_ignored`.
    """

    async def on_closed(msg: Msg) -> None:
        try:
            event = Event.model_validate_json(msg.data)
        except ValueError as exc:
            raise Permanent(f"not an event: {exc}") from None
        # Decision 5: the cheap short-circuit, before any read of the log or the model.
        if await repo.already_analyzed(event.session_id):
            log.info("already_analyzed", session_id=str(event.session_id))
            return
        if event.type not in CLOSINGS or await confirm(nc, event, consumer=CONSUMER) is None:
            return
        last_attempt = msg.metadata.num_delivered >= max_deliver
        beating = asyncio.create_task(_keep_alive(msg, keep_alive))
        try:
            prepared = await analyst.prepare(event.session_id, "auto")
            try:
                await analyst.analyse(prepared, last_attempt)
            except Retry:
                raise
            except Exception as exc:
                if not last_attempt:
                    raise
                # Never no outcome: the last delivery announces why it gave up.
                await analyst.give_up(
                    prepared, f"gave up after {msg.metadata.num_delivered} deliveries: {exc!r}"
                )
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating

    return on_closed
