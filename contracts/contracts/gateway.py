"""Frames of the gateway's WebSocket: what the web client sends and what it is sent.

Every frame is a JSON object with a `type`. A client frame may carry a `ref` (any
short string); the `ack` or `error` that answers it echoes it, so a client can match
answers to requests. Server frames are plain dicts built from these models.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal
from uuid import UUID

from pydantic import Field, StringConstraints

from contracts.common import TEXT_CHECK, AgentSlug, Int64, Key, Message, Text
from contracts.events import Event, NonBlank, Utterance
from contracts.metering import TurnId

Ref = Annotated[str, StringConstraints(min_length=1, max_length=100), TEXT_CHECK] | None


class ClientRequest(Message):
    """What every client frame may carry besides its own fields: the `ref` that the `ack`
    or `error` answering it echoes."""

    ref: Ref = None


class Join(ClientRequest):
    """Follow a session: its events after `after_seq` from the log, then live."""

    type: Literal["join"]
    session_id: UUID
    after_seq: Int64 = Field(default=0, ge=0)


# A client's own id for one request: sent again with the same id (after a lost socket,
# when the client cannot tell whether the first went in), it is the same request.
ClientMsgId = Annotated[str, StringConstraints(min_length=1, max_length=100), TEXT_CHECK]


class Chat(ClientRequest):
    """Say something in the joined session (`client_msg_id` makes a resend harmless)."""

    type: Literal["chat"]
    text: Utterance
    client_msg_id: ClientMsgId


class StartAgent(ClientRequest):
    """Start an agent the person may start (Criativo, ADR 0008 decision 4)."""

    type: Literal["start_agent"]
    agent: AgentSlug


class ConfirmReadiness(ClientRequest):
    """The person clicked "I'm ready to produce". With a `client_msg_id`, a resend is
    harmless: each readiness gets its own brief and offer, and a second one supersedes
    the offer the person may be answering."""

    type: Literal["confirm_readiness"]
    client_msg_id: ClientMsgId | None = None


class AcceptHandoff(ClientRequest):
    """Accept an offered handoff of the joined session."""

    type: Literal["accept_handoff"]
    handoff_id: UUID


class RejectHandoff(ClientRequest):
    """Reject an offered handoff of the joined session."""

    type: Literal["reject_handoff"]
    handoff_id: UUID


class CloseSessionFrame(ClientRequest):
    """End the joined session normally."""

    type: Literal["close_session"]


class StopTurn(ClientRequest):
    """The person pressed Stop while an answer of the joined session streams."""

    type: Literal["stop_turn"]
    turn_id: TurnId


class RetractRule(ClientRequest):
    """The person takes back a business rule of the joined session (its card's Remove)."""

    type: Literal["retract_rule"]
    rule_id: UUID
    reason: Text | None = None


class CorrectRule(ClientRequest):
    """The person corrects a business rule (its card's Edit): the corrected rule replaces
    it; `origin` is what the rule rested on, carried over."""

    type: Literal["correct_rule"]
    rule_id: UUID
    title: NonBlank
    statement: NonBlank
    origin: list[UUID] = Field(min_length=1)


class Heartbeat(ClientRequest):
    """The client is still there (the gateway also beats on its own while connected)."""

    type: Literal["heartbeat"]


ClientFrame = Annotated[
    Join
    | Chat
    | StartAgent
    | ConfirmReadiness
    | AcceptHandoff
    | RejectHandoff
    | CloseSessionFrame
    | StopTurn
    | RetractRule
    | CorrectRule
    | Heartbeat,
    Field(discriminator="type"),
]


class EventFrame(Message):
    """A persisted event of the joined session; sent in `seq` order, each once."""

    type: Literal["event"] = "event"
    event: Event


class DeltaFrame(Message):
    """A piece of an agent's reply as it streams; `message_id` is what it answers."""

    type: Literal["delta"] = "delta"
    message_id: UUID | None
    turn_id: str
    seq: int
    text: str
    # When the provider produced the text (seconds since the epoch), so a client can
    # measure the latency of the whole path.
    emitted_at: float | None = None


class DoneFrame(Message):
    """An agent's turn ended: its response event, or the error code of why there is none."""

    type: Literal["done"] = "done"
    message_id: UUID
    agent: AgentSlug
    turn_ids: list[str]
    response_id: UUID | None = None
    error_code: str | None = None


class AckFrame(Message):
    """A client frame was carried out; `result` is what the service answered."""

    type: Literal["ack"] = "ack"
    of: str
    ref: str | None = None
    client_msg_id: str | None = None
    result: dict[str, Any] = Field(default_factory=dict)


class ErrorFrame(Message):
    """A client frame was refused; the connection stays usable."""

    type: Literal["error"] = "error"
    code: str
    message: str
    ref: str | None = None


# --- HTTP API ---------------------------------------------------------------


class ClientConfig(Message):
    """`GET /api/projects/{project}`: who the token speaks for, and how the model runs."""

    project_id: str
    user: str
    # metering answers from its offline script: the page shows an "offline model" notice
    offline_model: bool


class WsTicket(Message):
    """`POST /api/projects/{project}/ws-ticket`: opens one WebSocket, `/ws?ticket=…`,
    within `expires_in` seconds (the token itself never goes in a URL)."""

    ticket: str
    expires_in: int


class ForkRequest(Message):
    """`POST /api/projects/{project}/sessions/{session}/fork`: a branch of the session
    that keeps its events up to `at_seq` and continues with `text` (Edit: the edited
    message; Retry: the message the answer replied to, again). `fork_id`, chosen by the
    client, makes a repeated click or request answer the same branch."""

    at_seq: Int64 = Field(ge=1)
    text: Utterance
    fork_id: Key


class SessionSummary(Message):
    """A session of the project as the sessions list shows it."""

    session_id: UUID
    opened_by: str
    opened_at: datetime
    status: Literal["open", "closed", "closed_abnormally"]
    closed_at: datetime | None = None
    reason: str | None = None
    # Its first message (cut to `contracts.session_events.TITLE_MAX_CHARS`), if any.
    title: str | None = None
    # When its latest event was appended: its last activity.
    last_event_at: datetime
    # A branch: the session it was forked from, and the parent's last event it keeps.
    parent_session_id: UUID | None = None
    forked_at_seq: int | None = None


class SessionsReply(Message):
    """The project's sessions, newest first."""

    sessions: list[SessionSummary]
