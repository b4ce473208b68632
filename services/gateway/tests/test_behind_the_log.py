"""No socket is left behind the log: an event the subscription delivered while the log
did not answer, or one published while the gateway's NATS connection was away, reaches
the socket once the log answers (the connection is back), in order, with no later event
of the session needed to show the gap. What the log denies is still never shown.

The log and the gateway run in this process, and nothing answers a chat: the event the
test appends is the session's last. The gateway reaches NATS through a relay the test
can cut; its reads of the log can be made to find no log, as when none of its replicas
runs (the rest of the platform, the test included, still reaches it).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client
from structlog.testing import capture_logs

import gateway.bus
import gateway.feed
import servicekit.client
from contracts import subjects
from contracts.events import ChatMessage, EventType
from contracts.session_events import AppendedReply
from gateway.app import main as gateway_main
from gateway.settings import GatewaySettings
from servicekit.provenance import FORGED_EVENTS
from servicekit.sessionlog import SessionLogClient
from session_events.app import main as log_main
from session_events.settings import LogSettings
from testkit.forgeries import forged_closing, publish_forged
from testkit.probes import wait_for
from testkit.proxy import TcpProxy, through
from testkit.services import running_service

from .conftest import SECRET, Gateway, WsClient, fast

PERSON = "user:ana"
LOG_READS = (subjects.EVENTS_GET, subjects.EVENTS_LIST)


@dataclass
class LogReads:
    """The gateway's reads of the log, counted; while `away`, they find no log (NATS's
    `no responders`, which the gateway's door takes for the log's silence)."""

    away: bool = False
    asked: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)


@pytest.fixture
def log_reads(monkeypatch: pytest.MonkeyPatch) -> LogReads:
    reads = LogReads()

    async def call(nc: Client, command: Any, request: Any, *, timeout: float) -> Any:
        if command.subject in LOG_READS:
            reads.asked[command.subject] += 1
            if reads.away:
                reads.refused[command.subject] += 1
                raise nats.errors.NoRespondersError
        return await servicekit.client.call(nc, command, request, timeout=timeout)

    monkeypatch.setattr(gateway.bus, "call", call)
    return reads


@pytest_asyncio.fixture(loop_scope="session")
async def nats_link(nats_url: str) -> AsyncIterator[TcpProxy]:
    """The gateway's way to NATS, which the test can cut and restore."""
    link = TcpProxy(nats_url)
    await link.start()
    yield link
    await link.cut()


@pytest_asyncio.fixture(loop_scope="session")
async def linked(
    nats_url: str, database_url: str, nc: Client, nats_link: TcpProxy, log_reads: LogReads
) -> AsyncIterator[Gateway]:
    """The log, and the gateway reaching NATS through `nats_link`."""
    urls: list[str] = []
    async with AsyncExitStack() as stack:
        log_service = log_main(LogSettings(**fast(nats_url, database_url)))
        await stack.enter_async_context(running_service(log_service, nc, "session_events"))
        settings = GatewaySettings(
            nats_url=through(nats_url, nats_link), gateway_port=0, gateway_secret=SECRET
        )
        main = gateway_main(settings, on_listening=urls.append)
        await stack.enter_async_context(running_service(main, nc, "gateway"))
        yield Gateway(urls[0], f"p-{uuid.uuid4().hex[:8]}")


async def joined(linked: Gateway) -> tuple[uuid.UUID, WsClient, int]:
    """A new session, a socket that joined it, and the last `seq` it holds."""
    session_id = await linked.open_session()
    client = await linked.ws()
    answer = await client.request({"type": "join", "session_id": str(session_id)})
    assert answer["type"] == "ack", answer
    seq: int = answer["result"]["seq"]
    assert client.event_seqs() == list(range(1, seq + 1))
    return session_id, client, seq


async def say(nc: Client, session_id: uuid.UUID, text: str) -> AppendedReply:
    """The person's message, appended by the test (not through the gateway)."""
    log = SessionLogClient(nc)
    return await log.append(session_id, EventType.CHAT_MESSAGE, PERSON, ChatMessage(text=text))


def feed_tasks(session_id: uuid.UUID) -> list[asyncio.Task[Any]]:
    """The feed's reads of the log under way for the session (`gateway.feed`)."""
    return [t for t in asyncio.all_tasks() if t.get_name() == f"feed-{session_id}"]


async def test_an_event_the_log_did_not_answer_for_reaches_the_socket_once_the_log_answers(
    linked: Gateway, nc: Client, log_reads: LogReads
) -> None:
    session_id, client, last = await joined(linked)
    log_reads.away = True
    said = await say(nc, session_id, "is anyone there?")
    assert said.seq == last + 1
    # Behind it, a copy the log never committed: the log's silence must not let it in.
    forged = forged_closing(linked.project, session_id, seq=said.seq + 1)
    await publish_forged(nc, forged)

    # The gateway asked the log for each, as often as it asks, and heard nothing.
    await wait_for(lambda: log_reads.refused[subjects.EVENTS_GET] >= 6, what="the confirmations")
    assert client.event_seqs()[-1] == last, "shown before the log confirmed it"
    log_reads.away = False

    await wait_for(lambda: said.seq in client.event_seqs(), what="the message, from the log")
    assert client.event_seqs() == list(range(1, said.seq + 1)), "in order, each once"
    [shown] = [f["event"] for f in client.of("event") if f["event"]["seq"] == said.seq]
    assert shown["id"] == str(said.event_id)
    assert shown["payload"]["text"] == "is anyone there?"
    assert str(forged.id) not in {f["event"]["id"] for f in client.of("event")}
    await wait_for(lambda: not feed_tasks(session_id), what="the feed live again")
    await client.ws.close()


async def test_an_event_the_log_denies_is_dropped_counted_and_starts_no_read(
    linked: Gateway, nc: Client, log_reads: LogReads
) -> None:
    session_id, client, last = await joined(linked)
    listed = log_reads.asked[subjects.EVENTS_LIST]
    forged_before = FORGED_EVENTS["not_in_log"]
    forged = forged_closing(linked.project, session_id, seq=last + 1)

    await publish_forged(nc, forged)
    await wait_for(lambda: FORGED_EVENTS["not_in_log"] > forged_before, what="the log's denial")
    # The real event at that very seq is shown, and the forgery never.
    said = await say(nc, session_id, "oi")
    assert said.seq == last + 1
    await wait_for(lambda: said.seq in client.event_seqs(), what="the real event")

    assert [f["event"]["id"] for f in client.of("event")][-1] == str(said.event_id)
    assert str(forged.id) not in {f["event"]["id"] for f in client.of("event")}
    assert log_reads.asked[subjects.EVENTS_LIST] == listed, "a denial is not a gap to read"
    await client.ws.close()


async def test_events_published_while_the_gateway_was_off_nats_reach_the_socket_on_reconnect(
    linked: Gateway, nc: Client, nats_link: TcpProxy
) -> None:
    session_id, client, last = await joined(linked)

    await nats_link.cut()  # the gateway's connection drops; the log's and the test's stay
    said = [await say(nc, session_id, text) for text in ("one", "two")]
    await nats_link.start()  # nats-py reconnects by itself, on the same port

    await wait_for(lambda: said[-1].seq in client.event_seqs(), what="what was missed")
    assert client.event_seqs() == list(range(1, last + 3)), "in order, each once"
    ids = [f["event"]["id"] for f in client.of("event")][-2:]
    assert ids == [str(s.event_id) for s in said]
    # Live again: the next event comes as any other.
    after = await say(nc, session_id, "three")
    await wait_for(lambda: after.seq in client.event_seqs(), what="a live event")
    assert client.event_seqs() == list(range(1, after.seq + 1))
    await client.ws.close()


async def test_a_feed_closed_while_it_waits_for_the_log_ends_cleanly(
    linked: Gateway, nc: Client, log_reads: LogReads
) -> None:
    session_id, client, _ = await joined(linked)
    log_reads.away = True
    await say(nc, session_id, "hello?")
    await wait_for(lambda: log_reads.refused[subjects.EVENTS_LIST], what="the feed waiting")
    assert feed_tasks(session_id)

    with capture_logs() as logged:
        await client.ws.close()
        await wait_for(lambda: not feed_tasks(session_id), what="the feed's read ended")
        log_reads.away = False
        # The gateway still serves: another socket joins the session and gets it all.
        other = await linked.ws()
        answer = await other.request({"type": "join", "session_id": str(session_id)})
        assert answer["type"] == "ack", answer

    assert other.event_seqs() == list(range(1, answer["result"]["seq"] + 1))
    complaints = [e for e in logged if e["log_level"] in ("warning", "error", "critical")]
    assert complaints == [], complaints
    await other.ws.close()


async def test_a_join_while_jetstream_does_not_answer_goes_on_without_the_open_turns_deltas(
    linked: Gateway, nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A NATS node lost: the DELTAS stream elects a leader, and its reads get a 503. The
    # open turns' text so far is a nicety (its outcome carries the whole); the log's
    # events are not, and the person gets them at once instead of joining again and again.
    async def no_jetstream(self: gateway.feed.SessionFeed) -> list[Any]:
        raise nats.js.errors.ServiceUnavailableError

    session_id = await linked.open_session()
    said = await say(nc, session_id, "hello")
    monkeypatch.setattr(gateway.feed.SessionFeed, "_open_turn_deltas", no_jetstream)
    client = await linked.ws()

    with capture_logs() as logged:
        answer = await client.request({"type": "join", "session_id": str(session_id)})

    assert answer["type"] == "ack", answer
    assert client.event_seqs() == list(range(1, said.seq + 1))
    warned = [e["event"] for e in logged if e["log_level"] == "warning"]
    assert warned == ["open_turn_deltas_unread"]
    await client.ws.close()
