"""Events for the session log as the outbox writes them: checked, before anything is
committed, against what the log would refuse (`check_appendable`), and queued as
`cmd.events.append` requests in their session's order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contracts import subjects
from contracts.common import ErrorCode, Message
from contracts.events import PAYLOADS
from contracts.session_events import AppendEnvelope, AppendEvent
from domain import log_rules
from domain.errors import DomainError
from servicekit.outbox.rows import Queued, queue_args


@dataclass(frozen=True)
class Announcement:
    """An event for the session log as a service announces it: its envelope and its
    payload as the contract model of its type. Both were validated when they were built
    by their constructors (never `model_construct`), so the outbox checks only what
    construction cannot know: that the payload is its type's model and fits the log
    (`check_appendable`). A service that builds the payload model anyway saves the
    `AppendEvent` route its second validation and its dict round trip."""

    envelope: AppendEnvelope
    payload: Message


def _announced(event: AppendEvent) -> Announcement:
    """`event` with its payload parsed by its type's contract model: the one validation
    of a payload that comes as JSON (refused with the log's code, `invalid_payload`…)."""
    event_type = log_rules.parse_event_type(event.type)
    return Announcement(event, log_rules.validate_payload(event_type, event.payload))


def check_appendable(event: Announcement) -> bytes:
    """The `cmd.events.append` request of `event`, or, before anything is committed, the
    refusal the log would give its shape: an unknown or reserved type, a payload that is
    not its type's contract model, an oversized one.

    A service's state change and its event commit together or not at all; an event the
    log could never take would leave the change announced to nobody, so the
    command is refused with the log's own code instead (`invalid_payload`, …).
    """
    event_type = log_rules.parse_event_type(event.envelope.type)
    contract = PAYLOADS[event_type]
    if type(event.payload) is not contract:
        raise DomainError(
            ErrorCode.INVALID_PAYLOAD,
            f"invalid {event_type.value} payload: a {type(event.payload).__name__}, "
            f"where its contract is {contract.__name__}",
            errors=[{"loc": [], "msg": f"must be a {contract.__name__}", "type": "model_type"}],
        )
    # Serialised once: the size checked is that of the bytes written, which are what the
    # log measures too (it keeps a payload as its contract model dumps it).
    payload = event.payload.model_dump_json().encode()
    log_rules.check_payload_size(len(payload))
    # An `AppendEvent` is its own envelope: its payload is written as serialised here,
    # as the envelope's last member, where `AppendEvent` puts it.
    envelope = event.envelope.model_dump_json(exclude={"payload"}).encode()
    return envelope[:-1] + b',"payload":' + payload + b"}"


def append_args(event: AppendEvent | Announcement) -> list[Any]:
    """`queue_args` for an event to append to the session log (see `Outbox.append`);
    raises `DomainError` for an event the log would refuse (`check_appendable`)."""
    envelope = event.envelope if isinstance(event, Announcement) else event
    if envelope.idempotency_key is None:
        raise ValueError("an event appended through the outbox needs an idempotency_key")
    if not isinstance(event, Announcement):
        event = _announced(event)
    return queue_args(
        subjects.EVENTS_APPEND,
        envelope.idempotency_key,
        check_appendable(event),
        ordering_key=str(envelope.session_id),
    )


def queued_append(event: AppendEvent | Announcement) -> Queued:
    """`Queued` for an event to append to the session log (see `Outbox.append`)."""
    subject, msg_id, body, headers, key = append_args(event)
    return Queued(subject, msg_id, body, key, headers)
