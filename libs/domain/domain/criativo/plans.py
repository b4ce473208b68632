"""Criativo's core: one input, one plan (docs/decisions/0012-criativo-plans.md).

The shell (`criativo.session`) reads the log, asks `plan` what one input calls for,
executes it and feeds what it got back to `conclude`: the rules stay here, with no
I/O, and every plan can be checked as a value (input + conversation -> plan).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from uuid import UUID

from contracts.common import ErrorCode, Message, person_of
from contracts.criativo import AgentDone
from contracts.events import (
    AgentError,
    AgentResponse,
    Event,
    EventType,
    TurnUsage,
)
from contracts.metering import ChatMessage, ToolSpec
from domain.criativo.conversation import (
    CRIATIVO,
    CRIATIVO_ACTOR,
    PLAIN_CHAT,
    Action,
    Conversation,
    brief_from_reply,
    check_artifact,
    consolidation_messages,
    decide,
    known,
    model_messages,
    readable_reason,
    rules_digest,
)
from domain.errors import DomainError


@dataclass(frozen=True)
class Prompts:
    """The texts the model is instructed with (the service's prompt files)."""

    # Criativo's system prompt; the recorded rules are added below it.
    criativo: str
    # The consolidation turn's request, with `{readiness_id}` to fill in.
    consolidation: str


EMIT_ARTIFACT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": known()},
        "title": {"type": "string", "description": "a short name for the rule"},
        "statement": {"type": "string", "description": "the rule, precisely"},
        "origin": {
            "type": "array",
            "items": {"type": "string", "format": "uuid"},
            "minItems": 1,
            "description": "ids of the person's messages it comes from ([message <id>])",
        },
    },
    "required": ["type", "title", "statement", "origin"],
}

# Built (and validated) once: every answer by Criativo offers the same tool.
EMIT_ARTIFACT = ToolSpec(
    name="emit_artifact",
    description="Record an artifact of the conversation. Only business_rule can be emitted; "
    "the product brief is written by the system after the person confirms readiness.",
    input_schema=EMIT_ARTIFACT_SCHEMA,
)
RULE_RECORDED = "business_rule recorded as event {event_id}"


@dataclass(frozen=True)
class Ask:
    """A model turn to run: who answers what, with which prompt and tools, under which ids.

    An ask that offers tools is a loop of calls, numbered `<turn_id>.<n>`, whose answer
    is every call's text as the person saw it streamed; one without is one call under
    `turn_id`. Turn ids are the same on every delivery of the input, so metering replays
    a turn that already ran instead of calling the model again.
    """

    agent: str
    # The message or readiness answered: the deltas and the records carry it.
    cause: UUID
    session_id: UUID
    project_id: str
    turn_id: str
    system: str
    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSpec, ...] = ()
    # Whose limits apply beside the project's: the person who sent the input.
    person: str | None = None

    @property
    def run_id(self) -> str:
        return f"{self.agent}.{self.session_id}"

    def call_id(self, iteration: int) -> str:
        """The turn id of the loop's call `iteration` (before any retry)."""
        return f"{self.turn_id}.{iteration}" if self.tools else self.turn_id


@dataclass(frozen=True)
class Record:
    """An event to append to the session's log, under a key that makes it once-only."""

    type: EventType
    payload: Message
    causation_id: UUID | None
    idempotency_key: str
    actor: str = CRIATIVO_ACTOR


@dataclass(frozen=True)
class Refusal:
    """A tool call refused: `text` goes back to the model, which corrects itself."""

    text: str


@dataclass(frozen=True)
class Reply:
    """A model turn that ended with an answer (maybe cut by the person's Stop)."""

    text: str
    turn_ids: tuple[str, ...]
    usage: TurnUsage
    stopped: bool = False


@dataclass(frozen=True)
class Failure:
    """A model turn metering refused or could not complete."""

    code: str
    turn_ids: tuple[str, ...] = ()
    # What metering said beside the code (a limit's scope, metric and reset).
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Finish:
    """How an input's handling ends: `record` appended, then the turn's end told on the
    session's done subject, then (a brief) the offer to PO queued."""

    agent: str
    cause: UUID
    turn_ids: tuple[str, ...]
    record: Record | None = None
    error_code: str | None = None
    # The answer already in the log, when nothing is recorded (a brief written before a
    # crash: it is offered, not written again).
    answer: UUID | None = None
    offer: bool = False

    def answered_by(self, recorded: UUID | None) -> UUID | None:
        """The event that answers the input, given the id `record` was appended as."""
        return None if self.error_code is not None else (self.answer or recorded)

    def done(self, recorded: UUID | None) -> AgentDone:
        """What closes the turn's deltas for the clients."""
        return AgentDone(
            agent=self.agent,
            causation_id=self.cause,
            turn_ids=list(self.turn_ids),
            response_id=self.answered_by(recorded),
            error_code=self.error_code,
        )


class Then(Enum):
    """What the shell does once a plan is executed."""

    # Nothing more: the next input's catch-up reads what was written.
    STOP = "stop"
    # Read the log again (what a readiness wrote is seen before the next input).
    CATCH_UP = "catch_up"
    # An earlier message was answered first: read its answer, then plan the input again.
    PLAN_AGAIN = "plan_again"


@dataclass(frozen=True)
class Plan:
    """What one input calls for: a model turn (`ask`, concluded by `conclude`), or an end
    with no turn (`finish`), or nothing; then `then`."""

    input: UUID
    action: Action
    ask: Ask | None = None
    finish: Finish | None = None
    then: Then = Then.STOP


def acts_on(event_type: EventType) -> bool:
    """Whether an input of this type may be answered (so it is handled under the lease);
    the others only move the conversation's state, which moves from the log."""
    return event_type in (EventType.CHAT_MESSAGE, EventType.CRIATIVO_READINESS_CONFIRMED)


def brief_turn_id(readiness_id: UUID) -> str:
    """The turn id of the consolidation turn a readiness asks for (before any retry)."""
    return f"{CRIATIVO}.{readiness_id}.brief"


def plan(conv: Conversation, event: Event, prompts: Prompts) -> Plan:
    """The plan for `event`, an input the log holds, on the conversation caught up past it.

    A chat message is answered after every earlier message still unanswered, one at a
    time in `seq` order: the plan answers the first of them, and says to plan again
    once its answer is in the log, so the next prompt reads it.
    """
    if event.type is EventType.CHAT_MESSAGE:
        pending = conv.pending_before(event.seq)
        if not pending:
            return Plan(event.id, Action.ALREADY_ANSWERED)
        message_id = pending[0]
        action = decide(conv, EventType.CHAT_MESSAGE, message_id)
        then = Then.PLAN_AGAIN if message_id != event.id else Then.STOP
        if action is Action.ANSWER_WITH_CRIATIVO:
            return Plan(event.id, action, ask=answer(conv, message_id, prompts), then=then)
        if action is Action.ANSWER_PLAINLY:
            return Plan(event.id, action, ask=plain_answer(conv, message_id), then=then)
        return Plan(event.id, action)
    action = decide(conv, event.type, event.id)
    if action is Action.CONSOLIDATE:
        ask = consolidation(conv, event.id, prompts)
        return Plan(event.id, action, ask=ask, then=Then.CATCH_UP)
    if action is Action.OFFER_EXISTING_BRIEF:
        # The brief exists (a crash before the offer was queued): its turn ended, offer it.
        finish = Finish(
            CRIATIVO,
            event.id,
            (brief_turn_id(event.id),),
            answer=conv.briefs[event.id],
            offer=True,
        )
        return Plan(event.id, action, finish=finish, then=Then.CATCH_UP)
    return Plan(event.id, action)


def _asking(
    conv: Conversation,
    agent: str,
    cause: UUID,
    turn_id: str,
    system: str,
    messages: list[ChatMessage],
    tools: tuple[ToolSpec, ...] = (),
) -> Ask:
    """An ask in this session, for the person who sent the input it answers."""
    sent = conv.inputs.get(cause)
    return Ask(
        agent,
        cause,
        conv.session_id,
        conv.project_id,
        turn_id,
        system,
        tuple(messages),
        tools,
        person=person_of(sent.actor) if sent is not None else None,
    )


def _system(conv: Conversation, prompts: Prompts) -> str:
    return f"{prompts.criativo}\nBusiness rules recorded so far:\n{rules_digest(conv)}"


def answer(conv: Conversation, message_id: UUID, prompts: Prompts) -> Ask:
    """Criativo's answer to a message: the conversation so far, the rules, the tool."""
    messages = model_messages(conv, message_id)
    turn_id = f"{CRIATIVO}.{message_id}"
    system = _system(conv, prompts)
    return _asking(conv, CRIATIVO, message_id, turn_id, system, messages, (EMIT_ARTIFACT,))


def plain_answer(conv: Conversation, message_id: UUID) -> Ask:
    """The stateless answer of a session without Criativo: the current message only."""
    messages = [ChatMessage(role="user", content=conv.message(message_id).text)]
    return _asking(conv, PLAIN_CHAT, message_id, f"{PLAIN_CHAT}.{message_id}", "", messages)


def consolidation(conv: Conversation, readiness_id: UUID, prompts: Prompts) -> Ask:
    """The consolidation turn after readiness: the brief's text, no tools offered (the
    model can write the brief, never emit it)."""
    request = prompts.consolidation.format(readiness_id=readiness_id)
    messages = consolidation_messages(conv, conv.inputs[readiness_id].seq, request)
    turn_id = brief_turn_id(readiness_id)
    return _asking(conv, CRIATIVO, readiness_id, turn_id, _system(conv, prompts), messages)


def artifact_call(
    conv: Conversation, ask: Ask, tool_use_id: str, raw: dict[str, Any]
) -> Record | Refusal:
    """A call of `emit_artifact` during `ask`: the rule to record, or the refusal the model
    reads. One tool call, one artifact: a replayed turn repeats the tool_use id."""
    try:
        rule = check_artifact(raw, conv)
    except DomainError as exc:
        return Refusal(f"{exc.code}: {exc.message}")
    return Record(
        EventType.ARTIFACT_BUSINESS_RULE,
        rule,
        causation_id=ask.cause,
        idempotency_key=f"{CRIATIVO}:rule:{ask.cause}:{tool_use_id}",
    )


def conclude(conv: Conversation, plan: Plan, result: Reply | Failure) -> Finish:
    """How the input ends, given how its model turn ended.

    A failed turn is told to the person as an `agent.error` they can read, and the
    session goes on; an answer is an `agent.response`; a consolidation's reply becomes
    the brief, offered to PO.
    """
    ask = plan.ask
    if ask is None:
        raise ValueError(f"plan {plan.action.value} asked the model nothing")
    payload: Message
    if isinstance(result, Failure):
        reason = readable_reason(result.code, result.details)
        kind, what = EventType.AGENT_ERROR, "error"
        payload = AgentError(agent=ask.agent, code=result.code, reason=reason)
    elif plan.action is Action.CONSOLIDATE:
        kind, what = EventType.ARTIFACT_PRODUCT_BRIEF, "brief"
        payload = brief_from_reply(result.text, conv)
    else:
        kind, what = EventType.AGENT_RESPONSE, "response"
        payload = AgentResponse(
            agent=ask.agent,
            text=result.text,
            turn_id=result.turn_ids[-1] if result.turn_ids else None,
            usage=result.usage,
            stopped=result.stopped,
        )
    # One record per input and kind: a redelivered input gets the event first written.
    key = f"{ask.agent}:{what}:{ask.cause}"
    return Finish(
        ask.agent,
        ask.cause,
        result.turn_ids,
        record=Record(kind, payload, ask.cause, key, f"agent:{ask.agent}"),
        error_code=result.code if isinstance(result, Failure) else None,
        offer=kind is EventType.ARTIFACT_PRODUCT_BRIEF,
    )


def offer_refused(brief_id: UUID | None, code: str, message: str, offer_key: str) -> Record | None:
    """What the person is told when the handoff service refuses a brief's offer for good.

    PO already active in the project (`agente_ja_ativo`) is not a failure to retry: the
    handoff service's message is told in the session, and the brief stays in the log.
    Any other refusal tells nobody (ADR 0182, consequences).
    """
    if code != ErrorCode.AGENTE_JA_ATIVO:
        return None
    notice = AgentError(agent=CRIATIVO, code=code, reason=message)
    return Record(EventType.AGENT_ERROR, notice, brief_id, f"{offer_key}:refused")
