"""What a test reads to see an outcome: `wait_for` polls a probe until it holds, the rest
read what the bus and the databases hold."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from nats.aio.client import Client

from contracts import subjects
from contracts.session_events import EventsReply, ListEvents
from servicekit.client import call


async def wait_for(
    probe: Any, *, timeout: float = 15.0, interval: float = 0.05, what: str = "condition"
) -> Any:
    """Poll `probe()` (sync or async) until it returns something truthy; that value is returned.

    This is waiting on the effect that proves an outcome, not a sleep standing in for it.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


async def subscribed(nc: Client) -> None:
    """Return once every subscription `nc` has made is in force on the server.

    `nc.flush()` alone does not promise it (nats-py 2.16): its PING is written to the
    socket at once, ahead of the commands still queued for the client's flusher task (a
    SUB just made), and the server may send the PONG before it has read that SUB. A
    publish from another connection then finds no subscriber (`no responders`, a delta
    missed). When the first PONG is back the queue has been written, so a second PING
    goes after the SUB, and its PONG proves the server has it.
    """
    await nc.flush()
    await nc.flush()


async def stream_messages(nc: Client, stream: str, subject_filter: str) -> list[Any]:
    """Every message of `stream` on `subject_filter`, read through an ephemeral consumer."""
    js = nc.jetstream()
    info = await js.stream_info(stream, subjects_filter=subject_filter)
    total = sum((info.state.subjects or {}).values())
    if total == 0:
        return []
    sub = await js.pull_subscribe(subject_filter, stream=stream)
    try:
        msgs: list[Any] = []
        while len(msgs) < total:
            msgs.extend(await sub.fetch(total - len(msgs), timeout=5))
        for msg in msgs:
            await msg.ack()
        return msgs
    finally:
        await sub.unsubscribe()


async def log_events(nc: Client, session_id: uuid.UUID, prefix: str = "") -> list[Any]:
    """A session's events from the log (`cmd.events.list`), optionally of one type prefix."""
    reply = await call(nc, subjects.EVENTS_LIST, ListEvents(session_id=session_id), EventsReply)
    return [e for e in reply.events if e.type.value.startswith(prefix)]


async def outbox_drained(db: Any, schema: str) -> None:
    """Wait until every row a service committed to its outbox (`<schema>.outbox`) left it."""
    await wait_for(
        lambda: db.fetchval(f'SELECT count(*) = 0 FROM "{schema}".outbox'),
        what=f"the {schema} outbox to drain",
    )
