"""Metering's series on the service's /metrics (servicekit.metrics): what every provider
call cost, per model and agent (the same numbers as its `token_usage` row), the calls
the limits refused, and what each project used of its budget."""

from __future__ import annotations

from collections.abc import Iterable

from contracts.metering import LimitUse
from domain.metering_turn import UsageRecord
from metering.budgets import CounterUse
from metering.repository import Bill
from servicekit.metrics import SECONDS, Counter, Gauge, Histogram

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


def observe_refusal(use: LimitUse) -> None:
    """Count a call a limit refused."""
    LIMIT_REFUSALS.labels(use.scope, use.metric).inc()


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
