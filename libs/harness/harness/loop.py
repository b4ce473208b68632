"""`ToolLoop`: turns until the model stops calling tools, a hook halts, the iterations
or the budget run out (ADR 0015 decision 2).

Each iteration is one metered turn (`cmd.llm.turn`) whose `turn_id` is
`<run_id>.<iteration>`, so a loop re-run under the same run id replays the turns
metering already billed instead of paying for them twice. The run's budget is
enforced by metering, which refuses a turn that does not fit before calling anything.

A turn id that failed once (a provider error) can never run again in metering. A
re-run that meets such an iteration tries it again as `<turn_id>.r1`, `.r2`…, in
that order, so a later re-run still replays whichever attempt succeeded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal
from uuid import UUID

from contracts.common import ErrorCode
from contracts.metering import (
    ChatMessage,
    LlmTurn,
    ReplyBlock,
    TokenUsage,
    ToolResultBlock,
    ToolUseBlock,
    TurnReply,
)
from harness.client import MeteringClient
from harness.tools import Halt, PostToolHook, PreToolHook, Tool, ToolResult
from servicekit.client import CommandFailed
from servicekit.logs import get_logger

log = get_logger(__name__)

# Attempts of one iteration after the first failed (each billed by metering).
MAX_TURN_RETRIES = 3

LoopStatus = Literal["completed", "halted", "max_iterations", "budget_exceeded", "error"]


@dataclass(frozen=True)
class LoopContext:
    """Who runs, for whom, with what prompt and budget."""

    run_id: str
    agent_slug: str
    project_id: str
    system: str
    messages: list[ChatMessage]
    session_id: UUID | None = None
    budget_micros: int | None = None


@dataclass
class LoopResult:
    """How the loop ended, with what it cost."""

    status: LoopStatus
    iterations: int
    usage: TokenUsage
    cost_micros: int
    messages: list[ChatMessage]
    final_text: str = ""
    halt: Halt | None = None
    error_code: str | None = None
    error_message: str | None = None
    tool_calls: list[tuple[ToolUseBlock, ToolResult]] = field(default_factory=list)


def _add(a: TokenUsage, b: TokenUsage) -> TokenUsage:
    return TokenUsage(**{k: getattr(a, k) + getattr(b, k) for k in TokenUsage.model_fields})


def _text(content: list[ReplyBlock]) -> str:
    return "".join(b.text for b in content if b.type == "text")


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
    ) -> None:
        if max_iterations < 1:
            raise ValueError("max_iterations must be at least 1")
        self._client = client
        self._tools = {t.name: t for t in tools}
        self._max_iterations = max_iterations
        self._max_tokens = max_tokens
        self._pre = list(pre_tool_hooks or [])
        self._post = list(post_tool_hooks or [])

    async def run(self, ctx: LoopContext) -> LoopResult:
        """Loop until completed, halted, out of iterations, out of budget, or failed."""
        result = LoopResult("max_iterations", 0, TokenUsage(), 0, list(ctx.messages))
        specs = [t.spec() for t in self._tools.values()]
        for iteration in range(1, self._max_iterations + 1):
            turn = LlmTurn(
                run_id=ctx.run_id,
                turn_id=f"{ctx.run_id}.{iteration}",
                agent_slug=ctx.agent_slug,
                project_id=ctx.project_id,
                session_id=ctx.session_id,
                system=ctx.system,
                messages=result.messages,
                tools=specs,
                max_tokens=self._max_tokens,
                budget_micros=ctx.budget_micros,
            )
            try:
                reply = await self._turn(turn)
            except CommandFailed as exc:
                result.status = (
                    "budget_exceeded" if exc.code == ErrorCode.BUDGET_EXCEEDED else "error"
                )
                result.error_code, result.error_message = exc.code, exc.message
                # A failed turn is still billed by metering; its cost is in the details.
                result.cost_micros += int(exc.details.get("cost_micros", 0))
                return result
            result.iterations = iteration
            result.usage = _add(result.usage, reply.usage)
            result.cost_micros += reply.cost_micros
            result.messages.append(ChatMessage(role="assistant", content=list(reply.content)))
            result.final_text = _text(reply.content)
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

    async def _turn(self, turn: LlmTurn) -> TurnReply:
        """The iteration's turn, retried under the next retry id while metering says an
        earlier attempt of it already failed (see the module docstring)."""
        attempt = turn
        for retry in range(1, MAX_TURN_RETRIES + 1):
            try:
                return await self._client.turn(attempt)
            except CommandFailed as exc:
                if exc.code != ErrorCode.TURN_ALREADY_FAILED:
                    raise
                attempt = turn.model_copy(update={"turn_id": f"{turn.turn_id}.r{retry}"})
        return await self._client.turn(attempt)

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
            return await tool.handler(call.input)
        except Exception as exc:  # a crashing tool is reported to the model, not fatal
            log.exception("tool_crashed", tool=call.name)
            return ToolResult.error(f"the tool {call.name} failed: {type(exc).__name__}: {exc}")
