"""The scripted provider on its own: step matching, and the offline demo's default script."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from contracts.events import BusinessRule, HypothesisProposed, ProductBrief
from contracts.metering import ChatMessage, TextBlock, ToolResultBlock, ToolSpec, ToolUseBlock
from metering.providers.base import Progress, ProviderError, ProviderRequest
from metering.providers.scripted import (
    DEFAULT_SCRIPT,
    LoggingScripted,
    Script,
    ScriptedProvider,
    ScriptStep,
)

ANY_SCHEMA = {"type": "object"}


def request(agent: str, *messages: ChatMessage, tools: tuple[str, ...] = ()) -> ProviderRequest:
    return ProviderRequest(
        model="claude-sonnet-4-6",
        agent_slug=agent,
        system="",
        messages=list(messages),
        tools=[ToolSpec(name=t, input_schema=ANY_SCHEMA) for t in tools],
        max_tokens=500,
    )


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


async def test_the_first_matching_step_answers_and_text_is_emitted_word_by_word() -> None:
    script = Script(
        steps=[
            ScriptStep(agent="a", contains="bread", text="Bread it is."),
            ScriptStep(agent="a", text="Anything else."),
        ]
    )
    pieces: list[str] = []

    async def on_text(text: str, at: float) -> None:
        pieces.append(text)

    progress = Progress()
    reply = await ScriptedProvider(script).complete(
        request("a", user("I sell bread")), progress, on_text
    )
    assert pieces == ["Bread ", "it ", "is."]
    assert reply.content == [TextBlock(text="Bread it is.")]
    assert progress.usage.output_tokens == 3 and progress.usage.input_tokens > 0


async def test_no_matching_step_is_a_provider_error() -> None:
    with pytest.raises(ProviderError):
        await ScriptedProvider(Script(steps=[ScriptStep(agent="x")])).complete(
            request("y", user("hi")), Progress(), None
        )


async def test_default_script_psychologist_cites_event_ids_from_its_prompt() -> None:
    events = [str(uuid.uuid4()) for _ in range(3)]
    prompt = "\n".join(f"[{e}] chat.message: hello" for e in events)
    reply = await ScriptedProvider(DEFAULT_SCRIPT).complete(
        request("psicologo-leve", user(prompt), tools=("emit_hypotheses",)), Progress(), None
    )
    [call] = [b for b in reply.content if isinstance(b, ToolUseBlock)]
    assert call.name == "emit_hypotheses"
    [hypothesis] = call.input["hypotheses"]
    assert set(hypothesis["evidence_event_ids"]) <= set(events)
    HypothesisProposed.model_validate(
        {**hypothesis, "hypothesis_id": str(uuid.uuid4()), "analysis_id": str(uuid.uuid4())}
    )
    # after the tool accepted them, the model closes the loop in words
    accepted = ChatMessage(
        role="user", content=[ToolResultBlock(tool_use_id=call.id, content="accepted")]
    )
    closing = await ScriptedProvider(DEFAULT_SCRIPT).complete(
        request(
            "psicologo-leve",
            user(prompt),
            ChatMessage(role="assistant", content=[call]),
            accepted,
            tools=("emit_hypotheses",),
        ),
        Progress(),
        None,
    )
    assert not [b for b in closing.content if isinstance(b, ToolUseBlock)]


async def test_default_script_psychologist_cites_only_the_ids_its_prompt_marks_as_events() -> None:
    # A reanalysed session: its log ends with the last analysis's own events, whose
    # payloads hold uuids that are not events (the analysis's and the hypothesis's ids).
    said, answered, closed = (str(uuid.uuid4()) for _ in range(3))
    analysis, hypothesis, proposed = (str(uuid.uuid4()) for _ in range(3))
    t = "2026-11-30T20:00:00+00:00"
    prompt = "\n".join(
        [
            "# The session's event log, oldest first",
            f'#1 {t} chat.message by user:ana {{"text":"hi"}} event_id: {said}',
            f"#2 {t} agent.response by agent:criativo caused_by={said} {{}} event_id: {answered}",
            f"#3 {t} session.closed by user:ana {{}} event_id: {closed}",
            f"#4 {t} psychologist.hypothesis_proposed by agent:psicologo "
            f'{{"analysis_id":"{analysis}","hypothesis_id":"{hypothesis}",'
            f'"evidence_event_ids":["{answered}","{closed}"]}} event_id: {proposed}',
        ]
    )
    reply = await ScriptedProvider(DEFAULT_SCRIPT).complete(
        request("psicologo-leve", user(prompt), tools=("emit_hypotheses",)), Progress(), None
    )
    [call] = [b for b in reply.content if isinstance(b, ToolUseBlock)]
    [cited] = call.input["hypotheses"]
    assert cited["evidence_event_ids"] == [answered, closed]


async def test_default_script_criativo_records_a_rule_citing_the_message_and_writes_a_brief() -> (
    None
):
    message_id = str(uuid.uuid4())
    said = user(f"[{message_id}] Orders close at 18h on weekdays")
    reply = await ScriptedProvider(DEFAULT_SCRIPT).complete(
        request("criativo", said, tools=("emit_artifact",)), Progress(), None
    )
    [call] = [b for b in reply.content if isinstance(b, ToolUseBlock)]
    rule = BusinessRule.model_validate({k: v for k, v in call.input.items() if k != "type"})
    assert [str(o) for o in rule.origin] == [message_id]
    assert reply.content[0].type == "text"

    brief = await ScriptedProvider(DEFAULT_SCRIPT).complete(
        request("criativo", user("Write the product_brief now.")), Progress(), None
    )
    text = brief.content[0]
    assert isinstance(text, TextBlock)
    ProductBrief.model_validate(json.loads(text.text))


async def test_the_logging_provider_writes_a_line_per_call_before_it_answers(
    tmp_path: Path,
) -> None:
    script = Script(steps=[ScriptStep(text="Sure.")])
    calls, prompts = tmp_path / "calls.jsonl", tmp_path / "prompts.jsonl"
    counting = LoggingScripted(script, calls)
    recording = LoggingScripted(script, prompts, prompts=True)
    for provider in (counting, counting, recording):
        await provider.complete(request("chat", user("Olá")), Progress(), None)

    lines = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [(x["agent"], x["pid"]) for x in lines] == [("chat", os.getpid())] * 2
    assert lines[0]["at"] <= lines[1]["at"]
    (line,) = [json.loads(line) for line in prompts.read_text(encoding="utf-8").splitlines()]
    assert line["tools"] == []
    assert line["messages"] == [{"role": "user", "content": "Olá"}]
