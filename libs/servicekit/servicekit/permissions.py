"""Each NATS user's permissions, derived from what the contracts declare (a pure module).

The invariants it keeps (docs/architecture.md, "Who may use the bus"):
- one user per service, named after it; it may subscribe to the commands it serves
  and publish to the commands it calls, the subjects it publishes and its own
  JetStream consumers' API — nothing else;
- replies go back through `allow_responses`, and every user's own inbox is
  `_INBOX_<user>.>`: no user can read the replies meant for another; a request's
  grant to reply lasts `REPLY_GRANT_SECONDS`, longer than any caller waits;
- only metering publishes deltas' text, only the log publishes events; the gateway
  publishes neither and cannot call `cmd.llm.turn|stream`;
- `ops` reads streams and consumers, talks to `$SRV` and follows events, and creates
  no consumer at all: the unnamed create (`$JS.API.CONSUMER.CREATE.<stream>`) takes the
  consumer's name from the request's body, so a subject permission cannot keep it off
  a service's durable, and any consumer can be made a push consumer delivering the
  stream to any subject. It reads messages by (direct) get, and follows core subjects;
- a service creates and updates only its own durables, by name; a service that reads a
  stream through unnamed consumers of its own reads one where no service has a durable;
- `provision` alone creates, updates and deletes the agentbus streams and KV buckets
  (a bucket's owner writes keys, but cannot reshape its stream: `subjects` or
  `republish` could capture or inject other traffic);
- `admin` (tests and the local operator's tools) is unrestricted; `sys` is the
  system account's user, for `nats server report`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contracts import catalog, streams, subjects
from contracts.catalog import Access
from contracts.events import EventType
from contracts.metering import TURN_TIMEOUT_SECONDS

OPS = "ops"
PROVISION = "provision"
ADMIN = "admin"
SYSTEM = "sys"
SERVICES = [a.service for a in catalog.ACCESS]
# Every user of the application account, then the system account's.
APP_USERS = [*SERVICES, OPS, PROVISION, ADMIN]
USERS = [*APP_USERS, SYSTEM]

JS_API = "$JS.API"
# How long after a request its receiver may still answer it. nats-server's grant for
# `allow_responses: true` is one reply within 2 minutes: a model turn that took longer
# had its reply refused as a permissions violation, its caller left waiting for the
# reply metering had billed and stored. The longest wait is a model turn's; the margin
# covers a reply's queueing behind the turn's last deltas. One reply per request, as
# the server's default.
REPLY_GRANT_SECONDS = int(TURN_TIMEOUT_SECONDS) + 60
STREAM_NAMES = [s.name for s in streams.ALL]


@dataclass(frozen=True)
class Permissions:
    """One user's allow (and deny) lists; `None` as a whole means unrestricted."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    allow_responses: bool = True

    def as_config(self) -> dict[str, Any]:
        """The `permissions` block of a nats-server user."""
        publish: dict[str, Any] = {"allow": list(self.publish)}
        if self.publish_deny:
            publish["deny"] = list(self.publish_deny)
        config: dict[str, Any] = {"publish": publish, "subscribe": {"allow": list(self.subscribe)}}
        if self.allow_responses:
            config["allow_responses"] = {"max": 1, "expires": f"{REPLY_GRANT_SECONDS}s"}
        return config


def inbox_prefix(user: str) -> str:
    """Where `user`'s replies arrive (nats-py's `inbox_prefix`, the CLI's `--inbox-prefix`)."""
    return f"_INBOX_{user}"


def _unique(items: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def durable_api(durable: catalog.Durable) -> list[str]:
    """What a consumer's owner publishes to create, read and acknowledge it."""
    s, d = durable.stream, durable.name
    return [
        f"{JS_API}.CONSUMER.CREATE.{s}.{d}",
        f"{JS_API}.CONSUMER.CREATE.{s}.{d}.>",
        f"{JS_API}.CONSUMER.DURABLE.CREATE.{s}.{d}",
        f"{JS_API}.CONSUMER.INFO.{s}.{d}",
        # to create it again when it drifted in a way no update can undo (servicekit.drift)
        f"{JS_API}.CONSUMER.DELETE.{s}.{d}",
        f"{JS_API}.CONSUMER.MSG.NEXT.{s}.{d}",
        f"$JS.ACK.{s}.{d}.>",
        # the message a MAX_DELIVERIES advisory names, to record it as a dead letter
        f"{JS_API}.STREAM.MSG.GET.{s}",
        f"{JS_API}.DIRECT.GET.{s}",
        subjects.dead_letter_subject(d),
    ]


def durable_advisories(durable: catalog.Durable) -> list[str]:
    s, d = durable.stream, durable.name
    return [
        f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{s}.{d}",
        f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{s}.{d}",
    ]


def reader_api(stream: str) -> list[str]:
    """Short-lived consumers of the reader's own on `stream`, which holds no durable (the
    unnamed create cannot be kept off one: `readers_hold_no_durable`)."""
    return [
        f"{JS_API}.CONSUMER.CREATE.{stream}",
        f"{JS_API}.CONSUMER.CREATE.{stream}.>",
        f"{JS_API}.CONSUMER.INFO.{stream}.*",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.*",
        f"{JS_API}.CONSUMER.DELETE.{stream}.*",
    ]


def bucket_api(bucket: str) -> list[str]:
    """A KV bucket's user: open it, read and write its keys (`provision` creates it)."""
    kv = f"KV_{bucket}"
    return [
        f"{JS_API}.STREAM.INFO.{kv}",
        f"{JS_API}.STREAM.MSG.GET.{kv}",
        f"{JS_API}.DIRECT.GET.{kv}",
        f"{JS_API}.DIRECT.GET.{kv}.>",
        f"$KV.{bucket}.>",
    ]


def micro_subjects(service: str) -> list[str]:
    """The `$SRV` discovery subjects a service answers (`nats micro ls|info|stats`)."""
    return [
        f"$SRV.{verb}{suffix}"
        for verb in ("PING", "INFO", "STATS")
        for suffix in ("", f".{service}", f".{service}.*")
    ]


def readers_hold_no_durable(accesses: list[Access]) -> None:
    """Refuse a catalog where a service reads, through unnamed consumers, a stream on which
    a service has a durable: the unnamed create could reconfigure that durable."""
    durable_streams = {d.stream: d.name for a in accesses for d in a.durables}
    for access in accesses:
        for stream in access.reads:
            if stream in durable_streams:
                raise ValueError(
                    f"{access.service} reads {stream} through unnamed consumers, which could "
                    f"reconfigure the durable {durable_streams[stream]!r}: read it by get"
                )


def service_permissions(access: Access) -> Permissions:
    """A service's user: what it serves, calls, publishes and consumes, and no more."""
    readers_hold_no_durable(catalog.ACCESS)
    publish = [
        *access.calls,
        *access.publishes,
        # the probe in its own pod (`agentbus ping <service>`) pings its own replicas
        f"$SRV.PING.{access.service}",
        # the start-up check that the streams exist as declared
        f"{JS_API}.INFO",
        *(f"{JS_API}.STREAM.INFO.{name}" for name in STREAM_NAMES),
        *(f"$SRV.INFO.{service}" for service in access.info_of),
    ]
    subscribe = [
        *catalog.served_by(access.service),
        *access.subscribes,
        f"{inbox_prefix(access.service)}.>",
        *micro_subjects(access.service),
    ]
    for durable in access.durables:
        publish += durable_api(durable)
        subscribe += durable_advisories(durable)
    for stream in access.reads:
        publish += reader_api(stream)
    for bucket in access.buckets:
        publish += bucket_api(bucket)
    return Permissions(_unique(publish), _unique(subscribe))


# What no `ops` request may do, denied over the allow list below in case it ever widens.
OPS_DENIED = [
    *(f"{JS_API}.STREAM.{verb}.>" for verb in ("CREATE", "UPDATE", "DELETE", "PURGE")),
    f"{JS_API}.STREAM.MSG.DELETE.>",
    f"{JS_API}.CONSUMER.CREATE.>",
    f"{JS_API}.CONSUMER.DURABLE.CREATE.>",
    f"{JS_API}.CONSUMER.DELETE.>",
    f"{JS_API}.CONSUMER.MSG.NEXT.>",
    f"{JS_API}.CONSUMER.PAUSE.>",
]


def ops_permissions() -> Permissions:
    """Read-only, for the NATS CLI: stream and consumer info, messages by (direct) get,
    `$SRV`, and following the live subjects. No consumer of its own (module docstring)."""
    publish = [
        f"{JS_API}.INFO",
        f"{JS_API}.STREAM.NAMES",
        f"{JS_API}.STREAM.LIST",
        f"{JS_API}.STREAM.INFO.*",
        # `nats stream get`: the leader's copy, or any replica's (`allow_direct`)
        f"{JS_API}.STREAM.MSG.GET.*",
        # `nats sub --stream EVENTS --direct …`: batched direct gets, no consumer
        f"{JS_API}.DIRECT.GET.>",
        f"{JS_API}.CONSUMER.NAMES.*",
        f"{JS_API}.CONSUMER.LIST.*",
        f"{JS_API}.CONSUMER.INFO.*.*",
        "$SRV.>",
        # who may spend, on which model: the operator reads and sets bindings and limits
        *catalog.OPERATOR_COMMANDS,
    ]
    # by domain, as an operator types it: `nats sub 'handoff.>'`
    domains = [f"{t.value.split('.')[0]}.>" for t in EventType]
    subscribe = [
        f"{inbox_prefix(OPS)}.>",
        *domains,
        *catalog.EVERY_DELTA,
        f"{subjects.DEAD_LETTER_PREFIX}.>",
        "$JS.EVENT.>",
    ]
    return Permissions(_unique(publish), _unique(subscribe), _unique(OPS_DENIED))


def provision_permissions() -> Permissions:
    """The one user that creates, updates and deletes the agentbus streams and buckets."""
    publish = [f"{JS_API}.INFO", f"{JS_API}.STREAM.NAMES", f"{JS_API}.STREAM.LIST"]
    for name in [*STREAM_NAMES, *(b.stream for b in streams.BUCKETS)]:
        publish += [
            f"{JS_API}.STREAM.{verb}.{name}" for verb in ("CREATE", "UPDATE", "DELETE", "INFO")
        ]
    return Permissions(_unique(publish), (f"{inbox_prefix(PROVISION)}.>",), allow_responses=False)


def permissions_of(user: str) -> Permissions | None:
    """`user`'s permissions; None for the unrestricted ones (`admin`, `sys`)."""
    if user in SERVICES:
        return service_permissions(catalog.access_of(user))
    if user == OPS:
        return ops_permissions()
    if user == PROVISION:
        return provision_permissions()
    if user in (ADMIN, SYSTEM):
        return None
    raise KeyError(f"unknown NATS user {user!r}")
