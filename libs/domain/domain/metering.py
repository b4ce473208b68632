"""Metering's pure rules: the binding cascade, price arithmetic and budget reservation.

Invariants kept here:
- A binding is resolved session > agent (within the project) > agent (anywhere) >
  project > workspace: the most specific level that has one decides.
- A call's cost is computed once from integer µUSD-per-million-token prices and
  rounded once (half up), so summing rows never drifts from the provider's bill by
  more than half a µUSD per call.
- A run's budget is never promised twice: a turn is admitted only when its worst
  case fits in `budget - spent - reserved`; the caller holds the run's row lock
  while deciding (checking, calling, then adding would let parallel turns overspend
  by their number).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from uuid import UUID

from contracts.common import ErrorCode
from contracts.metering import Binding, LimitUse, SetBinding, SetLimits, TokenUsage
from domain.errors import DomainError

MICROS_PER_MILLION_TOKENS = 1_000_000

# --- bindings ----------------------------------------------------------------

# Which keys each level needs (True), may have (None) or must not have (False).
BINDING_KEYS: dict[str, dict[str, bool | None]] = {
    "session": {"session_id": True, "agent_slug": False, "project_id": False},
    "agent": {"session_id": False, "agent_slug": True, "project_id": None},
    "project": {"session_id": False, "agent_slug": False, "project_id": True},
    "workspace": {"session_id": False, "agent_slug": False, "project_id": False},
}


def check_binding(cmd: SetBinding) -> None:
    """Refuse a binding whose keys do not fit its level (a session binding with no session…)."""
    for key, rule in BINDING_KEYS[cmd.scope].items():
        present = getattr(cmd, key) is not None
        if rule is True and not present:
            raise DomainError(
                ErrorCode.INVALID_BINDING,
                f"a {cmd.scope} binding needs {key}",
                scope=cmd.scope,
                missing=key,
            )
        if rule is False and present:
            raise DomainError(
                ErrorCode.INVALID_BINDING,
                f"a {cmd.scope} binding does not take {key}; remove it or choose another scope",
                scope=cmd.scope,
                unexpected=key,
            )


def _rank(
    binding: Binding, agent_slug: str, project_id: str, session_id: UUID | None
) -> int | None:
    """How specific `binding` is for this call (lower wins), or None when it does not apply."""
    if binding.scope == "session":
        return 0 if session_id is not None and binding.session_id == session_id else None
    if binding.scope == "agent":
        if binding.agent_slug != agent_slug:
            return None
        if binding.project_id is None:
            return 2
        return 1 if binding.project_id == project_id else None
    if binding.scope == "project":
        return 3 if binding.project_id == project_id else None
    return 4


def resolve_binding(
    bindings: Iterable[Binding], agent_slug: str, project_id: str, session_id: UUID | None
) -> Binding | None:
    """The binding that decides the model of this call, following the cascade."""
    best: tuple[int, Binding] | None = None
    for binding in bindings:
        rank = _rank(binding, agent_slug, project_id, session_id)
        if rank is not None and (best is None or rank < best[0]):
            best = (rank, binding)
    return best[1] if best else None


# --- prices ------------------------------------------------------------------


@dataclass(frozen=True)
class Price:
    """A model's list price from `effective_from` on, in µUSD per million tokens."""

    model: str
    effective_from: date
    input: int
    output: int
    cache_write_5m: int
    cache_write_1h: int
    cache_read: int

    @property
    def worst_input(self) -> int:
        """The dearest way an input token can be billed (a cache write costs more than input)."""
        return max(self.input, self.cache_write_5m, self.cache_write_1h)


def price_on(prices: Sequence[Price], model: str, day: date) -> Price | None:
    """The price of `model` in force on `day`: the latest one effective by then."""
    candidates = [p for p in prices if p.model == model and p.effective_from <= day]
    return max(candidates, key=lambda p: p.effective_from) if candidates else None


def _round_half_up(numerator: int, denominator: int) -> int:
    return (numerator + denominator // 2) // denominator


def cost_micros(usage: TokenUsage, price: Price) -> int:
    """What a call cost in µUSD: every token class at its own price, rounded once."""
    exact = (
        usage.input_tokens * price.input
        + usage.output_tokens * price.output
        + usage.cache_write_5m_tokens * price.cache_write_5m
        + usage.cache_write_1h_tokens * price.cache_write_1h
        + usage.cache_read_tokens * price.cache_read
    )
    return _round_half_up(exact, MICROS_PER_MILLION_TOKENS)


# A Claude token covers about 3.5 characters of English; 2 UTF-8 bytes per token is
# a deliberately pessimistic floor (code, Portuguese, CJK), because the reservation
# must not fall short of the real bill. Each message adds framing tokens.
BYTES_PER_TOKEN_FLOOR = 2
TOKENS_PER_MESSAGE = 8


def estimate_input_tokens(prompt_bytes: int, message_count: int) -> int:
    """A pessimistic count of the input tokens of a request of `prompt_bytes` bytes."""
    return -(-prompt_bytes // BYTES_PER_TOKEN_FLOOR) + TOKENS_PER_MESSAGE * (message_count + 1)


def worst_case_micros(input_tokens: int, max_tokens: int, price: Price) -> int:
    """The most a call can cost: every input token at its dearest, `max_tokens` of output."""
    exact = input_tokens * price.worst_input + max_tokens * price.output
    return -(-exact // MICROS_PER_MILLION_TOKENS)  # rounded up: a hold never falls short


# --- budgets -----------------------------------------------------------------


@dataclass(frozen=True)
class RunBudget:
    """A run's budget as stored: the cap, what settled turns spent, what live turns hold."""

    budget: int | None
    spent: int
    reserved: int

    @property
    def remaining(self) -> int | None:
        """What a new turn may still hold; None when the run has no cap."""
        return None if self.budget is None else self.budget - self.spent - self.reserved


def choose_budget(recorded: int | None, requested: int | None, run_id: str) -> int | None:
    """The run's cap: set by the first turn that names one; a different figure later is refused."""
    if requested is None or recorded == requested:
        return recorded
    if recorded is None:
        return requested
    raise DomainError(
        ErrorCode.BUDGET_MISMATCH,
        f"run {run_id} already has a budget of {recorded} µUSD; this turn asked for {requested}. "
        "Send the same budget on every turn of a run, or start a new run.",
        run_id=run_id,
        budget_micros=recorded,
        requested_micros=requested,
    )


def reserve(run: RunBudget, worst_case: int, run_id: str) -> RunBudget:
    """The run after holding `worst_case` for a turn, or `budget_exceeded` when it does not fit."""
    remaining = run.remaining
    if remaining is not None and worst_case > remaining:
        raise DomainError(
            ErrorCode.BUDGET_EXCEEDED,
            f"run {run_id} has {max(remaining, 0)} µUSD left and this turn may cost up to "
            f"{worst_case} µUSD; nothing was called. Lower max_tokens or shorten the prompt.",
            run_id=run_id,
            remaining_micros=max(remaining, 0),
            required_micros=worst_case,
            budget_micros=run.budget,
        )
    return RunBudget(run.budget, run.spent, run.reserved + worst_case)


def settle(run: RunBudget, hold: int, cost: int) -> RunBudget:
    """The run after a turn that held `hold` turned out to cost `cost`."""
    return RunBudget(run.budget, run.spent + cost, run.reserved - hold)


# --- limits ------------------------------------------------------------------
# A project's and a person's spend per UTC day and month and their calls and tokens per
# minute are counted per window; a call is admitted only if its worst case fits under
# every limit that applies (the SQL holds it there atomically). These are the rules
# around that: when a window resets, what a refusal says.


def window_start(window: str, at: datetime) -> datetime:
    """The UTC start of the `window` ('minute', 'day', 'month') that holds `at`."""
    at = at.astimezone(UTC)
    if window == "minute":
        return at.replace(second=0, microsecond=0)
    if window == "day":
        return at.replace(hour=0, minute=0, second=0, microsecond=0)
    if window == "month":
        return at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    raise ValueError(f"unknown window {window!r}")


def window_end(window: str, starts: datetime) -> datetime:
    """When the window that began at `starts` resets (the next one begins)."""
    if window == "minute":
        return starts + timedelta(minutes=1)
    if window == "day":
        return starts + timedelta(days=1)
    if window == "month":
        year, month = divmod(starts.month, 12)
        return starts.replace(year=starts.year + year, month=month + 1)
    raise ValueError(f"unknown window {window!r}")


_PER = {"day": "daily", "month": "monthly", "minute": "per-minute"}


def _usd(micros: int) -> str:
    return f"${micros / 1_000_000:,.2f}"


def limit_refusal(use: LimitUse, now: datetime, amount: int = 0) -> DomainError:
    """The refusal of a call (that may cost `amount`) under a limit it does not fit:
    `budget_exceeded` for money, `rate_limited` for calls and tokens per minute, with
    when it resets."""
    resets = use.resets_at
    details: dict[str, object] = {
        "scope": use.scope,
        "name": use.name,
        "metric": use.metric,
        "window": use.window,
        "limit": use.limit,
        "used": use.used + use.held,
        "resets_at": resets.isoformat(),
    }
    who = f"{use.scope} {use.name}"
    cost = f" and this call may cost up to {_usd(amount)}" if amount else ""
    if use.metric == "micros":
        return DomainError(
            ErrorCode.BUDGET_EXCEEDED,
            f"{who} has used {_usd(use.used + use.held)} of its {_PER[use.window]} limit of "
            f"{_usd(use.limit)}{cost}; nothing was called. "
            f"The limit resets at {resets:%Y-%m-%d %H:%M} UTC.",
            **details,
        )
    retry_after = max(1, int((resets - now).total_seconds() + 0.999))
    unit = "calls" if use.metric == "requests" else "tokens"
    return DomainError(
        ErrorCode.RATE_LIMITED,
        f"{who} is at its limit of {use.limit:,} {unit} a minute; nothing was called. "
        f"Try again in {retry_after} s.",
        **details,
        retry_after_seconds=retry_after,
    )


PROJECT_NAME = re.compile(r"^(\*|[A-Za-z0-9_-]{1,64})$")


def check_limits(cmd: SetLimits) -> None:
    """Refuse limits set on a name that cannot be a project's (a person's may hold `.` or `@`)."""
    if cmd.scope == "project" and not PROJECT_NAME.match(cmd.name):
        raise DomainError(
            ErrorCode.INVALID_LIMITS,
            f"{cmd.name!r} is not a project id (letters, digits, _ and -) nor '*'",
            scope=cmd.scope,
            name=cmd.name,
        )
