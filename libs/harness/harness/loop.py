"""`ToolLoop`: turns until the model stops calling tools, a hook halts, the person stops
the answer, the iterations or the budget run out (ADR 0015 decision 2).

Every agent's model calls run here, whole-reply (`cmd.llm.turn`) or streaming
(`cmd.llm.stream`, ADR 0008 decision 2: deltas go to the session's
`agent.delta.<project>.<session>` as the model writes): one code path for both.

Turn ids are deterministic: iteration N of a run is `<run_id>.<N>` unless the caller
names its own ids (`LoopContext.turn_id`). Metering answers a turn id that already ran
from its stored reply and never calls the model again, so a loop re-run under the same
ids replays the very turns metering already billed — the same tool calls with the same
tool_use ids — instead of paying for them twice. The run's budget is enforced by
metering, which refuses a turn that does not fit before calling anything.

A turn id that failed once (a provider error, or metering shut down mid-call) can
never run again in metering. A re-run that meets such an iteration tries it again as
`<turn_id>.r1`, `.r2`…, in that order, so a later re-run still replays whichever
attempt succeeded. A turn id still running in metering (an earlier run died waiting
for it) is waited for when the loop is given `in_progress_wait_seconds`: its reply,
once stored, is ours to replay; past the wait it is tried again under the next retry
id (its metering replica died mid-call). Without a wait, it is an error the caller
may retry later. A turn lost with its metering replica (`harness.client.TurnLost`: a
stream whose replica went silent, before or after its first delta, or a whole-reply turn
with no reply in the client's timeout) is asked for again under its own id first when
the loop may wait: a replica that only seemed lost (stalled, cut off from NATS, slower
than the client's timeout) still runs it, and metering answers "in progress", then its
reply, so it is never run, nor billed, twice; a dead replica's turn is ended (a survivor
bills it at its hold within seconds) and tried again under the next retry id. Without a
wait, a lost turn goes to the next retry id at once.

A streaming turn the person stopped (`cmd.llm.cancel`; metering's `stop_reason`
"cancelled") ends the loop at once: its tool calls never run, and the answer is the
text written up to then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal
from uuid import UUID

from contracts import subjects
from contracts.common import ErrorCode
from contracts.metering import (
    ChatMessage,
    LlmStream,
    LlmTurn,
    ReplyBlock,
    TextBlock,
    TokenUsage,
    ToolResultBlock,
    ToolUseBlock,
    TurnReply,
)
from harness.client import MeteringClient, TurnLost
from harness.tools import Halt, PostToolHook, PreToolHook, Tool, ToolResult
from servicekit.client import CommandFailed
from servicekit.logs import get_logger

log = get_logger(__name__)

# Attempts of one iteration after the first failed (each billed by metering).
MAX_TURN_RETRIES = 3
# How often to ask again about a turn id metering is still running.
IN_PROGRESS_POLL_SECONDS = 0.25
# Metering's `stop_reason` for a stream stopped with `cmd.llm.cancel` (`TurnReply`).
CANCELLED = "cancelled"

LoopStatus = Literal["completed", "stopped", "halted", "max_iterations", "budget_exceeded", "error"]
# The turn id of iteration N (1-based), the same on every run of the same input.
TurnIds = Callable[[int], str]


@dataclass(frozen=True)
class LoopContext:
    """Who runs, for whom, with what prompt and budget, under which turn ids, streamed or not."""

    run_id: str
    agent_slug: str
    project_id: str
    system: str
    messages: list[ChatMessage]
    session_id: UUID | None = None
    budget_micros: int | None = None
    # The person the run works for: their limits apply beside the project's.
    person: str | None = None
    # Iteration N's turn id; `<run_id>.<N>` when not given.
    turn_id: TurnIds | None = None
    # Stream every turn: deltas go to `delta_subject` (the session's by default),
    # stamped with `causation_id` (the event the run answers).
    stream: bool = False
    delta_subject: str | None = None
    causation_id: UUID | None = None

    def turn_id_of(self, iteration: int) -> str:
        """Iteration `iteration`'s turn id, before any retry."""
        if self.turn_id is None:
            return f"{self.run_id}.{iteration}"
        return self.turn_id(iteration)


@dataclass
class LoopResult:
    """How the loop ended, with what it cost."""

    status: LoopStatus
    iterations: int
    usage: TokenUsage
    cost_micros: int
    messages: list[ChatMessage]
    # The text of the last reply.
    final_text: str = ""
    halt: Halt | None = None
    error_code: str | None = None
    error_message: str | None = None
    # What metering said of the refusal beside its message (a limit's scope and reset).
    error_details: dict[str, Any] = field(default_factory=dict)
    tool_calls: list[tuple[ToolUseBlock, ToolResult]] = field(default_factory=list)
    # Every non-empty text block of every reply, in order (what the person saw streamed).
    texts: list[str] = field(default_factory=list)
    # The turn id each call ran under (a retry id where one was needed), the failed one last.
    turn_ids: list[str] = field(default_factory=list)
    # The model of the last reply ("" when no call succeeded).
    model: str = ""

    def add(self, reply: TurnReply) -> None:
        """Count one reply: its usage and cost (summed here only), its model and text."""
        self.usage = TokenUsage(
            **{k: getattr(self.usage, k) + getattr(reply.usage, k) for k in TokenUsage.model_fields}
        )
        self.cost_micros += reply.cost_micros
        self.model = reply.model
        self.final_text = _text(reply.content)
        self.texts.extend(b.text for b in reply.content if isinstance(b, TextBlock) and b.text)
        self.messages.append(ChatMessage(role="assistant", content=list(reply.content)))


def _text(content: list[ReplyBlock]) -> str:
    return "".join(b.text for b in content if isinstance(b, TextBlock))


class ToolLoop:
    """Runs an agent's tools against the model, through metering only."""

    def __init__(
        self,
        client: MeteringClient,
        tools: list[Tool],
        *,
        max_iterations: int,
        max_tokens: int = 4096,
        pre_tool_hooks: list[PreToolHook] | None = None,
        post_tool_hooks: list[PostToolHook] | None = None,
        in_progress_wait_seconds: float | None = None,
        report_tool_crashes: bool = True,
    ) -> None:
        """`report_tool_crashes=False` lets a tool's exception end the run (raised to the
        caller) instead of going to the model: for a tool whose effect must happen, where
        the caller's retry (a redelivery) is the cure, not the model's next attempt."""
        if max_iterations < 1:
            raise ValueError("max_iterations must be at least 1")
        self._client = client
        self._tools = {t.name: t for t in tools}
        # The same on every iteration: built (validated) once per loop, not per turn.
        self._specs = [t.spec() for t in self._tools.values()]
        self._max_iterations = max_iterations
        self._max_tokens = max_tokens
        self._pre = list(pre_tool_hooks or [])
        self._post = list(post_tool_hooks or [])
        self._in_progress_wait = in_progress_wait_seconds
        self._report_crashes = report_tool_crashes
        retryable = {ErrorCode.TURN_ALREADY_FAILED.value}
        if in_progress_wait_seconds is not None:
            retryable.add(ErrorCode.TURN_IN_PROGRESS.value)
        self._retryable = frozenset(retryable)

    async def run(self, ctx: LoopContext) -> LoopResult:
        """Loop until completed, stopped, halted, out of iterations or budget, or failed."""
        result = LoopResult("max_iterations", 0, TokenUsage(), 0, list(ctx.messages))
        for iteration in range(1, self._max_iterations + 1):
            try:
                reply = await self._call(self._turn(ctx, iteration, result.messages), result)
            except CommandFailed as exc:
                result.status = (
                    "budget_exceeded" if exc.code == ErrorCode.BUDGET_EXCEEDED else "error"
                )
                result.error_code, result.error_message = exc.code, exc.message
                result.error_details = dict(exc.details)
                # A failed turn is still billed by metering; its cost is in the details.
                result.cost_micros += int(exc.details.get("cost_micros", 0))
                return result
            result.iterations = iteration
            result.add(reply)
            if reply.stop_reason == CANCELLED:
                result.status = "stopped"  # its tool calls never run
                return result
            calls = [b for b in reply.content if isinstance(b, ToolUseBlock)]
            if not calls:
                result.status = "completed"
                return result
            blocks, halt = await self._run_tools(calls, result)
            result.messages.append(ChatMessage(role="user", content=list(blocks)))
            if halt is not None:
                result.status, result.halt = "halted", halt
                return result
        return result

    def _turn(self, ctx: LoopContext, iteration: int, messages: list[ChatMessage]) -> LlmTurn:
        fields = {
            "run_id": ctx.run_id,
            "turn_id": ctx.turn_id_of(iteration),
            "agent_slug": ctx.agent_slug,
            "project_id": ctx.project_id,
            "session_id": ctx.session_id,
            "system": ctx.system,
            "messages": list(messages),
            "tools": list(self._specs),
            "max_tokens": self._max_tokens,
            "budget_micros": ctx.budget_micros,
            "person": ctx.person,
        }
        if not ctx.stream:
            return LlmTurn(**fields)
        if ctx.session_id is None:
            raise ValueError("a streaming run needs the session its deltas belong to")
        # Built (and validated) once, as the command it is: on every turn's start.
        return LlmStream(
            **fields,
            delta_subject=ctx.delta_subject
            or subjects.delta_subject(ctx.project_id, ctx.session_id),
            causation_id=ctx.causation_id,
        )

    async def _call(self, turn: LlmTurn, result: LoopResult) -> TurnReply:
        """The iteration's turn under its id, waited for while metering still runs it and
        retried under the next retry id when it cannot run (see the module docstring).
        The id actually used goes to `result.turn_ids`, failed or not."""
        attempt, retry, waited, asked_again = turn, 0, 0.0, False
        while True:
            try:
                if isinstance(attempt, LlmStream):
                    reply = await self._client.stream(attempt)
                else:
                    reply = await self._client.turn(attempt)
            except CommandFailed as exc:
                if (
                    exc.code == ErrorCode.TURN_IN_PROGRESS
                    and self._in_progress_wait is not None
                    and waited < self._in_progress_wait
                ):
                    await asyncio.sleep(IN_PROGRESS_POLL_SECONDS)
                    waited += IN_PROGRESS_POLL_SECONDS
                    continue
                # A turn lost with its metering replica (a silent stream, no reply): metering
                # knows whether that replica still runs it (see the module docstring).
                lost = isinstance(exc, TurnLost)
                if lost and self._in_progress_wait is not None and not asked_again:
                    asked_again = True
                    self._client.ask_again(attempt.turn_id)
                    continue
                if (lost or exc.code in self._retryable) and retry < MAX_TURN_RETRIES:
                    retry, waited, asked_again = retry + 1, 0.0, False
                    attempt = turn.model_copy(update={"turn_id": f"{turn.turn_id}.r{retry}"})
                    continue
                result.turn_ids.append(attempt.turn_id)
                raise
            result.turn_ids.append(attempt.turn_id)
            return reply

    async def _run_tools(
        self, calls: list[ToolUseBlock], result: LoopResult
    ) -> tuple[list[ToolResultBlock], Halt | None]:
        """Every tool call of one turn, in order; a halt takes effect after all of them."""
        blocks: list[ToolResultBlock] = []
        halt: Halt | None = None
        for call in calls:
            outcome = await self._run_tool(call)
            result.tool_calls.append((call, outcome))
            blocks.append(
                ToolResultBlock(
                    tool_use_id=call.id, content=outcome.content, is_error=outcome.is_error
                )
            )
            for hook in self._post:
                decision = await hook(call, outcome)
                if decision is not None and halt is None:
                    halt = decision
        return blocks, halt

    async def _run_tool(self, call: ToolUseBlock) -> ToolResult:
        for hook in self._pre:
            refusal = await hook(call)
            if refusal is not None:
                return ToolResult.error(refusal)
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolResult.error(
                f"there is no tool named {call.name!r}; the tools are: "
                + ", ".join(sorted(self._tools))
            )
        try:
            return await tool.handler(call)
        except Exception as exc:  # a crashing tool is reported to the model, not fatal
            if not self._report_crashes:
                raise
            log.exception("tool_crashed", tool=call.name)
            return ToolResult.error(f"the tool {call.name} failed: {type(exc).__name__}: {exc}")
