"""Retention of the kit's bookkeeping tables: claims and dead letters pruned on a schedule.

Every service with a schema runs `Retention` (started by `Service.serve`). Two tables grow
with traffic and are pruned here:

- `processed_messages`, the claims of idempotent consumers. A claim may go only once its
  message can no longer be delivered: JetStream drops a message `max_age` after it was
  stored, and a message is claimed after it was stored, so a claim older than the
  longest `max_age` of the streams the service consumes, plus a margin
  (`AGENTBUS_CLAIMS_MARGIN_SECONDS`, for clock skew and a message stored late by a
  retrying relay), can no longer meet its message again. A service consuming a stream
  kept for ever (or one the contracts do not declare) keeps its claims for ever.
  A republish from the log (`agentbus republish`) of an event older than that bound is
  a new message to the bus; consumers check the log for their effect as well.
- `dead_letters`, kept `AGENTBUS_DEAD_LETTER_RETENTION_DAYS` (14 by default) for
  operators to read and replay.

Rows go in batches of `AGENTBUS_RETENTION_BATCH`, each its own short transaction, with
`SKIP LOCKED`: replicas pruning at once share the work, and a consumer claiming a
message is never held up behind a long delete. Pruned rows are counted in
`agentbus_retention_pruned_rows_total{schema,table}`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

import asyncpg
from prometheus_client import Counter

from contracts import streams
from contracts.streams import StreamSpec
from servicekit.cancellation import raise_if_cancelling
from servicekit.logs import get_logger
from servicekit.settings import ServiceSettings

log = get_logger(__name__)

PRUNED = Counter(
    "agentbus_retention_pruned_rows_total",
    "Rows of the kit's tables deleted by retention.",
    ["schema", "table"],
)

DAY_SECONDS = 24 * 3600

# One batch: the oldest rows past the bound, locked rows skipped (another replica has
# them). `$1` the age in seconds, `$2` the batch size.
PRUNE = {
    "processed_messages": """
        DELETE FROM processed_messages WHERE ctid = ANY(ARRAY(
            SELECT ctid FROM processed_messages
             WHERE processed_at < now() - make_interval(secs => $1)
             LIMIT $2 FOR UPDATE SKIP LOCKED))""",
    "dead_letters": """
        DELETE FROM dead_letters WHERE id = ANY(ARRAY(
            SELECT id FROM dead_letters
             WHERE recorded_at < now() - make_interval(secs => $1)
             LIMIT $2 FOR UPDATE SKIP LOCKED))""",
}


def claims_kept_seconds(
    consumed: Iterable[StreamSpec | None], margin_seconds: float
) -> float | None:
    """How long a claim must be kept: the longest `max_age` of the consumed streams plus
    the margin; None (for ever) when a stream keeps its messages for ever or is unknown
    (None), or when nothing is consumed (a claim could then be of anything)."""
    specs = list(consumed)
    if not specs or any(s is None or s.max_age_seconds <= 0 for s in specs):
        return None
    return max(s.max_age_seconds for s in specs if s is not None) + margin_seconds


def declared_stream(name: str) -> StreamSpec | None:
    """The contracts' declaration of the stream `name`, if it is one of them."""
    return next((s for s in streams.ALL if s.name == name), None)


@dataclass(frozen=True)
class RetentionPolicy:
    """How long each table's rows are kept, in seconds (None: for ever), and how."""

    claims_seconds: float | None
    dead_letters_seconds: float
    batch: int = 5000
    interval_seconds: float = 3600.0

    @classmethod
    def for_service(
        cls, settings: ServiceSettings, consumed_streams: Iterable[str]
    ) -> RetentionPolicy:
        """The policy of a service consuming `consumed_streams`, from its settings."""
        return cls(
            claims_seconds=claims_kept_seconds(
                [declared_stream(name) for name in consumed_streams],
                settings.claims_margin_seconds,
            ),
            dead_letters_seconds=settings.dead_letter_retention_days * DAY_SECONDS,
            batch=settings.retention_batch,
            interval_seconds=settings.retention_interval_seconds,
        )

    def ages(self) -> dict[str, float]:
        """Each prunable table and the age past which its rows go."""
        kept = {
            "processed_messages": self.claims_seconds,
            "dead_letters": self.dead_letters_seconds,
        }
        return {table: age for table, age in kept.items() if age is not None}


class Retention:
    """Prunes one schema's claims and dead letters on a schedule."""

    def __init__(self, pool: asyncpg.Pool, schema: str, policy: RetentionPolicy) -> None:
        self._pool = pool
        self._schema = schema
        self.policy = policy

    async def run(self) -> None:
        """Prune now and then every `interval_seconds`, until cancelled; a database
        outage skips a round, it does not stop the schedule."""
        while True:
            try:
                await self.prune_once()
            except (asyncpg.PostgresError, OSError) as exc:
                log.warning("retention_failed", schema=self._schema, error=repr(exc))
            raise_if_cancelling()
            await asyncio.sleep(self.policy.interval_seconds)  # the schedule itself

    async def prune_once(self) -> dict[str, int]:
        """Delete every row past its table's bound, batch by batch; rows deleted by table."""
        pruned: dict[str, int] = {}
        for table, age in self.policy.ages().items():
            pruned[table] = 0
            while True:
                async with self._pool.acquire() as conn:
                    status: str = await conn.execute(PRUNE[table], age, self.policy.batch)
                deleted = int(status.split()[-1])
                pruned[table] += deleted
                PRUNED.labels(self._schema, table).inc(deleted)
                if deleted < self.policy.batch:
                    break
                raise_if_cancelling()
        if any(pruned.values()):
            log.info("retention_pruned", schema=self._schema, **pruned)
        return pruned
