"""A session's feed for one connection: the log's events after a `seq`, then live, each
event exactly once and in `seq` order, plus the deltas of the turn in flight.

Live messages come from the session's one subscription, shared by its connections
(`gateway.fanout`), already decoded and encoded as frames. The seam between replay and
live is closed by following the session *before* reading the log: anything committed
after the read is published after the subscription started, and anything both read and
received is dropped by `seq`; what arrives while the feed replays waits in its backlog.
A live event whose `seq` jumps ahead (a message the subscription missed, or a relay
publishing late) makes the feed read the missing ones from the log first, so a gap never
reaches the client. So does a live event the log did not answer for (it is read from
the log, as committed, up to its `seq`) and the gateway's connection coming back (read
to the log's end: what was published meanwhile never came). Such a read waits for a log
that does not answer, with backoff, for as long as the feed lives: a missing event is
never given up, and later messages wait behind it, deltas too (a turn's text never
comes before the message it answers, nor after its outcome).

Deltas live in the short-lived DELTAS stream: on join, the deltas of every turn not yet
closed by an `agent.done` are replayed from it, then live ones follow, deduplicated by
(turn, seq). A turn's deltas are only worth sending before its outcome: the event that
answers what caused it (`agent.response` / `agent.error` for a message,
`artifact.product_brief` / `agent.error` for the consolidation turn after readiness, all
with the cause as `causation_id`). The `agent.done` that closes the turn is published
independently of the outcome, so a joiner can read the outcome from the log while the
DELTAS stream still holds the turn open: once this client has the outcome (sent now, or
at or before its `after_seq`), the turn's deltas are dropped, replayed or live. Without
that, a client joining as a turn ends got `agent.response`, then the whole turn again as
deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client

from contracts import streams, subjects
from contracts.criativo import AgentDone
from contracts.events import Event, EventType
from contracts.metering import TurnDelta
from contracts.session_events import EVENTS_PAGE_MAX
from gateway.fanout import (
    Fanout,
    Live,
    LiveDelta,
    LiveDone,
    LiveEvent,
    delta_frame,
    event_frame,
    foreign,
)
from servicekit.bus import stored_messages
from servicekit.logs import get_logger
from servicekit.patience import Patience, is_unavailable
from servicekit.sessionlog import SessionLogClient

log = get_logger(__name__)

# Queues one prepared frame for the client: (frame type, frame). Never waits on the socket.
Send = Callable[[str, bytes], object]
# How long a join waits for each read of the DELTAS stream before it goes on without the
# open turns' text so far (`_open_turn_deltas_if_answered`).
OPEN_TURNS_READ_SECONDS = 2.0
# Events that end the turn their `causation_id` caused: no delta of it may follow them.
OUTCOMES = frozenset(
    {
        EventType.AGENT_RESPONSE.value,
        EventType.AGENT_ERROR.value,
        EventType.ARTIFACT_PRODUCT_BRIEF.value,
    }
)
# A feed's reads of what it missed wait for the log for as long as the feed lives (a
# closed feed's read is cancelled), asked again at most every 5 s.
LOG_PATIENCE = Patience(math.inf, first_backoff=0.5, max_backoff=5.0)


@dataclass(frozen=True, slots=True)
class _Behind:
    """A mark in the backlog: the log may hold events up to `until_seq` (None: to its
    end) the feed was not offered; they are read before what came after the mark."""

    until_seq: int | None


# What waits in a feed's backlog.
_Pending = Live | _Behind


class SessionFeed:
    """Follows one session for one connection until `close()`."""

    def __init__(
        self,
        nc: Client,
        fanout: Fanout,
        session_log: SessionLogClient,
        project_id: str,
        session_id: uuid.UUID,
        send: Send,
    ) -> None:
        self._nc = nc
        self._fanout = fanout
        self._log = session_log
        self._project = project_id
        self.session_id = session_id
        self._send = send
        # Live messages not applied yet: while the feed replays, or reads from the log
        # what it missed. None when the feed is live and has nothing pending: a message
        # is applied as it arrives, with no task hop.
        self._backlog: deque[_Pending] | None = deque()
        self._catching_up: asyncio.Task[None] | None = None
        self._following = False
        self.last_seq = 0
        # (turn, seq) already sent, per open turn; forgotten when the turn is done.
        self._sent_deltas: dict[str, set[int]] = {}
        self._closed_turns: set[str] = set()
        # Causes (message, readiness) whose outcome this client has: their turns are over.
        self._answered: set[uuid.UUID] = set()

    async def start(self, after_seq: int, log_last_seq: int) -> None:
        """Follow, replay the log after `after_seq` and the open turns' deltas, go live.

        `log_last_seq` is the session's last `seq` as the log reported it before this
        call. A client cannot hold what was never written: a claim past it is taken as
        that, so the live events after it are sent, and no read of the log walks a range
        the session does not have.
        """
        after_seq = min(after_seq, log_last_seq)
        await self._fanout.follow(self._project, self.session_id, self)
        self._following = True
        self.last_seq = after_seq
        pending_deltas = await self._open_turn_deltas_if_answered()
        await self._outcomes_already_sent(pending_deltas, after_seq)
        await self._catch_up()
        # After the log: a turn whose outcome was just sent is dropped here, and the
        # others' deltas still come before their outcome, which is live, later.
        for delta in pending_deltas:
            self._send_delta(delta, delta_frame(delta))
        # What came meanwhile goes before the join's answer, read from the log where it
        # must be; a log that does not answer that read fails the join (`unavailable`:
        # the client joins again after what it has), rather than hold it.
        await self._drain(patience=None)

    async def close(self) -> None:
        if self._following:
            self._following = False
            await self._fanout.unfollow(self._project, self.session_id, self)
        if self._catching_up is not None:
            self._catching_up.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._catching_up

    def offer(self, live: Live | _Behind) -> None:
        """A live message of the session (from the fan-out), in the order NATS delivered
        it (or a mark of what the log holds that the feed was not offered)."""
        if self._backlog is not None:
            self._backlog.append(live)
        elif not self._apply(live):
            # The log holds what the client must get first: it is read, and whatever
            # arrives meanwhile waits behind it.
            self._backlog = deque([live])
            self._catching_up = asyncio.create_task(self._drain(), name=f"feed-{self.session_id}")

    def behind(self, until_seq: int | None) -> None:
        """The log may hold events up to `until_seq` (None: to its end) that the feed
        was not offered (`gateway.fanout.Follower`): they are read from the log, before
        any message offered after this call."""
        self.offer(_Behind(until_seq))

    async def _drain(self, patience: Patience | None = LOG_PATIENCE) -> None:
        """Apply the backlog in order, reading from the log first what a message needs
        (a gap's events, a mark's); the feed is live again once the backlog is empty.

        A log that does not answer is waited for (`patience`) until it does or the feed
        closes: giving up would leave the client behind the log until the session's
        next event, which may be long in coming (the answer it waits for). Without
        `patience` (a join), its silence is raised."""
        backlog = self._backlog
        assert backlog is not None
        while backlog:
            pending = backlog[0]
            try:
                if isinstance(pending, _Behind):
                    await self._catch_up(pending.until_seq, patience=patience)
                elif not self._apply(pending):
                    assert isinstance(pending, LiveEvent)
                    await self._catch_up(pending.event.seq - 1, patience=patience)
                    self._send_event(pending.event, pending.frame)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bad message, or the log refusing the read
                if patience is None and is_unavailable(exc):
                    raise
                log.warning("feed_message_dropped", session=str(self.session_id), error=repr(exc))
            backlog.popleft()
        self._backlog = None

    def _apply(self, pending: _Pending) -> bool:
        """Send what the client needs of `pending`; False when the log must be read first
        (an event past a gap, not sent; a mark past `last_seq`)."""
        if isinstance(pending, LiveDelta):
            self._send_delta(pending.delta, pending.frame)
        elif isinstance(pending, LiveDone):
            self._end_turns(pending.done)
            self._send("done", pending.frame)
        elif isinstance(pending, _Behind):
            return pending.until_seq is not None and pending.until_seq <= self.last_seq
        elif pending.event.seq > self.last_seq + 1:
            return False
        else:
            self._send_event(pending.event, pending.frame)
        return True

    async def _catch_up(
        self, until_seq: int | None = None, *, patience: Patience | None = None
    ) -> None:
        """Send the log's events after `last_seq` (up to `until_seq`, else to the log's
        end), page by page. With `patience`, a log that does not answer is asked again
        until it does; without, its failure is raised (a join is answered `unavailable`
        and the client joins again)."""
        while until_seq is None or self.last_seq < until_seq:
            read = functools.partial(self._log.page, self.session_id, self.last_seq)
            page = await (read() if patience is None else patience.retry(read, "session log"))
            for event in page:
                if event.seq > self.last_seq:
                    self._send_event(event, event_frame(event))
            if len(page) < EVENTS_PAGE_MAX:
                return

    async def _outcomes_already_sent(self, deltas: list[TurnDelta], after_seq: int) -> None:
        """Note the outcomes at or before `after_seq` of the turns `deltas` belong to.

        A resuming client has everything up to `after_seq`; an open turn's outcome may be
        among it, after the turn's cause. The log reads only forward, so pages are read
        from further and further back until every cause is found: open turns are recent,
        so in practice this is one page, and only when an open turn has such a cause.
        `seq`s have no gaps, so a page the log does not fill lies past the session's
        last event: the walk stops there rather than step down towards it a page at a
        time (`start` clamps `after_seq`, so this is the bound of last resort).
        """
        causes = {d.causation_id for d in deltas if d.causation_id is not None}
        end = after_seq if causes else 0
        while causes and end > 0:
            start = max(0, end - EVENTS_PAGE_MAX)
            page = await self._log.page(self.session_id, after_seq=start, limit=end - start)
            for event in page:
                self._note_outcome(event)
                causes.discard(event.id)
            if len(page) < end - start:
                return
            end = start

    def _note_outcome(self, event: Event) -> None:
        if event.type in OUTCOMES and event.causation_id is not None:
            self._answered.add(event.causation_id)

    def _end_turns(self, done: AgentDone) -> None:
        for turn_id in done.turn_ids:
            self._sent_deltas.pop(turn_id, None)
        self._closed_turns.update(done.turn_ids)

    def _send_event(self, event: Event, frame: bytes) -> None:
        if event.seq <= self.last_seq:
            return  # already sent (read from the log and received live)
        self.last_seq = event.seq
        self._note_outcome(event)
        self._send("event", frame)

    def _send_delta(self, delta: TurnDelta, frame: bytes) -> None:
        if delta.turn_id in self._closed_turns:
            return
        if delta.causation_id is not None and delta.causation_id in self._answered:
            return  # the client has the outcome: the whole text, and no delta after it
        seen = self._sent_deltas.setdefault(delta.turn_id, set())
        if delta.seq in seen:
            return
        seen.add(delta.seq)
        self._send("delta", frame)

    async def _open_turn_deltas_if_answered(self) -> list[TurnDelta]:
        """The open turns' deltas, or none when JetStream does not answer (a node lost,
        its streams electing leaders): the join goes on without them. They only fill in
        a turn's text so far; its later deltas come live and its outcome carries the
        whole text, where refusing the join would leave the person with nothing, asking
        again on the client's back-off, until JetStream answers (`make chaos`: joins
        refused for 10–20 s after a NATS node was killed)."""
        try:
            return await self._open_turn_deltas()
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            log.warning("open_turn_deltas_unread", session=str(self.session_id), error=repr(exc))
            return []

    async def _open_turn_deltas(self) -> list[TurnDelta]:
        """Deltas of the turns in flight, from the DELTAS stream (a reconnect mid-turn)."""
        flt = f"agent.*.{self._project}.{self.session_id}"
        stored = await stored_messages(self._nc, streams.DELTAS.name, flt, OPEN_TURNS_READ_SECONDS)
        deltas: list[TurnDelta] = []
        for msg in stored:
            reason = foreign(msg.subject, None, self._project, self.session_id)
            if reason is not None:
                log.warning("foreign_message_dropped", subject=msg.subject, reason=reason)
            elif msg.subject.startswith(subjects.DONE_PREFIX):
                self._end_turns(AgentDone.model_validate_json(msg.data))
            else:
                deltas.append(TurnDelta.model_validate_json(msg.data))
        return [d for d in deltas if d.turn_id not in self._closed_turns]
