"""What the session log accepts (ADR 0008 decisions 5-6, ADR 0182 decision 1, ADR 0015).

Invariants kept here, so no prompt has to keep them:
- only the event types of `contracts.events.EventType` exist; `session.*` events are
  written by the log itself (open/close/terminate), never appended by a caller;
- every payload validates against its contract model;
- a closed session refuses conversation (chat, agent, artifact, readiness) but still
  records system facts about it (handoff and psychologist events, RN-581);
- `artifact.product_brief` comes only from `agent:criativo`, as the consequence of a
  person's `criativo.readiness_confirmed` in the same session;
- a business rule stops standing only by the person's word: a retraction
  (`artifact.business_rule_retracted`) or a correction (an `artifact.business_rule`
  with `replaces`) is written by a person, names a rule of the same project, and
  retires a rule at most once (`check_retirement`).
- a branch (`cmd.sessions.fork`) is a person's, within the parent's project, from an
  event of the parent's conversation (before any closing), and its copies keep their
  causes and references inside the branch (`check_fork`, `copy_prefix`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any
from uuid import UUID

from pydantic import ValidationError

from contracts.common import ErrorCode, Message
from contracts.events import EVENT_REFERENCES, PAYLOADS, Event, EventType
from contracts.session_events import MAX_EVENT_PAYLOAD_BYTES
from domain.errors import DomainError


class ClosedSession(Enum):
    """What a closed session does with an event of a given domain."""

    REFUSE = "refuse"
    ACCEPT = "accept"


# By event type first, then by domain (the type's first token). Anything not listed
# is refused: a new domain must say here whether it is conversation or a system fact.
CLOSED_SESSION_POLICY: dict[str, ClosedSession] = {
    # A turn that fails while the session closes is still recorded: a failure is never
    # left without an outcome (ADR 0015 decision 5, ADR 0182 RN-116).
    EventType.AGENT_ERROR.value: ClosedSession.ACCEPT,
    "chat": ClosedSession.REFUSE,
    "agent": ClosedSession.REFUSE,
    "artifact": ClosedSession.REFUSE,
    "criativo": ClosedSession.REFUSE,
    "handoff": ClosedSession.ACCEPT,
    "psychologist": ClosedSession.ACCEPT,
}

# Written only by the log's own commands (open, close, terminate, reaper).
RESERVED_DOMAINS = frozenset({"session"})

# Who may write a type: an exact actor, or every actor of a kind (`user:*`, a person).
AUTHORS: dict[EventType, str] = {
    EventType.CHAT_MESSAGE: "user:*",
    # Readiness is the person's action, never the model's inference (ADR 0008 decision 5).
    EventType.CRIATIVO_READINESS_CONFIRMED: "user:*",
    EventType.ARTIFACT_PRODUCT_BRIEF: "agent:criativo",
    # Taking a rule back is the person's word, never the model's (see `check_retirement`).
    EventType.ARTIFACT_BUSINESS_RULE_RETRACTED: "user:*",
}


def _may_write(actor: str, author: str) -> bool:
    return actor.startswith(author[:-1]) if author.endswith("*") else actor == author


# Types that must be caused by an event of a given type, written by a person.
REQUIRED_CAUSE: dict[EventType, EventType] = {
    EventType.ARTIFACT_PRODUCT_BRIEF: EventType.CRIATIVO_READINESS_CONFIRMED,
}


@dataclass(frozen=True)
class CausationFacts:
    """The event named by `causation_id`, as the log found it."""

    event_id: UUID
    session_id: UUID
    type: str
    actor: str


def session_not_found(session_id: UUID) -> DomainError:
    """The refusal for a session id the log does not know."""
    return DomainError(
        ErrorCode.SESSION_NOT_FOUND,
        f"session {session_id} does not exist",
        session_id=str(session_id),
    )


def known_event_type(raw: str) -> EventType:
    """The event type named by `raw`, refused when the contracts do not define it."""
    try:
        return EventType(raw)
    except ValueError:
        raise DomainError(
            ErrorCode.UNKNOWN_EVENT_TYPE,
            f"unknown event type {raw!r}; known types: "
            + ", ".join(t.value for t in EventType if t.domain not in RESERVED_DOMAINS),
            type=raw,
        ) from None


def parse_event_type(raw: str) -> EventType:
    """The type of an event a caller appends: known, and not one the log writes itself."""
    event_type = known_event_type(raw)
    if event_type.domain in RESERVED_DOMAINS:
        raise DomainError(
            ErrorCode.RESERVED_EVENT_TYPE,
            f"{raw!r} is written by the session log itself; use cmd.sessions.open/close/terminate",
            type=raw,
        )
    return event_type


def check_payload_size(size_bytes: int) -> None:
    """Refuse a payload larger than the log keeps."""
    if size_bytes > MAX_EVENT_PAYLOAD_BYTES:
        raise DomainError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"event payload is {size_bytes} bytes; the limit is {MAX_EVENT_PAYLOAD_BYTES}",
            size_bytes=size_bytes,
            limit_bytes=MAX_EVENT_PAYLOAD_BYTES,
        )


def validate_payload(event_type: EventType, payload: dict[str, Any]) -> Message:
    """The payload parsed by its contract model, or a refusal listing every problem."""
    try:
        return PAYLOADS[event_type].model_validate(payload)
    except ValidationError as exc:
        problems = [
            {"loc": list(err["loc"]), "msg": err["msg"], "type": err["type"]}
            for err in exc.errors(include_url=False, include_input=False)
        ]
        summary = "; ".join(
            f"{'.'.join(map(str, p['loc'])) or 'payload'}: {p['msg']}" for p in problems
        )
        raise DomainError(
            ErrorCode.INVALID_PAYLOAD,
            f"invalid {event_type.value} payload: {summary}",
            errors=problems,
        ) from None


def check_append(
    event_type: EventType,
    actor: str,
    session_id: UUID,
    session_is_open: bool,
    causation_id: UUID | None,
    causation: CausationFacts | None,
) -> None:
    """Refuse an append the log's rules forbid; return quietly when it is allowed."""
    policy = CLOSED_SESSION_POLICY.get(
        event_type.value, CLOSED_SESSION_POLICY.get(event_type.domain, ClosedSession.REFUSE)
    )
    if not session_is_open and policy is ClosedSession.REFUSE:
        raise DomainError(
            ErrorCode.SESSION_CLOSED,
            f"session {session_id} is closed; {event_type.value} is conversation and is refused",
            session_id=str(session_id),
        )
    author = AUTHORS.get(event_type)
    if author is not None and not _may_write(actor, author):
        raise DomainError(
            ErrorCode.ACTOR_NOT_ALLOWED,
            f"{event_type.value} may only be written by {author}, not {actor}",
            actor=actor,
        )
    if causation_id is not None and causation is None:
        raise DomainError(
            ErrorCode.CAUSATION_NOT_FOUND,
            f"causation event {causation_id} does not exist",
            causation_id=str(causation_id),
        )
    required = REQUIRED_CAUSE.get(event_type)
    if required is not None and not _is_person_event_in(causation, required, session_id):
        raise DomainError(
            ErrorCode.BRIEF_REQUIRES_READINESS,
            f"{event_type.value} must be caused by a person's {required.value} in the same "
            "session; the brief is written only after the person confirms readiness",
            causation_id=str(causation_id) if causation_id else None,
        )


def _is_person_event_in(
    causation: CausationFacts | None, required: EventType, session_id: UUID
) -> bool:
    return (
        causation is not None
        and causation.type == required.value
        and causation.actor.startswith("user:")
        and causation.session_id == session_id
    )


# --- retiring a business rule: retraction and correction ------------------------


@dataclass(frozen=True)
class RuleFacts:
    """The event a retraction or correction names, as the log found it: its project,
    its type, and the event that already retired it, if one did."""

    event_id: UUID
    project_id: str
    type: str
    retired_by: UUID | None = None


def retired_rule(event_type: EventType, payload: Mapping[str, Any]) -> UUID | None:
    """The rule an event takes out of standing: a retraction's `rule_id`, a correction's
    `replaces`; None for every other event."""
    if event_type is EventType.ARTIFACT_BUSINESS_RULE_RETRACTED:
        named = payload.get("rule_id")
    elif event_type is EventType.ARTIFACT_BUSINESS_RULE:
        named = payload.get("replaces")
    else:
        return None
    return UUID(str(named)) if named else None


def check_retirement(
    event_type: EventType, actor: str, project_id: str, rule_id: UUID, rule: RuleFacts | None
) -> None:
    """Refuse a retraction or correction of `rule_id` that the log's rules forbid.

    Only a person retires a rule: a rule the model recorded is the model's reading of
    the person, so only the person may say it was wrong. The rule may be of any session
    of the session's project (whatever the log holds came before this append, so it is
    of this session or an earlier one); a rule of another project is refused as not
    found, so an id says nothing about projects the caller cannot see. A rule is
    retired once: a second retraction, or a correction of a corrected rule, is refused
    `rule_not_standing` (correct the correction instead)."""
    if not actor.startswith("user:"):
        raise DomainError(
            ErrorCode.ACTOR_NOT_ALLOWED,
            f"only a person may retract or correct a business rule, not {actor}",
            actor=actor,
        )
    if (
        rule is None
        or rule.project_id != project_id
        or rule.type != EventType.ARTIFACT_BUSINESS_RULE.value
    ):
        raise DomainError(
            ErrorCode.RULE_NOT_FOUND,
            f"{event_type.value} names {rule_id}, which is not a business rule of project "
            f"{project_id}",
            rule_id=str(rule_id),
        )
    if rule.retired_by is not None:
        raise DomainError(
            ErrorCode.RULE_NOT_STANDING,
            f"business rule {rule_id} was already retracted or replaced (by event "
            f"{rule.retired_by}); only a standing rule can be retracted or corrected",
            rule_id=str(rule_id),
            retired_by=str(rule.retired_by),
        )


def retirements(events: Iterable[Event]) -> dict[UUID, Event]:
    """Each retired rule's id, with the retraction or correction that retired it (the
    first, as the log admits only one)."""
    retired: dict[UUID, Event] = {}
    for event in events:
        rule_id = retired_rule(event.type, event.payload)
        if rule_id is not None:
            retired.setdefault(rule_id, event)
    return retired


# --- branches (`cmd.sessions.fork`) ------------------------------------------


@dataclass(frozen=True)
class ForkFacts:
    """The parent session of a fork, as the log found it (locked)."""

    session_id: UUID
    project_id: str
    last_seq: int
    # The seq of its closing event, when it is closed.
    closing_seq: int | None


def check_fork(
    parent: ForkFacts | None, session_id: UUID, project_id: str, actor: str, at_seq: int
) -> ForkFacts:
    """The parent, when the fork is allowed; otherwise a refusal, and nothing is written.

    A branch starts a new conversation with a person's message, so only a person forks,
    as only a person writes `chat.message`. The parent is any session of the project,
    open or closed (a session the reaper closed is the commonest one to go back to), but
    the fork point is an event of its conversation: the closing and what the log records
    after it (the psychologist's analysis, handoff facts) would make the branch closed
    or analysed before it began."""
    author = AUTHORS[EventType.CHAT_MESSAGE]
    if not _may_write(actor, author):
        raise DomainError(
            ErrorCode.ACTOR_NOT_ALLOWED,
            f"a session is forked only by a person ({author}), not {actor}",
            actor=actor,
        )
    if parent is None:
        raise session_not_found(session_id)
    if parent.project_id != project_id:
        raise DomainError(
            ErrorCode.SESSION_NOT_IN_PROJECT,
            f"session {session_id} is not a session of project {project_id}",
            session_id=str(session_id),
            project_id=project_id,
        )
    last = parent.last_seq if parent.closing_seq is None else parent.closing_seq - 1
    if not 1 <= at_seq <= last:
        raise DomainError(
            ErrorCode.FORK_POINT_NOT_FOUND,
            f"session {session_id} has no event {at_seq} to fork at; its conversation is "
            f"events 1 to {last}",
            session_id=str(session_id),
            at_seq=at_seq,
            last_seq=last,
        )
    return parent


@dataclass(frozen=True)
class Copy:
    """One event of a branch's prefix: the parent's event under a new id, with its cause
    and the events its payload names moved to their copies."""

    id: UUID
    type: EventType
    actor: str
    payload: dict[str, Any]
    causation_id: UUID | None
    copied_from: UUID


def copy_prefix(originals: Sequence[Event], new_ids: Iterator[UUID]) -> list[Copy]:
    """The copies of `originals` (the parent's events up to the fork point, in `seq`
    order), each taking the next id of `new_ids`.

    A cause or reference to an event of the prefix names its copy, so the branch's
    answers are caused by the branch's messages (Criativo reads them as answered) and a
    rule's origin cites the branch's own messages. One outside the prefix is kept."""
    copied: dict[UUID, UUID] = {}
    copies: list[Copy] = []
    for event in originals:
        new_id = next(new_ids)
        copied[event.id] = new_id
        payload = dict(event.payload)
        for name in EVENT_REFERENCES.get(event.type, ()):
            payload[name] = _moved(payload.get(name), copied)
        cause = event.causation_id
        copies.append(
            Copy(
                id=new_id,
                type=event.type,
                actor=event.actor,
                payload=payload,
                causation_id=copied.get(cause, cause) if cause is not None else None,
                copied_from=event.id,
            )
        )
    return copies


def _moved(value: Any, copied: dict[UUID, UUID]) -> Any:
    """An event id (or a list of them, as JSON text) moved to its copy, if it has one."""
    if isinstance(value, list):
        return [_moved(v, copied) for v in value]
    if isinstance(value, str):
        try:
            original = UUID(value)
        except ValueError:
            return value
        return str(copied.get(original, original))
    return value
