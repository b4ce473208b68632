"""What a session does with each input: catch up on the log, decide (domain), act.

Each input is handled under the session's lease, after catching up with the log,
so the decision is taken on the log as it stands, not on what this replica last saw:
- a chat message is answered with every earlier message still unanswered, in `seq`
  order (those another replica received and has not answered yet) — by Criativo when
  it is active in the session, otherwise by the plain stateless chat;
- a message whose `agent.response` (or `agent.error`) is in the log is not answered
  again, and every record is appended with an idempotency key derived from the
  message (a rule: from the message and its tool_use id), so even two turns racing
  past an expired lease leave one answer and one artifact per tool call;
- a readiness confirmation gets the consolidation turn, the brief and the offer;
- an input is acted on only when the log confirms it (same id, type, session, actor,
  payload): a forged copy on the bus is acknowledged and ignored;
- a dependency that is restarting is a wait, not a crash: a turn metering
  cannot take is asked again with backoff for `dependency_wait_seconds`, then the
  message gets an `agent.error` coded `dependency_unavailable` (send it again) and the
  session goes on; the log being away is waited for the same way, then the input is
  retried by redelivery. Neither counts toward the crash limit, kept for real faults.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from uuid import UUID

import asyncpg
from nats.aio.client import Client

from contracts import subjects
from contracts.common import ErrorCode
from contracts.criativo import AgentDone
from contracts.events import (
    AgentError,
    AgentResponse,
    BusinessRule,
    Event,
    EventType,
)
from criativo.lease import SessionLeases
from criativo.offers import queue_offer
from criativo.turns import TurnFailed, TurnOutcome, Turns, consolidation_turn_id
from domain import criativo as rules
from domain.criativo import Action, Conversation
from servicekit import provenance
from servicekit.client import CommandFailed
from servicekit.logs import get_logger
from servicekit.outbox import Wake
from servicekit.patience import Patience, is_unavailable
from servicekit.sessionlog import SessionClosed, SessionLogClient, SessionNotFound

log = get_logger(__name__)

# The durable consumer of the inputs (`criativo.handlers`), named in
# `forged_event_ignored` lines.
CONSUMER = "criativo-inputs"


class SessionWork:
    """The handlers of a session's inputs; one instance serves every actor."""

    def __init__(
        self,
        nc: Client,
        pool: asyncpg.Pool,
        sessions: SessionLogClient,
        leases: SessionLeases,
        turns: Turns,
        crash_limit: int,
        dependency_wait_seconds: float = 60.0,
        wake_offers: Wake | None = None,
    ) -> None:
        """`wake_offers`: wakes the offer relay of this process once an offer is queued."""
        self._nc = nc
        self._pool = pool
        self._wake_offers = wake_offers
        self._log = sessions
        self._leases = leases
        self._turns = turns
        self._crash_limit = crash_limit
        # One per dependency: giving up on metering (the message gets its agent.error)
        # is a success of the log's work, and must not make metering look back.
        self._metering = Patience(dependency_wait_seconds)
        self._log_patience = Patience(dependency_wait_seconds)

    async def catch_up(self, conv: Conversation) -> Conversation:
        """The conversation with every event the log has past what `conv` saw.

        A session the log does not know (a forged input named it) stays empty.
        """
        try:
            events = await self._log.events(conv.session_id, conv.last_seq)
        except SessionNotFound:
            return conv
        for event in events:
            conv = rules.apply(conv, event)
        return conv

    async def confirmed(self, conv: Conversation, event: Event) -> bool:
        """Whether the log holds `event` as delivered (trust the log, not the bus).

        The caught-up conversation already holds the log's copy of every input, so a
        real input costs no extra round trip; anything else is asked of the log, which
        logs and counts a forged or stale copy as `forged_event_ignored`.
        """
        logged = conv.inputs.get(event.id)
        if logged is not None and provenance.mismatch(event, logged) is None:
            return True
        return await provenance.confirm(self._nc, event, consumer=CONSUMER) is not None

    async def handle(self, conv: Conversation, event: Event, deliveries: int) -> Conversation:
        """Handle one input; after `crash_limit` failed deliveries, end the session.

        The log (or the bus) being away is waited for, then the input fails without
        ending anything: its redelivery tries again later."""
        try:
            return await self._log_patience.retry(
                lambda: self._handle(conv, event), f"{event.type.value} {event.id}"
            )
        except Exception as exc:
            if is_unavailable(exc) or deliveries < self._crash_limit:
                raise
            # Never end a session on the word of a copy the log does not hold.
            if await provenance.confirm(self._nc, event, consumer=CONSUMER) is None:
                return conv
            reason = (
                f"criativo crashed {deliveries} times handling {event.type.value} {event.id}: "
                f"{exc!r}"
            )
            log.error("criativo_actor_crashing", session_id=str(event.session_id), reason=reason)
            with contextlib.suppress(SessionClosed):  # already ended: it stays as it is
                await self._log.terminate(event.session_id, reason)
            return await self.catch_up(conv)

    async def _handle(self, conv: Conversation, event: Event) -> Conversation:
        if event.type not in (EventType.CHAT_MESSAGE, EventType.CRIATIVO_READINESS_CONFIRMED):
            # Activation, closing: only the state moves, and it moves from the log.
            conv = await self.catch_up(conv)
            await self.confirmed(conv, event)  # a forged one is logged and counted
            return conv
        # The log is read while the lease is taken, when the lease may be resumed, and the
        # read stands only if it was: no other replica held the session since this one
        # released it, and all this one wrote under the lease had been written before the
        # read went out. Otherwise the log is read again, under the lease. This keeps a round
        # trip off every turn's first token.
        ahead = self._read_ahead(conv) if self._leases.may_resume(event.session_id) else None
        try:
            async with self._leases.hold(event.session_id) as resumed:
                if ahead is not None and resumed:
                    conv = await ahead
                else:
                    conv = await self.catch_up(conv)
                return await self._handle_held(conv, event)
        finally:
            if ahead is not None:
                ahead.cancel()  # unused, or done

    def _read_ahead(self, conv: Conversation) -> asyncio.Task[Conversation]:
        """`catch_up`, started now; if it goes unused, its failure is nobody's."""
        task = asyncio.ensure_future(self.catch_up(conv))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _handle_held(self, conv: Conversation, event: Event) -> Conversation:
        """A message or a readiness, under the session's lease, on the caught-up log."""
        if not await self.confirmed(conv, event):
            return conv  # forged or stale: acknowledged, never acted on
        if event.type is EventType.CHAT_MESSAGE:
            for n, message_id in enumerate(conv.pending_before(event.seq)):
                if n:  # the answer before, as the log holds it, is in this one's prompt
                    conv = await self.catch_up(conv)
                conv = await self._answer(conv, message_id)
            # The last answer is read back by the next input's catch-up, which every
            # input starts with: one read of the log per turn, not two.
            return conv
        return await self._readiness(conv, event)

    async def _answer(self, conv: Conversation, message_id: UUID) -> Conversation:
        action = rules.decide(conv, EventType.CHAT_MESSAGE, message_id)
        said = conv.message(message_id)
        if action is Action.ANSWER_WITH_CRIATIVO:
            agent = rules.CRIATIVO

            async def record(rule: BusinessRule, tool_use_id: str) -> UUID:
                # One tool call, one artifact: a replayed turn repeats the tool_use id.
                appended = await self._log.append(
                    conv.session_id,
                    EventType.ARTIFACT_BUSINESS_RULE,
                    rules.CRIATIVO_ACTOR,
                    rule,
                    causation_id=message_id,
                    idempotency_key=f"criativo:rule:{message_id}:{tool_use_id}",
                )
                return appended.event_id

            def run() -> Awaitable[TurnOutcome]:
                return self._turns.criativo(conv, message_id, record)
        elif action is Action.ANSWER_PLAINLY:
            agent = rules.PLAIN_CHAT

            def run() -> Awaitable[TurnOutcome]:
                return self._turns.plain(conv, message_id, said.text)
        else:
            return conv
        try:
            outcome = await self._patiently(run, f"turn for {message_id}")
        except TurnFailed as exc:
            await self._failed(conv, agent, message_id, exc)
        else:
            await self._respond(conv, agent, message_id, outcome)
        return conv

    async def _patiently(self, run: Callable[[], Awaitable[TurnOutcome]], what: str) -> TurnOutcome:
        """The turn, waited for while metering restarts (its turn ids make a retried turn
        replay what already ran); still away after the wait, it fails as unavailable."""

        async def attempt() -> TurnOutcome:
            try:
                return await run()
            except TurnFailed as exc:  # metering's own store away: a wait as well
                if exc.code != ErrorCode.UNAVAILABLE:
                    raise
                raise CommandFailed(exc.code, exc.message) from exc

        try:
            return await self._metering.retry(attempt, what)
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            raise TurnFailed(ErrorCode.DEPENDENCY_UNAVAILABLE, repr(exc), []) from exc

    async def _respond(
        self, conv: Conversation, agent: str, message_id: UUID, outcome: TurnOutcome
    ) -> None:
        response = AgentResponse(
            agent=agent,
            text=outcome.text,
            turn_id=outcome.turn_ids[-1] if outcome.turn_ids else None,
            usage=outcome.turn_usage(),
            stopped=outcome.stopped,
        )
        appended = await self._log.append(
            conv.session_id,
            EventType.AGENT_RESPONSE,
            f"agent:{agent}",
            response,
            causation_id=message_id,
            idempotency_key=f"{agent}:response:{message_id}",
        )
        await self._done(
            conv,
            AgentDone(
                agent=agent,
                causation_id=message_id,
                turn_ids=outcome.turn_ids,
                response_id=appended.event_id,
            ),
        )

    async def _failed(self, conv: Conversation, agent: str, cause: UUID, exc: TurnFailed) -> None:
        """A turn metering could not complete: the person reads why; the session goes on."""
        log.warning(
            "turn_failed", session_id=str(conv.session_id), code=exc.code, error=exc.message
        )
        await self._log.append(
            conv.session_id,
            EventType.AGENT_ERROR,
            f"agent:{agent}",
            AgentError(
                agent=agent, code=exc.code, reason=rules.readable_reason(exc.code, exc.details)
            ),
            causation_id=cause,
            idempotency_key=f"{agent}:error:{cause}",
        )
        await self._done(
            conv,
            AgentDone(agent=agent, causation_id=cause, turn_ids=exc.turn_ids, error_code=exc.code),
        )

    async def _done(self, conv: Conversation, done: AgentDone) -> None:
        await self._nc.publish(
            subjects.done_subject(conv.project_id, conv.session_id),
            done.model_dump_json().encode(),
        )

    async def _readiness(self, conv: Conversation, readiness: Event) -> Conversation:
        readiness_id = readiness.id
        action = rules.decide(conv, EventType.CRIATIVO_READINESS_CONFIRMED, readiness_id)
        if action is Action.CONSOLIDATE:
            try:
                outcome = await self._patiently(
                    lambda: self._turns.consolidate(conv, readiness_id, readiness.seq),
                    f"consolidation for {readiness_id}",
                )
            except TurnFailed as exc:
                await self._failed(conv, rules.CRIATIVO, readiness_id, exc)
                return await self.catch_up(conv)
            brief = rules.brief_from_reply(outcome.text, conv)
            appended = await self._log.append(
                conv.session_id,
                EventType.ARTIFACT_PRODUCT_BRIEF,
                rules.CRIATIVO_ACTOR,
                brief,
                causation_id=readiness_id,
                idempotency_key=f"criativo:brief:{readiness_id}",
            )
            brief_id = appended.event_id
            turn_ids = outcome.turn_ids
        elif action is Action.OFFER_EXISTING_BRIEF:
            brief_id = conv.briefs[readiness_id]
            turn_ids = [consolidation_turn_id(readiness_id)]
        else:
            log.info("readiness_ignored", session_id=str(conv.session_id), action=action.value)
            return conv
        # The consolidation's deltas end here; the brief is the event the turn produced.
        await self._done(
            conv,
            AgentDone(
                agent=rules.CRIATIVO,
                causation_id=readiness_id,
                turn_ids=turn_ids,
                response_id=brief_id,
            ),
        )
        await queue_offer(
            self._pool, self._wake_offers, conv.project_id, conv.session_id, readiness_id, brief_id
        )
        return await self.catch_up(conv)
