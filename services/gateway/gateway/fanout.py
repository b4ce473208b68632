"""One NATS subscription per followed session, shared by every connection that follows it.

A message of a session (an event, a delta, a done) is decoded and encoded as the frame
its clients get once, here, however many connections follow the session, down to the
WebSocket frame's bytes (`gateway.wire`); each connection's `SessionFeed` then only
decides whether it still needs that frame (its own `seq`, dedupe and outcome state) and
queues the same bytes. The per-token cost of a session with many clients is one decode
and one encode, not one of each per client.

Messages of a session reach its feeds in the order NATS delivered them: one
subscription, one callback, feeds offered each message in turn.

What the subscriptions cannot deliver, the feeds read from the log: a live event the log
did not answer for, and whatever was published while the gateway's connection was away
(`Follower.behind`).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from contracts import subjects
from contracts.criativo import AgentDone
from contracts.events import Event
from contracts.gateway import DoneFrame, EventFrame
from contracts.metering import TurnDelta
from gateway.metrics import FOLLOWED_SESSIONS
from gateway.wire import model_frame, text_frame
from servicekit.logs import get_logger
from servicekit.provenance import Confirmations, LogUnanswered

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class LiveDelta:
    """A delta off the bus, with its prepared `delta` frame."""

    delta: TurnDelta
    frame: bytes


@dataclass(frozen=True, slots=True)
class LiveDone:
    """An `agent.done` off the bus, with its prepared `done` frame."""

    done: AgentDone
    frame: bytes


@dataclass(frozen=True, slots=True)
class LiveEvent:
    """A persisted event off the bus, with its prepared `event` frame."""

    event: Event
    frame: bytes


Live = LiveDelta | LiveDone | LiveEvent


def delta_frame(delta: TurnDelta) -> bytes:
    """The prepared `DeltaFrame`, built as a plain dict and encoded by orjson: the
    per-token path, where a model round trip per delta, then `json.dumps`, would be the
    gateway's largest costs after the socket (bench/gateway.py)."""
    frame = {
        "type": "delta",
        "message_id": delta.causation_id,  # orjson writes a UUID as its string
        "turn_id": delta.turn_id,
        "seq": delta.seq,
        "text": delta.text,
        "emitted_at": delta.emitted_at,
    }
    return text_frame(orjson.dumps(frame))


def done_frame(done: AgentDone) -> bytes:
    """The prepared `DoneFrame` that tells clients a turn ended."""
    return model_frame(
        DoneFrame(
            message_id=done.causation_id,
            agent=done.agent,
            turn_ids=done.turn_ids,
            response_id=done.response_id,
            error_code=done.error_code,
        )
    )


def event_frame(event: Event) -> bytes:
    """The prepared `EventFrame` carrying a persisted event."""
    return model_frame(EventFrame(event=event))


def decode(subject: str, data: bytes) -> Live:
    """A session subject's message, validated once (the bus is not trusted) and encoded."""
    if subject.startswith(subjects.DELTA_PREFIX):
        delta = TurnDelta.model_validate_json(data)
        return LiveDelta(delta, delta_frame(delta))
    if subject.startswith(subjects.DONE_PREFIX):
        done = AgentDone.model_validate_json(data)
        return LiveDone(done, done_frame(done))
    event = Event.model_validate_json(data)
    return LiveEvent(event, event_frame(event))


def session_filter(project_id: str, session_id: uuid.UUID) -> str:
    """Every event type, delta and done of one session (all are `<a>.<b>.<project>.<session>`)."""
    return f"*.*.{project_id}.{session_id}"


def foreign(subject: str, live: Live | None, project_id: str, session_id: uuid.UUID) -> str | None:
    """Why a message received for a session is not that session's (None when it is): its
    subject names another, or the event it carries does (deltas and dones name theirs by
    subject only).

    A subject is only where someone chose to publish: a client allowed to publish on the
    session's subject, or an operator's push consumer delivering EVENTS there, can put
    any well-formed message on it, even one the log confirms (a real event of another
    session). A client is shown nothing of a session it did not join.
    """
    if subject.split(".")[-2:] != [project_id, str(session_id)]:
        return "subject_names_another_session"
    if isinstance(live, LiveEvent) and (
        live.event.project_id != project_id or live.event.session_id != session_id
    ):
        return "event_of_another_session"
    return None


class Follower(Protocol):
    """What the fan-out hands a session's messages to (a connection's `SessionFeed`)."""

    def offer(self, live: Live) -> None: ...

    def behind(self, until_seq: int | None) -> None:
        """The log may hold events of the session this follower was not offered: up to
        `until_seq` (an event that came, the log not answering for it), or, None,
        to the log's end (the subscription was away). It reads them from the log, in
        order, however long the log takes to answer."""


@dataclass(eq=False)
class _Topic:
    """One followed session: its subscription and the feeds following it."""

    project_id: str
    session_id: uuid.UUID
    confirmations: Confirmations
    followers: list[Follower] = field(default_factory=list)
    subscribed: asyncio.Future[Subscription] | None = None

    async def subscribe(self, nc: Client) -> Subscription:
        subject = session_filter(self.project_id, self.session_id)
        sub = await nc.subscribe(subject, cb=self.dispatch)
        await nc.flush()  # the server knows the subscription before any feed reads the log
        return sub

    async def dispatch(self, msg: Msg) -> None:
        try:
            live = decode(msg.subject, msg.data)
        except ValidationError as exc:  # one bad message must not end the feeds
            log.warning("feed_message_dropped", subject=msg.subject, error=repr(exc))
            return
        reason = foreign(msg.subject, live, self.project_id, self.session_id)
        if reason is not None:
            log.warning("foreign_message_dropped", subject=msg.subject, reason=reason)
            return
        # A live event is shown only as the log committed it
        # (docs/decisions/0004-trust-the-log.md): a forged copy is never shown, nor lets
        # the feeds drop the real one as a duplicate of its `seq`. The session's later
        # messages wait behind it, in order. The bus's permissions alone would not do:
        # of the services only session_events may publish on an event subject
        # (servicekit.permissions), but the embedded stack's and the tests' `admin` may
        # publish anything, and this is a core subscription: a plain publish on the
        # subject reaches it without passing through the EVENTS stream.
        if isinstance(live, LiveEvent):
            try:
                if await self.confirmations.confirm(live.event) is None:
                    return  # denied by the log: a forgery, logged and counted
            except LogUnanswered:
                # Neither shown nor dropped: the feeds read the log up to its `seq`, as
                # the log committed it, once it answers (a forgery's `seq` reads no
                # further than the log's end).
                self.behind(live.event.seq)
                return
        for follower in tuple(self.followers):
            try:
                follower.offer(live)
            except Exception as exc:  # nor a feed's failure reach the others
                log.warning("feed_message_dropped", subject=msg.subject, error=repr(exc))

    def behind(self, until_seq: int | None) -> None:
        """Tell every follower the log may hold what it was not offered (`Follower.behind`)."""
        for follower in tuple(self.followers):
            try:
                follower.behind(until_seq)
            except Exception as exc:
                log.warning("feed_catch_up_failed", session=str(self.session_id), error=repr(exc))


class Fanout:
    """The gateway's subscriptions to the sessions its connections follow."""

    def __init__(self, nc: Client, confirmations: Confirmations) -> None:
        self._nc = nc
        self._confirmations = confirmations
        self._topics: dict[str, _Topic] = {}

    def following(self) -> int:
        """How many sessions have a subscription now."""
        return len(self._topics)

    def reconnected(self) -> None:
        """The connection is back (`servicekit.bus.on_reconnected`): what was published
        while it was away never reached the subscriptions, so every follower reads the
        log to its end. The server holds the subscriptions again by now: anything
        committed after such a read is delivered live."""
        for topic in tuple(self._topics.values()):
            topic.behind(None)

    async def follow(self, project_id: str, session_id: uuid.UUID, follower: Follower) -> None:
        """Offer `follower` every message of the session from now on; returns once the
        NATS server has the subscription, so a log read after it misses nothing."""
        key = session_filter(project_id, session_id)
        topic = self._topics.get(key)
        if topic is None:
            topic = self._topics[key] = _Topic(project_id, session_id, self._confirmations)
            FOLLOWED_SESSIONS.inc()
            topic.subscribed = asyncio.ensure_future(topic.subscribe(self._nc))
        topic.followers.append(follower)
        assert topic.subscribed is not None
        try:
            # shielded: a join given up must not cancel the subscription others wait on
            await asyncio.shield(topic.subscribed)
        except BaseException:
            await self.unfollow(project_id, session_id, follower)
            raise

    async def unfollow(self, project_id: str, session_id: uuid.UUID, follower: Follower) -> None:
        """Stop offering the session to `follower`; the last one out unsubscribes."""
        key = session_filter(project_id, session_id)
        topic = self._topics.get(key)
        if topic is None or follower not in topic.followers:
            return
        topic.followers.remove(follower)
        if topic.followers:
            return
        del self._topics[key]
        FOLLOWED_SESSIONS.dec()
        assert topic.subscribed is not None
        with contextlib.suppress(Exception):  # a failed subscribe or a closed connection
            await (await topic.subscribed).unsubscribe()
