"""The model turns of a session, all on the harness's `ToolLoop` (streaming, through
metering only).

- `criativo`: a streaming tool loop. Each model call is one `cmd.llm.stream` whose
  deltas go to the session's `agent.delta.<project>.<session>`; tool calls
  (`emit_artifact`) run between calls and their results go back to the model, so a
  refused rule is corrected on the next call. The person sees every call's text.
  A call the person stopped (`stop_reason` "cancelled", from `cmd.llm.cancel`) ends
  the answer at once: its tool calls never run, and the answer is the text written
  so far, marked stopped (the rule is the harness `ToolLoop`'s, kept there only).
- `plain`: the chat of sessions without Criativo (docs/architecture.md, "A chat
  message"): one streaming, stateless call with the current message only, agent slug
  `chat`.
- `consolidate`: the brief after readiness, one streaming call with no tools — the
  model can write the brief's text, never emit it (ADR 0008 decision 5).

Turn ids are the same on every delivery of an input (`criativo.<message>.<iteration>`):
metering answers a turn id that already ran from its stored reply and never calls the
model again, so a redelivered or retried turn replays the very same tool calls, with
the same tool_use ids. A rule is appended under a key derived from its tool_use id,
so one tool call records one artifact however many times the turn is replayed. A
turn id that ended without a reply (metering shut down mid-call) is tried again as
`<turn_id>.r1`, `.r2`…; one still running in metering (our previous delivery died
waiting for it) is waited for — both done by the `ToolLoop`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any
from uuid import UUID

from contracts.common import person_of
from contracts.events import BusinessRule, TurnUsage
from contracts.metering import ChatMessage, TokenUsage, ToolSpec, ToolUseBlock
from domain import criativo as rules
from domain.criativo import Conversation
from domain.errors import DomainError
from harness import LoopContext, LoopResult, MeteringClient, Tool, ToolLoop, ToolResult
from servicekit.faults import crash_point

CRIATIVO_PROMPT = (files("criativo") / "prompts" / "criativo.md").read_text(encoding="utf-8")
CONSOLIDATION_PROMPT = (files("criativo") / "prompts" / "consolidation.md").read_text(
    encoding="utf-8"
)

# Records a valid rule in the log, once per tool_use id; returns its event id.
RecordRule = Callable[[BusinessRule, str], Awaitable[UUID]]


class TurnFailed(Exception):
    """Metering refused or failed the turn (after the provider's retries)."""

    def __init__(
        self,
        code: str,
        message: str,
        turn_ids: list[str],
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.turn_ids = turn_ids
        self.details = details or {}


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


# Built (and validated) once: every turn offers the same tool, with its own handler.
EMIT_ARTIFACT = ToolSpec(
    name="emit_artifact",
    description="Record an artifact of the conversation. Only business_rule can be emitted; "
    "the product brief is written by the system after the person confirms readiness.",
    input_schema=EMIT_ARTIFACT_SCHEMA,
)


def emit_artifact(conv: Conversation, record: RecordRule) -> Tool:
    """The tool: validated by the domain; a refusal goes back verbatim; a valid rule is
    recorded under its call's tool_use id (the same on every replay of the turn)."""

    async def handler(call: ToolUseBlock) -> ToolResult:
        try:
            rule = rules.check_artifact(call.input, conv)
        except DomainError as exc:
            return ToolResult.error(f"{exc.code}: {exc.message}")
        event_id = await record(rule, call.id)
        crash_point("criativo.after_rule")
        return ToolResult.ok(f"business_rule recorded as event {event_id}", data=event_id)

    return Tool.of(EMIT_ARTIFACT, handler)


def _person(conv: Conversation, input_id: UUID) -> str | None:
    """Whom a turn works for: the person whose message or readiness it answers."""
    event = conv.inputs.get(input_id)
    return person_of(event.actor) if event is not None else None


class Turns:
    """Runs a session's model turns through metering, on the harness's `ToolLoop`."""

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
        result = await self._run(
            [emit_artifact(conv, record)],
            self._max_iterations,
            LoopContext(
                run_id=f"criativo.{conv.session_id}",
                turn_id=lambda iteration: f"criativo.{message_id}.{iteration}",
                agent_slug=rules.CRIATIVO,
                project_id=conv.project_id,
                session_id=conv.session_id,
                system=self._system(conv),
                messages=rules.model_messages(conv, message_id),
                budget_micros=self._budget,
                person=_person(conv, message_id),
                stream=True,
                causation_id=message_id,
            ),
        )
        # The answer is every call's text, as the person saw it streamed.
        return _outcome(result, "\n\n".join(result.texts))

    async def plain(self, conv: Conversation, message_id: UUID, text: str) -> TurnOutcome:
        """The stateless answer of a session without Criativo: the current message only."""
        result = await self._run(
            [],
            1,
            LoopContext(
                run_id=f"chat.{conv.session_id}",
                turn_id=lambda _: f"chat.{message_id}",
                agent_slug=rules.PLAIN_CHAT,
                project_id=conv.project_id,
                session_id=conv.session_id,
                system="",
                messages=[ChatMessage(role="user", content=text)],
                budget_micros=self._budget,
                person=_person(conv, message_id),
                stream=True,
                causation_id=message_id,
            ),
        )
        return _outcome(result, result.final_text)

    async def consolidate(
        self, conv: Conversation, readiness_id: UUID, readiness_seq: int
    ) -> TurnOutcome:
        """The consolidation turn after readiness: the brief's text, no tools offered."""
        ask = CONSOLIDATION_PROMPT.format(readiness_id=readiness_id)
        # Streamed like any answer, so the person sees the brief being written; its
        # deltas and its `agent.done` carry the readiness as their causation.
        result = await self._run(
            [],
            1,
            LoopContext(
                run_id=f"criativo.{conv.session_id}",
                turn_id=lambda _: consolidation_turn_id(readiness_id),
                agent_slug=rules.CRIATIVO,
                project_id=conv.project_id,
                session_id=conv.session_id,
                system=self._system(conv),
                messages=rules.consolidation_messages(conv, readiness_seq, ask),
                budget_micros=self._budget,
                person=_person(conv, readiness_id),
                stream=True,
                causation_id=readiness_id,
            ),
        )
        return _outcome(result, result.final_text)

    async def _run(self, tools: list[Tool], max_iterations: int, ctx: LoopContext) -> LoopResult:
        """One loop; a turn metering refused or failed raises `TurnFailed` with every
        turn id tried. A tool that raises (the log unreachable while recording a rule)
        ends the turn with its exception, so the delivery is retried: a rule must be
        recorded, never reported to the model as its mistake."""
        loop = ToolLoop(
            self._client,
            tools,
            max_iterations=max_iterations,
            max_tokens=self._max_tokens,
            in_progress_wait_seconds=self._in_progress_wait,
            report_tool_crashes=False,
        )
        result = await loop.run(ctx)
        if result.status in ("error", "budget_exceeded"):
            raise TurnFailed(
                result.error_code or "error",
                result.error_message or "",
                result.turn_ids,
                result.error_details,
            )
        return result

    @staticmethod
    def _system(conv: Conversation) -> str:
        return f"{CRIATIVO_PROMPT}\nBusiness rules recorded so far:\n{rules.rules_digest(conv)}"


def consolidation_turn_id(readiness_id: UUID) -> str:
    """The turn id of the consolidation turn a readiness asks for (before any retry)."""
    return f"criativo.{readiness_id}.brief"


def _outcome(result: LoopResult, text: str) -> TurnOutcome:
    """What the person is answered, from how the loop ended."""
    return TurnOutcome(
        text=text,
        turn_ids=result.turn_ids,
        usage=result.usage,
        cost_micros=result.cost_micros,
        model=result.model,
        rules=[
            outcome.data
            for _, outcome in result.tool_calls
            if not outcome.is_error and isinstance(outcome.data, UUID)
        ],
        stopped=result.status == "stopped",
    )
