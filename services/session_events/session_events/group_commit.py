"""Group commit of `cmd.events.append`: appends that arrive together are written together.

Each append is validated on its own first (type, payload, size: `handlers.append`), then
waits here. While a batch is being written the next appends gather, and the next batch
takes them all. With one producer a batch is one append, so nothing waits for a timer.
Up to `MAX_IN_FLIGHT` batches are written at once, each of sessions no other batch being
written holds: while one waits for its commit (the WAL's flush) the next is read, decided
and written beside it, and a session's appends still go one batch after another.

A batch costs two round trips and holds no lock while Python decides: one statement reads
its sessions, the events its idempotency keys already wrote, its causes and the rules it
retires (each with whatever already retired it); `decide` applies the log's rules to
each append against them; one statement writes every event,
one outbox row each, moves the sessions' `last_seq` on and sends one NOTIFY. That write
is a compare-and-set: it moves a session on only from the `last_seq` the read found, and
when another writer moved one in between (a replica's batch, a close) it writes nothing
and the batch is decided again the old way, in a transaction holding the sessions' rows
`FOR UPDATE` (in id order). Either way seqs stay gap-free and each key is written once.
A single statement is all or nothing, so a crash leaves a batch wholly written (its
callers' retries are answered with it: idempotency keys) or not written at all.

Every rule stays per append: a refused append gets its own coded error and writes nothing
while the others of its batch go in. Each append is answered only after its batch
committed; when the write failed (a value Postgres refuses), each of its appends is tried
again alone, so only the one Postgres cannot keep fails.

Appends sent together (`append_chain`, `cmd.events.append_many`) keep their order: each
waits behind the one before it of its session, and when that one failed to be written (an
exception, not a refusal) it is not written either but answered `unavailable`, so a
session's events never go in with a gap a retry would fill out of order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from uuid import UUID

import asyncpg

from contracts.common import ErrorCode
from contracts.events import Event, EventType
from contracts.session_events import AppendedReply
from domain import log_rules
from domain.errors import DomainError
from servicekit.faults import crash_point
from servicekit.telemetry import inject_headers
from session_events.repository import (
    RETIRED_RULE_INDEX,
    BatchFacts,
    LogRepository,
    LogTransaction,
    NewEvent,
    Written,
    next_event,
)

# The most appends one transaction takes; the rest wait for the next batch.
MAX_BATCH = 256
# The most batches written at once (each of other sessions than the rest).
MAX_IN_FLIGHT = 2


@dataclass(frozen=True)
class Pending:
    """One append whose shape is valid, waiting for its batch."""

    session_id: UUID
    type: EventType
    actor: str
    payload: dict[str, Any]
    causation_id: UUID | None = None
    idempotency_key: str | None = None
    # The trace context of the request, carried into the event's outbox row.
    trace: Mapping[str, str] = field(default_factory=dict)


Outcome = AppendedReply | DomainError
# One waiting append: what it is, its answer, and the answer of the append it must follow
# (the one before it of its session, in an `append_chain`).
Waiting = tuple[Pending, "asyncio.Future[Outcome]", "asyncio.Future[Outcome] | None"]


@dataclass
class Decided:
    """What a batch writes, and each append's answer, in the order they came."""

    written: list[NewEvent]
    trace: list[Mapping[str, str]]
    outcomes: list[Outcome]


def decide(
    batch: Sequence[Pending], facts: BatchFacts, new_event: Callable[..., Event] = next_event
) -> Decided:
    """Each append of `batch` judged by the log's rules, as if they came one by one in this
    order: the next seq of its session, or a refusal; a repeated idempotency key (earlier,
    or earlier in the batch) answers with the event its first append wrote."""
    decided = Decided([], [], [])
    keyed = dict(facts.earlier)
    causes = facts.causes
    rules = dict(facts.rules)  # retired by this batch too, as it goes
    for p in batch:
        session = facts.sessions.get(p.session_id)
        key = (p.session_id, p.idempotency_key) if p.idempotency_key is not None else None
        try:
            if session is None:
                raise log_rules.session_not_found(p.session_id)
            if key is not None and key in keyed:
                first = keyed[key]
                decided.outcomes.append(
                    AppendedReply(event_id=first.id, seq=first.seq, duplicate=True)
                )
                continue
            log_rules.check_append(
                p.type,
                p.actor,
                session.id,
                session.is_open,
                p.causation_id,
                causes.get(p.causation_id) if p.causation_id else None,
            )
            retires = log_rules.retired_rule(p.type, p.payload)
            if retires is not None:
                log_rules.check_retirement(
                    p.type, p.actor, session.project_id, retires, rules.get(retires)
                )
        except DomainError as refused:
            decided.outcomes.append(refused)
            continue
        event = new_event(session, p.type, p.actor, p.payload, p.causation_id)
        if retires is not None:
            rules[retires] = replace(rules[retires], retired_by=event.id)
        session.last_seq = event.seq
        if key is not None:
            keyed[key] = Written(event.id, event.seq)
        decided.written.append(NewEvent(event, p.idempotency_key))
        decided.trace.append(p.trace)
        decided.outcomes.append(AppendedReply(event_id=event.id, seq=event.seq))
    return decided


class _StatementFailed(Exception):
    """A statement of the batch failed: the transaction rolled back, nothing committed."""


class _RuleRetiredMeanwhile(Exception):
    """Another session's write retired a rule this batch retires, after the batch read
    it: nothing was written, and deciding again refuses the later one."""


class GroupCommit:
    """Gathers concurrent appends into shared transactions (see the module's docstring)."""

    def __init__(
        self, repo: LogRepository, max_batch: int = MAX_BATCH, max_in_flight: int = MAX_IN_FLIGHT
    ) -> None:
        self._repo = repo
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._waiting: list[Waiting] = []
        self._writing: set[UUID] = set()  # the sessions of the batches being written
        self._in_flight = 0
        self._writers: set[asyncio.Task[None]] = set()  # referenced until done
        self.batches = 0  # batches written or tried, for tests and benches
        self.decided_again = 0  # batches whose unlocked read went stale before their write

    async def append(self, pending: Pending) -> AppendedReply:
        """Append once the batch it joins committed; raise its refusal when refused."""
        [answer] = self._enqueue([pending], chained=False)
        outcome = await answer
        if isinstance(outcome, DomainError):
            raise outcome
        return outcome

    async def append_chain(self, pendings: Sequence[Pending]) -> list[Outcome | Exception]:
        """Append each in the order given, a session's behind its predecessor (see the
        module's docstring); each one's reply, refusal or failure."""
        answers = self._enqueue(pendings, chained=True)
        outcomes: list[Outcome | Exception] = []
        for answer in await asyncio.gather(*answers, return_exceptions=True):
            if not isinstance(answer, (AppendedReply, Exception)):
                raise answer  # cancelled
            outcomes.append(answer)
        return outcomes

    def _enqueue(self, pendings: Sequence[Pending], chained: bool) -> list[asyncio.Future[Outcome]]:
        loop = asyncio.get_running_loop()
        last: dict[UUID, asyncio.Future[Outcome]] = {}
        answers = []
        for p in pendings:
            answer: asyncio.Future[Outcome] = loop.create_future()
            self._waiting.append((p, answer, last.get(p.session_id) if chained else None))
            last[p.session_id] = answer
            answers.append(answer)
        self._start_writers()
        return answers

    @staticmethod
    def pending(
        session_id: UUID,
        event_type: EventType,
        actor: str,
        payload: dict[str, Any],
        causation_id: UUID | None,
        idempotency_key: str | None,
        trace: Mapping[str, str] | None = None,
    ) -> Pending:
        """A `Pending` carrying `trace`, or else the current request's trace context."""
        trace = inject_headers() if trace is None else trace
        return Pending(session_id, event_type, actor, payload, causation_id, idempotency_key, trace)

    def _start_writers(self) -> None:
        # A writer takes its batch when it first runs, so appends enqueued together (an
        # `asyncio.gather`, a request's many) are in it.
        if self._in_flight < self._max_in_flight:
            self._in_flight += 1
            writer = asyncio.create_task(self._write_while_waiting())
            self._writers.add(writer)
            writer.add_done_callback(self._writers.discard)

    async def _write_while_waiting(self) -> None:
        try:
            while batch := self._next_batch():
                try:
                    await self._commit(batch)
                finally:
                    self._writing.difference_update(p.session_id for p, _, _ in batch)
        finally:
            self._in_flight -= 1

    def _next_batch(self) -> list[Waiting]:
        """The waiting appends of the sessions no batch being written holds, in the order
        they came, up to `max_batch`; their sessions are held until it is written."""
        batch: list[Waiting] = []
        later: list[Waiting] = []
        for waiting in self._waiting:
            free = waiting[0].session_id not in self._writing
            (batch if free and len(batch) < self._max_batch else later).append(waiting)
        self._waiting = later
        self._writing.update(p.session_id for p, _, _ in batch)
        return batch

    async def _commit(self, batch: list[Waiting]) -> None:
        batch = [w for w in batch if not _held_back(w)]
        if not batch:
            return
        try:
            outcomes = await self._transaction([p for p, _, _ in batch])
        except _StatementFailed as failed:
            if len(batch) > 1:  # find the one Postgres refuses; the others go in
                for one in batch:
                    await self._commit([one])
                return
            _settle(batch, failed.__cause__ or failed)
        except Exception as exc:  # the commit itself, or the connection: each caller hears
            _settle(batch, exc)
        else:
            for (_, answer, _), outcome in zip(batch, outcomes, strict=True):
                if not answer.done():
                    answer.set_result(outcome)

    async def _transaction(self, batch: list[Pending]) -> list[Outcome]:
        """Decide the batch on what one unlocked read finds and write it with one guarded
        statement: two round trips, no lock held while Python decides. When a session
        moved in between (another replica's batch, a close), nothing was written: decide
        again with the sessions locked."""
        self.batches += 1
        try:
            async with self._repo.autocommit() as statements:
                return await _decide_and_write(statements, batch)
        except (asyncpg.TransactionRollbackError, _RuleRetiredMeanwhile):
            # moved (or, rarely, a deadlock), or a rule retired by another session's
            # write: undone
            self.decided_again += 1
            async with self._repo.transaction() as tx:
                await tx.lock_sessions(p.session_id for p in batch)
                return await _decide_and_write(tx, batch)


async def _decide_and_write(tx: LogTransaction, batch: list[Pending]) -> list[Outcome]:
    try:
        facts = await tx.batch_facts(
            (p.session_id for p in batch),
            ((p.session_id, p.idempotency_key) for p in batch if p.idempotency_key),
            (p.causation_id for p in batch if p.causation_id),
            (r for p in batch if (r := log_rules.retired_rule(p.type, p.payload))),
        )
        decided = decide(batch, facts)
        if decided.written:
            await tx.write(decided.written, decided.trace)
        crash_point("append.batch_written")
    except asyncpg.TransactionRollbackError:
        raise
    except asyncpg.UniqueViolationError as exc:
        if exc.constraint_name == RETIRED_RULE_INDEX:
            raise _RuleRetiredMeanwhile from exc
        raise _StatementFailed(repr(exc)) from exc
    except asyncpg.PostgresError as exc:
        raise _StatementFailed(repr(exc)) from exc
    return decided.outcomes


def _settle(batch: list[Waiting], exc: BaseException) -> None:
    for _, answer, _ in batch:
        if not answer.done():
            answer.set_exception(exc)


def _held_back(waiting: Waiting) -> bool:
    """Answer `unavailable` (and write nothing) when the append this one must follow failed
    to be written; False when it may go (its predecessor went in, was refused, or is in
    the same batch and shares its fate)."""
    pending, answer, after = waiting
    if after is None or not after.done() or (not after.cancelled() and after.exception() is None):
        return False
    answer.set_exception(
        DomainError(
            ErrorCode.UNAVAILABLE,
            f"held back behind an earlier event of session {pending.session_id} that "
            "could not be written; retry",
            session_id=str(pending.session_id),
        )
    )
    return True
