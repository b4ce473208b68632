"""A durable consumer kept as its service declares it (`ConsumerSpec.config()`).

Anyone who could create or update a consumer (`admin`, a mistake, a future grant) could
reshape a service's durable in place: `headers_only` starves the handler of bodies, a
`deliver_subject` pushes the stream elsewhere, an `inactive_threshold` deletes it while
the service is down. The owner compares the consumer with its declaration when it starts
and every `ConsumerSpec.drift_check_seconds`, logs which fields differ, counts it
(`agentbus_consumer_drift_total{consumer}`) and puts it back:
- in place (an update with the declared config) when the server allows it;
- otherwise (the fields in `RECREATED`, which the server refuses to update, so whoever
  set them deleted the consumer and made one of that name) by deleting it and creating
  it again as declared, from the declared start: the impostor's ack floor says nothing
  of what the service handled, so everything is delivered again and the handlers'
  idempotency (`claim_once`) skips what was done.
Where a consumer starts (`deliver_policy`, `opt_start_*`) only matters when it is
created, and cannot be updated: it is kept as found, never compared.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig

from servicekit.logs import get_logger
from servicekit.metrics import CONSUMER_DRIFT

log = get_logger(__name__)

JS_API = "$JS.API"
# Fields (as the server spells them) a declaration leaves unset that change what the
# consumer delivers, to whom, or how long it lives; each must be unset on the server too.
# Read from the server's own answer: nats-py's ConsumerConfig drops the pull limits.
MUST_BE_UNSET = (
    "deliver_subject",
    "deliver_group",
    "headers_only",
    "flow_control",
    "idle_heartbeat",
    "rate_limit_bps",
    "sample_freq",
    "inactive_threshold",
    "max_batch",
    "max_expires",
    "max_bytes",
    "mem_storage",
    "priority_groups",
    "priority_policy",
)
# Fields compared with the declaration whenever it sets them.
DECLARED = (
    "ack_policy",
    "ack_wait",
    "max_deliver",
    "backoff",
    "max_ack_pending",
    "max_waiting",
    "replay_policy",
)
# What the server refuses to update in place (nats-server `checkNewConsumerConfig`).
RECREATED = frozenset(
    {
        "deliver_subject",
        "flow_control",
        "idle_heartbeat",
        "mem_storage",
        "ack_policy",
        "replay_policy",
        "max_waiting",
    }
)


def _unset(value: Any) -> bool:
    """Whether the server's value means "not set" (it omits, or says none)."""
    return value in (None, False, 0, "", "none", [], {})


def _filters(config: dict[str, Any]) -> list[str]:
    """What a consumer filters on: the server keeps a lone filter as `filter_subject`."""
    lone = config.get("filter_subject")
    return sorted(config.get("filter_subjects") or ([lone] if lone else []))


def drift(declared: ConsumerConfig, found: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The fields where `found` (the server's config, as it sends it) differs from
    `declared`: name → (found, declared)."""
    wanted = declared.as_dict()
    differ: dict[str, tuple[Any, Any]] = {}
    if _filters(found) != _filters(wanted):
        differ["filter_subjects"] = (_filters(found), _filters(wanted))
    for name in MUST_BE_UNSET:
        if not _unset(found.get(name)):
            differ[name] = (found[name], None)
    for name in DECLARED:
        want = wanted.get(name)
        if _unset(want):
            continue  # the server's default
        if found.get(name) != want:
            differ[name] = (found.get(name), want)
    return differ


def repaired(declared: ConsumerConfig, found: dict[str, Any]) -> ConsumerConfig:
    """The declared config, starting where the consumer found starts: where a consumer
    starts only matters when it is created, and an update may not move it."""
    start = ConsumerConfig.from_response(dict(found))
    return dataclasses.replace(
        declared,
        deliver_policy=start.deliver_policy,
        opt_start_seq=start.opt_start_seq,
        opt_start_time=start.opt_start_time,
    )


async def consumer_state(nc: Client, stream: str, durable: str) -> dict[str, Any] | None:
    """The consumer's info as the server sends it; None when there is no such consumer."""
    reply = await nc.request(f"{JS_API}.CONSUMER.INFO.{stream}.{durable}", b"", timeout=5)
    info: dict[str, Any] = json.loads(reply.data)
    error = info.get("error")
    if error is None:
        return info
    if error.get("err_code") == 10014:  # consumer not found
        return None
    raise RuntimeError(f"consumer info of {stream}/{durable}: {error}")


def _shown(differ: dict[str, tuple[Any, Any]]) -> dict[str, dict[str, str]]:
    return {k: {"found": repr(f), "declared": repr(d)} for k, (f, d) in differ.items()}


async def keep_declared(
    nc: Client, js: JetStreamContext, stream: str, declared: ConsumerConfig
) -> bool:
    """Create the durable if it is missing, or put it back to `declared` if it drifted;
    whether it had drifted."""
    durable = declared.durable_name
    assert durable is not None
    info = await consumer_state(nc, stream, durable)
    if info is None:
        await js.add_consumer(stream, declared)
        return False
    differ = drift(declared, info["config"])
    if not differ:
        return False
    CONSUMER_DRIFT.labels(durable).inc()
    recreate = sorted(RECREATED & differ.keys())
    log.error(
        "consumer_drift",
        consumer=durable,
        stream=stream,
        fields=_shown(differ),
        repair="recreate" if recreate else "update",
        why=f"{', '.join(recreate)} cannot be updated in place" if recreate else None,
    )
    if not recreate:
        await js.add_consumer(stream, repaired(declared, info["config"]))
        return True
    # Read it again just before deleting: another replica may have put it back already.
    info = await consumer_state(nc, stream, durable)
    if info is None:
        await js.add_consumer(stream, declared)
    elif RECREATED & drift(declared, info["config"]).keys():
        await js.delete_consumer(stream, durable)
        await js.add_consumer(stream, declared)
    return True
