"""Tools and hooks: what a model may call, and what runs around each call.

A tool's handler gets the whole call (its `input`, and its `id`: the same on every
replay of a turn, so it can key an effect that must happen once) and returns a
`ToolResult`. An error result goes back to the model,
verbatim, as the next tool result, so the model can correct itself on the next
turn (ADR 0015 decision 2: "M attempts" is the loop's `max_iterations`, not a retry
subsystem). Validation belongs in the tool; ending the loop belongs in a post-tool
hook (ADR 0015 decision 2: "the tool validates, the hook terminates").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from contracts.metering import ToolSpec, ToolUseBlock


@dataclass(frozen=True)
class ToolResult:
    """What a tool call produced: `content` for the model; `data` for the hooks and caller."""

    content: str
    is_error: bool = False
    data: Any = None

    @classmethod
    def ok(cls, content: str, data: Any = None) -> ToolResult:
        return cls(content, False, data)

    @classmethod
    def error(cls, message: str) -> ToolResult:
        """A refusal written for the model: say what was wrong and what would be accepted."""
        return cls(message, True)


ToolHandler = Callable[[ToolUseBlock], Awaitable[ToolResult]]


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: name, description, JSON schema of its input, handler."""

    name: str
    description: str
    input_schema: dict[str, Any]
    handler: ToolHandler = field(compare=False)
    # The spec as built once (`of`), for a tool made afresh for every turn.
    built: ToolSpec | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, spec: ToolSpec, handler: ToolHandler) -> Tool:
        """The tool `spec` describes, run by `handler`; its spec is not built again."""
        return cls(spec.name, spec.description, spec.input_schema, handler, spec)

    def spec(self) -> ToolSpec:
        if self.built is not None:
            return self.built
        return ToolSpec(
            name=self.name, description=self.description, input_schema=self.input_schema
        )


@dataclass(frozen=True)
class Halt:
    """A post-tool hook's decision to end the loop now, with why and what it produced."""

    reason: str
    output: Any = None


# Before a tool runs: None lets it run; a string refuses it (sent to the model as the error).
PreToolHook = Callable[[ToolUseBlock], Awaitable[str | None]]
# After a tool ran: None goes on; a `Halt` ends the loop once this turn's tools ran.
PostToolHook = Callable[[ToolUseBlock, ToolResult], Awaitable[Halt | None]]
