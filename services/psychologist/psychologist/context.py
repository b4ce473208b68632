"""The analysis context as the model reads it: facts, rules, standing hypotheses, the log.

The session's log comes last and every line ends with its `event_id`, so the ids the
model is asked to cite are the ones nearest to its answer. Ids of other sessions (rules
and hypotheses recorded elsewhere) are left out on purpose: they could only be cited by
mistake, and a citation of another session rejects the whole batch (decision 3).

Business rules the person retracted or replaced are shown, marked, not left out: the
Psicólogo judges how the agents behaved, and a rule the person had to take back or
correct is itself evidence of how Criativo listened (a rule the person never stated, a
misread detail). Marked, so they are never taken for rules that stand; the retraction
or correction, when it is of this session, is in the log below with its id.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files

from contracts.events import Event, EventType
from contracts.psychologist import Hypothesis
from contracts.session_events import SessionView
from domain.log_rules import retirements
from domain.psychologist import Termination

# One event's payload is cut beyond this, so a single huge event cannot crowd out the rest.
MAX_PAYLOAD_CHARS = 2000
# The whole log is cut beyond this: the prompt travels in one NATS message (1 MiB by
# default) to metering. The beginning and the end of a long session are kept, where
# its course is set and where it ended; the middle is summarised by type.
MAX_LOG_CHARS = 600_000


def system_prompt() -> str:
    """The Psicólogo's instructions, kept next to the service (`prompt.md`)."""
    return files("psychologist").joinpath("prompt.md").read_text(encoding="utf-8")


@dataclass(frozen=True)
class AnalysisContext:
    """Everything an analysis is given, as read from the log and this service's tables."""

    session: SessionView
    events: Sequence[Event]
    # The project's `artifact.business_rule` events, and its retractions (which say
    # which rules stopped standing); oldest first.
    business_rules: Sequence[Event]
    earlier: Sequence[Hypothesis]
    termination: Termination


def _payload(event: Event) -> str:
    text = json.dumps(event.payload, ensure_ascii=False, separators=(",", ":"))
    if len(text) > MAX_PAYLOAD_CHARS:
        return text[:MAX_PAYLOAD_CHARS] + f"…(cut, {len(text)} chars)"
    return text


def _event_line(event: Event) -> str:
    caused = f" caused_by={event.causation_id}" if event.causation_id else ""
    return (
        f"#{event.seq} {event.created_at.isoformat(timespec='seconds')} {event.type.value} "
        f"by {event.actor}{caused} {_payload(event)} event_id: {event.id}"
    )


def render(ctx: AnalysisContext) -> str:
    """The first user message of the analysis."""
    session = ctx.session
    lines = [
        "# Facts",
        f"Project: {session.project_id}. Session opened by {session.opened_by} at "
        f"{session.opened_at.isoformat(timespec='seconds')}, ended at "
        f"{session.closed_at.isoformat(timespec='seconds') if session.closed_at else 'unknown'}"
        f", {len(ctx.events)} events.",
        f"Termination ({ctx.termination.kind.value}): {ctx.termination.fact()}",
        f"termination_analysis is {'REQUIRED on at least one' if ctx.termination.abnormal else 'optional on every'} hypothesis.",  # noqa: E501
        "",
        "# Business rules of the project",
    ]
    rules = [r for r in ctx.business_rules if r.type is EventType.ARTIFACT_BUSINESS_RULE]
    retired = retirements(ctx.business_rules)
    for rule in rules:
        here = " (recorded in this session)" if rule.session_id == session.session_id else ""
        lines.append(
            f"- {rule.payload.get('title', '')}: {rule.payload.get('statement', '')}{here}"
            f"{_standing(rule, retired.get(rule.id))}"
        )
    if not rules:
        lines.append("(none recorded)")
    lines += ["", "# Hypotheses standing for this project (not dismissed)"]
    for h in ctx.earlier:
        lines.append(
            f"- about {h.target_agent} ({h.status}, confidence {h.confidence}): {h.statement}"
        )
    if not ctx.earlier:
        lines.append("(none)")
    lines += ["", "# The session's event log, oldest first"]
    lines.extend(fit_log(ctx.events, MAX_LOG_CHARS))
    return "\n".join(lines)


def _standing(rule: Event, retired_by: Event | None) -> str:
    """What a rule's line says of where it stands: a correction, retracted, replaced."""
    said = " — the person's correction of an earlier rule" if rule.payload.get("replaces") else ""
    if retired_by is None:
        return said
    if retired_by.type is EventType.ARTIFACT_BUSINESS_RULE:
        new = retired_by.payload.get("title", "")
        return f"{said} — NO LONGER STANDS: the person replaced it with {new!r}"
    reason = retired_by.payload.get("reason")
    because = f" ({reason})" if reason else ""
    return f"{said} — NO LONGER STANDS: the person retracted it{because}"


def fit_log(events: Sequence[Event], budget_chars: int) -> list[str]:
    """The log's lines within `budget_chars`: all of them when they fit, else the first
    third and the last two thirds of the budget, with the events between summarised."""
    lines = [_event_line(e) for e in events]
    if sum(len(line) + 1 for line in lines) <= budget_chars:
        return lines
    head: list[str] = []
    used = 0
    for line in lines:
        if used + len(line) + 1 > budget_chars // 3:
            break
        head.append(line)
        used += len(line) + 1
    tail: list[str] = []
    for line in reversed(lines[len(head) :]):
        if used + len(line) + 1 > budget_chars:
            break
        tail.insert(0, line)
        used += len(line) + 1
    omitted = events[len(head) : len(events) - len(tail)]
    by_type: dict[str, int] = {}
    for event in omitted:
        by_type[event.type.value] = by_type.get(event.type.value, 0) + 1
    counts = ", ".join(f"{n} {t}" for t, n in sorted(by_type.items()))
    gap = (
        f"… {len(omitted)} events omitted to fit the prompt (#{omitted[0].seq}–"
        f"#{omitted[-1].seq}: {counts}); cite only events shown here"
        if omitted
        else ""
    )
    return [*head, gap, *tail] if gap else [*head, *tail]
