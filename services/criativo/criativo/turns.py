"""The model turns of a session, all on the harness's `ToolLoop` (streaming, through
metering only). What each turn asks (prompt, tools, turn ids) is the core's
(`domain.criativo.Ask`); here it is run.

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

from contracts.events import TurnUsage
from contracts.metering import TokenUsage, ToolUseBlock
from domain import criativo as rules
from domain.criativo import Conversation, Failure, Reply
from harness import LoopContext, LoopResult, MeteringClient, Tool, ToolLoop, ToolResult
from servicekit.faults import crash_point

PROMPTS = rules.Prompts(
    criativo=(files("criativo") / "prompts" / "criativo.md").read_text(encoding="utf-8"),
    consolidation=(files("criativo") / "prompts" / "consolidation.md").read_text(encoding="utf-8"),
)

# Appends a record the core asked for (a rule, during a turn); returns its event id.
RecordRule = Callable[[rules.Record], Awaitable[UUID]]


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

    def failure(self) -> Failure:
        """The failure, as the core concludes from it."""
        return Failure(self.code, tuple(self.turn_ids), self.details)


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

    def reply(self) -> Reply:
        """The answer, as the core concludes from it."""
        return Reply(self.text, tuple(self.turn_ids), self.turn_usage(), self.stopped)


def emit_artifact(conv: Conversation, ask: rules.Ask, record: RecordRule) -> Tool:
    """The tool: each call judged by the core; a refusal goes back verbatim; a valid rule
    is recorded under its call's tool_use id (the same on every replay of the turn)."""

    async def handler(call: ToolUseBlock) -> ToolResult:
        judged = rules.artifact_call(conv, ask, call.id, call.input)
        if isinstance(judged, rules.Refusal):
            return ToolResult.error(judged.text)
        event_id = await record(judged)
        crash_point("criativo.after_rule")
        return ToolResult.ok(rules.RULE_RECORDED.format(event_id=event_id), data=event_id)

    return Tool.of(rules.EMIT_ARTIFACT, handler)


class Turns:
    """Runs the model turns the core asks for through metering, on the harness's `ToolLoop`.

    One method per kind of turn, each running the ask the core plans for it
    (`domain.criativo.answer`, `plain_answer`, `consolidation`).
    """

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
        return await self.run(conv, rules.answer(conv, message_id, PROMPTS), record)

    async def plain(self, conv: Conversation, message_id: UUID, record: RecordRule) -> TurnOutcome:
        """The stateless answer of a session without Criativo: the current message only."""
        return await self.run(conv, rules.plain_answer(conv, message_id), record)

    async def consolidate(
        self, conv: Conversation, readiness_id: UUID, record: RecordRule
    ) -> TurnOutcome:
        """The consolidation turn after readiness: the brief's text, no tools offered.

        Streamed like any answer, so the person sees the brief being written; its deltas
        and its `agent.done` carry the readiness as their causation."""
        return await self.run(conv, rules.consolidation(conv, readiness_id, PROMPTS), record)

    async def run(self, conv: Conversation, ask: rules.Ask, record: RecordRule) -> TurnOutcome:
        """One loop for `ask`; a turn metering refused or failed raises `TurnFailed` with
        every turn id tried. A tool that raises (the log unreachable while recording a
        rule) ends the turn with its exception, so the delivery is retried: a rule must be
        recorded, never reported to the model as its mistake."""
        tools = [emit_artifact(conv, ask, record)] if ask.tools else []
        loop = ToolLoop(
            self._client,
            tools,
            max_iterations=self._max_iterations if ask.tools else 1,
            max_tokens=self._max_tokens,
            in_progress_wait_seconds=self._in_progress_wait,
            report_tool_crashes=False,
        )
        result = await loop.run(
            LoopContext(
                run_id=ask.run_id,
                turn_id=ask.call_id,
                agent_slug=ask.agent,
                project_id=ask.project_id,
                session_id=ask.session_id,
                system=ask.system,
                messages=list(ask.messages),
                budget_micros=self._budget,
                person=ask.person,
                stream=True,
                causation_id=ask.cause,
            )
        )
        if result.status in ("error", "budget_exceeded"):
            raise TurnFailed(
                result.error_code or "error",
                result.error_message or "",
                result.turn_ids,
                result.error_details,
            )
        # A loop's answer is every call's text, as the person saw it streamed.
        return _outcome(result, "\n\n".join(result.texts) if ask.tools else result.final_text)


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
