"""The NATS permissions derived from the contracts (`servicekit.permissions`), table-driven.

Each row names a user, a subject and whether the user may publish (or subscribe) on it,
decided with NATS's own subject matching (`*` one token, `>` the rest), deny over allow.
"""

from __future__ import annotations

import pytest

from contracts import catalog, subjects
from contracts.events import EventType
from servicekit.permissions import (
    ADMIN,
    OPS,
    PROVISION,
    SERVICES,
    SYSTEM,
    USERS,
    Permissions,
    permissions_of,
    readers_hold_no_durable,
)


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a final `>` one or more."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def may_publish(perms: Permissions, subject: str) -> bool:
    allowed = any(matches(p, subject) for p in perms.publish)
    return allowed and not any(matches(p, subject) for p in perms.publish_deny)


def may_subscribe(perms: Permissions, subject: str) -> bool:
    return any(matches(p, subject) for p in perms.subscribe)


def perms(user: str) -> Permissions:
    found = permissions_of(user)
    assert found is not None
    return found


CLOSED = subjects.event_subject(EventType.SESSION_CLOSED, "p", "s")
CHAT = subjects.event_subject(EventType.CHAT_MESSAGE, "p", "s")
DELTA = subjects.delta_subject("p", "s")
DONE = subjects.done_subject("p", "s")

PUBLISH = [
    # the gateway: commands a person's actions become, never events nor the provider
    ("gateway", subjects.EVENTS_APPEND, True),
    ("gateway", subjects.SESSIONS_OPEN, True),
    ("gateway", subjects.LLM_CANCEL, True),
    ("gateway", subjects.LLM_TURN, False),
    ("gateway", subjects.LLM_STREAM, False),
    ("gateway", subjects.BINDINGS_RESOLVE, False),
    # who may spend, and on which model, is an operator's to set, never a token's
    ("gateway", subjects.BINDINGS_SET, False),
    ("gateway", subjects.LIMITS_SET, False),
    ("gateway", subjects.LIMITS_STATUS, True),
    ("criativo", subjects.LIMITS_SET, False),
    ("psychologist", subjects.LIMITS_SET, False),
    ("psychologist", subjects.LIMITS_STATUS, True),
    ("gateway", CLOSED, False),
    ("gateway", CHAT, False),
    ("gateway", DELTA, False),
    ("gateway", "$JS.API.STREAM.DELETE.EVENTS", False),
    ("gateway", "$JS.API.CONSUMER.CREATE.DELTAS", True),
    ("gateway", "$JS.API.CONSUMER.CREATE.EVENTS.criativo-inputs", False),
    # metering's micro info (which provider: the "offline model" notice), no one else's
    ("gateway", "$SRV.INFO.metering", True),
    ("gateway", "$SRV.INFO", False),
    ("gateway", "$SRV.INFO.criativo", False),
    ("gateway", "$SRV.STATS.metering", False),
    # the log alone publishes events
    ("session_events", CLOSED, True),
    ("session_events", CHAT, True),
    ("session_events", subjects.LLM_TURN, False),
    ("session_events", "$JS.API.STREAM.CREATE.EVENTS", False),
    ("session_events", "$JS.API.STREAM.INFO.EVENTS", True),
    # agents spend through metering, append through the log, never publish events
    ("criativo", subjects.LLM_STREAM, True),
    ("criativo", subjects.EVENTS_APPEND, True),
    ("criativo", subjects.HANDOFFS_OFFER, True),
    ("criativo", subjects.BINDINGS_SET, False),
    ("criativo", CHAT, False),
    ("criativo", DONE, True),
    ("criativo", DELTA, False),
    ("criativo", "$JS.API.CONSUMER.MSG.NEXT.EVENTS.criativo-inputs", True),
    ("criativo", "$JS.ACK.EVENTS.criativo-inputs.1.2.3.4.5.6.7", True),
    ("criativo", "$JS.API.CONSUMER.MSG.NEXT.EVENTS.psychologist-session-closings", False),
    ("criativo", "$JS.ACK.EVENTS.handoff-session-closings.1.2.3.4.5.6.7", False),
    ("criativo", "deadletter.criativo-inputs", True),
    ("criativo", "deadletter.handoff-session-closings", False),
    # a bucket's user writes keys; `provision` alone makes and shapes its stream
    ("criativo", "$JS.API.STREAM.CREATE.KV_criativo_leases", False),
    ("criativo", "$JS.API.STREAM.UPDATE.KV_criativo_leases", False),
    ("criativo", "$JS.API.STREAM.INFO.KV_criativo_leases", True),
    # its own durable, created again when it drifted beyond an update; no one else's
    ("criativo", "$JS.API.CONSUMER.DELETE.EVENTS.criativo-inputs", True),
    ("criativo", "$JS.API.CONSUMER.DELETE.EVENTS.handoff-session-closings", False),
    ("criativo", "$JS.API.CONSUMER.CREATE.EVENTS", False),
    ("criativo", "$KV.criativo_leases.some-session", True),
    ("criativo", "$JS.API.STREAM.CREATE.EVENTS", False),
    ("criativo", "$JS.API.STREAM.DELETE.KV_criativo_leases", False),
    # a lease's holder is asked whether it lives, by Criativo's replicas only
    ("criativo", subjects.holder_subject("some-process"), True),
    ("gateway", subjects.holder_subject("some-process"), False),
    ("psychologist", subjects.LLM_TURN, True),
    ("psychologist", subjects.EVENTS_QUERY, True),
    ("psychologist", subjects.HANDOFFS_ACCEPT, False),
    ("psychologist", "$JS.API.CONSUMER.CREATE.EVENTS.psychologist-session-closings", True),
    ("handoff", subjects.EVENTS_APPEND, True),
    ("handoff", subjects.LLM_TURN, False),
    ("handoff", "$JS.API.CONSUMER.CREATE.EVENTS.handoff-session-closings", True),
    # a probe in the service's pod pings its own replicas, no one else's
    ("handoff", "$SRV.PING.handoff", True),
    ("handoff", "$SRV.PING.metering", False),
    ("handoff", "$SRV.INFO", False),
    # metering: deltas (only there), its notices; it calls nobody
    ("metering", DELTA, True),
    ("metering", DONE, False),
    ("metering", subjects.EVENTS_APPEND, False),
    ("metering", subjects.BINDINGS_CHANGED, True),
    # a stream's beat: metering's to publish (its caller only listens)
    ("metering", subjects.alive_subject("k1"), True),
    ("criativo", subjects.alive_subject("k1"), False),
    # ops: reads and looks, never deletes, purges, creates streams or takes a durable
    (OPS, "$JS.API.STREAM.INFO.EVENTS", True),
    (OPS, "$JS.API.STREAM.LIST", True),
    (OPS, "$JS.API.CONSUMER.INFO.EVENTS.criativo-inputs", True),
    (OPS, "$JS.API.DIRECT.GET.EVENTS", True),
    (OPS, "$JS.API.STREAM.MSG.GET.EVENTS", True),
    (OPS, "$JS.API.CONSUMER.LIST.EVENTS", True),
    # no consumer at all: the unnamed create names it in its body, any can push anywhere
    (OPS, "$JS.API.CONSUMER.CREATE.EVENTS", False),
    (OPS, "$JS.API.CONSUMER.CREATE.EVENTS.ephemeral123", False),
    (OPS, "$JS.API.CONSUMER.CREATE.EVENTS.ephemeral123.chat.message.*.*", False),
    (OPS, "$JS.API.CONSUMER.DURABLE.CREATE.EVENTS.anything", False),
    (OPS, "$JS.API.CONSUMER.MSG.NEXT.EVENTS.anything", False),
    (OPS, "$JS.API.CONSUMER.PAUSE.EVENTS.criativo-inputs", False),
    (OPS, "$JS.API.STREAM.UPDATE.KV_criativo_leases", False),
    (OPS, "$SRV.PING", True),
    (OPS, "$SRV.STATS.metering", True),
    (OPS, "$JS.API.STREAM.DELETE.EVENTS", False),
    (OPS, "$JS.API.STREAM.PURGE.EVENTS", False),
    (OPS, "$JS.API.STREAM.CREATE.EVENTS", False),
    (OPS, "$JS.API.STREAM.UPDATE.EVENTS", False),
    (OPS, "$JS.API.STREAM.MSG.DELETE.EVENTS", False),
    (OPS, "$JS.API.CONSUMER.DELETE.EVENTS.criativo-inputs", False),
    (OPS, "$JS.API.CONSUMER.CREATE.EVENTS.criativo-inputs", False),
    (OPS, "$JS.API.CONSUMER.MSG.NEXT.EVENTS.handoff-session-closings", False),
    (OPS, CLOSED, False),
    (OPS, subjects.LLM_TURN, False),
    (OPS, subjects.LIMITS_SET, True),
    (OPS, subjects.LIMITS_STATUS, True),
    (OPS, subjects.BINDINGS_SET, True),
    # provision: the streams, nothing else
    (PROVISION, "$JS.API.STREAM.CREATE.EVENTS", True),
    (PROVISION, "$JS.API.STREAM.UPDATE.DELTAS", True),
    (PROVISION, "$JS.API.STREAM.DELETE.DEADLETTERS", True),
    (PROVISION, "$JS.API.STREAM.DELETE.SOMEONE_ELSES", False),
    (PROVISION, "$JS.API.STREAM.CREATE.KV_criativo_leases", True),
    (PROVISION, "$JS.API.STREAM.UPDATE.KV_criativo_leases", True),
    (PROVISION, CLOSED, False),
    (PROVISION, subjects.SESSIONS_OPEN, False),
]


@pytest.mark.parametrize(("user", "subject", "allowed"), PUBLISH)
def test_who_may_publish_what(user: str, subject: str, allowed: bool) -> None:
    assert may_publish(perms(user), subject) is allowed


SUBSCRIBE = [
    ("session_events", subjects.EVENTS_APPEND, True),
    ("session_events", "_INBOX_session_events.abc.def", True),
    ("session_events", "$SRV.PING.session_events", True),
    ("session_events", "$SRV.PING.metering", False),
    ("metering", subjects.LLM_TURN, True),
    ("metering", subjects.EVENTS_APPEND, False),
    ("metering", subjects.TURN_CANCELLED, True),
    ("gateway", CHAT, True),
    ("gateway", DELTA, True),
    ("gateway", "*.*.bakery.some-session", True),
    ("gateway", subjects.LLM_TURN, False),
    ("gateway", subjects.TURN_CANCELLED, False),
    ("gateway", "$KV.criativo_leases.some-session", False),
    ("gateway", "deadletter.criativo-inputs", False),
    # nobody reads another user's replies: no `_INBOX.>` anywhere
    ("gateway", "_INBOX.abc", False),
    ("gateway", "_INBOX_metering.abc", False),
    ("criativo", "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.EVENTS.criativo-inputs", True),
    (
        "criativo",
        "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.EVENTS.handoff-session-closings",
        False,
    ),
    ("criativo", CHAT, False),  # it consumes through its durable, not a core subscription
    ("criativo", DELTA, False),  # it never reads a delta: a stream's beat is its liveness
    ("criativo", subjects.alive_subject("k1"), True),  # (harness.client), never to publish
    ("criativo", subjects.holder_subject("some-process"), True),  # answers for its leases
    ("gateway", subjects.holder_subject("some-process"), False),
    (OPS, CLOSED, True),
    (OPS, "handoff.>", True),
    (OPS, "session.>", True),
    (OPS, "deadletter.criativo-inputs", True),
    (OPS, "_INBOX_ops.x", True),
    (OPS, "_INBOX_gateway.x", False),
    (OPS, subjects.SESSIONS_OPEN, False),
    (PROVISION, CLOSED, False),
]


@pytest.mark.parametrize(("user", "subject", "allowed"), SUBSCRIBE)
def test_who_may_subscribe_to_what(user: str, subject: str, allowed: bool) -> None:
    assert may_subscribe(perms(user), subject) is allowed


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_serves_exactly_its_commands_and_no_other(service: str) -> None:
    p = perms(service)
    for command in catalog.COMMANDS:
        assert may_subscribe(p, command.subject) is (command.service == service), command.subject


@pytest.mark.parametrize("user", [u for u in USERS if u not in (ADMIN, SYSTEM)])
def test_every_restricted_user_has_its_own_inbox_and_no_wildcard(user: str) -> None:
    p = perms(user)
    assert may_subscribe(p, f"_INBOX_{user}.anything")
    assert not any(s in (">", "_INBOX.>", "*.>") for s in p.subscribe + p.publish)


def test_every_call_is_a_declared_command_and_every_service_has_a_user() -> None:
    declared = {c.subject for c in catalog.COMMANDS}
    for access in catalog.ACCESS:
        assert set(access.calls) <= declared, access.service
    assert {c.service for c in catalog.COMMANDS} <= set(SERVICES)


def test_only_the_log_publishes_events_and_only_metering_deltas() -> None:
    for service in SERVICES:
        assert may_publish(perms(service), CLOSED) is (service == "session_events")
        assert may_publish(perms(service), DELTA) is (service == "metering")


def test_admin_and_sys_are_unrestricted() -> None:
    assert permissions_of(ADMIN) is None
    assert permissions_of(SYSTEM) is None
    with pytest.raises(KeyError):
        permissions_of("nobody")


def test_a_reader_never_reads_a_stream_holding_a_durable() -> None:
    """The unnamed create a reader uses could reconfigure any consumer of its stream."""
    reader = catalog.Access("reader", reads=(catalog.CRIATIVO_INPUTS.stream,))

    with pytest.raises(ValueError, match="criativo-inputs"):
        readers_hold_no_durable([*catalog.ACCESS, reader])
    readers_hold_no_durable(catalog.ACCESS)
