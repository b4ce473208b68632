"""No one but a consumer's owner reshapes it, and no service reshapes a KV bucket's stream.

One test per form of the consumer API (the unnamed 5-token create with a durable's name
in its body, the named 6- and 7-token creates, the legacy durable create, a push
consumer delivering elsewhere) and per KV stream update, each as `ops` (and as a
service where it applies): refused, by a permissions violation or an API error, and the
consumer's or stream's config read afterwards as admin is what it was. Then what an
operator reads keeps working: stream and consumer info and lists, a message by its
sequence (the leader's copy and a direct get), a batch of direct gets the way `nats sub
--stream EVENTS --direct` asks, and following `handoff.>` live.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import catalog, streams, subjects
from contracts.events import EventType
from servicekit.consumer import ConsumerSpec
from testkit.probes import subscribed, wait_for

from .test_kit_bus_security import ConnectAs, as_user, received

EVENTS = streams.EVENTS.name
DURABLE = catalog.CRIATIVO_INPUTS.name
# A durable shaped like Criativo's inputs (servicekit cannot import the service).
INPUTS = ConsumerSpec(
    durable=DURABLE,
    stream=EVENTS,
    filter_subjects=[subjects.event_filter(EventType.CHAT_MESSAGE)],
)


async def the_durable(nc: Client) -> dict[str, Any]:
    """Criativo's durable as admin created it (or as it is now): its config, as sent."""
    await nc.jetstream().add_consumer(EVENTS, INPUTS.config())
    return await config_of(nc, f"$JS.API.CONSUMER.INFO.{EVENTS}.{DURABLE}")


async def config_of(nc: Client, info_subject: str) -> dict[str, Any]:
    reply = await nc.request(info_subject, b"", timeout=5)
    config: dict[str, Any] = json.loads(reply.data)["config"]
    config.pop("metadata", None)  # the server's own bookkeeping (API level)
    return config


def create_request(stream: str, **config: Any) -> bytes:
    return json.dumps({"stream_name": stream, "config": config}).encode()


async def refused(client: Client, violations: Any, subject: str, body: bytes) -> None:
    """`subject` refused to `client`: a permissions violation, or an API error reply."""
    try:
        reply = await client.request(subject, body, timeout=1)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        await violations.reported(subject)
        return
    assert "error" in json.loads(reply.data), reply.data


def headers_only_inputs() -> dict[str, Any]:
    """The durable's own config, plus `headers_only`: Criativo then gets no bodies."""
    config = INPUTS.config().as_dict()
    return {**config, "headers_only": True}


# (user, subject, body): each a way to reshape Criativo's durable.
DURABLE_FORMS: list[tuple[str, str, Callable[[], bytes]]] = [
    # the unnamed create takes the consumer's name from the body
    (
        "ops",
        f"$JS.API.CONSUMER.CREATE.{EVENTS}",
        lambda: create_request(
            EVENTS,
            **{k: v for k, v in headers_only_inputs().items() if k != "durable_name"},
            name=DURABLE,
        ),
    ),
    (
        "ops",
        f"$JS.API.CONSUMER.CREATE.{EVENTS}.{DURABLE}",
        lambda: create_request(EVENTS, **headers_only_inputs(), name=DURABLE),
    ),
    (
        "ops",
        f"$JS.API.CONSUMER.CREATE.{EVENTS}.{DURABLE}.chat.message.*.*",
        lambda: create_request(
            EVENTS,
            **{k: v for k, v in headers_only_inputs().items() if k != "filter_subjects"},
            name=DURABLE,
            filter_subject="chat.message.*.*",
        ),
    ),
    (
        "ops",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{EVENTS}.{DURABLE}",
        lambda: create_request(EVENTS, **headers_only_inputs()),
    ),
    # a reader's unnamed create is for its own stream only (the gateway reads DELTAS)
    (
        "gateway",
        f"$JS.API.CONSUMER.CREATE.{EVENTS}",
        lambda: create_request(
            EVENTS,
            **{k: v for k, v in headers_only_inputs().items() if k != "durable_name"},
            name=DURABLE,
        ),
    ),
    # another service's durable, by name
    (
        "psychologist",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{EVENTS}.{DURABLE}",
        lambda: create_request(EVENTS, **headers_only_inputs()),
    ),
]


@pytest.mark.parametrize(("user", "subject", "body"), DURABLE_FORMS)
async def test_no_one_else_reshapes_a_services_durable(
    connect_as: ConnectAs, nc: Client, user: str, subject: str, body: Callable[[], bytes]
) -> None:
    before = await the_durable(nc)
    client, violations = await as_user(connect_as, user)

    await refused(client, violations, subject, body())

    after = await config_of(nc, f"$JS.API.CONSUMER.INFO.{EVENTS}.{DURABLE}")
    assert after == before
    assert not after.get("headers_only")


PUSH_FORMS = [
    f"$JS.API.CONSUMER.CREATE.{EVENTS}",
    f"$JS.API.CONSUMER.CREATE.{EVENTS}.ops-view",
    f"$JS.API.CONSUMER.CREATE.{EVENTS}.ops-view.chat.message.*.*",
]


@pytest.mark.parametrize("subject", PUSH_FORMS)
async def test_ops_cannot_push_a_stream_to_a_subject_of_its_choice(
    connect_as: ConnectAs, nc: Client, subject: str
) -> None:
    ops, violations = await as_user(connect_as, "ops")
    # a session feed's subject: the gateway would relay what arrives there
    target = "x.y.bakery.s1"
    delivered = await received(nc, target)
    await nc.jetstream().publish(
        subjects.event_subject(EventType.CHAT_MESSAGE, "other", uuid.uuid4()), b"{}"
    )
    config: dict[str, Any] = {"deliver_subject": target, "ack_policy": "none"}
    if subject.count(".") >= 5:
        config["name"] = "ops-view"
    if subject.endswith("*.*"):
        config["filter_subject"] = "chat.message.*.*"

    await refused(ops, violations, subject, create_request(EVENTS, **config))

    names = await nc.jetstream().consumers_info(EVENTS)
    assert [c.name for c in names] == []
    await nc.flush()
    assert delivered == []


# (user, bucket stream's reshaping): `subjects` would capture, `republish` re-send.
KV_RESHAPES = [("criativo", "subjects"), ("criativo", "republish"), ("ops", "republish")]


@pytest.mark.parametrize(("user", "reshape"), KV_RESHAPES)
async def test_no_service_or_operator_reshapes_a_buckets_stream(
    connect_as: ConnectAs, nc: Client, user: str, reshape: str
) -> None:
    kv_stream = streams.LEASES.stream
    info_subject = f"$JS.API.STREAM.INFO.{kv_stream}"
    before = json.loads((await nc.request(info_subject, b"", timeout=5)).data)["config"]
    config = dict(before)
    if reshape == "subjects":
        config["subjects"] = [*before["subjects"], "captured.>"]
    else:
        config["republish"] = {"src": ">", "dest": "x.y.bakery.s1"}
    client, violations = await as_user(connect_as, user)

    await refused(
        client, violations, f"$JS.API.STREAM.UPDATE.{kv_stream}", json.dumps(config).encode()
    )

    after = json.loads((await nc.request(info_subject, b"", timeout=5)).data)["config"]
    assert after == before


async def test_a_service_opens_its_bucket_and_writes_keys_without_reshaping_it(
    connect_as: ConnectAs,
) -> None:
    criativo, violations = await as_user(connect_as, "criativo")
    kv = await criativo.jetstream().key_value(streams.LEASES.name)

    revision = await kv.put("some-session", b"replica-a")

    assert (await kv.get("some-session")).revision == revision
    assert violations.errors == []


async def published_events(nc: Client, count: int) -> list[tuple[str, int]]:
    """`count` handoff events published (as the log would), with their sequences."""
    out = []
    for n in range(count):
        subject = subjects.event_subject(EventType.HANDOFF_OFFERED, "bakery", uuid.uuid4())
        ack = await nc.jetstream().publish(subject, json.dumps({"n": n}).encode())
        out.append((subject, ack.seq))
    return out


async def test_ops_reads_stream_and_consumer_info_and_lists(
    connect_as: ConnectAs, nc: Client
) -> None:
    await the_durable(nc)
    ops, violations = await as_user(connect_as, "ops")
    js = ops.jetstream()

    assert {s.config.name for s in await js.streams_info()} >= {s.name for s in streams.ALL}
    assert (await js.stream_info(EVENTS)).config.allow_direct
    assert (await js.consumer_info(EVENTS, DURABLE)).name == DURABLE
    assert [c.name for c in await js.consumers_info(EVENTS)] == [DURABLE]
    assert violations.errors == []


async def test_ops_gets_a_message_by_its_sequence_from_the_leader_and_directly(
    connect_as: ConnectAs, nc: Client
) -> None:
    [(subject, seq)] = await published_events(nc, 1)
    ops, violations = await as_user(connect_as, "ops")

    stored = await ops.jetstream().get_msg(EVENTS, seq)
    direct = await ops.jetstream().get_msg(EVENTS, seq, direct=True)

    assert (stored.subject, stored.data) == (subject, b'{"n": 0}')
    assert (direct.subject, direct.data) == (subject, b'{"n": 0}')
    assert violations.errors == []


async def test_ops_replays_a_stream_in_batches_of_direct_gets(
    connect_as: ConnectAs, nc: Client
) -> None:
    """What `nats sub --stream EVENTS --direct 'handoff.>' --all` asks: a batch of direct
    gets from a sequence, ended by a 204 status."""
    sent = await published_events(nc, 3)
    ops, violations = await as_user(connect_as, "ops")
    inbox = ops.new_inbox()
    got: list[Msg] = []
    ended = asyncio.Event()

    async def keep(msg: Msg) -> None:
        if (msg.headers or {}).get("Status") == "204":
            ended.set()
        else:
            got.append(msg)

    await ops.subscribe(inbox, cb=keep)
    await subscribed(ops)
    request = {"seq": 1, "batch": 10, "next_by_subj": "handoff.>"}
    await ops.publish(f"$JS.API.DIRECT.GET.{EVENTS}", json.dumps(request).encode(), reply=inbox)

    await asyncio.wait_for(ended.wait(), 10)
    assert [(m.headers or {}).get("Nats-Subject") for m in got] == [s for s, _ in sent]
    assert violations.errors == []


async def test_ops_follows_handoff_events_live(connect_as: ConnectAs, nc: Client) -> None:
    ops, violations = await as_user(connect_as, "ops")
    followed: list[Msg] = []

    async def keep(msg: Msg) -> None:
        followed.append(msg)

    await ops.subscribe("handoff.>", cb=keep)
    await subscribed(ops)

    [(subject, _)] = await published_events(nc, 1)

    await wait_for(lambda: followed, what="ops to see the handoff event")
    assert followed[0].subject == subject
    assert violations.errors == []
