"""A metered turn's decisions, called directly: its hold, its run's reservation, the
answer to a turn id that already ran, its bill and its reply."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any
from uuid import UUID

import pytest

from contracts.common import ErrorCode
from contracts.metering import (
    ChatMessage,
    LlmStream,
    LlmTurn,
    ReplyBlock,
    TextBlock,
    TokenUsage,
    TurnReply,
)
from domain.errors import DomainError
from domain.metering import Price, RunBudget
from domain.metering_turn import (
    CANCELLED,
    EndedTurn,
    Outcome,
    Timing,
    answer,
    check_owner,
    hold_for,
    may_replay,
    owner_of,
    prompt_bytes,
    repeat,
    replay_refused,
    reserved,
    reserved_if_fits,
    usage_record,
)

SESSION = UUID("00000000-0000-4000-8000-000000000001")
# Sonnet-like list prices, µUSD per million tokens.
SONNET = Price("sonnet", date(2026, 1, 1), 3_000_000, 15_000_000, 3_750_000, 6_000_000, 300_000)


def turn(**fields: Any) -> LlmTurn:
    base: dict[str, Any] = {
        "run_id": "run-1",
        "turn_id": "turn-1",
        "agent_slug": "criativo",
        "project_id": "p1",
        "session_id": SESSION,
        "person": "ana",
        "messages": [ChatMessage(role="user", content="x" * 100)],
        "max_tokens": 1000,
    }
    return LlmTurn.model_validate({**base, **fields})


@dataclass(frozen=True)
class Said:
    """A provider's whole message."""

    content: list[ReplyBlock]
    stop_reason: str
    model: str


STORED = TurnReply(
    turn_id="turn-1",
    content=[TextBlock(text="hi")],
    stop_reason="end_turn",
    model="sonnet",
    usage=TokenUsage(input_tokens=10, output_tokens=2),
    cost_micros=60,
    budget_remaining_micros=None,
)


# --- the hold ------------------------------------------------------------------


def test_the_hold_is_the_worst_case_of_the_estimated_prompt_and_max_tokens() -> None:
    cmd = turn()
    hold = hold_for(cmd, SONNET)
    # 2 bytes a token, 8 framing tokens a message and 8 more
    input_estimate = -(-prompt_bytes(cmd) // 2) + 16
    assert hold.tokens == input_estimate + 1000
    # input at the dearest rate (the 1-hour cache write), output at its own; rounded up
    assert hold.micros == -(-(input_estimate * 6_000_000 + 1000 * 15_000_000) // 1_000_000)
    assert hold.owner == owner_of(cmd)


@pytest.mark.parametrize(
    ("change", "same_owner"),
    [
        # a retry whose prompt was rebuilt is the same request
        ({"messages": [ChatMessage(role="user", content="other bytes")]}, True),
        ({"max_tokens": 5}, True),
        # anything that says whose request it is makes another one
        ({"run_id": "run-2"}, False),
        ({"project_id": "p2"}, False),
        ({"session_id": None}, False),
        ({"person": "bia"}, False),
        ({"person": None}, False),
        ({"agent_slug": "psicologo"}, False),
    ],
)
def test_the_owner_of_a_turn_id_is_who_asked_not_what_was_asked(
    change: dict[str, Any], same_owner: bool
) -> None:
    assert (owner_of(turn(**change)) == owner_of(turn())) is same_owner


# --- the run's reservation -----------------------------------------------------


@pytest.mark.parametrize(
    ("run", "requested", "hold", "expected", "refused"),
    [
        # the run's first turn names its budget
        (RunBudget(None, 0, 0), 1_000, 400, RunBudget(1_000, 0, 400), None),
        # no budget named: no cap, anything fits
        (RunBudget(None, 0, 0), None, 10**9, RunBudget(None, 0, 10**9), None),
        # a later turn may leave it out, or repeat it
        (RunBudget(1_000, 300, 200), None, 500, RunBudget(1_000, 300, 700), None),
        (RunBudget(1_000, 300, 200), 1_000, 500, RunBudget(1_000, 300, 700), None),
        # what is spent and what live turns hold are both taken
        (RunBudget(1_000, 300, 200), None, 501, None, ErrorCode.BUDGET_EXCEEDED),
        # another figure is refused
        (RunBudget(1_000, 0, 0), 2_000, 1, None, ErrorCode.BUDGET_MISMATCH),
    ],
)
def test_a_turn_is_reserved_only_when_its_hold_fits_the_run(
    run: RunBudget, requested: int | None, hold: int, expected: RunBudget | None, refused: str
) -> None:
    cmd = turn(budget_micros=requested)
    if refused is None:
        assert reserved(run, cmd, hold) == expected
        assert reserved_if_fits(run, cmd, hold) == expected
        return
    with pytest.raises(DomainError) as refusal:
        reserved(run, cmd, hold)
    assert refusal.value.code == refused
    # on the row as this replica saw it, a refusal is not final: the locked row decides
    assert reserved_if_fits(run, cmd, hold) is None


def test_a_run_without_a_row_is_reserved_as_an_empty_one() -> None:
    assert reserved_if_fits(None, turn(budget_micros=900), 100) == RunBudget(900, 0, 100)


# --- a turn id that was claimed already ----------------------------------------

RAN = EndedTurn("ok", None, STORED)
FAILED = EndedTurn("error", ErrorCode.PROVIDER_ERROR, None)
BROKE = DomainError(ErrorCode.BUDGET_EXCEEDED, "no room")
REUSED = DomainError(ErrorCode.TURN_ID_REUSED, "reused")


@pytest.mark.parametrize(
    ("refusal", "ended", "answered"),
    [
        # a turn that ran is answered from its row even when its run is broke today
        (BROKE, RAN, "duplicate"),
        (BROKE, FAILED, ErrorCode.TURN_ALREADY_FAILED),
        (BROKE, None, ErrorCode.BUDGET_EXCEEDED),
    ],
)
def test_a_refused_reservation_is_answered_from_the_row_when_the_turn_ran(
    refusal: DomainError, ended: EndedTurn | None, answered: str
) -> None:
    assert may_replay(refusal)
    if answered == "duplicate":
        assert replay_refused("turn-1", refusal, ended) == STORED.model_copy(
            update={"duplicate": True}
        )
        return
    with pytest.raises(DomainError) as refused:
        replay_refused("turn-1", refusal, ended)
    assert refused.value.code == answered


def test_a_reused_turn_id_is_refused_whatever_its_row_says() -> None:
    assert not may_replay(REUSED)


@pytest.mark.parametrize(
    ("claimed_for", "ended", "answered"),
    [
        ("me", RAN, "duplicate"),
        (None, RAN, "duplicate"),  # no owner noted on the claim
        ("me", FAILED, ErrorCode.TURN_ALREADY_FAILED),
        ("me", None, ErrorCode.TURN_IN_PROGRESS),
        ("someone else", RAN, ErrorCode.TURN_ID_REUSED),
        ("someone else", None, ErrorCode.TURN_ID_REUSED),
    ],
)
def test_a_claimed_turn_id_is_answered_from_its_row_for_its_owner_only(
    claimed_for: str | None, ended: EndedTurn | None, answered: str
) -> None:
    def answer_to_repeat() -> TurnReply:
        check_owner("turn-1", "me", claimed_for)
        return repeat("turn-1", ended)

    if answered == "duplicate":
        reply = answer_to_repeat()
        assert reply.duplicate and reply.content == STORED.content
        return
    with pytest.raises(DomainError) as refused:
        answer_to_repeat()
    assert refused.value.code == answered


# --- the bill and the reply ----------------------------------------------------

USED = TokenUsage(input_tokens=1_000, output_tokens=100)  # 3,000 + 1,500 µUSD
TIMING = Timing(1_800_000_000.0, 1_800_000_001.0, 1_800_000_002.0)
FAILURE = DomainError(ErrorCode.PROVIDER_OVERLOADED, "overloaded")


@pytest.mark.parametrize(
    ("outcome", "stream", "row"),
    [
        (
            Outcome(Said([TextBlock(text="hi")], "end_turn", "sonnet-1"), "ok"),
            False,
            ("turn", None),
        ),
        (Outcome(Said([], CANCELLED, "sonnet"), CANCELLED), True, ("stream", None)),
        (
            Outcome(None, "error", FAILURE),
            True,
            ("stream", ErrorCode.PROVIDER_OVERLOADED),
        ),
    ],
)
def test_every_call_is_billed_at_its_usage_whatever_its_outcome(
    outcome: Outcome, stream: bool, row: tuple[str, str | None]
) -> None:
    cmd = (
        LlmStream.model_validate({**turn().model_dump(), "delta_subject": "_INBOX.x"})
        if stream
        else turn()
    )
    record = usage_record(cmd, "anthropic", "sonnet", SONNET, USED, outcome, TIMING)
    assert (record.kind, record.error_code) == row
    assert (record.status, record.cost_micros, record.usage) == (outcome.status, 4_500, USED)
    assert (record.provider, record.model, record.run_id) == ("anthropic", "sonnet", "run-1")
    assert record.started_at == datetime.fromtimestamp(TIMING.started, UTC)
    assert record.first_token_at == datetime.fromtimestamp(1_800_000_001.0, UTC)
    if outcome.reply is None:
        assert record.reply is None and record.error_message == "overloaded"
        return
    assert record.reply is not None
    assert (record.reply.model, record.reply.stop_reason) == (
        outcome.reply.model,
        outcome.reply.stop_reason,
    )
    assert (record.reply.cost_micros, record.reply.usage) == (4_500, USED)


def test_a_call_without_text_has_no_first_token() -> None:
    outcome = Outcome(None, "error", FAILURE)
    record = usage_record(turn(), "openai", "m", SONNET, TokenUsage(), outcome, Timing(1, None, 2))
    assert record.first_token_at is None and record.cost_micros == 0


def test_the_reply_carries_what_is_left_of_the_run() -> None:
    outcome = Outcome(Said([TextBlock(text="hi")], "end_turn", "sonnet"), "ok")
    record = usage_record(turn(), "anthropic", "sonnet", SONNET, USED, outcome, TIMING)
    reply = answer(record, outcome, 12_345)
    assert reply.budget_remaining_micros == 12_345 and not reply.duplicate


def test_a_failed_call_answers_its_error_with_what_it_cost() -> None:
    failure = DomainError(ErrorCode.PROVIDER_ERROR, "boom")
    outcome = Outcome(None, "error", failure)
    record = usage_record(turn(), "anthropic", "sonnet", SONNET, USED, outcome, TIMING)
    with pytest.raises(DomainError) as refused:
        answer(record, outcome, 100)
    assert refused.value is failure
    assert refused.value.details == {"turn_id": "turn-1", "cost_micros": 4_500, "status": "error"}
