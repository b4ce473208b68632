"""One metered turn's decisions, in the order the turn takes them: what it holds, whether
its run can hold it, how a turn id that already ran is answered, its bill, its reply.

The order is the guarantee (ADR 0008 decision 2; ADR 0006, spend limits held in the
reservation's transaction): the worst case is held before the provider is called, the
bill is written whatever happened to the call, and a turn id whose row exists is answered
from that row, never called again. The statements that carry these decisions out are
metering's; nothing here does I/O.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol
from uuid import UUID

from pydantic import TypeAdapter

from contracts.common import ErrorCode
from contracts.metering import (
    ChatMessage,
    LlmStream,
    LlmTurn,
    ReplyBlock,
    TokenUsage,
    ToolSpec,
    TurnReply,
)
from domain.errors import DomainError
from domain.metering import (
    Price,
    RunBudget,
    choose_budget,
    cost_micros,
    estimate_input_tokens,
    reserve,
    worst_case_micros,
)

# The stop reason of a stream stopped by `cmd.llm.cancel` (contracts.metering.TurnReply),
# and the status of its usage row: a stop is not a failure.
CANCELLED = "cancelled"

# --- the hold ----------------------------------------------------------------

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


@dataclass(frozen=True)
class Hold:
    """What a turn reserves before its call: its worst-case cost and tokens, for whom."""

    micros: int
    tokens: int
    owner: str


def hold_for(cmd: LlmTurn, price: Price) -> Hold:
    """The turn's worst case at `price`: a pessimistic input estimate at the dearest input
    rate plus `max_tokens` of output, held on its run and on every limit it counts against."""
    input_estimate = estimate_input_tokens(prompt_bytes(cmd), len(cmd.messages))
    return Hold(
        worst_case_micros(input_estimate, cmd.max_tokens, price),
        input_estimate + cmd.max_tokens,
        owner_of(cmd),
    )


# --- the run's reservation ---------------------------------------------------
# A replica decides on the run's row as it last wrote it and writes the decision only if
# the row is still that one; a row someone else changed, or a turn that does not fit what
# the replica saw, is decided again under the row lock, on the row as it is.


def reserved(run: RunBudget, cmd: LlmTurn, hold: int) -> RunBudget:
    """The run once the turn's hold is reserved (the cap its first turn named), or the
    domain's refusal (`budget_mismatch`, `budget_exceeded`)."""
    budget = choose_budget(run.budget, cmd.budget_micros, cmd.run_id)
    return reserve(RunBudget(budget, run.spent, run.reserved), hold, cmd.run_id)


def reserved_if_fits(seen: RunBudget | None, cmd: LlmTurn, hold: int) -> RunBudget | None:
    """The run once the hold is reserved on the row as this replica saw it (None: the run
    had no row), or None when it does not fit there: what was seen may be stale, so only
    the locked row may refuse the turn."""
    try:
        return reserved(seen if seen is not None else RunBudget(None, 0, 0), cmd, hold)
    except DomainError:
        return None


# --- a turn id that was claimed already --------------------------------------


@dataclass(frozen=True)
class EndedTurn:
    """A turn that already has its usage row."""

    status: str
    error_code: str | None
    reply: TurnReply | None


def turn_id_reused(turn_id: str) -> DomainError:
    """The refusal of a turn id already used for another request."""
    return DomainError(
        ErrorCode.TURN_ID_REUSED,
        f"turn id {turn_id} was already used for another request (another run, project, "
        "person or prompt); send each new request under a new turn_id",
        turn_id=turn_id,
    )


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


def may_replay(refusal: DomainError) -> bool:
    """Whether a refused reservation is answered from the turn's row when it already ran:
    a turn that ran is answered even when its run or its limits could not afford it again
    today, but a turn id reused for another request is refused whatever its row says."""
    return refusal.code != ErrorCode.TURN_ID_REUSED


def replay_refused(turn_id: str, refusal: DomainError, ended: EndedTurn | None) -> TurnReply:
    """A refused reservation's answer: the turn's row when it already ran, else the refusal."""
    if ended is None:
        raise refusal
    return replay(turn_id, ended)


def check_owner(turn_id: str, owner: str, claimed_for: str | None) -> None:
    """Refuse a claimed turn id that was claimed for another request (`owner_of`)."""
    if claimed_for is not None and claimed_for != owner:
        raise turn_id_reused(turn_id)


def repeat(turn_id: str, ended: EndedTurn | None) -> TurnReply:
    """The answer to a turn id claimed for this request: its row, or that it still runs."""
    if ended is None:
        raise DomainError(
            ErrorCode.TURN_IN_PROGRESS,
            f"turn {turn_id} is already running; wait for its reply or use a new turn_id",
            turn_id=turn_id,
        )
    return replay(turn_id, ended)


# --- the bill ----------------------------------------------------------------


class Reply(Protocol):
    """The whole message a provider returned (metering's `ProviderReply`)."""

    @property
    def content(self) -> list[ReplyBlock]: ...

    @property
    def stop_reason(self) -> str: ...

    @property
    def model(self) -> str: ...


@dataclass(frozen=True)
class Outcome:
    """How a provider call ended: its reply (None when it failed), the usage row's status
    (`ok`, `error`, `cancelled`), the error to answer with, and whether this replica is
    shutting down (the turn is billed, then not answered: its command is redelivered)."""

    reply: Reply | None
    status: str
    error: DomainError | None = None
    shutdown: bool = False


@dataclass(frozen=True)
class Timing:
    """When the turn started, its provider's first text (None: no text) and its end, in
    seconds since the epoch."""

    started: float
    first_token_at: float | None
    finished: float


@dataclass(frozen=True)
class UsageRecord:
    """One `token_usage` row: who called, what it consumed and cost, how it ended."""

    turn_id: str
    run_id: str
    kind: str
    provider: str
    model: str
    agent_slug: str
    project_id: str
    session_id: UUID | None
    usage: TokenUsage
    cost_micros: int
    status: str
    error_code: str | None
    error_message: str | None
    started_at: datetime
    first_token_at: datetime | None
    finished_at: datetime
    reply: TurnReply | None

    def as_log(self) -> dict[str, Any]:
        """The row as log fields (the reply left out: it can be large)."""
        fields = {k: v for k, v in vars(self).items() if k not in ("reply", "usage")}
        return {**fields, **self.usage.model_dump()}


def _at(seconds: float | None) -> datetime | None:
    return datetime.fromtimestamp(seconds, UTC) if seconds is not None else None


def usage_record(
    cmd: LlmTurn,
    provider: str,
    model: str,
    price: Price,
    usage: TokenUsage,
    outcome: Outcome,
    timing: Timing,
) -> UsageRecord:
    """The turn's bill, whatever the call did: `usage` (every attempt, up to a failure or a
    stop) at `price`, and the reply it will give when the call answered."""
    cost = cost_micros(usage, price)
    reply, error = outcome.reply, outcome.error
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
    return UsageRecord(
        turn_id=cmd.turn_id,
        run_id=cmd.run_id,
        kind="stream" if isinstance(cmd, LlmStream) else "turn",
        provider=provider,
        model=model,
        agent_slug=cmd.agent_slug,
        project_id=cmd.project_id,
        session_id=cmd.session_id,
        usage=usage,
        cost_micros=cost,
        status=outcome.status,
        error_code=error.code if error else None,
        error_message=error.message if error else None,
        started_at=datetime.fromtimestamp(timing.started, UTC),
        first_token_at=_at(timing.first_token_at),
        finished_at=datetime.fromtimestamp(timing.finished, UTC),
        reply=answer,
    )


# --- the reply ---------------------------------------------------------------


def answer(record: UsageRecord, outcome: Outcome, remaining: int | None) -> TurnReply:
    """The billed turn's reply with what is left of its run's budget (None: no cap), or
    its call's error, carrying the turn id, what it cost and how it ended."""
    if outcome.error is not None:
        outcome.error.details.update(
            turn_id=record.turn_id, cost_micros=record.cost_micros, status=record.status
        )
        raise outcome.error
    assert record.reply is not None  # a call without an error has a reply
    return record.reply.model_copy(update={"budget_remaining_micros": remaining})
