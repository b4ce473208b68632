"""Metering's pure rules, called directly: cascade, prices, reservation."""

from __future__ import annotations

from datetime import date
from uuid import UUID

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.common import ErrorCode
from contracts.metering import Binding, SetBinding, TokenUsage
from domain.errors import DomainError
from domain.metering import (
    Price,
    RunBudget,
    check_binding,
    choose_budget,
    cost_micros,
    estimate_input_tokens,
    price_on,
    reserve,
    resolve_binding,
    settle,
    worst_case_micros,
)

pure = settings(database=None, deadline=None)

SESSION = UUID("00000000-0000-4000-8000-000000000001")
OTHER_SESSION = UUID("00000000-0000-4000-8000-000000000002")

WORKSPACE = Binding(scope="workspace", model="m-workspace")
PROJECT = Binding(scope="project", project_id="p1", model="m-project")
AGENT_ANYWHERE = Binding(scope="agent", agent_slug="criativo", model="m-agent")
AGENT_IN_PROJECT = Binding(
    scope="agent", agent_slug="criativo", project_id="p1", model="m-agent-p1"
)
SESSION_BINDING = Binding(scope="session", session_id=SESSION, model="m-session")
ALL = [WORKSPACE, PROJECT, AGENT_ANYWHERE, AGENT_IN_PROJECT, SESSION_BINDING]


@pytest.mark.parametrize(
    ("bindings", "agent", "project", "session", "expected"),
    [
        # each level overrides the ones below it
        (ALL, "criativo", "p1", SESSION, "m-session"),
        (ALL, "criativo", "p1", None, "m-agent-p1"),
        (ALL, "criativo", "p2", None, "m-agent"),
        (ALL, "psicologo", "p1", None, "m-project"),
        (ALL, "psicologo", "p2", None, "m-workspace"),
        # a session binding of another session does not apply
        (ALL, "criativo", "p1", OTHER_SESSION, "m-agent-p1"),
        # the order the bindings come in does not matter
        (list(reversed(ALL)), "criativo", "p1", SESSION, "m-session"),
        (list(reversed(ALL)), "psicologo", "p1", None, "m-project"),
        # an agent binding of another project does not apply
        ([WORKSPACE, AGENT_IN_PROJECT], "criativo", "p2", None, "m-workspace"),
        ([], "criativo", "p1", None, None),
    ],
)
def test_cascade_session_over_agent_over_project_over_workspace(
    bindings: list[Binding], agent: str, project: str, session: UUID | None, expected: str | None
) -> None:
    decided = resolve_binding(bindings, agent, project, session)
    assert (decided.model if decided else None) == expected


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"scope": "session"}, "missing"),
        ({"scope": "session", "session_id": SESSION, "agent_slug": "criativo"}, "unexpected"),
        ({"scope": "agent"}, "missing"),
        ({"scope": "agent", "agent_slug": "criativo", "session_id": SESSION}, "unexpected"),
        ({"scope": "project"}, "missing"),
        ({"scope": "project", "project_id": "p1", "agent_slug": "x"}, "unexpected"),
        ({"scope": "workspace", "project_id": "p1"}, "unexpected"),
    ],
)
def test_a_binding_whose_keys_do_not_fit_its_level_is_refused(
    fields: dict[str, object], problem: str
) -> None:
    with pytest.raises(DomainError) as refused:
        check_binding(SetBinding.model_validate({**fields, "model": "m"}))
    assert refused.value.code == ErrorCode.INVALID_BINDING
    assert problem in refused.value.details


@pytest.mark.parametrize(
    "fields",
    [
        {"scope": "session", "session_id": SESSION},
        {"scope": "agent", "agent_slug": "criativo"},
        {"scope": "agent", "agent_slug": "criativo", "project_id": "p1"},
        {"scope": "project", "project_id": "p1"},
        {"scope": "workspace"},
    ],
)
def test_well_formed_bindings_pass(fields: dict[str, object]) -> None:
    check_binding(SetBinding.model_validate({**fields, "model": "m"}))


# Sonnet-like list prices, µUSD per million tokens.
SONNET = Price("sonnet", date(2026, 1, 1), 3_000_000, 15_000_000, 3_750_000, 6_000_000, 300_000)


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (TokenUsage(), 0),
        (TokenUsage(input_tokens=1_000_000), 3_000_000),
        (TokenUsage(output_tokens=1_000), 15_000),
        (TokenUsage(cache_write_5m_tokens=1_000), 3_750),
        (TokenUsage(cache_write_1h_tokens=1_000), 6_000),
        (TokenUsage(cache_read_tokens=1_000), 300),
        # every class at its own price, summed exactly then rounded once:
        # 1234*3 + 567*15 + 89*3.75 + 10*6 + 4321*0.3 = 3702+8505+333.75+60+1296.3 = 13897.05
        (
            TokenUsage(
                input_tokens=1234,
                output_tokens=567,
                cache_write_5m_tokens=89,
                cache_write_1h_tokens=10,
                cache_read_tokens=4321,
            ),
            13_897,
        ),
        # rounding once, half up: 1 read token = 0.3 µUSD -> 0; 2 -> 0.6 -> 1
        (TokenUsage(cache_read_tokens=1), 0),
        (TokenUsage(cache_read_tokens=2), 1),
    ],
)
def test_cost_prices_each_token_class_and_rounds_once(usage: TokenUsage, expected: int) -> None:
    assert cost_micros(usage, SONNET) == expected


def test_rounding_once_differs_from_rounding_each_class() -> None:
    # 1 read token (0.3) + 1 input token at a price of 0.3 too: once = round(0.6) = 1
    price = Price("x", date(2026, 1, 1), 300_000, 0, 0, 0, 300_000)
    assert cost_micros(TokenUsage(input_tokens=1, cache_read_tokens=1), price) == 1


def test_price_on_takes_the_latest_effective_price() -> None:
    old = Price("m", date(2025, 1, 1), 1, 1, 1, 1, 1)
    new = Price("m", date(2026, 6, 1), 2, 2, 2, 2, 2)
    other = Price("n", date(2024, 1, 1), 9, 9, 9, 9, 9)
    prices = [new, other, old]
    assert price_on(prices, "m", date(2026, 5, 31)) == old
    assert price_on(prices, "m", date(2026, 6, 1)) == new
    assert price_on(prices, "m", date(2024, 12, 31)) is None
    assert price_on(prices, "zzz", date(2026, 6, 1)) is None


def test_worst_case_prices_input_at_the_dearest_rate_and_rounds_up() -> None:
    # 1000 input at the 1h cache-write rate (6) + 100 output at 15 = 6000 + 1500
    assert worst_case_micros(1000, 100, SONNET) == 7_500
    # one input token at the dearest rate: 6_000_000 µUSD per million tokens = 6 µUSD
    assert worst_case_micros(1, 0, SONNET) == 6
    cheap = Price("c", date(2026, 1, 1), 1, 1, 1, 1, 1)
    assert worst_case_micros(1, 1, cheap) == 1  # 2e-6 µUSD rounds up, never down to 0


@pytest.mark.parametrize(
    ("prompt_bytes", "messages", "expected"),
    [(0, 1, 16), (1, 1, 17), (2, 1, 17), (1000, 3, 532)],
)
def test_input_estimate_is_pessimistic(prompt_bytes: int, messages: int, expected: int) -> None:
    assert estimate_input_tokens(prompt_bytes, messages) == expected


@pytest.mark.parametrize(
    ("run", "worst", "fits"),
    [
        (RunBudget(None, 10**9, 10**9), 10**9, True),  # no cap
        (RunBudget(100, 0, 0), 100, True),  # exactly fits
        (RunBudget(100, 0, 0), 101, False),
        (RunBudget(100, 40, 0), 60, True),
        (RunBudget(100, 40, 1), 60, False),  # a live hold counts like spending
        (RunBudget(100, 120, 0), 0, False),  # overspent (an estimate fell short): nothing fits
        (RunBudget(0, 0, 0), 0, True),
    ],
)
def test_reserve_admits_a_turn_only_when_its_worst_case_fits(
    run: RunBudget, worst: int, fits: bool
) -> None:
    if fits:
        after = reserve(run, worst, "r")
        assert (after.spent, after.reserved) == (run.spent, run.reserved + worst)
    else:
        with pytest.raises(DomainError) as refused:
            reserve(run, worst, "r")
        assert refused.value.code == ErrorCode.BUDGET_EXCEEDED
        assert refused.value.details["required_micros"] == worst
        assert refused.value.details["remaining_micros"] >= 0


def test_settle_releases_the_hold_and_adds_the_real_cost() -> None:
    after = settle(RunBudget(1000, 100, 500), hold=300, cost=120)
    assert (after.spent, after.reserved, after.remaining) == (220, 200, 580)


@pytest.mark.parametrize(
    ("recorded", "requested", "expected"),
    [(None, None, None), (None, 50, 50), (50, None, 50), (50, 50, 50)],
)
def test_the_first_budget_named_is_the_runs(
    recorded: int | None, requested: int | None, expected: int | None
) -> None:
    assert choose_budget(recorded, requested, "r") == expected


def test_a_different_budget_for_the_same_run_is_refused() -> None:
    with pytest.raises(DomainError) as refused:
        choose_budget(50, 60, "r")
    assert refused.value.code == ErrorCode.BUDGET_MISMATCH


@pure
@given(
    budget=st.integers(0, 10_000),
    turns=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 3000)), max_size=40),
)
def test_admitted_turns_never_spend_more_than_the_budget(
    budget: int, turns: list[tuple[int, int]]
) -> None:
    """Whatever order holds and settlements come in, if no turn costs more than it held,
    the run never spends more than its budget."""
    run = RunBudget(budget, 0, 0)
    live: list[tuple[int, int]] = []
    for worst, actual in turns:
        try:
            run = reserve(run, worst, "r")
            live.append((worst, min(actual, worst)))
        except DomainError:
            if live:  # settle the oldest live turn, freeing room
                hold, cost = live.pop(0)
                run = settle(run, hold, cost)
        assert run.spent + run.reserved <= budget
    for hold, cost in live:
        run = settle(run, hold, cost)
    assert run.spent <= budget and run.reserved == 0
