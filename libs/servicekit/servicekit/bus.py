"""NATS and JetStream: connection and idempotent stream provisioning."""

from __future__ import annotations

from collections.abc import Iterable

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from contracts.streams import StreamSpec
from servicekit.logs import get_logger

log = get_logger(__name__)


async def connect(url: str, name: str) -> Client:
    """A client that reconnects for ever and logs every change of connection state."""

    async def on_disconnect() -> None:
        log.warning("nats_disconnected", client=name)

    async def on_reconnect() -> None:
        log.info("nats_reconnected", client=name)

    async def on_error(exc: Exception) -> None:
        log.warning("nats_error", client=name, error=repr(exc))

    return await nats.connect(
        url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
    )


def stream_config(spec: StreamSpec, replicas: int = 1) -> StreamConfig:
    """The nats-py configuration of a stream declared in `contracts.streams`."""
    return StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=list(spec.subjects),
        storage=StorageType.FILE if spec.storage == "file" else StorageType.MEMORY,
        max_age=spec.max_age_seconds,
        duplicate_window=spec.duplicate_window_seconds,
        max_msg_size=spec.max_msg_size,
        num_replicas=replicas,
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
