"""The transactional outbox and its relay.

A service writes its state change and an outbox row in one transaction; a relay delivers
the committed rows, each key's in the order written. The modules, each one idea:

- `writer`: `Outbox`, the one way a service writes a row, and `with_outbox`, the one way
  to open a transaction with an outbox;
- `announcement`: events for the session log, checked against what the log would refuse;
- `rows`: the statements that insert rows, and the channel that announces them;
- `delivery`: what a relay hands its sender and hears back, and the per-key order every
  sender keeps;
- `publisher`: the sender to JetStream (`JetStreamPublisher`), a backlog as one atomic
  batch;
- `commands`: the sender of queued commands to the services that own them
  (`CommandSender`: the log's appends, the handoff service's offers);
- `relay`: `OutboxRelay`, its leased claim, its ordering guards, retries and dead letters.

Callers import the names below from `servicekit.outbox`.
"""

from servicekit.outbox.announcement import Announcement, check_appendable
from servicekit.outbox.commands import MAX_INTERNAL_ATTEMPTS, CommandSender
from servicekit.outbox.delivery import (
    DELIVERED,
    HELD_BACK,
    DeliverRows,
    Delivery,
    OutboxRow,
    Sender,
    in_key_order,
    key_chains,
    one_after_another,
)
from servicekit.outbox.publisher import ATOMIC_BATCH_MIN, BATCH_ID, JetStreamPublisher
from servicekit.outbox.relay import (
    CLAIM,
    LEASE_SECONDS,
    MAX_BACKOFF_SECONDS,
    OutboxRelay,
    overtaking,
    retry_delay,
)
from servicekit.outbox.rows import NOTIFY_CHANNEL_PREFIX, Queued, notify_channel
from servicekit.outbox.writer import Outbox, Wake, with_outbox

__all__ = [
    "ATOMIC_BATCH_MIN",
    "BATCH_ID",
    "CLAIM",
    "DELIVERED",
    "HELD_BACK",
    "LEASE_SECONDS",
    "MAX_BACKOFF_SECONDS",
    "MAX_INTERNAL_ATTEMPTS",
    "NOTIFY_CHANNEL_PREFIX",
    "Announcement",
    "CommandSender",
    "DeliverRows",
    "Delivery",
    "JetStreamPublisher",
    "Outbox",
    "OutboxRelay",
    "OutboxRow",
    "Queued",
    "Sender",
    "Wake",
    "check_appendable",
    "in_key_order",
    "key_chains",
    "notify_channel",
    "one_after_another",
    "overtaking",
    "retry_delay",
    "with_outbox",
]
