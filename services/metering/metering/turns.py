"""One metered turn: resolve the model, reserve the worst case, call, bill, settle.

The order is the guarantee (ADR 0008 decision 2): checking, calling, then adding would
let parallel turns overspend by their number (docs/decisions/0006-limits-in-the-reservation.md):
1. the run's budget row is locked and the turn's worst case is held before the
   provider is called — a turn that does not fit is refused and nothing is called;
2. whatever happens to the call (success, provider error, cancellation), its usage
   row is written and its hold settled to the real cost, in one transaction;
3. a turn id whose row exists is answered from that row, never called again.

A stream stopped by `cmd.llm.cancel` (metering.cancels) is not a failure: its reply is
a normal `TurnReply` with `stop_reason: "cancelled"` and the text published up to the
stop, its row has status `cancelled` and the usage the provider consumed until then.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from uuid import UUID

from nats.aio.client import Client
from pydantic import TypeAdapter

from contracts.common import ErrorCode
from contracts.metering import (
    ChatMessage,
    LlmStream,
    LlmTurn,
    ReplyBlock,
    TextBlock,
    ToolSpec,
    TurnDelta,
    TurnReply,
)
from domain.errors import DomainError
from domain.metering import (
    RunBudget,
    choose_budget,
    cost_micros,
    estimate_input_tokens,
    limit_refusal,
    reserve,
    worst_case_micros,
)
from metering.beats import beating
from metering.cancels import Cancellations, RunningTurn
from metering.catalog import Catalog
from metering.providers.base import (
    Progress,
    Provider,
    ProviderError,
    ProviderReply,
    ProviderRequest,
    Providers,
)
from metering.repository import (
    Bill,
    CounterUse,
    EndedTurn,
    MeteringRepository,
    StoredRun,
    UsageRecord,
    turn_id_reused,
)
from servicekit.endpoint import UNAVAILABLE_ERRORS
from servicekit.logs import get_logger
from servicekit.metrics import SECONDS, Counter, Gauge, Histogram

log = get_logger(__name__)

# Runs whose row each replica remembers (`TurnRunner._reserve`): a few hundred bytes each.
REMEMBERED_RUNS = 10_000
# Writing the bill is retried for about half a minute before giving up on the store.
RECORD_ATTEMPTS = 9
# The stop reason of a stream stopped by `cmd.llm.cancel` (contracts.metering.TurnReply).
CANCELLED = "cancelled"

# Per model and agent: what every provider call cost (the same numbers as its
# `token_usage` row), served on the service's /metrics (servicekit.metrics).
LLM_CALLS = Counter(
    "agentbus_llm_calls_total", "Provider calls, by how they ended.", ["model", "agent", "status"]
)
LLM_TOKENS = Counter(
    "agentbus_llm_tokens_total",
    "Tokens billed, by kind (input, output, cache_read, cache_write).",
    ["model", "agent", "kind"],
)
LLM_COST = Counter("agentbus_llm_cost_micro_usd_total", "Cost billed, in µUSD.", ["model", "agent"])
LLM_FIRST_TOKEN = Histogram(
    "agentbus_llm_time_to_first_token_seconds",
    "From the command's arrival to the provider's first text.",
    ["model", "agent"],
    buckets=SECONDS,
)
LLM_ERRORS = Counter(
    "agentbus_llm_errors_total", "Provider calls that failed, by code.", ["model", "agent", "code"]
)


LIMIT_REFUSALS = Counter(
    "agentbus_llm_limit_refusals_total",
    "Calls refused by a project's or person's limit, by scope and what was exhausted.",
    ["scope", "metric"],
)
PROJECT_BUDGET_USED = Gauge(
    "agentbus_project_budget_used_ratio",
    "What a project has used (settled) of its spend limit in the current window.",
    ["project", "window"],
)


@dataclass(frozen=True)
class Hold:
    """What a turn reserves before its call: its worst-case cost and tokens, for whom."""

    micros: int
    tokens: int
    owner: str


def observe_limits(bill: Bill) -> None:
    """Set the project's budget gauges from the counters its bill settled."""
    observe_spend(bill.counters)


def observe_spend(counters: Iterable[CounterUse], *, whole: bool = False) -> None:
    """Set the project budget gauges from spend counters; `whole`: these are all of the
    windows open now, so a gauge of a window that ended (or a project without a limit
    any more) is dropped rather than left at its last figure."""
    if whole:
        PROJECT_BUDGET_USED.clear()
    for c in counters:
        if c.scope == "project" and c.metric == "micros" and c.limit > 0:
            PROJECT_BUDGET_USED.labels(c.name, c.window).set(c.used / c.limit)


def observe(record: UsageRecord, started: float, first_token_at: float | None) -> None:
    """Count one provider call in the LLM series."""
    model, agent, usage = record.model, record.agent_slug, record.usage
    LLM_CALLS.labels(model, agent, record.status).inc()
    for kind, tokens in (
        ("input", usage.input_tokens),
        ("output", usage.output_tokens),
        ("cache_read", usage.cache_read_tokens),
        ("cache_write", usage.cache_write_5m_tokens + usage.cache_write_1h_tokens),
    ):
        LLM_TOKENS.labels(model, agent, kind).inc(tokens)
    LLM_COST.labels(model, agent).inc(record.cost_micros)
    if first_token_at is not None:
        LLM_FIRST_TOKEN.labels(model, agent).observe(max(first_token_at - started, 0.0))
    if record.error_code is not None:
        LLM_ERRORS.labels(model, agent, record.error_code).inc()


# The conversation and the tools, as compact JSON, by pydantic's own serializer: this runs
# on every turn's start, the conversation grows with the session, and the serializer
# takes about a tenth of the time of dumping to dicts and `json.dumps`
# (docs/decisions/0010-light-per-token-path.md).
PROMPT_BODY = TypeAdapter(tuple[list[ChatMessage], list[ToolSpec]])


def prompt_bytes(cmd: LlmTurn) -> int:
    """The size of what the model reads: system prompt, conversation and tool schemas."""
    body = PROMPT_BODY.dump_json((cmd.messages, cmd.tools))
    return len(cmd.system.encode()) + len(body)


def owner_of(cmd: LlmTurn) -> str:
    """Whose request a turn id was taken for: its run, project, session, person and agent.

    A repeat under the same owner is a retry and gets the first reply, even if its prompt
    was rebuilt with other bytes (a redelivered message's conversation is read again
    from the log); under another owner the turn id was reused, and is refused."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (cmd.run_id, cmd.project_id, str(cmd.session_id), str(cmd.person), cmd.agent_slug):
        digest.update(part.encode() + b"\x00")
    return digest.hexdigest()


def _reserved(run: RunBudget, cmd: LlmTurn, hold: int) -> RunBudget:
    """The run once the turn's hold is reserved (the cap its first turn named), or the
    domain's refusal."""
    budget = choose_budget(run.budget, cmd.budget_micros, cmd.run_id)
    return reserve(RunBudget(budget, run.spent, run.reserved), hold, cmd.run_id)


def _at(seconds: float | None) -> datetime | None:
    return datetime.fromtimestamp(seconds, UTC) if seconds is not None else None


def replay(turn_id: str, ended: EndedTurn) -> TurnReply:
    """The answer to a turn id that already ran: its stored reply, or why it cannot be rerun."""
    if ended.reply is not None:
        return ended.reply.model_copy(update={"duplicate": True})
    raise DomainError(
        ErrorCode.TURN_ALREADY_FAILED,
        f"turn {turn_id} already ended as {ended.status} ({ended.error_code}); "
        "retry with a new turn_id",
        turn_id=turn_id,
        status=ended.status,
        error_code=ended.error_code,
    )


@dataclass
class DeltaPublisher:
    """Publishes a streaming turn's text on its delta subject, numbered from 1, in order.

    Coalesced under load: a piece is published at once, unless one already went out in
    this turn of the event loop (the provider handed on several without waiting: the
    events of one read of its stream). Those are held and go out as one delta once the
    provider waits for its next read. A stream read as fast as it comes gives a delta per
    piece, at the price of a callback each; one that arrives faster than this replica
    reads it (the events pile up in the socket) gives fewer, larger deltas, so every hop
    after this one (NATS, the gateway, each client) handles fewer messages just when it
    is loaded. `TurnDelta` is "a piece of text"; a held delta's `emitted_at`
    is its first piece's, so the latency it reports is its oldest's.
    """

    nc: Client
    subject: str
    turn_id: str
    causation_id: UUID | None = None
    seq: int = 0
    # Set once the stream runs: after a stop nothing more is published.
    running: RunningTurn | None = None
    # What was published, the reply of a stopped stream (the SDK's own copy is lost
    # with the aborted call).
    pieces: list[str] = field(default_factory=list)
    # Whether a piece went out in this turn of the loop; the pieces held since, the time
    # of the first, and the task that publishes them once the provider waits.
    _sent_this_turn: bool = False
    _held: list[str] = field(default_factory=list)
    _held_at: float = 0.0
    _publishing: asyncio.Task[None] | None = None
    # Looked up once, where the publisher is made (in the turn's task), not per piece:
    # `asyncio.get_running_loop()` makes a getpid() system call each time (gateway.ws).
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def stopped(self) -> bool:
        return self.running is not None and self.running.stopped

    async def __call__(self, text: str, emitted_at: float) -> None:
        if self.stopped:
            return  # stopped: a flag look-up, no I/O on the per-token path
        if self._held or self._sent_this_turn:  # never ahead of a held piece
            if not self._held:
                self._held_at = emitted_at
                self._publishing = asyncio.create_task(self._publish_held())
            self._held.append(text)
            return
        self._sent_this_turn = True
        self._loop.call_soon(self._next_turn)
        await self._publish(text, emitted_at)

    async def flush(self) -> None:
        """Publish what is held now (the stream ended: its reply must not overtake it)."""
        if self._publishing is not None:
            await self._publishing

    def _next_turn(self) -> None:
        self._sent_this_turn = False

    async def _publish_held(self) -> None:
        held, self._held = self._held, []
        if not self.stopped:  # a stop drops what was held: the reply holds what went out
            await self._publish("".join(held), self._held_at)

    async def _publish(self, text: str, emitted_at: float) -> None:
        self.seq += 1
        # Before the publish: nats-py queues the message before its first await, so a
        # piece recorded here is a piece that went out.
        self.pieces.append(text)
        # Built from values already checked (the command's turn id, our own count, the
        # provider's text): constructed, not validated again, on the per-token path.
        delta = TurnDelta.model_construct(
            turn_id=self.turn_id,
            seq=self.seq,
            text=text,
            emitted_at=emitted_at,
            causation_id=self.causation_id,
        )
        try:
            # Core NATS: no ack to wait for on the per-token path; the DELTAS stream
            # captures `agent.delta.>` for a client that reconnects.
            await self.nc.publish(self.subject, delta.model_dump_json().encode())
        except Exception as exc:  # the turn is still completed and billed
            log.warning("delta_publish_failed", turn_id=self.turn_id, error=repr(exc))


@dataclass(frozen=True)
class Outcome:
    """How a provider call ended: its reply (None when it failed), the usage row's status,
    the error to answer with, and whether this replica is shutting down."""

    reply: ProviderReply | None
    status: str
    error: DomainError | None = None
    shutdown: bool = False


def _stopped(publisher: DeltaPublisher | None) -> bool:
    """Whether a cancel stopped this stream (and the command itself is not being cancelled:
    a replica shutting down is not a person pressing Stop)."""
    if publisher is None or not publisher.stopped:
        return False
    task = asyncio.current_task()
    return task is None or task.cancelling() == 0


class TurnRunner:
    """Runs metered turns, each against the provider its binding names."""

    def __init__(
        self,
        repo: MeteringRepository,
        catalog: Catalog,
        providers: Providers | Provider,
        nc: Client,
        cancels: Cancellations | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._repo = repo
        self._catalog = catalog
        # One provider alone serves every binding (as before bindings named providers).
        self.providers = providers if isinstance(providers, Providers) else Providers(providers)
        self._nc = nc
        self.cancels = cancels or Cancellations()
        self._clock = clock
        # Run rows as this replica last wrote them, by run id, least recently written first.
        self._runs: dict[str, StoredRun] = {}

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
        input_estimate = estimate_input_tokens(prompt_bytes(cmd), len(cmd.messages))
        hold = Hold(
            worst_case_micros(input_estimate, cmd.max_tokens, price),
            input_estimate + cmd.max_tokens,
            owner_of(cmd),
        )
        try:
            claimed = await self._reserve(cmd, hold)
        except DomainError as exc:
            if exc.code == ErrorCode.TURN_ID_REUSED:
                raise
            # A turn that already ran is answered from its row even when the run
            # could not afford it again today.
            ended = await self._repo.ended_turn(cmd.turn_id)
            if ended is None:
                raise
            return replay(cmd.turn_id, ended)
        if not claimed:  # this turn id ran, or runs: answer from its row, call nothing
            return await self._repeated(cmd.turn_id, hold.owner)

        request = ProviderRequest(
            model=binding.model,
            agent_slug=cmd.agent_slug,
            system=cmd.system,
            messages=list(cmd.messages),
            tools=list(cmd.tools),
            max_tokens=cmd.max_tokens,
        )
        progress = Progress()
        stream = isinstance(cmd, LlmStream)
        outcome = await self._call(provider, cmd, request, progress)
        reply, status, error = outcome.reply, outcome.status, outcome.error

        usage = progress.usage
        cost = cost_micros(usage, price)
        answer = None
        if reply is not None:
            answer = TurnReply(
                turn_id=cmd.turn_id,
                content=reply.content,
                stop_reason=reply.stop_reason,
                model=reply.model,
                usage=usage,
                cost_micros=cost,
                budget_remaining_micros=None,
            )
        record = UsageRecord(
            turn_id=cmd.turn_id,
            run_id=cmd.run_id,
            kind="stream" if stream else "turn",
            provider=provider.name,
            model=binding.model,
            agent_slug=cmd.agent_slug,
            project_id=cmd.project_id,
            session_id=cmd.session_id,
            usage=usage,
            cost_micros=cost,
            status=status,
            error_code=error.code if error else None,
            error_message=error.message if error else None,
            started_at=datetime.fromtimestamp(started, UTC),
            first_token_at=_at(progress.first_token_at),
            finished_at=datetime.fromtimestamp(self._clock(), UTC),
            reply=answer,
        )
        observe(record, started, progress.first_token_at)
        # Shielded: a cancellation must not stop the bill from being written.
        remaining = await asyncio.shield(self._record(record, cmd.run_id))
        if outcome.shutdown:
            raise asyncio.CancelledError
        if error is not None:
            error.details.update(turn_id=cmd.turn_id, cost_micros=cost, status=status)
            raise error
        assert answer is not None
        return answer.model_copy(update={"budget_remaining_micros": remaining})

    async def _reserve(self, cmd: LlmTurn, hold: Hold) -> bool:
        """Hold the turn's worst case on its run and on every limit of its project and person,
        all or nothing; False when the turn id is already claimed.

        The run's row first, then the limits' counters (the order a bill and the sweeper
        lock them in too). On the run, in one statement when this replica knows its row as
        it last wrote it (the run's previous turn): the decision is taken on that row and
        written only if the row is still the same (`hold_if_unchanged`). A row someone else
        changed, or a turn that does not fit what this replica saw, is decided again under
        the row lock, on the row as it is. A limit the turn does not fit under refuses it,
        and nothing of the transaction is kept.
        """
        seen = self._runs.get(cmd.run_id)
        if seen is None:
            seen = await self._repo.stored_run(cmd.run_id)
        async with self._repo.transaction() as tx:
            version = None
            try:  # decided on what may be stale: see below
                run = _reserved(seen.budget if seen else RunBudget(None, 0, 0), cmd, hold.micros)
            except DomainError:
                pass
            else:
                version = await tx.hold_if_unchanged(
                    cmd.run_id, cmd.turn_id, hold.micros, seen, run
                )
            if version is None:
                self._runs.pop(cmd.run_id, None)
                stored = await tx.lock_stored_run(cmd.run_id)
                run = _reserved(stored.budget, cmd, hold.micros)
                version = await tx.hold(cmd.run_id, cmd.turn_id, hold.micros, run)
                if version is None:
                    return False
            refused = await tx.hold_limits(
                cmd.turn_id, cmd.project_id, cmd.person, hold.micros, hold.tokens, hold.owner
            )
            if refused:
                LIMIT_REFUSALS.labels(refused[0].scope, refused[0].metric).inc()
                raise limit_refusal(refused[0], datetime.now(UTC), hold.micros)
        self._remember(cmd.run_id, StoredRun(run, version))
        return True

    def _remember(self, run_id: str, stored: StoredRun) -> None:
        """Keep the run's row as this replica last wrote it (the most recent runs only)."""
        self._runs.pop(run_id, None)
        self._runs[run_id] = stored
        if len(self._runs) > REMEMBERED_RUNS:
            del self._runs[next(iter(self._runs))]  # the least recently written

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

    async def _call(
        self, provider: Provider, cmd: LlmTurn, request: ProviderRequest, progress: Progress
    ) -> Outcome:
        """Call the provider. A stream's call runs in a task of its own, registered with
        the cancels, so that `cmd.llm.cancel` can abort it without touching this one."""
        if not isinstance(cmd, LlmStream):
            call = provider.complete(request, progress, None)
            outcome = await self._outcome(call, None, cmd.turn_id)
            assert outcome is not None  # only a stream can be stopped
            return outcome
        publisher = DeltaPublisher(self._nc, cmd.delta_subject, cmd.turn_id, cmd.causation_id)
        task = asyncio.ensure_future(provider.complete(request, progress, publisher))
        # A cancel heard before this point stops the task here, before its first step:
        # the provider is then never called.
        publisher.running = self.cancels.start(cmd.turn_id, cmd.project_id, cmd.session_id, task)
        try:
            outcome = await self._outcome(task, publisher, cmd.turn_id)
            await publisher.flush()
        finally:
            self.cancels.finish(publisher.running)
        if outcome is not None:
            return outcome
        # Stopped by a cancel: a normal reply holding the text published until then.
        content: list[ReplyBlock] = [TextBlock(text=publisher.text)] if publisher.pieces else []
        return Outcome(ProviderReply(content, CANCELLED, request.model), CANCELLED)

    async def _outcome(
        self, call: Awaitable[ProviderReply], publisher: DeltaPublisher | None, turn_id: str
    ) -> Outcome | None:
        """How the call ended; None when `cmd.llm.cancel` stopped it, whatever the provider
        did while it unwound (an error from the cut connection, even a whole reply)."""
        try:
            reply = await call
            if not _stopped(publisher):
                return Outcome(reply, "ok")
        except ProviderError as exc:
            if not _stopped(publisher):
                return Outcome(None, "error", DomainError(exc.code, exc.message))
        except asyncio.CancelledError:
            if not _stopped(publisher):
                # Shut down mid-call: bill what the provider produced, then stop.
                error = DomainError(ErrorCode.UNAVAILABLE, "the turn was cancelled; retry it")
                return Outcome(None, CANCELLED, error, shutdown=True)
        except Exception as exc:
            if not _stopped(publisher):
                log.exception("provider_failed", turn_id=turn_id)
                return Outcome(None, "error", DomainError(ErrorCode.PROVIDER_ERROR, repr(exc)))
        return None

    async def _repeated(self, turn_id: str, owner: str) -> TurnReply:
        claimed_for = await self._repo.owner_of(turn_id)
        if claimed_for is not None and claimed_for != owner:
            raise turn_id_reused(turn_id)
        ended = await self._repo.ended_turn(turn_id)
        if ended is None:
            raise DomainError(
                ErrorCode.TURN_IN_PROGRESS,
                f"turn {turn_id} is already running; wait for its reply or use a new turn_id",
                turn_id=turn_id,
            )
        return replay(turn_id, ended)

    async def _record(self, record: UsageRecord, run_id: str) -> int | None:
        """Write the usage row and settle the hold, retrying while the store is unreachable."""
        for attempt in range(RECORD_ATTEMPTS):
            try:
                return await self._record_once(record, run_id)
            except UNAVAILABLE_ERRORS as exc:
                if attempt == RECORD_ATTEMPTS - 1:
                    # Last resort: the row, in full, in the log, so it can be replayed.
                    log.error("usage_row_unwritten", error=repr(exc), **record.as_log())
                    raise
                await asyncio.sleep(min(0.1 * 2**attempt, 5.0))
        raise AssertionError("unreachable")

    async def _record_once(self, record: UsageRecord, run_id: str) -> int | None:
        """The usage row and the settled hold, in one statement (`MeteringRepository.bill`)."""
        bill = await self._repo.bill(record)
        observe_limits(bill)
        if bill.run is None:  # a run without a row: the call is billed, nothing to report
            return None
        if bill.billed:
            self._remember(run_id, bill.run)
        run = bill.run.budget
        if run.budget is not None and run.spent > run.budget:
            log.warning("run_overspent", run_id=run_id, budget=run.budget, spent=run.spent)
        log.info(
            "turn_billed",
            turn_id=record.turn_id,
            run_id=run_id,
            model=record.model,
            status=record.status,
            cost_micros=record.cost_micros,
        )
        return run.remaining
