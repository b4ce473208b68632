"""What a session does with each input: catch up on the log, plan, execute, feed back.

The rules are the core's (`domain.criativo.plan` and `conclude`, with no I/O); this
shell reads the log, runs the model turn a plan asks for, gives its result back to the
core, and appends, publishes and queues what the core concludes.

Each input is handled under the session's lease, after catching up with the log,
so the plan is made on the log as it stands, not on what this replica last saw:
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
from contracts.events import Event, EventType
from criativo.lease import SessionLeases
from criativo.offers import queue_offer
from criativo.turns import PROMPTS, TurnFailed, TurnOutcome, Turns
from domain import criativo as rules
from domain.criativo import Action, Ask, Conversation, Failure, Finish, Record, Reply, Then
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
        if not rules.acts_on(event.type):
            # Activation, closing: only the state moves, and it moves from the log.
            conv = await self.catch_up(conv)
            await self.confirmed(conv, event)  # a forged one is logged and counted
            return conv
        # The log is read while the lease is taken, and the read stands only if the lease
        # was taken alone (`SessionLeases.hold`): no other replica held the session since
        # this one released it, or within the TTL, and all this one wrote under its last
        # lease had been written before the read went out (its inputs are handled one at a
        # time). Otherwise the log is read again, under the lease. This keeps a round trip
        # off every turn's first token, the session's first turn included.
        ahead = self._read_ahead(conv)
        try:
            async with self._leases.hold(event.session_id) as alone:
                conv = await ahead if alone else await self.catch_up(conv)
                return await self._handle_held(conv, event)
        finally:
            ahead.cancel()  # unused, or done

    def _read_ahead(self, conv: Conversation) -> asyncio.Task[Conversation]:
        """`catch_up`, started now; if it goes unused, its failure is nobody's."""
        task = asyncio.ensure_future(self.catch_up(conv))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _handle_held(self, conv: Conversation, event: Event) -> Conversation:
        """A message or a readiness, under the session's lease, on the caught-up log: plan,
        execute, feed the result back, until the plan says the input is done."""
        if not await self.confirmed(conv, event):
            return conv  # forged or stale: acknowledged, never acted on
        while True:
            plan = rules.plan(conv, event, PROMPTS)
            finish = plan.finish
            if plan.ask is not None:
                result = await self._turn(conv, plan.action, plan.ask)
                finish = rules.conclude(conv, plan, result)
            if finish is not None:
                await self._finish(conv, finish)
            elif event.type is EventType.CRIATIVO_READINESS_CONFIRMED:
                log.info(
                    "readiness_ignored", session_id=str(conv.session_id), action=plan.action.value
                )
            if plan.then is Then.STOP:
                # What was written is read back by the next input's catch-up, which every
                # input starts with: one read of the log per turn, not two.
                return conv
            conv = await self.catch_up(conv)
            if plan.then is Then.CATCH_UP:
                return conv

    async def _turn(self, conv: Conversation, action: Action, ask: Ask) -> Reply | Failure:
        """The model turn a plan asks for, recording the rules the core accepts on the way;
        a turn metering could not complete is a failure the core concludes from too.

        `Turns` is called by the kind of turn, with the conversation and the input: each
        kind is replaceable on its own, and builds its ask with the very core function
        `plan` used, so it runs this `ask`."""
        cause = ask.cause
        run = {
            Action.ANSWER_WITH_CRIATIVO: self._turns.criativo,
            Action.ANSWER_PLAINLY: self._turns.plain,
            Action.CONSOLIDATE: self._turns.consolidate,
        }[action]

        async def record(rule: Record) -> UUID:
            return await self._record(conv, rule)

        try:
            outcome = await self._patiently(
                lambda: run(conv, cause, record), f"{action.value} for {cause}"
            )
        except TurnFailed as exc:
            log.warning(
                "turn_failed", session_id=str(conv.session_id), code=exc.code, error=exc.message
            )
            return exc.failure()
        return outcome.reply()

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

    async def _record(self, conv: Conversation, record: Record) -> UUID:
        appended = await self._log.append(
            conv.session_id,
            record.type,
            record.actor,
            record.payload,
            causation_id=record.causation_id,
            idempotency_key=record.idempotency_key,
        )
        return appended.event_id

    async def _finish(self, conv: Conversation, finish: Finish) -> None:
        """Record how the input ended, tell the clients the turn is over, offer a brief."""
        recorded = await self._record(conv, finish.record) if finish.record else None
        await self._nc.publish(
            subjects.done_subject(conv.project_id, conv.session_id),
            finish.done(recorded).model_dump_json().encode(),
        )
        answer = finish.answered_by(recorded)
        if finish.offer and answer is not None:
            await queue_offer(
                self._pool,
                self._wake_offers,
                conv.project_id,
                conv.session_id,
                finish.cause,
                answer,
            )
