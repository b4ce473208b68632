"""One metered turn: resolve the model, reserve the worst case, call, bill, reply.

The order is the guarantee (ADR 0008 decision 2): checking, calling, then adding would
let parallel turns overspend by their number (docs/decisions/0006-limits-in-the-reservation.md):
1. the run's budget row is locked and the turn's worst case is held before the
   provider is called — a turn that does not fit is refused and nothing is called;
2. whatever happens to the call (success, provider error, cancellation), its usage
   row is written and its hold settled to the real cost, in one transaction;
3. a turn id whose row exists is answered from that row, never called again.

This is the shell that runs those steps in that order: the decisions are
`domain.metering_turn`'s, the statements `metering.repository`'s, the call and its
deltas `metering.calls`' and `metering.publisher`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime

from nats.aio.client import Client

from contracts.common import ErrorCode
from contracts.metering import LlmTurn, TurnReply
from domain.errors import DomainError
from domain.metering import limit_refusal
from domain.metering_turn import (
    Hold,
    Timing,
    UsageRecord,
    answer,
    check_owner,
    hold_for,
    may_replay,
    repeat,
    replay_refused,
    usage_record,
)
from metering.beats import beating
from metering.calls import Streaming, call, request_of
from metering.cancels import Cancellations
from metering.catalog import Catalog
from metering.metrics import observe, observe_limits, observe_refusal
from metering.providers.base import Progress, Provider, Providers
from metering.publisher import Coalescing
from metering.repository import MeteringRepository
from servicekit.endpoint import UNAVAILABLE_ERRORS
from servicekit.faults import crash_point
from servicekit.logs import get_logger

log = get_logger(__name__)

# Writing the bill is retried for about half a minute before giving up on the store.
RECORD_ATTEMPTS = 9


class TurnRunner:
    """Runs metered turns, each against the provider its binding names."""

    def __init__(
        self,
        repo: MeteringRepository,
        catalog: Catalog,
        providers: Providers | Provider,
        nc: Client,
        cancels: Cancellations | None = None,
        coalescing: Coalescing | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._repo = repo
        self._catalog = catalog
        # One provider alone serves every binding.
        self.providers = providers if isinstance(providers, Providers) else Providers(providers)
        self._nc = nc
        self.cancels = cancels or Cancellations()
        self._streaming = Streaming(nc, self.cancels, coalescing or Coalescing())
        self._clock = clock

    async def run(self, cmd: LlmTurn) -> TurnReply:
        """Answer `cmd.llm.turn` / `cmd.llm.stream` (an `LlmStream` streams its deltas, and
        beats on its alive subject until the reply)."""
        async with beating(self._nc, cmd):
            return await self._run(cmd)

    async def _run(self, cmd: LlmTurn) -> TurnReply:
        started = self._clock()
        binding = self._catalog.resolve(cmd.agent_slug, cmd.project_id, cmd.session_id)
        provider = self._provider_of(binding.provider)
        price = self._catalog.price(binding.model, datetime.fromtimestamp(started, UTC).date())

        hold = hold_for(cmd, price)
        repeated = await self._reserve(cmd, hold, provider.name, binding.model)
        if repeated is not None:  # this turn id ran, or runs: answered from its row
            return repeated

        progress = Progress()
        request = request_of(cmd, binding.model)
        outcome = await call(provider, cmd, request, progress, self._streaming)
        crash_point("metering.before_bill")  # the call made, its bill not written

        timing = Timing(started, progress.first_token_at, self._clock())
        record = usage_record(
            cmd, provider.name, binding.model, price, progress.usage, outcome, timing
        )
        observe(record, started, progress.first_token_at)
        # Shielded: a cancellation must not stop the bill from being written.
        remaining = await asyncio.shield(self._bill(record))

        if outcome.shutdown:
            raise asyncio.CancelledError
        return answer(record, outcome, remaining)

    def _provider_of(self, name: str | None) -> Provider:
        provider = self.providers.get(name)
        if provider is None:
            raise DomainError(
                ErrorCode.PROVIDER_ERROR,
                f"the binding names provider {name}, which this metering is not configured "
                f"for (it has {', '.join(self.providers.names)}); configure it or rebind",
                provider=name,
            )
        return provider

    async def _reserve(
        self, cmd: LlmTurn, hold: Hold, provider: str, model: str
    ) -> TurnReply | None:
        """Hold the turn's worst case on its run and its limits (`MeteringRepository.reserve`);
        None once held: the call may go. A turn id that already ran, or runs, is answered
        from its row and calls nothing."""
        try:
            reservation = await self._repo.reserve(cmd, hold, provider, model)
            if reservation.refused is not None:
                observe_refusal(reservation.refused)
                raise limit_refusal(reservation.refused, datetime.now(UTC), hold.micros)
        except DomainError as refusal:
            if not may_replay(refusal):
                raise
            return replay_refused(cmd.turn_id, refusal, await self._repo.ended_turn(cmd.turn_id))
        if reservation.claimed:
            return None
        check_owner(cmd.turn_id, hold.owner, await self._repo.owner_of(cmd.turn_id))
        return repeat(cmd.turn_id, await self._repo.ended_turn(cmd.turn_id))

    async def _bill(self, record: UsageRecord) -> int | None:
        """Write the usage row and settle the hold, retrying while the store is unreachable;
        what is left of the run's budget (None: no cap, or no row)."""
        for attempt in range(RECORD_ATTEMPTS):
            try:
                return await self._bill_once(record)
            except UNAVAILABLE_ERRORS as exc:
                if attempt == RECORD_ATTEMPTS - 1:
                    # Last resort: the row, in full, in the log, so it can be replayed.
                    log.error("usage_row_unwritten", error=repr(exc), **record.as_log())
                    raise
                await asyncio.sleep(min(0.1 * 2**attempt, 5.0))
        raise AssertionError("unreachable")

    async def _bill_once(self, record: UsageRecord) -> int | None:
        """The usage row and the settled hold, in one statement (`MeteringRepository.bill`)."""
        bill = await self._repo.bill(record)
        observe_limits(bill)
        if bill.run is None:  # a run without a row: the call is billed, nothing to report
            return None
        run = bill.run.budget
        if run.budget is not None and run.spent > run.budget:
            log.warning("run_overspent", run_id=record.run_id, budget=run.budget, spent=run.spent)
        log.info(
            "turn_billed",
            turn_id=record.turn_id,
            run_id=record.run_id,
            model=record.model,
            status=record.status,
            cost_micros=record.cost_micros,
        )
        return run.remaining
