"""Every command of the bus, declared once: its subject, who serves it and its models.

AsyncAPI, the fuzz test of every `cmd.*` subject and the NATS permissions are read
off this list; a command that is not here does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts import subjects
from contracts.common import Message
from contracts.handoff import (
    AcceptReply,
    ActivateAgent,
    ActivationReply,
    ActiveAgents,
    ActiveAgentsReply,
    HandoffDecision,
    HandoffReply,
    HandoffsReply,
    ListHandoffs,
    OfferHandoff,
    OfferMany,
    OfferManyReply,
    OfferReply,
)
from contracts.metering import (
    BindingSetReply,
    BindingsReply,
    CancelReply,
    CancelTurn,
    ListBindings,
    LlmStream,
    LlmTurn,
    ResolveBinding,
    ResolvedBinding,
    SetBinding,
    TurnReply,
    UsageSummaryReply,
    UsageSummaryRequest,
)
from contracts.psychologist import (
    AnalysisOutcome,
    HypothesesReply,
    HypothesisDecision,
    HypothesisReply,
    ListHypotheses,
    Reanalyze,
)
from contracts.session_events import (
    AppendedReply,
    AppendEvent,
    CloseSession,
    EventsReply,
    GetEvents,
    HeartbeatReply,
    ListEvents,
    ListSessions,
    OpenSession,
    QueryEvents,
    SessionClosedReply,
    SessionOpenedReply,
    SessionRef,
    SessionsReply,
    SessionView,
    TerminateSession,
)


@dataclass(frozen=True)
class Command:
    """One request/reply command: who serves it (its queue group) and its models."""

    subject: str
    service: str
    request: type[Message]
    reply: type[Message]


COMMANDS = [
    Command(subjects.SESSIONS_OPEN, "session_events", OpenSession, SessionOpenedReply),
    Command(subjects.SESSIONS_CLOSE, "session_events", CloseSession, SessionClosedReply),
    Command(subjects.SESSIONS_TERMINATE, "session_events", TerminateSession, SessionClosedReply),
    Command(subjects.SESSIONS_HEARTBEAT, "session_events", SessionRef, HeartbeatReply),
    Command(subjects.SESSIONS_GET, "session_events", SessionRef, SessionView),
    Command(subjects.SESSIONS_LIST, "session_events", ListSessions, SessionsReply),
    Command(subjects.EVENTS_APPEND, "session_events", AppendEvent, AppendedReply),
    Command(subjects.EVENTS_GET, "session_events", GetEvents, EventsReply),
    Command(subjects.EVENTS_LIST, "session_events", ListEvents, EventsReply),
    Command(subjects.EVENTS_QUERY, "session_events", QueryEvents, EventsReply),
    Command(subjects.HANDOFFS_OFFER, "handoff", OfferHandoff, OfferReply),
    Command(subjects.HANDOFFS_OFFER_MANY, "handoff", OfferMany, OfferManyReply),
    Command(subjects.HANDOFFS_ACCEPT, "handoff", HandoffDecision, AcceptReply),
    Command(subjects.HANDOFFS_REJECT, "handoff", HandoffDecision, HandoffReply),
    Command(subjects.HANDOFFS_COMPLETE, "handoff", HandoffDecision, HandoffReply),
    Command(subjects.HANDOFFS_LIST, "handoff", ListHandoffs, HandoffsReply),
    Command(subjects.AGENTS_ACTIVATE, "handoff", ActivateAgent, ActivationReply),
    Command(subjects.AGENTS_ACTIVE, "handoff", ActiveAgents, ActiveAgentsReply),
    Command(subjects.LLM_TURN, "metering", LlmTurn, TurnReply),
    Command(subjects.LLM_STREAM, "metering", LlmStream, TurnReply),
    Command(subjects.LLM_CANCEL, "metering", CancelTurn, CancelReply),
    Command(subjects.BINDINGS_SET, "metering", SetBinding, BindingSetReply),
    Command(subjects.BINDINGS_LIST, "metering", ListBindings, BindingsReply),
    Command(subjects.BINDINGS_RESOLVE, "metering", ResolveBinding, ResolvedBinding),
    Command(subjects.USAGE_SUMMARY, "metering", UsageSummaryRequest, UsageSummaryReply),
    Command(subjects.PSYCHOLOGIST_REANALYZE, "psychologist", Reanalyze, AnalysisOutcome),
    Command(subjects.HYPOTHESES_ACCEPT, "psychologist", HypothesisDecision, HypothesisReply),
    Command(subjects.HYPOTHESES_DISMISS, "psychologist", HypothesisDecision, HypothesisReply),
    Command(subjects.HYPOTHESES_LIST, "psychologist", ListHypotheses, HypothesesReply),
]
