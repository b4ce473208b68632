"""Criativo's rules (ADR 0008 decisions 1, 5 and 6), with no I/O.

Invariants kept here, so no prompt has to keep them:
- the conversation an actor holds is a fold of the session log (`apply`): a restart
  rebuilds exactly what the actor had, because the log is the only source;
- a message is answered at most once: any `agent.response` or `agent.error` caused by
  it is its outcome (`Conversation.outcomes`);
- the prompt for a message is causal (`model_messages`): every earlier message with
  its answer, the message last, nothing said after it;
- the model may emit only the artifacts of `known()`; `product_brief` is written by
  the service after the person's readiness, never through the tool;
- a business rule's `origin` cites chat messages of this very conversation;
- only standing rules are held (`Conversation.rules`): a rule the person retracted or
  replaced by a correction leaves the fold, so no later prompt, digest or brief reads
  it; a correction takes the place of the rule it replaces;
- the model only records rules: retracting or correcting one is the person's (the
  log's rules), so `emit_artifact` refuses a `replaces`;
- a session's inputs are handled one at a time in `seq` order, none dropped, each
  at most once (`admit`);
- an input is acted on only as the log holds it (`Conversation.inputs` keeps the
  log's copies; the bus's copy is compared with them before anything is done);
- a branch's history (the parent's events it copies, `copied_from`) is read, never acted
  on again: the parent already answered it, or is answering it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import Enum
from typing import Any
from uuid import UUID

from pydantic import ValidationError

from contracts.common import ErrorCode
from contracts.events import (
    BusinessRule,
    Event,
    EventType,
    ProductBrief,
)
from contracts.metering import ChatMessage
from domain.errors import DomainError
from domain.log_rules import retired_rule

CRIATIVO = "criativo"
# Sessions where Criativo was never started get a stateless chat, the one ADR 0008
# leaves them, so a person is never left talking to nobody; under this agent slug.
PLAIN_CHAT = "chat"
CRIATIVO_ACTOR = f"agent:{CRIATIVO}"

# Artifacts the model may emit with `emit_artifact` (ADR 0008 decision 5: known/0).
EMITTABLE_ARTIFACTS: dict[str, type[BusinessRule]] = {"business_rule": BusinessRule}
# Written by the service itself, only after the person's readiness.
SYSTEM_ARTIFACTS = frozenset({"product_brief"})

# The model reads at most this many conversation messages; older ones are dropped
# whole (the recorded business rules, kept in the system prompt, carry what matters).
HISTORY_LIMIT = 200


def known() -> list[str]:
    """The artifact types the model may emit; `product_brief` is never among them."""
    return sorted(EMITTABLE_ARTIFACTS)


@dataclass(frozen=True)
class Utterance:
    """One of the person's messages, as the log holds it."""

    event_id: UUID
    seq: int
    text: str
    # Copied from the parent into a branch: history, never answered in the branch.
    copied: bool = False


@dataclass(frozen=True)
class Outcome:
    """How a message was answered: the reply's text (maybe cut by Stop), or an error."""

    event_id: UUID
    text: str = ""
    stopped: bool = False
    error_code: str | None = None


@dataclass(frozen=True)
class RecordedRule:
    """A business rule already in the log."""

    event_id: UUID
    title: str
    statement: str


@dataclass(frozen=True)
class Conversation:
    """What Criativo knows of one session: the fold of its log up to `last_seq`.

    `rules` are the standing ones, in the order recorded (a correction where the rule it
    replaced was): retracted and replaced rules are gone."""

    session_id: UUID
    project_id: str = ""
    last_seq: int = 0
    # The person's messages in `seq` order, and the outcome each one got (the first
    # `agent.response` / `agent.error` whose causation is the message).
    said: tuple[Utterance, ...] = ()
    outcomes: dict[UUID, Outcome] = field(default_factory=dict)
    rules: tuple[RecordedRule, ...] = ()
    # readiness event id -> the brief it caused
    briefs: dict[UUID, UUID] = field(default_factory=dict)
    readiness: frozenset[UUID] = frozenset()
    criativo_active: bool = False
    closed: bool = False
    # The log's own copy of each input (chat, readiness, activation, closing), so a
    # delivered input is confirmed against the log without asking it again.
    inputs: dict[UUID, Event] = field(default_factory=dict)

    @property
    def chat_ids(self) -> frozenset[UUID]:
        """The ids of the person's messages (what a rule's origin may cite)."""
        return frozenset(u.event_id for u in self.said)

    @property
    def answered(self) -> frozenset[UUID]:
        """The messages that already have an outcome."""
        return frozenset(self.outcomes)

    def message(self, event_id: UUID) -> Utterance:
        """The person's message with this id (KeyError when it is not in the conversation)."""
        for u in self.said:
            if u.event_id == event_id:
                return u
        raise KeyError(event_id)

    def pending_before(self, seq: int) -> list[UUID]:
        """Chat messages up to `seq` without an outcome, after the last answered one.

        A replica that takes the session's lease answers these in `seq` order, so a
        message another replica holds is never overtaken by a later one.
        """
        tail: list[UUID] = []
        for u in self.said:
            if u.seq > seq:
                break
            if u.event_id in self.outcomes or u.copied:
                tail = []
            else:
                tail.append(u.event_id)
        return tail


# The events a session's actor acts on (Criativo's consumer reads these subjects).
INPUTS = frozenset(
    {
        EventType.CHAT_MESSAGE,
        EventType.CRIATIVO_READINESS_CONFIRMED,
        EventType.AGENT_ACTIVATED,
        EventType.SESSION_CLOSED,
        EventType.SESSION_CLOSED_ABNORMALLY,
    }
)


def apply(conv: Conversation, event: Event) -> Conversation:
    """The conversation after `event` (events at or below `last_seq` change nothing)."""
    if event.seq <= conv.last_seq:
        return conv
    conv = replace(conv, last_seq=event.seq, project_id=event.project_id)
    kind = event.type
    if kind in INPUTS:
        conv = replace(conv, inputs={**conv.inputs, event.id: event})
    if kind is EventType.CHAT_MESSAGE:
        said = Utterance(
            event.id,
            event.seq,
            str(event.payload.get("text", "")),
            copied=event.copied_from is not None,
        )
        return replace(conv, said=(*conv.said, said))
    if kind in (EventType.AGENT_RESPONSE, EventType.AGENT_ERROR):
        cause = event.causation_id
        # Only a message's first outcome counts (two racing turns leave one answer,
        # but should a second ever land, the model keeps reading the first).
        if cause is None or cause in conv.outcomes or cause not in conv.chat_ids:
            return conv
        if kind is EventType.AGENT_RESPONSE:
            outcome = Outcome(
                event.id,
                text=str(event.payload.get("text", "")),
                stopped=bool(event.payload.get("stopped", False)),
            )
        else:
            outcome = Outcome(event.id, error_code=str(event.payload.get("code", "error")))
        return replace(conv, outcomes={**conv.outcomes, cause: outcome})
    if kind is EventType.ARTIFACT_BUSINESS_RULE:
        rule = RecordedRule(
            event.id, str(event.payload.get("title", "")), str(event.payload.get("statement", ""))
        )
        return replace(conv, rules=_standing(conv.rules, retired_rule(kind, event.payload), rule))
    if kind is EventType.ARTIFACT_BUSINESS_RULE_RETRACTED:
        return replace(conv, rules=_standing(conv.rules, retired_rule(kind, event.payload)))
    if kind is EventType.ARTIFACT_PRODUCT_BRIEF and event.causation_id is not None:
        return replace(conv, briefs={**conv.briefs, event.causation_id: event.id})
    if kind is EventType.CRIATIVO_READINESS_CONFIRMED:
        return replace(conv, readiness=conv.readiness | {event.id})
    if kind is EventType.AGENT_ACTIVATED and event.payload.get("agent") == CRIATIVO:
        return replace(conv, criativo_active=True)
    if kind in (EventType.SESSION_CLOSED, EventType.SESSION_CLOSED_ABNORMALLY):
        return replace(conv, closed=True)
    return conv


def _standing(
    rules: tuple[RecordedRule, ...], retired: UUID | None, new: RecordedRule | None = None
) -> tuple[RecordedRule, ...]:
    """`rules` without the `retired` one, with `new` in its place (or last, when the
    retired rule is not among them: one of an earlier session, or none)."""
    kept = [new if r.event_id == retired else r for r in rules]
    if new is not None and new not in kept:
        kept.append(new)
    return tuple(r for r in kept if r is not None)


def rebuild(session_id: UUID, events: list[Event]) -> Conversation:
    """The conversation of a session from its log (rehydration, ADR 0008 decision 1)."""
    conv = Conversation(session_id)
    for event in sorted(events, key=lambda e: e.seq):
        conv = apply(conv, event)
    return conv


# --- what the model sees ----------------------------------------------------------
#
# The prompt is causal, not positional:
# the answer to message N reads every earlier message of the person, in message
# order, each immediately followed by the answer it got, then N last. A message typed
# while a turn runs lands in the log before that turn's answer; reading the log in
# `seq` order would put two person's messages side by side (merged, the model answers
# the first again) and leave the running turn's answer out. Messages after N are
# never shown, even when they are already in the log.
#
# Roles must alternate (the Messages API), so a message with no reply text still gets
# an assistant turn: a bracketed note saying it was not answered (an `agent.error`)
# or was stopped by the person. A note rather than merging the message into the next
# one, because merged messages are exactly what made the model answer the wrong one.

NOT_ANSWERED = "[This message was not answered: the turn failed ({code}).]"
NO_OUTCOME = "[This message has not been answered.]"
STOPPED = "[The person stopped this answer here.]"
NO_TEXT = "[Answered without text.]"


def quote(utterance: Utterance) -> str:
    """How a person's message reads to the model: with the id a rule's origin cites."""
    return f"[message {utterance.event_id}]\n{utterance.text}"


def answer_text(outcome: Outcome | None) -> str:
    """What the model reads as the answer a message got (never empty)."""
    if outcome is None:
        return NO_OUTCOME
    if outcome.error_code is not None:
        return NOT_ANSWERED.format(code=outcome.error_code)
    if outcome.stopped:
        return f"{outcome.text}\n\n{STOPPED}" if outcome.text.strip() else STOPPED
    return outcome.text if outcome.text.strip() else NO_TEXT


def history_before(conv: Conversation, seq: int, limit: int = HISTORY_LIMIT) -> list[ChatMessage]:
    """Every message of the person before `seq`, each followed by its answer.

    At most `limit` messages in all; older exchanges are dropped whole, so the
    history always starts with the person and roles always alternate.
    """
    keep = limit // 2
    earlier = [u for u in conv.said if u.seq < seq][-keep:] if keep else []
    messages: list[ChatMessage] = []
    for u in earlier:
        messages.append(ChatMessage(role="user", content=quote(u)))
        messages.append(
            ChatMessage(role="assistant", content=answer_text(conv.outcomes.get(u.event_id)))
        )
    return messages


def model_messages(
    conv: Conversation, answering: UUID, limit: int = HISTORY_LIMIT
) -> list[ChatMessage]:
    """The prompt for the answer to message `answering`: the history before it, it last."""
    target = conv.message(answering)
    history = history_before(conv, target.seq, max(limit - 1, 0))
    return [*history, ChatMessage(role="user", content=quote(target))]


def consolidation_messages(
    conv: Conversation, readiness_seq: int, ask: str, limit: int = HISTORY_LIMIT
) -> list[ChatMessage]:
    """The prompt of the consolidation turn: what was said before readiness, then `ask`."""
    history = history_before(conv, readiness_seq, max(limit - 1, 0))
    return [*history, ChatMessage(role="user", content=ask)]


def rules_digest(conv: Conversation) -> str:
    """The business rules standing, for the system prompt (a retracted or replaced rule
    is not there: the model must not build on what the person took back)."""
    if not conv.rules:
        return "(none yet)"
    return "\n".join(f"- [{r.event_id}] {r.title}: {r.statement}" for r in conv.rules)


# --- the emit_artifact tool ---------------------------------------------------


def check_artifact(raw: dict[str, Any], conv: Conversation) -> BusinessRule:
    """The artifact the model asked to emit, or a refusal it can correct itself from."""
    kind = raw.get("type")
    if kind in SYSTEM_ARTIFACTS:
        raise DomainError(
            ErrorCode.ARTIFACT_NOT_EMITTABLE,
            "product_brief cannot be emitted with this tool: the brief is written by the "
            'system only after the person clicks "I\'m ready to produce". Keep shaping the '
            "idea and recording business rules; do not say the brief exists.",
            type=kind,
            known=known(),
        )
    model = EMITTABLE_ARTIFACTS.get(str(kind))
    if model is None:
        raise DomainError(
            ErrorCode.UNKNOWN_ARTIFACT_TYPE,
            f"unknown artifact type {kind!r}; the tool emits only: {', '.join(known())}",
            type=kind,
            known=known(),
        )
    fields = {k: v for k, v in raw.items() if k != "type"}
    if fields.get("replaces") is not None:
        raise DomainError(
            ErrorCode.INVALID_ARTIFACT,
            "a business rule cannot replace another through this tool: only the person "
            "corrects or retracts a rule. Record a new rule, or ask the person to edit the "
            "one that is wrong.",
        )
    try:
        rule = model.model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'input'}: {e['msg']}"
            for e in exc.errors(include_url=False, include_input=False)
        )
        raise DomainError(
            ErrorCode.INVALID_ARTIFACT,
            f"invalid business_rule: {problems}. Send title, statement and origin (the ids "
            "of the person's messages it came from, as shown in [message <id>]).",
        ) from None
    foreign = [str(i) for i in rule.origin if i not in conv.chat_ids]
    if foreign:
        raise DomainError(
            ErrorCode.ORIGIN_NOT_IN_CONVERSATION,
            f"origin cites {', '.join(foreign)}, which are not messages of this conversation; "
            "cite the ids shown as [message <id>] before the person's words",
            foreign=foreign,
        )
    return rule


# --- readiness: the consolidated brief ------------------------------------------

_JSON_OBJECT = re.compile(r"\{.*\}", re.DOTALL)


def brief_from_reply(text: str, conv: Conversation) -> ProductBrief:
    """The brief from the consolidation turn's reply, resting on every standing rule.

    The model is asked for a JSON object; prose (or broken JSON) still becomes a brief,
    because the person's readiness must never be left without one.
    """
    rule_ids = [r.event_id for r in conv.rules]
    found = _JSON_OBJECT.search(text)
    if found is not None:
        try:
            data = json.loads(found.group(0))
            if isinstance(data, dict):
                return ProductBrief(
                    title=str(data.get("title") or "Product brief"),
                    summary=str(data.get("summary") or text.strip() or "Product brief"),
                    details=str(data.get("details") or ""),
                    business_rule_ids=rule_ids,
                )
        except (ValueError, ValidationError):
            pass
    return ProductBrief(
        title="Product brief",
        summary=text.strip() or "The brief of the conversation.",
        business_rule_ids=rule_ids,
    )


# --- what a session does with an input ------------------------------------------


class Action(Enum):
    """What the session's actor does with one input."""

    ANSWER_WITH_CRIATIVO = "answer_with_criativo"
    ANSWER_PLAINLY = "answer_plainly"
    ALREADY_ANSWERED = "already_answered"
    CONSOLIDATE = "consolidate"
    OFFER_EXISTING_BRIEF = "offer_existing_brief"
    READINESS_WITHOUT_CRIATIVO = "readiness_without_criativo"
    SESSION_CLOSED = "session_closed"
    NOTHING = "nothing"


def decide(conv: Conversation, event_type: EventType, event_id: UUID) -> Action:
    """The action for an input of the log, given the conversation caught up past it."""
    logged = conv.inputs.get(event_id)
    if logged is not None and logged.copied_from is not None:
        return Action.NOTHING  # a branch's history: acted on in its parent
    if event_type is EventType.CHAT_MESSAGE:
        if event_id in conv.answered:
            return Action.ALREADY_ANSWERED
        if conv.closed:
            return Action.SESSION_CLOSED
        return Action.ANSWER_WITH_CRIATIVO if conv.criativo_active else Action.ANSWER_PLAINLY
    if event_type is EventType.CRIATIVO_READINESS_CONFIRMED:
        if event_id in conv.briefs:
            # The brief exists (a crash before the offer was queued): offer it, once.
            return Action.OFFER_EXISTING_BRIEF
        if conv.closed:
            return Action.SESSION_CLOSED
        if not conv.criativo_active:
            return Action.READINESS_WITHOUT_CRIATIVO
        return Action.CONSOLIDATE
    return Action.NOTHING


# --- the mailbox ----------------------------------------------------------------


@dataclass(frozen=True)
class Inbound:
    """An input waiting in a session's mailbox."""

    event_id: UUID
    seq: int


class Admission(Enum):
    """What the mailbox did with an input."""

    QUEUED = "queued"
    DUPLICATE = "duplicate"


def admit(queue: list[Inbound], item: Inbound) -> tuple[list[Inbound], Admission]:
    """The mailbox policy: every input is queued, in `seq` order; none is ever dropped.

    A message that arrives during a turn waits for it (a turn is never interrupted or
    merged with the next). The same event delivered twice (a redelivery racing its
    first copy) is queued once: the copy is acknowledged with the original's outcome.
    """
    if any(q.event_id == item.event_id for q in queue):
        return queue, Admission.DUPLICATE
    position = len(queue)
    while position > 0 and queue[position - 1].seq > item.seq:
        position -= 1
    return [*queue[:position], item, *queue[position:]], Admission.QUEUED


# --- errors the person reads ---------------------------------------------------

_READABLE: dict[str, str] = {
    ErrorCode.BUDGET_EXCEEDED.value: "This session has used up its model budget, so I cannot "
    "answer right now. Ask the project owner to raise it; the conversation is kept.",
    ErrorCode.PROVIDER_OVERLOADED.value: "The model is overloaded and did not answer after "
    "several attempts. Please send your message again in a moment; nothing was lost.",
    ErrorCode.DEPENDENCY_UNAVAILABLE.value: "A service I need to answer is restarting and "
    "did not come back in time, so this message was not answered. Please send it again "
    "in a moment; the conversation so far is kept.",
    ErrorCode.PROVIDER_ERROR.value: "The model failed to answer this message. Please send it "
    "again; the conversation so far is kept.",
}


_LIMIT_NAMES = {"day": "daily", "month": "monthly", "minute": "per-minute"}
_LIMITED = {
    "micros": "has used up its {window} spending limit",
    "requests": "has reached its limit of model calls per minute",
    "tokens": "has reached its limit of model tokens per minute",
}


def readable_reason(code: str, details: Mapping[str, Any] | None = None) -> str:
    """Why a turn failed, written for the person (the `reason` of `agent.error`); a refusal
    under a project's or a person's limit says whose, which, and when it resets."""
    details = details or {}
    if code in (ErrorCode.BUDGET_EXCEEDED, ErrorCode.RATE_LIMITED) and "resets_at" in details:
        whose = "Your account" if details.get("scope") == "person" else "This project"
        limited = _LIMITED.get(str(details.get("metric")), "has reached a limit").format(
            window=_LIMIT_NAMES.get(str(details.get("window")), "")
        )
        resets = datetime.fromisoformat(str(details["resets_at"]))
        day = "" if details.get("window") == "minute" else f" on {resets:%b %d}"
        return (
            f"{whose} {limited}, so I cannot answer right now. It resets at "
            f"{resets:%H:%M} UTC{day}; send your message again then. "
            "The conversation so far is kept."
        )
    return _READABLE.get(
        code,
        f"I could not answer this message ({code}). Please send it again; "
        "the conversation so far is kept.",
    )
