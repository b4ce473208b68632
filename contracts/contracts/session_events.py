"""Commands and replies of the `session_events` service."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal
from uuid import UUID

from pydantic import Field, StringConstraints

from contracts.common import (
    TEXT_CHECK,
    Actor,
    ErrorBody,
    Int64,
    JsonObject,
    Key,
    Message,
    ProjectId,
)
from contracts.events import Event, Utterance

# Size of one event payload, serialised. Larger artifacts belong in a blob store;
# the log keeps what a person or a model reads.
MAX_EVENT_PAYLOAD_BYTES = 256 * 1024
# The most events one `cmd.events.list` or `cmd.events.get` answers: a client reading
# more pages at this size (`servicekit.sessionlog`).
EVENTS_PAGE_MAX = 1000
# The most events one `cmd.events.append_many` takes (an outbox relay's claim, at most).
APPEND_MANY_MAX = 256
# A listed session's title is its first `chat.message`, looked for among its first
# events only (a bounded index read per session), and cut to this many characters.
TITLE_SEARCH_EVENTS = 20
TITLE_MAX_CHARS = 200

EventTypeName = Annotated[str, StringConstraints(min_length=1, max_length=128), TEXT_CHECK]
SessionStatus = Literal["open", "closed", "closed_abnormally"]


class OpenSession(Message):
    """`cmd.sessions.open`: start a session in a project."""

    project_id: ProjectId
    opened_by: Actor


class SessionOpenedReply(Message):
    """The new session and its `session.opened` event."""

    session_id: UUID
    event_id: UUID


class ForkSession(Message):
    """`cmd.sessions.fork`: open a branch of a session at one of its events, with a new
    message of the person's (Edit: the edited text; Retry: the same text again). The
    branch's log is `session.forked`, copies of the parent's events up to `at_seq`, then
    `text` as a `chat.message`; the parent is left as it is. A repeat with the same
    `fork_id` answers the branch it made (`duplicate`)."""

    session_id: UUID = Field(description="the parent session")
    project_id: ProjectId
    at_seq: Int64 = Field(ge=1, description="the parent's last event the branch keeps")
    text: Utterance
    forked_by: Actor
    fork_id: Key


class SessionForkedReply(Message):
    """The branch: its session, its first event and the person's new message in it."""

    session_id: UUID
    parent_session_id: UUID
    at_seq: int
    forked_event_id: UUID
    message_event_id: UUID
    duplicate: bool = False


class AppendEnvelope(Message):
    """What `cmd.events.append` says of an event besides its payload: its session, type
    and author, what caused it, and the key that makes a repeat a no-op."""

    session_id: UUID
    type: EventTypeName
    actor: Actor
    causation_id: UUID | None = None
    idempotency_key: Key | None = None


class AppendEvent(AppendEnvelope):
    """`cmd.events.append`: append one event to a session's log."""

    payload: JsonObject


class AppendedReply(Message):
    """Where the event landed; `duplicate` when an idempotency key matched an earlier append."""

    event_id: UUID
    seq: int
    duplicate: bool = False


class AppendMany(Message):
    """`cmd.events.append_many`: append each event as `cmd.events.append` would, in the
    order given, with one answer each: an event the log refuses (its type, payload,
    session, author…) gets its own coded error and the others go in. A malformed request
    (any event not an `AppendEvent`) is refused whole, as any command's; an outbox relay
    then sends its rows one per request, so only the bad one is dead-lettered. An
    event that fails to be written (an error a retry may cure) holds back the later
    events of its session in the request, answered `unavailable`: a session's events are
    written in the order given or not at all."""

    events: list[AppendEvent] = Field(min_length=1, max_length=APPEND_MANY_MAX)


class AppendOutcome(Message):
    """One event of `cmd.events.append_many`: the `AppendedReply` fields, or `error`."""

    event_id: UUID | None = None
    seq: int | None = None
    duplicate: bool = False
    error: ErrorBody | None = None


class AppendManyReply(Message):
    """One outcome per event, in the order of the request."""

    results: list[AppendOutcome]


class GetEvents(Message):
    """`cmd.events.get`: events by id (ids that do not exist are listed in `missing`)."""

    event_ids: list[UUID] = Field(min_length=1, max_length=EVENTS_PAGE_MAX)


class EventsReply(Message):
    """Events in `seq` order within each session."""

    events: list[Event]
    missing: list[UUID] = Field(default_factory=list)


class ListEvents(Message):
    """`cmd.events.list`: a session's events after `after_seq`, in `seq` order."""

    session_id: UUID
    after_seq: Int64 = Field(default=0, ge=0)
    limit: Int64 = Field(default=500, ge=1, le=EVENTS_PAGE_MAX)


class QueryEvents(Message):
    """`cmd.events.query`: a project's events of the given types, oldest first."""

    project_id: ProjectId
    types: list[EventTypeName] = Field(min_length=1, max_length=32)
    limit: Int64 = Field(default=1000, ge=1, le=5000)


class SessionRef(Message):
    """`cmd.sessions.heartbeat` and `cmd.sessions.get`: the session addressed."""

    session_id: UUID


class CloseSession(Message):
    """`cmd.sessions.close`: end a session normally (termination reason stays null)."""

    session_id: UUID
    closed_by: Actor | None = None


class TerminateSession(Message):
    """`cmd.sessions.terminate`: end a session abnormally, keeping the reason."""

    session_id: UUID
    reason: Annotated[
        str, StringConstraints(strip_whitespace=True, min_length=1, max_length=4000), TEXT_CHECK
    ]


class SessionClosedReply(Message):
    """The session's new status and the closing event."""

    session_id: UUID
    status: SessionStatus
    event_id: UUID


class HeartbeatReply(Message):
    """When the heartbeat was recorded."""

    session_id: UUID
    last_heartbeat_at: datetime


class ListSessions(Message):
    """`cmd.sessions.list`: a project's sessions, newest first."""

    project_id: ProjectId
    limit: Int64 = Field(default=200, ge=1, le=1000)
    # Only the branches forked from this session (`cmd.sessions.fork`).
    forked_from: UUID | None = None


class SessionView(Message):
    """A session's state as `cmd.sessions.get` reports it."""

    session_id: UUID
    project_id: ProjectId
    opened_by: Actor
    status: SessionStatus
    termination_reason: str | None
    opened_at: datetime
    closed_at: datetime | None
    last_heartbeat_at: datetime | None
    event_count: int
    # A branch: the session it was forked from and the parent's last event it keeps.
    parent_session_id: UUID | None = None
    forked_at_seq: int | None = None


class ListedSession(SessionView):
    """A session as `cmd.sessions.list` lists it: its state, what it is about and when it
    last moved, so a list needs no request per session."""

    # Its first message (among the first `TITLE_SEARCH_EVENTS` events), cut to
    # `TITLE_MAX_CHARS`; None while nobody has said anything.
    title: str | None
    # When its latest event was appended.
    last_event_at: datetime


class SessionsReply(Message):
    """Sessions, newest first."""

    sessions: list[ListedSession]
