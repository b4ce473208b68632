"""The model turns of a session, all through metering (the harness's client only).

- `criativo`: a streaming tool loop. Each model call is one `cmd.llm.stream` whose
  deltas go to the session's `agent.delta.<project>.<session>`; tool calls
  (`emit_artifact`) run between calls and their results go back to the model, so a
  refused rule is corrected on the next call. The person sees every call's text.
  A call the person stopped (`stop_reason` "cancelled", from `cmd.llm.cancel`) ends
  the answer at once: its tool calls never run, and the answer is the text written
  so far, marked stopped (`domain.criativo.after_call`).
- `plain`: the chat of sessions without Criativo (DESIGN.md flow 1): one streaming,
  stateless call with the current message only, agent slug `chat`.
- `consolidate`: the brief after readiness, one streaming call with no tools — the
  model can write the brief's text, never emit it (ADR 0008 decision 5).

Turn ids are the same on every delivery of an input (`criativo.<message>.<iteration>`):
metering answers a turn id that already ran from its stored reply and never calls the
model again, so a redelivered or retried turn replays the very same tool calls, with
the same tool_use ids. A rule is appended under a key derived from its tool_use id,
so one tool call records one artifact however many times the turn is replayed. A
turn id that ended without a reply (metering shut down mid-call) is tried again as
`<turn_id>.r1`, `.r2`…, in that order, as the harness's ToolLoop does; one still
running in metering (our previous delivery died waiting for it) is waited for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any
from uuid import UUID

from contracts import subjects
from contracts.common import ErrorCode
from contracts.events import BusinessRule, TurnUsage
from contracts.metering import (
    ChatMessage,
    LlmStream,
    LlmTurn,
    TextBlock,
    TokenUsage,
    ToolResultBlock,
    ToolUseBlock,
    TurnReply,
)
from domain import criativo as rules
from domain.criativo import Conversation, NextStep
from domain.errors import DomainError
from harness import MeteringClient, Tool, ToolResult
from servicekit.client import CommandFailed
from servicekit.faults import crash_point

CRIATIVO_PROMPT = (files("criativo") / "prompts" / "criativo.md").read_text(encoding="utf-8")
CONSOLIDATION_PROMPT = (files("criativo") / "prompts" / "consolidation.md").read_text(
    encoding="utf-8"
)

# Records a valid rule in the log, once per tool_use id; returns its event id.
RecordRule = Callable[[BusinessRule, str], Awaitable[UUID]]

# Attempts of one model call after its turn id ended without a reply.
MAX_TURN_RETRIES = 3
# How often to ask again about a turn id metering is still running.
IN_PROGRESS_POLL_SECONDS = 0.25


class TurnFailed(Exception):
    """Metering refused or failed the turn (after the provider's retries)."""

    def __init__(self, code: str, message: str, turn_ids: list[str]) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.turn_ids = turn_ids


@dataclass
class TurnOutcome:
    """What a turn produced: its text, the calls it made and what they cost."""

    text: str
    turn_ids: list[str] = field(default_factory=list)
    usage: TokenUsage = field(default_factory=TokenUsage)
    cost_micros: int = 0
    model: str = ""
    rules: list[UUID] = field(default_factory=list)
    # The person pressed Stop: `text` is what was written up to then.
    stopped: bool = False

    def add(self, reply: TurnReply) -> None:
        self.usage = TokenUsage(
            **{k: getattr(self.usage, k) + getattr(reply.usage, k) for k in TokenUsage.model_fields}
        )
        self.cost_micros += reply.cost_micros
        self.model = reply.model

    def turn_usage(self) -> TurnUsage:
        """The usage the `agent.response` carries (cache writes of both lifetimes summed)."""
        u = self.usage
        return TurnUsage(
            model=self.model or "unknown",
            input_tokens=u.input_tokens,
            output_tokens=u.output_tokens,
            cache_creation_input_tokens=u.cache_write_5m_tokens + u.cache_write_1h_tokens,
            cache_read_input_tokens=u.cache_read_tokens,
            cost_micros=self.cost_micros,
        )


EMIT_ARTIFACT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": rules.known()},
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


def emit_artifact(conv: Conversation, record: RecordRule, tool_use_id: str = "") -> Tool:
    """The tool for one call: validated by the domain; a refusal goes back verbatim."""

    async def handler(call: ToolUseBlock) -> ToolResult:
        try:
            rule = rules.check_artifact(call.input, conv)
        except DomainError as exc:
            return ToolResult.error(f"{exc.code}: {exc.message}")
        event_id = await record(rule, tool_use_id)
        crash_point("criativo.after_rule")
        return ToolResult.ok(f"business_rule recorded as event {event_id}", data=event_id)

    return Tool(
        "emit_artifact",
        "Record an artifact of the conversation. Only business_rule can be emitted; the "
        "product brief is written by the system after the person confirms readiness.",
        EMIT_ARTIFACT_SCHEMA,
        handler,
    )


class Turns:
    """Runs a session's model turns through metering."""

    def __init__(
        self,
        client: MeteringClient,
        *,
        max_iterations: int,
        max_tokens: int,
        budget_micros: int | None,
        in_progress_wait_seconds: float = 120.0,
    ) -> None:
        self._client = client
        self._in_progress_wait = in_progress_wait_seconds
        self._max_iterations = max_iterations
        self._max_tokens = max_tokens
        self._budget = budget_micros

    async def criativo(
        self, conv: Conversation, message_id: UUID, record: RecordRule
    ) -> TurnOutcome:
        """Answer one message with the conversation so far, recording rules as they come."""
        tool = emit_artifact(conv, record)  # its spec; each call runs under its tool_use id
        system = f"{CRIATIVO_PROMPT}\nBusiness rules recorded so far:\n{rules.rules_digest(conv)}"
        messages = rules.model_messages(conv, message_id)
        outcome = TurnOutcome(text="")
        texts: list[str] = []
        for iteration in range(1, self._max_iterations + 1):
            cmd = LlmStream(
                run_id=f"criativo.{conv.session_id}",
                turn_id=f"criativo.{message_id}.{iteration}",
                agent_slug=rules.CRIATIVO,
                project_id=conv.project_id,
                session_id=conv.session_id,
                system=system,
                messages=messages,
                max_tokens=self._max_tokens,
                tools=[tool.spec()],
                budget_micros=self._budget,
                delta_subject=subjects.delta_subject(conv.project_id, conv.session_id),
                causation_id=message_id,
            )
            reply = await self._call(cmd, outcome.turn_ids)
            outcome.add(reply)
            texts.extend(b.text for b in reply.content if isinstance(b, TextBlock) and b.text)
            calls = [b for b in reply.content if isinstance(b, ToolUseBlock)]
            step = rules.after_call(reply.stop_reason, len(calls))
            if step is not NextStep.RUN_TOOLS:
                outcome.stopped = step is NextStep.STOPPED
                break
            results: list[ToolResultBlock] = []
            for call in calls:
                result = await self._run(emit_artifact(conv, record, call.id), call)
                if not result.is_error and isinstance(result.data, UUID):
                    outcome.rules.append(result.data)
                results.append(
                    ToolResultBlock(
                        tool_use_id=call.id, content=result.content, is_error=result.is_error
                    )
                )
            messages = [
                *messages,
                ChatMessage(role="assistant", content=list(reply.content)),
                ChatMessage(role="user", content=list(results)),
            ]
        outcome.text = "\n\n".join(texts)
        return outcome

    @staticmethod
    async def _run(tool: Tool, call: ToolUseBlock) -> ToolResult:
        if call.name != tool.name:
            return ToolResult.error(
                f"there is no tool named {call.name!r}; the only tool is {tool.name}"
            )
        return await tool.handler(call)

    async def plain(self, conv: Conversation, message_id: UUID, text: str) -> TurnOutcome:
        """The stateless answer of a session without Criativo: the current message only."""
        cmd = LlmStream(
            run_id=f"chat.{conv.session_id}",
            turn_id=f"chat.{message_id}",
            agent_slug=rules.PLAIN_CHAT,
            project_id=conv.project_id,
            session_id=conv.session_id,
            system="",
            messages=[ChatMessage(role="user", content=text)],
            max_tokens=self._max_tokens,
            delta_subject=subjects.delta_subject(conv.project_id, conv.session_id),
            causation_id=message_id,
        )
        turn_ids: list[str] = []
        reply = await self._call(cmd, turn_ids)
        return _one_turn(reply, turn_ids)

    async def consolidate(
        self, conv: Conversation, readiness_id: UUID, readiness_seq: int
    ) -> TurnOutcome:
        """The consolidation turn after readiness: the brief's text, no tools offered."""
        ask = CONSOLIDATION_PROMPT.format(readiness_id=readiness_id)
        history = rules.consolidation_messages(conv, readiness_seq, ask)
        system = f"{CRIATIVO_PROMPT}\nBusiness rules recorded so far:\n{rules.rules_digest(conv)}"
        # Streamed like any answer, so the person sees the brief being written; its
        # deltas and its `agent.done` carry the readiness as their causation.
        cmd = LlmStream(
            run_id=f"criativo.{conv.session_id}",
            turn_id=consolidation_turn_id(readiness_id),
            agent_slug=rules.CRIATIVO,
            project_id=conv.project_id,
            session_id=conv.session_id,
            system=system,
            messages=history,
            max_tokens=self._max_tokens,
            budget_micros=self._budget,
            delta_subject=subjects.delta_subject(conv.project_id, conv.session_id),
            causation_id=readiness_id,
        )
        turn_ids: list[str] = []
        reply = await self._call(cmd, turn_ids)
        return _one_turn(reply, turn_ids)

    async def _call(self, cmd: LlmTurn, turn_ids: list[str]) -> TurnReply:
        """One model call under its deterministic turn id (see the module docstring).

        Appends the turn id actually used to `turn_ids`; a refusal or failure raises
        `TurnFailed` carrying every turn id tried.
        """
        attempt = cmd
        retry = 0
        waited = 0.0
        while True:
            try:
                if isinstance(attempt, LlmStream):
                    reply = await self._client.stream(attempt)
                else:
                    reply = await self._client.turn(attempt)
            except CommandFailed as exc:
                if exc.code == ErrorCode.TURN_IN_PROGRESS and waited < self._in_progress_wait:
                    # An earlier delivery's call is still running in metering: its
                    # reply, once stored, is ours to replay.
                    await asyncio.sleep(IN_PROGRESS_POLL_SECONDS)
                    waited += IN_PROGRESS_POLL_SECONDS
                    continue
                if exc.code in _RETRYABLE and retry < MAX_TURN_RETRIES:
                    retry, waited = retry + 1, 0.0
                    attempt = cmd.model_copy(update={"turn_id": f"{cmd.turn_id}.r{retry}"})
                    continue
                turn_ids.append(attempt.turn_id)
                raise TurnFailed(exc.code, exc.message, turn_ids) from None
            turn_ids.append(attempt.turn_id)
            return reply


# A turn id that ended without a reply, or is stuck in progress past the wait (its
# metering replica died mid-call), is tried again under the next retry id.
_RETRYABLE = frozenset({ErrorCode.TURN_ALREADY_FAILED.value, ErrorCode.TURN_IN_PROGRESS.value})


def consolidation_turn_id(readiness_id: UUID) -> str:
    """The turn id of the consolidation turn a readiness asks for (before any retry)."""
    return f"criativo.{readiness_id}.brief"


def _one_turn(reply: TurnReply, turn_ids: list[str]) -> TurnOutcome:
    """The outcome of a turn made of a single model call."""
    outcome = TurnOutcome(
        text="".join(b.text for b in reply.content if isinstance(b, TextBlock)),
        turn_ids=turn_ids,
        stopped=rules.after_call(reply.stop_reason, 0) is NextStep.STOPPED,
    )
    outcome.add(reply)
    return outcome
