"""NATS and JetStream: connecting with a service's own identity, and the streams.

Streams and KV buckets have one owner: `provision_streams` and `provision_buckets` run
as the `provision` user (`agentbus provision`, a Job in k8s); a service only checks at
start that the streams exist as declared (`check_streams`), opens its buckets
(`Bucket.open`) and never creates either, so a deleted EVENTS is never re-created empty
behind the operator's back, and no service can reshape a bucket's stream.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    Header,
    KeyValueConfig,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from contracts import streams
from contracts.streams import BucketSpec, StreamSpec
from servicekit.logs import get_logger
from servicekit.natsconf import read_secrets
from servicekit.permissions import inbox_prefix
from servicekit.settings import ServiceSettings

log = get_logger(__name__)


@dataclass(frozen=True)
class Credentials:
    """A NATS user and its password."""

    user: str
    password: str


def credentials_for(settings: ServiceSettings, service: str) -> Credentials | None:
    """The identity `service` connects with: NATS_USER/NATS_PASSWORD, else its own entry
    in the secrets file; None leaves it to `NATS_URL` (credentials in it, or anonymous)."""
    if settings.nats_user and settings.nats_password:
        return Credentials(settings.nats_user, settings.nats_password)
    if settings.nats_secrets_file:
        password = read_secrets(Path(settings.nats_secrets_file)).get(service)
        if password:
            return Credentials(service, password)
    return None


async def connect_service(settings: ServiceSettings, service: str) -> Client:
    """`service`'s connection, with its own identity (`credentials_for`)."""
    return await connect(
        settings.nats_url, f"{service}:{settings.instance_id}", credentials_for(settings, service)
    )


def server_urls(url: str) -> list[str]:
    """The servers a `NATS_URL` names: one URL, or a cluster's URLs joined by commas
    (nats-py takes a list; the client fails over between them)."""
    return [u.strip() for u in url.split(",") if u.strip()]


def identity_options(credentials: Credentials | None) -> dict[str, str]:
    """nats-py's connect options for `credentials` (none: the URL's, or anonymous)."""
    if credentials is None:
        return {}
    return {
        "user": credentials.user,
        "password": credentials.password,
        "inbox_prefix": inbox_prefix(credentials.user),
    }


# What each client of `connect` calls once it is connected again (`on_reconnected`).
_RECONNECTED: weakref.WeakKeyDictionary[Client, list[Callable[[], None]]] = (
    weakref.WeakKeyDictionary()
)


def on_reconnected(nc: Client, listener: Callable[[], None]) -> None:
    """Call `listener` each time `nc` (a client of `connect`) is connected again.

    A core subscription misses whatever was published while its client was away (its
    server down, the client moved to another node): a reader that must not miss
    anything catches up here. nats-py calls back once it has sent every subscription
    again and the server has answered a ping sent after them, so the server holds them:
    a read started from the listener misses nothing published later. The listener runs
    on the client's reconnect path: it must be quick (start a task for any wait), and
    a failure of it is logged, never raised there.
    """
    listeners = _RECONNECTED.get(nc)
    if listeners is None:
        raise ValueError("on_reconnected: the client was not made by servicekit.bus.connect")
    listeners.append(listener)


async def stored_messages(
    nc: Client, stream: str, subject_filter: str, timeout: float
) -> list[Msg]:
    """Every message `stream` holds on `subject_filter`, oldest first, read once through
    an ephemeral consumer that acknowledges nothing, which the server drops once it has
    been idle 30 s (a stream with no message there costs no consumer). Each JetStream
    call waits at most `timeout`, and its failure is raised: what a stream that does not
    answer means is the caller's to decide."""
    js = nc.jetstream(timeout=timeout)
    info = await js.stream_info(stream, subjects_filter=subject_filter)
    total = sum((info.state.subjects or {}).values())
    if total == 0:
        return []
    sub = await js.pull_subscribe(
        subject_filter,
        stream=stream,
        config=ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.ALL,
            inactive_threshold=30.0,
        ),
    )
    messages: list[Msg] = []
    try:
        while len(messages) < total:
            messages += await sub.fetch(total - len(messages), timeout=timeout)
    finally:
        await sub.unsubscribe()
    return messages


async def connect(url: str, name: str, credentials: Credentials | None = None) -> Client:
    """A client that reconnects for ever and logs every change of connection state.

    With `credentials`, replies arrive under the user's own inbox prefix, the only
    inbox its permissions let it read. `on_reconnected` adds what it calls once
    connected again.
    """
    listeners: list[Callable[[], None]] = []

    async def on_disconnect() -> None:
        log.warning("nats_disconnected", client=name)

    async def on_reconnect() -> None:
        log.info("nats_reconnected", client=name)
        for listener in tuple(listeners):
            try:
                listener()
            except Exception as exc:  # nats-py would take it for a failed reconnect
                log.error("nats_reconnected_listener_failed", client=name, error=repr(exc))

    async def on_error(exc: Exception) -> None:
        log.warning("nats_error", client=name, error=repr(exc))

    nc = await nats.connect(
        server_urls(url),
        name=name,
        **identity_options(credentials),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
    )
    _RECONNECTED[nc] = listeners
    return nc


def stream_config(spec: StreamSpec, replicas: int = 1) -> StreamConfig:
    """The nats-py configuration of a stream declared in `contracts.streams`."""
    return StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=list(spec.subjects),
        storage=StorageType.FILE if spec.storage == "file" else StorageType.MEMORY,
        max_age=spec.max_age_seconds,
        max_bytes=spec.max_bytes,
        duplicate_window=spec.duplicate_window_seconds,
        max_msg_size=spec.max_msg_size,
        num_replicas=replicas,
        allow_atomic=spec.allow_atomic,
        allow_direct=spec.allow_direct,
    )


async def provision_streams(
    js: JetStreamContext, specs: Iterable[StreamSpec], replicas: int = 1
) -> None:
    """Create each stream, or bring it to the declared configuration; safe to run concurrently."""
    for spec in specs:
        config = stream_config(spec, replicas)
        try:
            await js.stream_info(spec.name)
        except NotFoundError:
            try:
                await js.add_stream(config)
                log.info("stream_created", stream=spec.name)
                continue
            except BadRequestError:
                pass  # another replica created it first: fall through to update
        await js.update_stream(config)


def bucket_config(spec: BucketSpec, replicas: int = 1) -> KeyValueConfig:
    """The nats-py configuration of a bucket declared in `contracts.streams`."""
    return KeyValueConfig(
        bucket=spec.name,
        description=spec.description,
        ttl=spec.ttl_seconds,
        history=spec.history,
        replicas=replicas,
    )


async def provision_buckets(
    js: JetStreamContext, specs: Iterable[BucketSpec], replicas: int = 1
) -> None:
    """Create each bucket, or bring an existing one's TTL to the declared one."""
    for spec in specs:
        try:
            await js.create_key_value(bucket_config(spec, replicas))
            log.info("bucket_created", bucket=spec.name)
        except BadRequestError:  # exists with another TTL
            info = await js.stream_info(spec.stream)
            info.config.max_age = spec.ttl_seconds
            info.config.duplicate_window = min(spec.ttl_seconds, 120.0)
            await js.update_stream(info.config)


async def provision_declared(js: JetStreamContext, replicas: int = 1) -> None:
    """Everything the services expect to find: the streams and the KV buckets declared in
    `contracts.streams` (what `agentbus provision` runs)."""
    await provision_streams(js, streams.ALL, replicas)
    await provision_buckets(js, streams.BUCKETS, replicas)


def _mismatches(spec: StreamSpec, found: StreamConfig, replicas: int) -> list[str]:
    want = stream_config(spec, replicas)
    problems = []
    for name in (
        "storage",
        "max_age",
        "max_bytes",
        "duplicate_window",
        "max_msg_size",
        "num_replicas",
    ):
        if getattr(found, name) != getattr(want, name):
            problems.append(f"{name} is {getattr(found, name)}, expected {getattr(want, name)}")
    if bool(found.allow_atomic) != spec.allow_atomic:  # the server omits it when false
        problems.append(f"allow_atomic is {bool(found.allow_atomic)}, expected {spec.allow_atomic}")
    if set(found.subjects or []) != set(want.subjects or []):
        problems.append("subjects differ from the contracts")
    return problems


async def check_streams(
    js: JetStreamContext, specs: Iterable[StreamSpec], replicas: int = 1
) -> list[str]:
    """What is wrong with the streams (missing, or configured otherwise than declared)."""
    problems: list[str] = []
    for spec in specs:
        try:
            info = await js.stream_info(spec.name)
        except NotFoundError:
            problems.append(f"{spec.name}: missing")
            continue
        problems += [f"{spec.name}: {p}" for p in _mismatches(spec, info.config, replicas)]
    return problems


class BucketNotProvisioned(RuntimeError):
    """A KV bucket a service opens does not exist: `agentbus provision` has not run."""

    code = "bucket_not_provisioned"

    def __init__(self, bucket: str) -> None:
        super().__init__(f"{self.code}: KV bucket {bucket!r} does not exist")
        self.bucket = bucket


@dataclass(frozen=True)
class Bucket:
    """A KV bucket: its reads and writes, nats-py's `KeyValue` (`kv`) where it has them and
    what it lacks beside them, so a caller never spells the bucket's stream or subjects
    itself. Every write goes through a method here: a test stands in for a cluster's
    answers by overriding them."""

    js: JetStreamContext
    name: str
    kv: KeyValue
    ttl: float  # seconds a key lives unless written again

    @classmethod
    async def open(cls, js: JetStreamContext, name: str) -> Bucket:
        """The bucket as `agentbus provision` made it, its TTL read from it; a missing one
        is `BucketNotProvisioned` (a service never creates one)."""
        try:
            kv = await js.key_value(name)
            status = await kv.status()
        except (BucketNotFoundError, NotFoundError) as exc:
            raise BucketNotProvisioned(name) from exc
        return cls(js, name, kv, status.ttl or 0.0)

    async def latest(self, key: str) -> KeyValue.Entry | None:
        """The key as the stream's leader has it; None when absent, deleted or purged.

        `kv.get` may be answered by any replica (a direct get), and one still catching up
        after a restart answers with a revision the leader has moved past: checked against
        that, a refused compare-and-set is refused again and again. Read what the
        compare-and-set was refused against: the leader's."""
        try:
            msg = await self.js.get_msg(
                f"KV_{self.name}", subject=f"$KV.{self.name}.{key}", direct=False
            )
        except NotFoundError:
            return None
        if (msg.headers or {}).get(KV_OP) in (KV_DEL, KV_PURGE):
            return None
        return KeyValue.Entry(self.name, key, msg.data, msg.seq, None, None, None)

    async def create(self, key: str, value: bytes) -> int:
        """Write `key` if it is absent (deleted or expired counts as absent); its revision.
        Refused with `KeyWrongLastSequenceError` while it is there (`KeyValue.create`)."""
        return await self.kv.create(key, value)

    async def put(self, key: str, value: bytes) -> int:
        """Write `key` whatever it holds; its new revision (`KeyValue.put`)."""
        return await self.kv.put(key, value)

    async def update(self, key: str, value: bytes, last: int) -> int:
        """Write `key` if its revision is still `last` (`KeyValue.update`); its new revision.
        Refused with `KeyWrongLastSequenceError`."""
        return await self.kv.update(key, value, last=last)

    async def delete(self, key: str, last: int | None) -> int:
        """Delete `key` if its revision is still `last` (None: whatever it is), as
        `KeyValue.delete(key, last=…)` does, and return the delete marker's revision,
        which that one does not: a caller that writes the key again next can
        compare-and-set on the marker (`kv.update(key, value, last=marker)`) in one
        round trip."""
        headers = {KV_OP: KV_DEL}
        if last is not None:
            headers[Header.EXPECTED_LAST_SUBJECT_SEQUENCE] = str(last)
        ack = await self.js.publish(f"$KV.{self.name}.{key}", b"", headers=headers)
        return ack.seq
