"""The `anthropic` provider — the official SDK — against a local fake of the Messages API."""

from __future__ import annotations

import asyncio
import gc
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import anthropic
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from contracts import subjects
from contracts.common import ErrorCode
from contracts.metering import (
    ChatMessage,
    LlmStream,
    TextBlock,
    TokenUsage,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
    TurnDelta,
    TurnReply,
)
from domain.metering import cost_micros
from metering.app import build_provider
from metering.providers.anthropic import AnthropicProvider, build_params
from metering.providers.base import Progress, Provider, ProviderError, ProviderRequest
from metering.settings import MeteringSettings
from servicekit.client import call
from testkit.fake_messages_api import (
    MESSAGE_STOP,
    FakeMessagesApi,
    Reply,
    error_reply,
    message_body,
    message_delta,
    message_start,
    overloaded_event,
    text_block,
    tool_block,
)
from testkit.fake_sse import RawData, Recorded
from testkit.metering import Starter
from testkit.probes import subscribed, wait_for
from testkit.spans import recorded_spans

from .providing import Sleeps, Texts, failed_call
from .test_metering_service import SONNET

REQUEST = ProviderRequest(
    model="claude-sonnet-4-6",
    agent_slug="criativo",
    system="You are Criativo.",
    messages=[
        ChatMessage(role="user", content="I want a bakery app."),
        ChatMessage(role="assistant", content="Tell me more."),
        ChatMessage(role="user", content="Orders close at 18h."),
    ],
    tools=[],
    max_tokens=500,
)


@pytest_asyncio.fixture(loop_scope="session")
async def fake() -> AsyncIterator[FakeMessagesApi]:
    server = await FakeMessagesApi().start()
    yield server
    await server.stop()


def provider(fake: FakeMessagesApi, sleeps: Sleeps | None = None) -> AnthropicProvider:
    return AnthropicProvider(
        api_key="test-key", base_url=fake.base_url, max_retries=3, sleep=sleeps or Sleeps()
    )


def streamed(*events: Any) -> Reply:
    flat: list[Any] = []
    for e in events:
        flat.extend(e if isinstance(e, list) else [e])
    return Reply(events=flat)


async def test_text_streams_in_order_and_usage_takes_the_last_cumulative_delta(
    fake: FakeMessagesApi,
) -> None:
    fake.replies.append(
        streamed(
            message_start(25, cache_read=1000, cache_5m=30, cache_1h=10),
            text_block(0, ["Orders ", "close ", "at 18h."]),
            message_delta(5, stop_reason=None),  # cumulative: 5 so far
            message_delta(12),  # cumulative: 12 in all — never 5 + 12
            MESSAGE_STOP,
        )
    )
    texts, progress = Texts(), Progress()
    llm = provider(fake)
    reply = await llm.complete(REQUEST, progress, texts)
    await llm.close()

    assert texts.pieces == ["Orders ", "close ", "at 18h."]
    assert reply.content == [TextBlock(text="Orders close at 18h.")]
    assert (reply.stop_reason, reply.model) == ("end_turn", "claude-sonnet-4-6")
    assert progress.usage == TokenUsage(
        input_tokens=25,
        output_tokens=12,
        cache_write_5m_tokens=30,
        cache_write_1h_tokens=10,
        cache_read_tokens=1000,
    )
    assert progress.first_token_at is not None
    sent = fake.requests[-1]
    assert sent.path == "/v1/messages"
    # SDK 2.x sends the key as a bearer token (older ones used x-api-key)
    assert "test-key" in sent.headers.get("x-api-key", sent.headers.get("authorization", ""))
    assert sent.body["stream"] is True and sent.body["model"] == "claude-sonnet-4-6"
    # prompt caching: the system prompt, the previous user turn (read back) and the
    # end of the conversation (written for the next turn)
    assert sent.body["system"][0]["cache_control"] == {"type": "ephemeral"}
    marked = [i for i, m in enumerate(sent.body["messages"]) if "cache_control" in m["content"][-1]]
    assert marked == [0, 2]


async def test_a_tool_use_block_streamed_as_input_json_delta_is_assembled(
    fake: FakeMessagesApi,
) -> None:
    fake.replies.append(
        streamed(
            message_start(40),
            text_block(0, ["Recording it."]),
            tool_block(1, "toolu_1", "emit_artifact", ['{"title": "Hou', 'rs", "origin": ["a"]}']),
            message_delta(30, stop_reason="tool_use"),
            MESSAGE_STOP,
        )
    )
    llm = provider(fake)
    reply = await llm.complete(REQUEST, Progress(), Texts())
    await llm.close()
    assert reply.stop_reason == "tool_use"
    assert reply.content[1] == ToolUseBlock(
        id="toolu_1", name="emit_artifact", input={"title": "Hours", "origin": ["a"]}
    )


async def test_a_whole_turn_uses_create_and_reads_cache_usage(fake: FakeMessagesApi) -> None:
    fake.replies.append(Reply(body=message_body("Hi.", 12, 3, cache_read=900)))
    progress = Progress()
    llm = provider(fake)
    reply = await llm.complete(REQUEST, progress, None)
    await llm.close()
    assert reply.content == [TextBlock(text="Hi.")]
    assert "stream" not in fake.requests[-1].body
    assert progress.usage == TokenUsage(input_tokens=12, output_tokens=3, cache_read_tokens=900)


async def test_an_overload_before_any_text_is_retried_and_both_attempts_are_billed(
    fake: FakeMessagesApi,
) -> None:
    fake.replies.append(streamed(message_start(50), overloaded_event()))
    fake.replies.append(
        streamed(message_start(50), text_block(0, ["ok"]), message_delta(2), MESSAGE_STOP)
    )
    sleeps, progress, texts = Sleeps(), Progress(), Texts()
    llm = provider(fake, sleeps)
    reply = await llm.complete(REQUEST, progress, texts)
    await llm.close()
    assert reply.content == [TextBlock(text="ok")] and texts.pieces == ["ok"]
    assert len(sleeps.delays) == 1 and 0 < sleeps.delays[0] <= 0.5  # backoff, no retry-after
    # the failed attempt's message_start (50 in, 1 out so far) stays billed
    assert progress.usage == TokenUsage(input_tokens=100, output_tokens=3)


async def test_an_overload_mid_stream_after_text_fails_without_repeating_deltas(
    fake: FakeMessagesApi,
) -> None:
    fake.replies.append(
        streamed(message_start(60), text_block(0, ["one ", "two "])[:-1], overloaded_event())
    )
    sleeps = Sleeps()
    failed, progress, texts = await failed_call(provider(fake, sleeps), REQUEST)
    assert failed.code == ErrorCode.PROVIDER_OVERLOADED
    assert sleeps.delays == [] and texts.pieces == ["one ", "two "]
    # billed for the input and at least one token per text received
    assert progress.usage == TokenUsage(input_tokens=60, output_tokens=2)


@pytest.mark.parametrize(
    ("headers", "expected"), [({"retry-after": "2"}, 2.0), ({"retry-after-ms": "1500"}, 1.5)]
)
async def test_a_429_is_retried_after_the_wait_the_server_asked_for(
    fake: FakeMessagesApi, headers: dict[str, str], expected: float
) -> None:
    fake.replies.append(error_reply(429, "rate_limit_error", **headers))
    fake.replies.append(Reply(body=message_body("after the wait", 10, 4)))
    sleeps = Sleeps()
    llm = provider(fake, sleeps)
    reply = await llm.complete(REQUEST, Progress(), None)
    await llm.close()
    assert reply.content == [TextBlock(text="after the wait")]
    assert sleeps.delays == [expected]


async def test_a_529_is_retried_until_the_retries_run_out(fake: FakeMessagesApi) -> None:
    fake.replies.extend(error_reply(529, "overloaded_error") for _ in range(4))
    sleeps = Sleeps()
    llm = provider(fake, sleeps)
    with pytest.raises(ProviderError) as failed:
        await llm.complete(REQUEST, Progress(), None)
    await llm.close()
    assert failed.value.code == ErrorCode.PROVIDER_OVERLOADED
    assert len(sleeps.delays) == 3  # max_retries=3: four attempts in all


async def test_a_bad_request_is_not_retried_and_its_message_is_kept(fake: FakeMessagesApi) -> None:
    fake.replies.append(error_reply(400, "invalid_request_error"))
    sleeps = Sleeps()
    llm = provider(fake, sleeps)
    with pytest.raises(ProviderError) as failed:
        await llm.complete(REQUEST, Progress(), None)
    await llm.close()
    assert failed.value.code == ErrorCode.PROVIDER_ERROR
    assert "invalid_request_error" in failed.value.message
    assert sleeps.delays == []


async def test_a_connection_dropped_mid_stream_is_billed_for_what_arrived(
    fake: FakeMessagesApi,
) -> None:
    events = [message_start(70), *text_block(0, ["a ", "b ", "c "])]
    fake.replies.append(Reply(events=events, drop_after=len(events) - 1))
    progress, texts = Progress(), Texts()
    llm = provider(fake)
    with pytest.raises(ProviderError):
        await llm.complete(REQUEST, progress, texts)
    await llm.close()
    assert progress.usage == TokenUsage(input_tokens=70, output_tokens=len(texts.pieces))
    assert texts.pieces


@pytest.mark.parametrize(
    "broken",
    ['{"type": "content_block_delta", "index": 0, "delta": {"type": "text_del', "[1, 2]", "NaN"],
    ids=["cut", "not-an-object", "nan"],
)
async def test_an_event_that_is_not_a_json_object_fails_the_call_with_a_code(
    fake: FakeMessagesApi, broken: str
) -> None:
    # What came before it was handed on and is billed; a retry would hand it on twice.
    events = [message_start(40), *text_block(0, ["one ", "two "])[:-1]]
    events += [("content_block_delta", RawData(broken)), message_delta(9), MESSAGE_STOP]
    fake.replies.append(Reply(events=events))
    sleeps = Sleeps()
    failed, progress, texts = await failed_call(provider(fake, sleeps), REQUEST)
    assert failed.code == ErrorCode.PROVIDER_ERROR
    assert "not a JSON object" in failed.message and broken[:20] in failed.message
    assert sleeps.delays == [] and texts.pieces == ["one ", "two "]
    assert progress.usage == TokenUsage(input_tokens=40, output_tokens=2)


async def test_a_stream_that_stalls_fails_after_the_read_timeout_and_is_billed(
    fake: FakeMessagesApi,
) -> None:
    # The provider timeout bounds each read of the stream, whatever the HTTP client.
    fake.client_left.clear()
    events = [message_start(30), *text_block(0, ["a "])[:-1], message_delta(1), MESSAGE_STOP]
    fake.replies.append(Reply(events=events, hold_after=4))
    progress, texts = Progress(), Texts()
    llm = AnthropicProvider(api_key="test-key", base_url=fake.base_url, timeout=0.5)
    with pytest.raises(ProviderError) as failed:
        await llm.complete(REQUEST, progress, texts)
    await asyncio.wait_for(fake.client_left.wait(), 10)  # the connection was closed
    await llm.close()
    assert failed.value.code == ErrorCode.PROVIDER_ERROR
    assert "ReadTimeout" in failed.value.message
    assert texts.pieces == ["a "]  # text went out: not retried
    assert progress.usage == TokenUsage(input_tokens=30, output_tokens=1)


async def test_a_call_cancelled_mid_stream_disconnects_and_keeps_its_usage(
    fake: FakeMessagesApi,
) -> None:
    fake.client_left.clear()
    events = [message_start(80), *text_block(0, ["x ", "y ", "z "]), message_delta(9)]
    fake.replies.append(Reply(events=events, hold_after=len(events) - 2))
    progress, texts = Progress(), Texts()
    llm = provider(fake)
    task = asyncio.create_task(llm.complete(REQUEST, progress, texts))
    await wait_for(lambda: len(texts.pieces) == 3, what="three texts before the hold")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(fake.client_left.wait(), 10)  # the SDK closed the connection
    await llm.close()
    assert progress.usage == TokenUsage(input_tokens=80, output_tokens=3)


async def test_metering_streams_and_bills_through_the_sdk_at_anthropic_base_url(
    fake: FakeMessagesApi, start_metering: Starter, nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The SDK's own variable names the endpoint; configuration picks the provider.
    monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.base_url)
    chosen = build_provider(MeteringSettings(provider="auto"))
    assert isinstance(chosen, AnthropicProvider)
    running = await start_metering(provider=chosen)

    fake.replies.append(
        streamed(
            message_start(300, cache_read=2000, cache_5m=100),
            text_block(0, ["Bom ", "dia."]),
            message_delta(4),
            MESSAGE_STOP,
        )
    )
    subject = subjects.delta_subject("proj", uuid.uuid4())
    deltas: list[TurnDelta] = []

    async def collect(msg: Msg) -> None:
        deltas.append(TurnDelta.model_validate_json(msg.data))

    await nc.subscribe(subject, cb=collect)
    await subscribed(nc)
    cmd = LlmStream(
        run_id="run-a",
        turn_id=f"turn-{uuid.uuid4().hex}",
        agent_slug="criativo",
        project_id="proj",
        messages=[ChatMessage(role="user", content="Olá")],
        max_tokens=100,
        delta_subject=subject,
    )
    reply = await call(nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=30)
    usage = TokenUsage(
        input_tokens=300, output_tokens=4, cache_write_5m_tokens=100, cache_read_tokens=2000
    )
    assert reply.usage == usage and reply.cost_micros == cost_micros(usage, SONNET)
    # Sent back to back: read at once or not, the same text in numbered deltas.
    await wait_for(lambda: "".join(d.text for d in deltas) == "Bom dia.", what="the deltas")
    assert [d.seq for d in deltas] == list(range(1, len(deltas) + 1))
    row = await running.db.fetchrow("SELECT * FROM token_usage WHERE turn_id = $1", cmd.turn_id)
    assert row is not None
    assert (row["provider"], row["status"], row["cache_read_tokens"]) == ("anthropic", "ok", 2000)


def thinking_block(index: int, pieces: list[str]) -> list[Any]:
    return [
        ("content_block_start", {"type": "content_block_start", "index": index,
                                 "content_block": {"type": "thinking", "thinking": "",
                                                   "signature": ""}}),
        *[
            ("content_block_delta", {"type": "content_block_delta", "index": index,
                                     "delta": {"type": "thinking_delta", "thinking": p}})
            for p in pieces
        ],
        ("content_block_delta", {"type": "content_block_delta", "index": index,
                                 "delta": {"type": "signature_delta", "signature": "c2ln"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": index}),
    ]  # fmt: skip


async def test_a_reply_of_several_blocks_is_assembled_from_many_small_deltas(
    fake: FakeMessagesApi,
) -> None:
    tool_input = '{"title": "Opening hours", "origin": ["msg-1", "msg-2"], "n": 3}'
    fake.replies.append(
        streamed(
            message_start(40),
            thinking_block(0, ["The person ", "wants hours."]),
            text_block(1, ["Record", "ing ", "it."]),
            # the input's JSON cut at every character, as the API may stream it
            tool_block(2, "toolu_1", "emit_artifact", list(tool_input)),
            text_block(3, ["And ", "this."]),
            tool_block(4, "toolu_2", "ask", ['{"q"', ': "why?"}']),
            tool_block(5, "toolu_3", "noop", []),  # no input deltas: the input is {}
            message_delta(30, stop_reason="tool_use"),
            MESSAGE_STOP,
        )
    )
    texts = Texts()
    llm = provider(fake)
    reply = await llm.complete(REQUEST, Progress(), texts)
    await llm.close()
    assert texts.pieces == ["Record", "ing ", "it.", "And ", "this."]  # no thinking handed on
    assert reply.content == [
        TextBlock(text="Recording it."),
        ToolUseBlock(
            id="toolu_1",
            name="emit_artifact",
            input={"title": "Opening hours", "origin": ["msg-1", "msg-2"], "n": 3},
        ),
        TextBlock(text="And this."),
        ToolUseBlock(id="toolu_2", name="ask", input={"q": "why?"}),
        ToolUseBlock(id="toolu_3", name="noop", input={}),
    ]
    assert reply.stop_reason == "tool_use"


async def test_event_types_it_does_not_know_are_skipped(fake: FakeMessagesApi) -> None:
    fake.replies.append(
        streamed(
            message_start(10),
            ("future_event", {"type": "future_event", "anything": [1, 2]}),
            text_block(0, ["Still "]),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "future_delta", "x": 1}}),
            text_block(1, ["fine."]),
            message_delta(3),
            MESSAGE_STOP,
        )
    )  # fmt: skip
    texts = Texts()
    llm = provider(fake)
    reply = await llm.complete(REQUEST, Progress(), texts)
    await llm.close()
    assert texts.pieces == ["Still ", "fine."]
    assert reply.content == [TextBlock(text="Still "), TextBlock(text="fine.")]


async def test_a_message_delta_with_input_and_cache_counts_replaces_message_starts(
    fake: FakeMessagesApi,
) -> None:
    final = message_delta(7)
    # The API may repeat every count at the end, cumulative: they replace, never add.
    final[1]["usage"].update(
        input_tokens=25, cache_read_input_tokens=1000, cache_creation_input_tokens=40
    )
    fake.replies.append(
        streamed(
            message_start(25, cache_read=1000, cache_5m=30, cache_1h=10),
            text_block(0, ["ok"]),
            message_delta(4, stop_reason=None),
            final,
            MESSAGE_STOP,
        )
    )
    progress = Progress()
    llm = provider(fake)
    await llm.complete(REQUEST, progress, Texts())
    await llm.close()
    assert progress.usage == TokenUsage(
        input_tokens=25,
        output_tokens=7,
        cache_write_5m_tokens=30,
        cache_write_1h_tokens=10,
        cache_read_tokens=1000,
    )


async def test_a_tool_input_that_is_not_a_json_object_fails_the_call_with_a_code(
    fake: FakeMessagesApi,
) -> None:
    fake.replies.append(
        streamed(
            message_start(40),
            tool_block(0, "toolu_1", "emit_artifact", ['{"title": ', "oops}"]),
            message_delta(30, stop_reason="tool_use"),
            MESSAGE_STOP,
        )
    )
    sleeps = Sleeps()
    llm = provider(fake, sleeps)
    with pytest.raises(ProviderError) as failed:
        await llm.complete(REQUEST, Progress(), Texts())
    await llm.close()
    assert failed.value.code == ErrorCode.PROVIDER_ERROR
    assert "not a JSON object" in failed.value.message
    assert sleeps.delays == []  # the same request would get the same answer


async def test_a_streamed_reply_builds_no_sdk_model_per_event(
    fake: FakeMessagesApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Building a typed model of every event cost metering more CPU per token than the
    # rest of its work; the stream is read raw.
    fake.replies.append(
        streamed(message_start(5), text_block(0, ["a ", "b ", "c"]), message_delta(3), MESSAGE_STOP)
    )
    llm = provider(fake)
    built: list[object] = []
    sdk_process = llm._client._process_response_data

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(kwargs.get("cast_to"))
        return sdk_process(*args, **kwargs)

    monkeypatch.setattr(llm._client, "_process_response_data", counting)
    reply = await llm.complete(REQUEST, Progress(), Texts())
    await llm.close()
    assert reply.content == [TextBlock(text="a b c")]
    assert built == []


def conversation(turns: int, model: str = "claude-sonnet-4-6") -> ProviderRequest:
    """A turn carrying what a request can: a system prompt, a tool, text and tool blocks
    (tool_use, tool_result), text beyond ASCII, and `turns` exchanges of history before the
    person's last message (both cache breakpoints)."""
    history: list[ChatMessage] = []
    for i in range(turns):
        history += [
            ChatMessage(role="user", content=f"Pão de queijo até às 17h? ({i})"),
            ChatMessage(
                role="assistant",
                content=[
                    TextBlock(text="Recording it ✓"),
                    ToolUseBlock(id=f"toolu_{i}", name="emit_artifact", input={"title": "Hours"}),
                ],
            ),
            ChatMessage(
                role="user", content=[ToolResultBlock(tool_use_id=f"toolu_{i}", content="saved")]
            ),
            ChatMessage(role="assistant", content="Saved. What else?"),
        ]
    schema = {"type": "object", "properties": {"title": {"type": "string"}}}
    return ProviderRequest(
        model=model,
        agent_slug="criativo",
        system="You are Criativo. Açúcar, café.",
        messages=[*history, ChatMessage(role="user", content="Orders close at 18h.")],
        tools=[ToolSpec(name="emit_artifact", description="Record it.", input_schema=schema)],
        max_tokens=500,
    )


def a_reply(streams: bool) -> Reply:
    if streams:
        return streamed(message_start(5), text_block(0, ["ok"]), message_delta(1), MESSAGE_STOP)
    return Reply(body=message_body("ok", 5, 1))


# The headers the Messages API reads; the SDK's others (its version, the platform) are
# its own business.
HEADERS_READ = ("x-api-key", "authorization", "anthropic-version", "content-type")


@pytest.mark.parametrize("streams", [True, False], ids=["stream", "whole"])
async def test_the_request_sent_is_the_one_the_sdks_create_writes_for_it(
    fake: FakeMessagesApi, streams: bool
) -> None:
    request = conversation(2)
    fake.replies.extend([a_reply(streams), a_reply(streams)])
    llm = provider(fake)
    await llm.complete(request, Progress(), Texts() if streams else None)
    await llm.close()
    ours = fake.requests[-1]

    sdk = anthropic.AsyncAnthropic(api_key="test-key", base_url=fake.base_url, max_retries=0)
    if streams:
        async for _ in await sdk.messages.create(**build_params(request), stream=True):
            pass
    else:
        await sdk.messages.create(**build_params(request))
    await sdk.close()
    theirs = fake.requests[-1]

    assert_same_request(ours, theirs, "/v1/messages", HEADERS_READ)


def assert_same_request(
    ours: Recorded, theirs: Recorded, path: str, headers: Sequence[str]
) -> None:
    """The same path, JSON body and `headers`, and a body of the same length: written as
    compactly, its text as UTF-8 (not \\u escapes)."""
    assert ours.path == theirs.path == path
    assert ours.body == theirs.body
    assert [ours.headers.get(h) for h in headers] == [theirs.headers.get(h) for h in headers]
    assert ours.headers["content-length"] == theirs.headers["content-length"]


async def sdk_calls(package_file: str, work: Awaitable[Any]) -> int:
    """How many Python function calls were made inside a package's files while `work`
    ran (a coroutine resumed after an await is the same call; the fake, in this thread
    too, is in no package's files)."""
    root = str(Path(package_file).parent)
    called: dict[int, FrameType] = {}  # held, so that no frame's id is reused meanwhile

    def hook(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            called[id(frame)] = frame

    # Nor is a finalizer the garbage collector would run meanwhile (an earlier test's
    # client): it runs before, or after.
    gc.collect()
    gc.disable()
    sys.setprofile(hook)
    try:
        await work
    finally:
        sys.setprofile(None)
        gc.enable()
    return len(called)


@pytest.mark.parametrize("streams", [True, False], ids=["stream", "whole"])
async def test_the_sdks_work_for_a_call_does_not_grow_with_the_conversation(
    fake: FakeMessagesApi, streams: bool
) -> None:
    # A burst of turns starting at once pays each call's start one after another: the
    # SDK walking and copying the whole conversation (and then writing it) on every
    # call made a long conversation's turn start later. The body is handed over written.
    llm, sdk = provider(fake), anthropic.__file__
    short, long = await sdk_calls_short_and_long(
        llm, sdk, lambda: fake.replies.append(a_reply(streams)), REQUEST.model, streams
    )
    assert short > 0  # the SDK sent both
    assert long == short


async def sdk_calls_short_and_long(
    llm: Provider, sdk_file: str, next_reply: Callable[[], None], model: str, streams: bool
) -> tuple[int, int]:
    """The SDK's calls (`sdk_calls`) during a call of a short conversation and during one
    forty times as long, after a first call not counted (its one-time work: the
    platform's name, lazy imports); `next_reply` queues each call's answer."""
    counts = []
    for turns in (1, 1, 40):
        next_reply()
        call = llm.complete(conversation(turns, model), Progress(), Texts() if streams else None)
        counts.append(await sdk_calls(sdk_file, call))
    await llm.close()
    return counts[1], counts[2]


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    yield from recorded_spans()


def traceparent_of(span: ReadableSpan) -> str:
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


async def test_a_call_is_one_span_and_the_provider_hears_its_trace_context(
    fake: FakeMessagesApi, spans: InMemorySpanExporter
) -> None:
    # A trace shows a provider call once, with the usage it was billed for; a provider
    # that joins traces hangs its own under that span.
    spans.clear()
    fake.replies.append(a_reply(True))
    llm = provider(fake)
    await llm.complete(REQUEST, Progress(), Texts())
    await llm.close()
    (call_span,) = spans.get_finished_spans()
    assert (call_span.name, call_span.kind) == ("chat claude-sonnet-4-6", SpanKind.CLIENT)
    assert (call_span.attributes or {})["gen_ai.usage.output_tokens"] == 1
    assert fake.requests[-1].headers["traceparent"] == traceparent_of(call_span)


class CountingFake(FakeMessagesApi):
    """Holds every request until `gate` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def _one_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        await self.gate.wait()
        return await super()._one_request(reader, writer)


@pytest.mark.parametrize("streams", [True, False], ids=["stream", "whole"])
async def test_a_burst_of_calls_reuses_the_connections_of_the_burst_before(
    streams: bool,
) -> None:
    # As many calls at once as the replica runs (`connections`; the SDK's own pool keeps
    # 100): a burst opening connections anew pays a TLS handshake each against the real
    # API before its first token.
    burst = 6
    fake = await CountingFake().start()
    fake.replies.extend(a_reply(streams) for _ in range(2 * burst))
    llm = AnthropicProvider(api_key="test-key", base_url=fake.base_url, connections=burst)

    async def call() -> object:
        return await llm.complete(REQUEST, Progress(), Texts() if streams else None)

    first = [asyncio.create_task(call()) for _ in range(burst)]
    await wait_for(lambda: fake.connections == burst, what="a connection per call")
    fake.gate.set()
    await asyncio.gather(*first)
    await asyncio.gather(*(call() for _ in range(burst)))
    await llm.close()
    await fake.stop()
    assert fake.connections == burst


async def test_calls_one_after_another_stream_on_one_connection() -> None:
    # A stream read to its end leaves its connection to the next call, as the API keeps it
    # alive: a turn does not pay a new connection (a TLS handshake against the real API)
    # before its first token.
    fake = await FakeMessagesApi().start()
    fake.replies.extend(a_reply(True) for _ in range(3))
    llm = provider(fake)
    for _ in range(3):
        texts = Texts()
        await llm.complete(REQUEST, Progress(), texts)
        assert texts.pieces == ["ok"]
    await llm.close()
    await fake.stop()
    assert fake.connections == 1


class IdleClosingFake(CountingFake):
    """Closes each connection once its answer is written, as a server or a load balancer
    closes a connection left idle."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await super()._serve(reader, writer)
        self.closed += 1

    async def _one_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        await super()._one_request(reader, writer)
        return False


async def test_a_connection_the_server_closed_while_idle_is_not_used_again() -> None:
    # Sent on a connection the server closed, a call would fail and wait out a retry's
    # backoff before its first token.
    fake = await IdleClosingFake().start()
    fake.gate.set()
    fake.replies.extend(a_reply(True) for _ in range(2))
    sleeps = Sleeps()
    llm = provider(fake, sleeps)
    await llm.complete(REQUEST, Progress(), Texts())
    await wait_for(lambda: fake.closed == 1, what="the server closed the idle connection")
    # The client hears the close when its event loop next reads the socket, as it does
    # in the time between two turns.
    await asyncio.sleep(0.05)
    texts = Texts()
    await llm.complete(REQUEST, Progress(), texts)
    await llm.close()
    await fake.stop()
    assert (texts.pieces, sleeps.delays, fake.connections) == (["ok"], [], 2)


async def test_a_provider_that_cannot_be_reached_is_retried_then_answered_provider_error() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sleeps = Sleeps()
    llm = AnthropicProvider(
        api_key="test-key", base_url=f"http://127.0.0.1:{port}", max_retries=2, sleep=sleeps
    )
    progress = Progress()
    with pytest.raises(ProviderError) as failed:
        await llm.complete(REQUEST, progress, Texts())
    await llm.close()
    assert failed.value.code == ErrorCode.PROVIDER_ERROR
    assert "connection to the provider failed" in failed.value.message
    assert (len(sleeps.delays), progress.usage) == (2, TokenUsage())
