"""The `openai` provider — the official SDK — against a local fake of the Chat Completions
API (HTTP + SSE on loopback), alone and behind metering on real NATS and Postgres."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import date

import openai
import pytest
import pytest_asyncio
from nats.aio.client import Client
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from contracts import subjects
from contracts.common import ErrorCode
from contracts.metering import (
    ChatMessage,
    LlmStream,
    LlmTurn,
    ResolveBinding,
    ResolvedBinding,
    TextBlock,
    TokenUsage,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
    TurnReply,
)
from domain.metering import Price, cost_micros
from metering.providers.base import Progress, ProviderError, ProviderRequest, estimate_output_tokens
from metering.providers.openai import OpenAICompatibleProvider, prompt_tokens_estimate
from metering.providers.openai import build_params as openai_params
from servicekit.client import CommandFailed, call
from testkit.fake_chat_api import (
    Chunk,
    FakeChatApi,
    Reply,
    error_chunk,
    error_reply,
    finish,
    text_chunks,
    text_reply,
    tool_call_chunks,
    usage_chunk,
)
from testkit.fake_sse import RawData
from testkit.metering import Metering, Starter
from testkit.probes import wait_for
from testkit.spans import recorded_spans

from .providing import Sleeps, Texts, failed_call
from .test_anthropic_provider import (
    assert_same_request,
    conversation,
    sdk_calls_short_and_long,
    traceparent_of,
)
from .test_cancel import billed, cancel, order, start, usage_of, watch
from .test_metering_service import bind

LOCAL = "llama3.2"  # seeded at price 0
REQUEST = ProviderRequest(
    model=LOCAL,
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
async def fake() -> AsyncIterator[FakeChatApi]:
    server = await FakeChatApi().start()
    yield server
    await server.stop()


def provider(fake: FakeChatApi, sleeps: Sleeps | None = None) -> OpenAICompatibleProvider:
    return OpenAICompatibleProvider(
        api_key="test-key", base_url=fake.base_url, max_retries=3, sleep=sleeps or Sleeps()
    )


# --- the provider against the fake -------------------------------------------------


async def test_text_streams_in_order_and_usage_comes_from_the_include_usage_chunk(
    fake: FakeChatApi,
) -> None:
    fake.replies.append(
        Reply(
            chunks=[
                *text_chunks(["Orders ", "close ", "at 18h."]),
                finish("stop"),
                usage_chunk(prompt=1250, completion=7, cached=1000),
            ]
        )
    )
    texts, progress = Texts(), Progress()
    llm = provider(fake)
    reply = await llm.complete(REQUEST, progress, texts)
    await llm.close()

    assert texts.pieces == ["Orders ", "close ", "at 18h."]
    assert reply.content == [TextBlock(text="Orders close at 18h.")]
    assert (reply.stop_reason, reply.model) == ("end_turn", LOCAL)
    # prompt_tokens counts the cached ones: input is what is left
    assert progress.usage == TokenUsage(input_tokens=250, output_tokens=7, cache_read_tokens=1000)
    assert progress.first_token_at is not None
    sent = fake.requests[-1]
    assert sent.path == "/v1/chat/completions"
    assert sent.headers["authorization"] == "Bearer test-key"
    body = sent.body
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["model"], body["max_tokens"]) == (LOCAL, 500)
    assert body["messages"] == [
        {"role": "system", "content": "You are Criativo."},
        {"role": "user", "content": "I want a bakery app."},
        {"role": "assistant", "content": "Tell me more."},
        {"role": "user", "content": "Orders close at 18h."},
    ]
    assert "tools" not in body


async def test_a_tool_call_streamed_in_pieces_becomes_a_tool_use_block(fake: FakeChatApi) -> None:
    fake.replies.append(
        Reply(
            chunks=[
                *text_chunks(["Recording it."]),
                *tool_call_chunks(0, "call_1", "emit_artifact", ['{"title": "Hou', 'rs", "or',
                                                                 'igin": ["a"]}']),
                *tool_call_chunks(1, "call_2", "emit_artifact", ['{"title": "Pay"}']),
                finish("tool_calls"),
                usage_chunk(40, 30),
            ]
        )
    )  # fmt: skip
    texts = Texts()
    llm = provider(fake)
    reply = await llm.complete(REQUEST, Progress(), texts)
    await llm.close()
    assert reply.stop_reason == "tool_use"
    assert reply.content == [
        TextBlock(text="Recording it."),
        ToolUseBlock(id="call_1", name="emit_artifact", input={"title": "Hours", "origin": ["a"]}),
        ToolUseBlock(id="call_2", name="emit_artifact", input={"title": "Pay"}),
    ]
    assert texts.pieces == ["Recording it."]  # a tool call's JSON is not text


async def test_arguments_that_are_not_json_reach_the_tool_as_they_came(fake: FakeChatApi) -> None:
    fake.replies.append(
        Reply(
            chunks=[
                *tool_call_chunks(0, "", "emit_artifact", ["{title: Hours"]),
                finish("tool_calls"),
                usage_chunk(40, 9),
            ]
        )
    )
    llm = provider(fake)
    reply = await llm.complete(REQUEST, Progress(), None)
    await llm.close()
    # no id from the server: one is made up, as the harness needs one to answer
    assert reply.content == [
        ToolUseBlock(
            id="call_0", name="emit_artifact", input={"_unparsed_arguments": "{title: Hours"}
        )
    ]


async def test_a_tool_name_that_cannot_exist_is_a_provider_error_not_a_crash(
    fake: FakeChatApi,
) -> None:
    fake.replies.append(
        Reply(
            chunks=[
                *tool_call_chunks(0, "call_1", "emit artifact!", ["{}"]),
                finish("tool_calls"),
                usage_chunk(40, 9),
            ]
        )
    )
    sleeps, progress = Sleeps(), Progress()
    llm = provider(fake, sleeps)
    with pytest.raises(ProviderError) as failed:
        await llm.complete(REQUEST, progress, None)
    await llm.close()
    assert failed.value.code == ErrorCode.PROVIDER_ERROR
    assert sleeps.delays == []  # not retried: the answer was given, and billed
    assert progress.usage == TokenUsage(input_tokens=40, output_tokens=9)


def test_tool_blocks_and_tools_are_translated_to_chat_completions() -> None:
    request = ProviderRequest(
        model=LOCAL,
        agent_slug="criativo",
        system="",
        messages=[
            ChatMessage(role="user", content=[TextBlock(text="Orders close at 18h.")]),
            ChatMessage(
                role="assistant",
                content=[
                    TextBlock(text="Noted."),
                    ToolUseBlock(id="call_9", name="emit_artifact", input={"title": "Hours"}),
                ],
            ),
            ChatMessage(
                role="user",
                content=[
                    ToolResultBlock(tool_use_id="call_9", content="origin missing", is_error=True)
                ],
            ),
        ],
        tools=[
            ToolSpec(name="emit_artifact", description="Record.", input_schema={"type": "object"})
        ],
        max_tokens=100,
    )
    params = openai_params(request)
    assert params["messages"] == [
        {"role": "user", "content": "Orders close at 18h."},
        {
            "role": "assistant",
            "content": "Noted.",
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "emit_artifact", "arguments": '{"title": "Hours"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "error: origin missing"},
    ]
    assert params["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "emit_artifact",
                "description": "Record.",
                "parameters": {"type": "object"},
            },
        }
    ]


async def test_a_whole_turn_streams_too_but_hands_no_text_on(fake: FakeChatApi) -> None:
    fake.replies.append(text_reply(["Hi", "."], prompt=12, completion=3))
    progress = Progress()
    llm = provider(fake)
    reply = await llm.complete(REQUEST, progress, None)
    await llm.close()
    assert reply.content == [TextBlock(text="Hi.")]
    assert progress.usage == TokenUsage(input_tokens=12, output_tokens=3)
    assert progress.texts == 0 and progress.first_token_at is None


@pytest.mark.parametrize(
    ("headers", "expected"), [({"retry-after": "2"}, 2.0), ({"retry-after-ms": "1500"}, 1.5)]
)
async def test_a_429_is_retried_after_the_wait_the_server_asked_for(
    fake: FakeChatApi, headers: dict[str, str], expected: float
) -> None:
    fake.replies.append(error_reply(429, "rate_limit_exceeded", **headers))
    fake.replies.append(text_reply(["after ", "the wait"], prompt=10, completion=4))
    sleeps, texts, progress = Sleeps(), Texts(), Progress()
    llm = provider(fake, sleeps)
    reply = await llm.complete(REQUEST, progress, texts)
    await llm.close()
    assert reply.content == [TextBlock(text="after the wait")]
    assert sleeps.delays == [expected]
    assert texts.pieces == ["after ", "the wait"]
    assert progress.usage == TokenUsage(input_tokens=10, output_tokens=4)  # the 429 cost nothing


async def test_a_429_asking_too_long_a_wait_is_answered_at_once(fake: FakeChatApi) -> None:
    fake.replies.append(error_reply(429, "rate_limit_exceeded", **{"retry-after": "3600"}))
    sleeps = Sleeps()
    llm = provider(fake, sleeps)
    with pytest.raises(ProviderError) as failed:
        await llm.complete(REQUEST, Progress(), None)
    await llm.close()
    assert failed.value.code == ErrorCode.PROVIDER_OVERLOADED
    assert failed.value.retry_after == 3600.0 and sleeps.delays == []


async def test_a_bad_request_is_not_retried_and_its_message_is_kept(fake: FakeChatApi) -> None:
    fake.replies.append(error_reply(400, "invalid_request_error"))
    sleeps = Sleeps()
    llm = provider(fake, sleeps)
    with pytest.raises(ProviderError) as failed:
        await llm.complete(REQUEST, Progress(), None)
    await llm.close()
    assert failed.value.code == ErrorCode.PROVIDER_ERROR
    assert "invalid_request_error" in failed.value.message
    assert sleeps.delays == []


async def test_an_error_chunk_before_any_text_is_retried_and_the_attempt_is_billed(
    fake: FakeChatApi,
) -> None:
    fake.replies.append(Reply(chunks=[error_chunk("server_error", "out of memory")]))
    fake.replies.append(text_reply(["ok"], prompt=50, completion=2))
    sleeps, progress, texts = Sleeps(), Progress(), Texts()
    llm = provider(fake, sleeps)
    reply = await llm.complete(REQUEST, progress, texts)
    await llm.close()
    assert reply.content == [TextBlock(text="ok")] and texts.pieces == ["ok"]
    assert len(sleeps.delays) == 1 and 0 < sleeps.delays[0] <= 0.5
    # the failed attempt had begun answering: its prompt is billed from its size
    estimate = prompt_tokens_estimate(openai_params(REQUEST))
    assert progress.usage == TokenUsage(input_tokens=estimate + 50, output_tokens=2)


async def test_an_error_mid_stream_after_text_fails_without_repeating_deltas(
    fake: FakeChatApi,
) -> None:
    fake.replies.append(
        Reply(chunks=[*text_chunks(["one ", "two "]), error_chunk("server_error", "crashed")])
    )
    sleeps = Sleeps()
    failed, progress, texts = await failed_call(provider(fake, sleeps), REQUEST)
    assert failed.code == ErrorCode.PROVIDER_ERROR
    assert "crashed" in failed.message
    assert sleeps.delays == [] and texts.pieces == ["one ", "two "]
    assert progress.usage == TokenUsage(
        input_tokens=prompt_tokens_estimate(openai_params(REQUEST)),
        output_tokens=estimate_output_tokens(2, len("one two ")),
    )


@pytest.mark.parametrize(
    "broken",
    ['{"choices": [{"index": 0, "delta": {"cont', "[1, 2]", "NaN"],
    ids=["cut", "not-an-object", "nan"],
)
async def test_a_chunk_that_is_not_a_json_object_fails_the_call_with_a_code(
    fake: FakeChatApi, broken: str
) -> None:
    # What came before it was handed on and is billed; a retry would hand it on twice.
    chunks: list[Chunk | RawData] = [*text_chunks(["one ", "two "]), RawData(broken)]
    fake.replies.append(Reply(chunks=[*chunks, finish("stop"), usage_chunk(9, 3)]))
    sleeps = Sleeps()
    failed, progress, texts = await failed_call(provider(fake, sleeps), REQUEST)
    assert failed.code == ErrorCode.PROVIDER_ERROR
    assert "not a JSON object" in failed.message and broken[:20] in failed.message
    assert sleeps.delays == [] and texts.pieces == ["one ", "two "]
    assert progress.usage == TokenUsage(
        input_tokens=prompt_tokens_estimate(openai_params(REQUEST)),
        output_tokens=estimate_output_tokens(2, len("one two ")),
    )


async def test_a_connection_dropped_mid_stream_is_billed_for_what_arrived(
    fake: FakeChatApi,
) -> None:
    chunks = text_chunks(["a ", "b ", "c "])
    fake.replies.append(Reply(chunks=chunks, drop_after=len(chunks) - 1))
    progress, texts = Progress(), Texts()
    llm = OpenAICompatibleProvider(api_key="k", base_url=fake.base_url, max_retries=0)
    with pytest.raises(ProviderError):
        await llm.complete(REQUEST, progress, texts)
    await llm.close()
    assert texts.pieces == ["a ", "b "]
    assert progress.usage.output_tokens == 2 and progress.usage.input_tokens > 0


async def test_calls_one_after_another_stream_on_one_connection() -> None:
    # As with Anthropic's API: a stream read to its end leaves its connection to the next
    # call, which pays no new one (a TLS handshake against a remote server).
    fake = await FakeChatApi().start()
    fake.replies.extend(text_reply(["ok"]) for _ in range(3))
    llm = provider(fake)
    for _ in range(3):
        texts = Texts()
        await llm.complete(REQUEST, Progress(), texts)
        assert texts.pieces == ["ok"]
    await llm.close()
    await fake.stop()
    assert fake.connections == 1


async def test_a_stream_that_ends_without_finishing_is_an_error(fake: FakeChatApi) -> None:
    # a clean end of body, but no finish reason and no [DONE]: the server gave up
    fake.replies.append(Reply(chunks=text_chunks(["half"]), done=False))
    llm = OpenAICompatibleProvider(api_key="k", base_url=fake.base_url, max_retries=0)
    with pytest.raises(ProviderError) as failed:
        await llm.complete(REQUEST, Progress(), Texts())
    await llm.close()
    assert failed.value.code == ErrorCode.PROVIDER_ERROR


# --- behind metering ---------------------------------------------------------------


def project() -> str:
    return f"p-{uuid.uuid4().hex[:10]}"


async def on_openai(start_metering: Starter, fake: FakeChatApi) -> Metering:
    """A metering replica with the scripted default and the OpenAI-compatible fake beside it."""
    return await start_metering(
        openai_base_url=fake.base_url, openai_api_key="test-key", provider_max_retries=1
    )


async def test_a_binding_names_the_openai_provider_and_metering_streams_and_bills_through_it(
    fake: FakeChatApi, start_metering: Starter, nc: Client
) -> None:
    running = await on_openai(start_metering, fake)
    proj = project()
    bound = await bind(nc, scope="agent", project_id=proj, agent_slug="criativo",
                       model=LOCAL, provider="openai")  # fmt: skip
    assert bound.binding is not None and bound.binding.provider == "openai"
    resolved = await call(
        nc,
        subjects.BINDINGS_RESOLVE,
        ResolveBinding(agent_slug="criativo", project_id=proj),
        ResolvedBinding,
    )
    assert (resolved.model, resolved.decided_by.provider) == (LOCAL, "openai")

    fake.replies.append(text_reply(["Bom ", "dia."], prompt=300, completion=4))
    session = uuid.uuid4()
    cmd = LlmStream(
        run_id=f"run-{uuid.uuid4().hex[:8]}",
        turn_id=f"turn-{uuid.uuid4().hex}",
        agent_slug="criativo",
        project_id=proj,
        session_id=session,
        messages=[ChatMessage(role="user", content="Olá")],
        max_tokens=100,
        delta_subject=subjects.delta_subject(proj, session),
        budget_micros=0,  # a local model costs nothing: a zero budget is enough
    )
    deltas = await watch(nc, cmd)
    reply = await call(nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=30)
    assert reply.content == [TextBlock(text="Bom dia.")]
    assert reply.usage == TokenUsage(input_tokens=300, output_tokens=4)
    assert reply.cost_micros == 0 and reply.budget_remaining_micros == 0
    await wait_for(lambda: deltas.text(cmd.turn_id) == "Bom dia.", what="the deltas")
    numbered = [d.seq for d in deltas.of(cmd.turn_id)]
    assert numbered == list(range(1, len(numbered) + 1))
    row, hold, _ = await billed(running.db, cmd)
    assert (row["provider"], row["model"], row["status"]) == ("openai", LOCAL, "ok")
    assert usage_of(row) == reply.usage
    assert hold["status"] == "settled"

    # another agent of the project, with no provider named, stays on the default
    other = LlmTurn(
        run_id="run-writer",
        turn_id=f"turn-{uuid.uuid4().hex}",
        agent_slug="writer",
        project_id=proj,
        messages=[ChatMessage(role="user", content="Hello")],
        max_tokens=100,
    )
    asked = len(fake.requests)
    await call(nc, subjects.LLM_TURN, other, TurnReply, timeout=30)
    row = await running.db.fetchrow("SELECT * FROM token_usage WHERE turn_id = $1", other.turn_id)
    assert row is not None and row["provider"] == "scripted"
    assert len(fake.requests) == asked


async def test_an_openai_model_is_priced_from_the_catalogue(
    fake: FakeChatApi, start_metering: Starter, nc: Client
) -> None:
    running = await on_openai(start_metering, fake)
    model = f"local-{uuid.uuid4().hex[:6]}"
    price = Price(model, date(2026, 1, 1), 200_000, 800_000, 0, 0, 50_000)
    await running.db.execute(
        """INSERT INTO prices (model, effective_from, input_micros, output_micros,
               cache_write_5m_micros, cache_write_1h_micros, cache_read_micros, source)
           VALUES ($1, $2, $3, $4, $5, $6, $7, 'test')""",
        model, price.effective_from, price.input, price.output, 0, 0, price.cache_read,
    )  # fmt: skip
    proj = project()
    # any binding change reloads every replica's catalogue, so the new price is known
    await bind(nc, scope="project", project_id=proj, model=LOCAL, provider="openai")
    await bind(nc, scope="project", project_id=proj, model=model, provider="openai")

    fake.replies.append(
        Reply(chunks=[*text_chunks(["x"]), finish(), usage_chunk(10_000, 2_000, cached=4_000)])
    )
    cmd = LlmTurn(
        run_id=f"run-{uuid.uuid4().hex[:8]}",
        turn_id=f"turn-{uuid.uuid4().hex}",
        agent_slug="anyone",
        project_id=proj,
        messages=[ChatMessage(role="user", content="Hi")],
        max_tokens=3_000,
    )
    reply = await call(nc, subjects.LLM_TURN, cmd, TurnReply, timeout=30)
    usage = TokenUsage(input_tokens=6_000, output_tokens=2_000, cache_read_tokens=4_000)
    assert reply.usage == usage
    assert reply.cost_micros == cost_micros(usage, price) > 0


async def test_a_binding_naming_an_unconfigured_provider_is_refused(
    start_metering: Starter, nc: Client
) -> None:
    await start_metering()  # no OPENAI_* settings: only the scripted default
    with pytest.raises(CommandFailed) as refused:
        await bind(nc, scope="project", project_id=project(), model=LOCAL, provider="openai")
    assert refused.value.code == ErrorCode.INVALID_BINDING
    assert "OPENAI_BASE_URL" in refused.value.message


async def test_a_cancel_closes_the_openai_stream_and_bills_the_partial_answer(
    fake: FakeChatApi, start_metering: Starter, nc: Client
) -> None:
    running = await on_openai(start_metering, fake)
    proj = project()
    await bind(nc, scope="agent", project_id=proj, agent_slug="criativo",
               model=LOCAL, provider="openai")  # fmt: skip
    pieces = [f"palavra{i} " for i in range(200)]
    chunks = [*text_chunks(pieces), finish("stop"), usage_chunk(120, 400)]
    # the role chunk and three pieces at once; then one chunk every 50 ms, as a long
    # answer is written: ten seconds for the rest.
    fake.client_left.clear()
    fake.replies.append(Reply(chunks=chunks, pace_after=4, pace_seconds=0.05))
    session = uuid.uuid4()
    cmd = LlmStream(
        run_id=f"run-{uuid.uuid4().hex[:8]}",
        turn_id=f"turn-{uuid.uuid4().hex}",
        agent_slug="criativo",
        project_id=proj,
        session_id=session,
        messages=[ChatMessage(role="user", content="Fale bastante.")],
        max_tokens=1000,
        delta_subject=subjects.delta_subject(proj, session),
    )
    deltas = await watch(nc, cmd)
    reply_task = start(nc, cmd)
    await wait_for(lambda: len(deltas.of(cmd.turn_id)) >= 3, what="three deltas")

    assert (await cancel(nc, order(cmd))).status == "cancelling"
    reply = await reply_task
    await asyncio.wait_for(fake.client_left.wait(), 60)  # the connection was closed
    assert fake.chunks_sent[-1] < len(chunks) - 2  # not drained: the rest never went out

    assert reply.stop_reason == "cancelled"
    [block] = reply.content
    assert block.type == "text"
    await wait_for(lambda: deltas.text(cmd.turn_id) == block.text, what="every delta sent")
    received = len(block.text.split())  # pieces: those that came together, fewer deltas
    assert 3 <= len(deltas.of(cmd.turn_id)) <= received < len(pieces)
    assert block.text == "".join(pieces[:received])
    # the usage chunk never came: input from the prompt's size, output from the text
    assert reply.usage.input_tokens > 0
    assert reply.usage.output_tokens >= estimate_output_tokens(received, len(block.text))
    row, hold, run = await billed(running.db, cmd)
    assert (row["status"], row["provider"]) == ("cancelled", "openai")
    assert usage_of(row) == reply.usage
    assert (hold["status"], run["reserved_micros"]) == ("settled", 0)


async def test_a_streamed_reply_builds_no_sdk_model_per_chunk(
    fake: FakeChatApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Building a typed model of every chunk cost metering more CPU per token than the
    # rest of its work; the stream is read raw.
    fake.replies.append(
        Reply(chunks=[*text_chunks(["a ", "b ", "c"]), finish("stop"), usage_chunk(9, 3)])
    )
    llm = provider(fake)
    built: list[object] = []
    sdk_process = llm._client._process_response_data

    def counting(*args: object, **kwargs: object) -> object:
        built.append(kwargs.get("cast_to"))
        return sdk_process(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(llm._client, "_process_response_data", counting)
    progress = Progress()
    reply = await llm.complete(REQUEST, progress, Texts())
    await llm.close()
    assert reply.content == [TextBlock(text="a b c")]
    assert progress.usage == TokenUsage(input_tokens=9, output_tokens=3)
    assert built == []


# The headers a Chat Completions server reads.
HEADERS_READ = ("authorization", "content-type")


async def test_the_request_sent_is_the_one_the_sdks_create_writes_for_it(fake: FakeChatApi) -> None:
    request = conversation(2, LOCAL)
    fake.replies.extend([text_reply(["ok"]), text_reply(["ok"])])
    llm = provider(fake)
    await llm.complete(request, Progress(), Texts())
    await llm.close()
    ours = fake.requests[-1]

    sdk = openai.AsyncOpenAI(api_key="test-key", base_url=fake.base_url, max_retries=0)
    async for _ in await sdk.chat.completions.create(**openai_params(request)):
        pass
    await sdk.close()
    theirs = fake.requests[-1]

    assert_same_request(ours, theirs, "/v1/chat/completions", HEADERS_READ)


async def test_the_sdks_work_for_a_call_does_not_grow_with_the_conversation(
    fake: FakeChatApi,
) -> None:
    # The SDK transformed the whole conversation by its types on every call (and then
    # wrote it), paid one call after another by a burst of turns starting at once. The
    # body is handed over written.
    llm, sdk = provider(fake), openai.__file__
    short, long = await sdk_calls_short_and_long(
        llm, sdk, lambda: fake.replies.append(text_reply(["ok"])), LOCAL, streams=True
    )
    assert short > 0  # the SDK sent both
    assert long == short


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    yield from recorded_spans()


async def test_a_call_is_one_span_and_the_server_hears_its_trace_context(
    fake: FakeChatApi, spans: InMemorySpanExporter
) -> None:
    # A server that joins traces (vLLM can) hangs its own span under the call's.
    spans.clear()
    fake.replies.append(text_reply(["ok"], prompt=5, completion=1))
    llm = provider(fake)
    await llm.complete(REQUEST, Progress(), Texts())
    await llm.close()
    (call_span,) = spans.get_finished_spans()
    assert call_span.name == f"chat {LOCAL}"
    assert fake.requests[-1].headers["traceparent"] == traceparent_of(call_span)
