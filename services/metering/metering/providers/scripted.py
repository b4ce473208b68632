"""The `scripted` provider: deterministic replies for tests, benchmarks and the offline demo.

A script is a list of steps; the first whose conditions all hold answers the call.
A step says what to write (text, tool calls, or a named responder that builds its
answer from the conversation), how many tokens to report, how fast to emit text,
and optionally to fail (before or in the middle of the stream) like a real
provider does. Text is emitted word by word at `token_delay_ms`, scheduled from the
start of the reply so the rate does not drift; words already due when the provider gets
to them (at a zero delay, all of them) come at once, without waiting in between, as the
events of one read of a real stream do (metering publishes the first at once and the
rest of them as one delta: `metering.publisher.DeltaPublisher`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from contracts.common import ErrorCode
from contracts.metering import ChatMessage, ReplyBlock, TextBlock, TokenUsage, ToolUseBlock
from metering.providers.base import (
    OnText,
    Progress,
    ProviderError,
    ProviderReply,
    ProviderRequest,
    traced,
)

UUID_PATTERN = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# Criativo shows each message as `[message <id>]` before its text (domain.criativo).
MESSAGE_TAG = re.compile(r"\[message [0-9a-f-]{36}\]")
WORD = re.compile(r"\S+\s*|\s+")
# The Psicólogo's log lines: `#<seq> <time> <type> by <actor> … event_id: <id>` (its context).
EVENT_ID = re.compile(rf"\bevent_id: ({UUID_PATTERN.pattern})\s*$")
PSYCHOLOGIST_LINE = re.compile(r"#\d+ \S+ psychologist\.")


class ScriptedToolCall(BaseModel):
    """A tool call the scripted model makes."""

    model_config = ConfigDict(extra="forbid")
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ScriptStep(BaseModel):
    """When this step answers (every condition given must hold) and what it answers."""

    model_config = ConfigDict(extra="forbid")
    # conditions
    agent: str | None = None
    contains: str | None = None  # in the text of the last user message (tool results included)
    system_contains: str | None = None
    has_tool: str | None = None  # a tool of this name is offered
    after_tool_error: bool | None = None  # the last message carries a tool error
    after_tool_result: bool | None = None  # the last message carries a tool result
    iteration: int | None = None  # assistant messages so far
    # answer
    text: str = ""
    tool_calls: list[ScriptedToolCall] = Field(default_factory=list)
    responder: (
        Literal["psychologist_hypotheses", "criativo_rule", "criativo_brief", "echo"] | None
    ) = None
    token_delay_ms: float | None = None
    input_tokens: int | None = None  # default: a quarter of the prompt's bytes
    output_tokens: int | None = None  # default: words written + 20 per tool call
    cache_write_5m_tokens: int = 0
    cache_write_1h_tokens: int = 0
    cache_read_tokens: int = 0
    stop_reason: str | None = None
    fail: Literal["overloaded", "error"] | None = None
    fail_after_words: int = 0  # words emitted before failing (0: fail before any text)


class Script(BaseModel):
    """Steps tried in order; `token_delay_ms` is the default pace of text."""

    model_config = ConfigDict(extra="forbid")
    steps: list[ScriptStep]
    token_delay_ms: float = 0.0

    @classmethod
    def from_file(cls, path: str | Path) -> Script:
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))


def _text_of(message: ChatMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if block.type == "text":
            parts.append(block.text)
        elif block.type == "tool_result":
            parts.append(block.content)
    return "\n".join(parts)


def _tool_results(message: ChatMessage) -> list[bool]:
    """The `is_error` flag of each tool result in `message`."""
    if isinstance(message.content, str):
        return []
    return [b.is_error for b in message.content if b.type == "tool_result"]


def matches(step: ScriptStep, request: ProviderRequest) -> bool:
    """Whether every condition of `step` holds for `request`."""
    last = request.messages[-1]
    results = _tool_results(last) if last.role == "user" else []
    checks = [
        step.agent is None or step.agent == request.agent_slug,
        step.contains is None or step.contains in _text_of(last),
        step.system_contains is None or step.system_contains in request.system,
        step.has_tool is None or any(t.name == step.has_tool for t in request.tools),
        step.after_tool_error is None or step.after_tool_error == any(results),
        step.after_tool_result is None or step.after_tool_result == bool(results),
        step.iteration is None
        or step.iteration == sum(1 for m in request.messages if m.role == "assistant"),
    ]
    return all(checks)


# --- responders: answers built from the conversation (the offline demo) -------


def _ids_in_conversation(request: ProviderRequest) -> list[str]:
    seen: dict[str, None] = {}
    for message in request.messages:
        for found in UUID_PATTERN.findall(_text_of(message)):
            seen.setdefault(found, None)
    return list(seen)


def _evidence_ids(request: ProviderRequest) -> list[str]:
    """The ids the Psicólogo's prompt marks as events (`… event_id: <id>` at the end of a log
    line), as its instructions say to cite. Other uuids of the prompt (an analysis's or a
    hypothesis's id in a payload) are not events and would be refused; the Psicólogo's own
    events (a reanalysed session holds the last analysis's) are left out, so the evidence
    does not depend on how many of them were relayed into the log yet. A prompt without
    those marks gives every uuid it holds."""
    lines = [
        line
        for message in request.messages
        if message.role == "user"
        for line in _text_of(message).splitlines()
    ]
    marked = [(line, EVENT_ID.search(line)) for line in lines]
    events = [(line, m.group(1)) for line, m in marked if m is not None]
    if not events:
        return _ids_in_conversation(request)
    behaviour = [i for line, i in events if not PSYCHOLOGIST_LINE.match(line)]
    return list(dict.fromkeys(behaviour or [i for _, i in events]))


def _psychologist_hypotheses(request: ProviderRequest, n: int) -> tuple[str, list[ToolUseBlock]]:
    ids = _evidence_ids(request)
    if not ids:
        return "The session holds no events I can cite, so I propose no hypothesis.", []
    hypothesis = {
        "target_agent": "criativo",
        "statement": "Criativo recorded the person's rules as they were said, without asking "
        "for the priorities between them.",
        "confidence": 60,
        "evidence_event_ids": ids[-2:],
        "termination_analysis": "The session ended as its log shows; the closing event is "
        "the last cited.",
    }
    call = ToolUseBlock(
        id=f"toolu_scripted_{n}", name="emit_hypotheses", input={"hypotheses": [hypothesis]}
    )
    return "I read the whole session; here is what its events support.", [call]


def _words(text: str) -> str:
    """The person's words without the `[message <id>]` tags Criativo puts before them."""
    return " ".join(MESSAGE_TAG.sub(" ", text).split())


def _criativo_rule(request: ProviderRequest, n: int) -> tuple[str, list[ToolUseBlock]]:
    said = _text_of(request.messages[-1])
    ids = UUID_PATTERN.findall(said)
    words = _words(said).split()
    reply = f"Understood. You want: {' '.join(words[:12])}. Who will use this day to day?"
    if not ids:
        return reply, []
    rule = {
        "type": "business_rule",
        "title": " ".join(words[:6]) or "Rule",
        "statement": _words(said)[:500] or "A rule the person stated.",
        "origin": [ids[-1]],
    }
    return reply, [ToolUseBlock(id=f"toolu_scripted_{n}", name="emit_artifact", input=rule)]


def _criativo_brief(request: ProviderRequest, n: int) -> tuple[str, list[ToolUseBlock]]:
    # Only what the person said: the person's turns, without the consolidation request
    # Criativo appends to the last one (its prompts/consolidation.md).
    turns = [
        _text_of(m).split("The person clicked", 1)[0] for m in request.messages if m.role == "user"
    ]
    said = _words(" ".join(turns))
    brief = {
        "title": "Product brief",
        "summary": " ".join(said.split()[:40]) or "What the person described.",
        "details": "Consolidated from the conversation and its business rules.",
    }
    return json.dumps(brief, ensure_ascii=False), []


def _echo(request: ProviderRequest, n: int) -> tuple[str, list[ToolUseBlock]]:
    said = " ".join(_words(_text_of(request.messages[-1])).split()[:20])
    return f"Understood: “{said}”. Tell me more about it.", []


RESPONDERS: dict[str, Callable[[ProviderRequest, int], tuple[str, list[ToolUseBlock]]]] = {
    "psychologist_hypotheses": _psychologist_hypotheses,
    "criativo_rule": _criativo_rule,
    "criativo_brief": _criativo_brief,
    "echo": _echo,
}


def _prompt_bytes(request: ProviderRequest) -> int:
    messages = [m.model_dump(mode="json") for m in request.messages]
    return len(request.system.encode()) + len(json.dumps(messages).encode())


class ScriptedProvider:
    """Answers from a `Script`; reports the model it was asked for, so pricing is real."""

    name = "scripted"

    def __init__(self, script: Script) -> None:
        self.script = script
        self.calls = 0

    @traced
    async def complete(
        self, request: ProviderRequest, progress: Progress, on_text: OnText | None
    ) -> ProviderReply:
        self.calls += 1
        step = next((s for s in self.script.steps if matches(s, request)), None)
        if step is None:
            raise ProviderError(ErrorCode.PROVIDER_ERROR, "the script has no step for this call")
        if step.responder is not None:
            text, calls = RESPONDERS[step.responder](request, self.calls)
        else:
            text = step.text
            calls = [
                ToolUseBlock(id=f"toolu_scripted_{self.calls}_{i}", name=c.name, input=c.input)
                for i, c in enumerate(step.tool_calls)
            ]
        words = WORD.findall(text)
        # message_start: input and cache tokens are known before any output
        progress.current = TokenUsage(
            input_tokens=step.input_tokens
            if step.input_tokens is not None
            else -(-_prompt_bytes(request) // 4),
            cache_write_5m_tokens=step.cache_write_5m_tokens,
            cache_write_1h_tokens=step.cache_write_1h_tokens,
            cache_read_tokens=step.cache_read_tokens,
        )
        delay = (
            step.token_delay_ms if step.token_delay_ms is not None else self.script.token_delay_ms
        ) / 1000
        started = time.monotonic()
        for i, word in enumerate(words):
            if step.fail is not None and i == step.fail_after_words:
                self._fail(step)
            # A word not yet due is waited for; words already due (this replica fell
            # behind) come at once, as a real stream's events do when they piled up in
            # the socket between two reads.
            wait = started + (i + 1) * delay - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            at = progress.text()
            # cumulative output so far, as a message_delta would report it
            progress.current = progress.current.model_copy(update={"output_tokens": i + 1})
            if on_text is not None:
                await on_text(word, at)
        if step.fail is not None:
            self._fail(step)
        output = (
            step.output_tokens if step.output_tokens is not None else len(words) + 20 * len(calls)
        )
        progress.current = progress.current.model_copy(update={"output_tokens": output})
        content: list[ReplyBlock] = [TextBlock(text=text)] if text else []
        content.extend(calls)
        stop = step.stop_reason or ("tool_use" if calls else "end_turn")
        return ProviderReply(content=content, stop_reason=stop, model=request.model)

    @staticmethod
    def _fail(step: ScriptStep) -> None:
        if step.fail == "overloaded":
            raise ProviderError(
                ErrorCode.PROVIDER_OVERLOADED, "the scripted provider is overloaded"
            )
        raise ProviderError(ErrorCode.PROVIDER_ERROR, "the scripted provider failed as scripted")

    async def close(self) -> None:
        return None


class LoggingScripted(ScriptedProvider):
    """The scripted provider, appending one JSON line per call to `path` before it answers.

    The fake model's own record of its calls, for a test or bench to compare with what
    metering billed (`bench/chaos.py` counts the lines against `token_usage`) or with what
    the model was shown. Each line holds the agent, the process, the time and the last
    words of a person the call answers (`last_words`: which input it serves); with
    `prompts`, also the tools offered and the whole conversation."""

    def __init__(self, script: Script, path: Path, *, prompts: bool = False) -> None:
        super().__init__(script)
        self._path = path
        self._prompts = prompts

    async def complete(
        self, request: ProviderRequest, progress: Progress, on_text: OnText | None
    ) -> ProviderReply:
        line: dict[str, Any] = {
            "agent": request.agent_slug,
            "pid": os.getpid(),
            "at": time.time(),
            "says": last_words(request.messages),
        }
        if self._prompts:
            line["tools"] = [t.name for t in request.tools]
            line["messages"] = [m.model_dump(mode="json") for m in request.messages]
        with self._path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
        return await super().complete(request, progress, on_text)


def last_words(messages: list[ChatMessage]) -> str:
    """The text of the last user message that has text (not only tool results)."""
    for message in reversed(messages):
        if message.role != "user":
            continue
        if isinstance(message.content, str):
            return message.content
        texts = [b.text for b in message.content if isinstance(b, TextBlock)]
        if texts:
            return texts[-1]
    return ""


# The Psicólogo's offline steps: hypotheses citing the session's events, again after a
# refusal, then done.
PSYCHOLOGIST_STEPS = [
    ScriptStep(
        has_tool="emit_hypotheses", after_tool_result=False, responder="psychologist_hypotheses"
    ),
    ScriptStep(
        has_tool="emit_hypotheses", after_tool_error=True, responder="psychologist_hypotheses"
    ),
    ScriptStep(has_tool="emit_hypotheses", text="Analysis complete."),
]
# Criativo's consolidation turn: the brief from what the person said.
BRIEF_STEP = ScriptStep(contains="product_brief", responder="criativo_brief")

# The offline demo: every flow of the system completes without a key.
DEFAULT_SCRIPT = Script(
    token_delay_ms=15,
    steps=[
        *PSYCHOLOGIST_STEPS,
        BRIEF_STEP,
        ScriptStep(has_tool="emit_artifact", after_tool_result=False, responder="criativo_rule"),
        ScriptStep(has_tool="emit_artifact", text="I noted that rule. What else matters?"),
        ScriptStep(responder="echo"),
    ],
)
