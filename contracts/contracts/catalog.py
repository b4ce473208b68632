"""Every command of the bus, declared once: its subject, who serves it and its models;
every subject published besides the commands and the log's events (`PUBLICATIONS`); and
what each service does on the bus (`ACCESS`).

AsyncAPI, the reference page, the fuzz test of every `cmd.*` subject and the NATS
permissions are read off these lists; a command or publication that is not here does
not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from contracts import streams, subjects
from contracts.common import Message
from contracts.criativo import AgentDone
from contracts.events import SESSION_CLOSINGS, EventType
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
    LimitsSetReply,
    LimitsStatus,
    LimitsStatusRequest,
    ListBindings,
    LlmStream,
    LlmTurn,
    ResolveBinding,
    ResolvedBinding,
    SetBinding,
    SetLimits,
    TurnDelta,
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
    AppendMany,
    AppendManyReply,
    CloseSession,
    EventsReply,
    ForkSession,
    GetEvents,
    HeartbeatReply,
    ListEvents,
    ListSessions,
    OpenSession,
    QueryEvents,
    SessionClosedReply,
    SessionForkedReply,
    SessionOpenedReply,
    SessionRef,
    SessionsReply,
    SessionView,
    TerminateSession,
)

Req = TypeVar("Req", bound=Message)
Rep = TypeVar("Rep", bound=Message)


@dataclass(frozen=True)
class Command(Generic[Req, Rep]):
    """One request/reply command: who serves it (its queue group) and its models.

    Typed by its models, so a client sending `SESSIONS_OPEN` is checked to send an
    `OpenSession` and handed a `SessionOpenedReply` (`servicekit.client.call`).
    """

    subject: str
    service: str
    request: type[Req]
    reply: type[Rep]


SESSIONS_OPEN = Command(subjects.SESSIONS_OPEN, "session_events", OpenSession, SessionOpenedReply)
SESSIONS_CLOSE = Command(
    subjects.SESSIONS_CLOSE, "session_events", CloseSession, SessionClosedReply
)
SESSIONS_TERMINATE = Command(
    subjects.SESSIONS_TERMINATE, "session_events", TerminateSession, SessionClosedReply
)
SESSIONS_HEARTBEAT = Command(
    subjects.SESSIONS_HEARTBEAT, "session_events", SessionRef, HeartbeatReply
)
SESSIONS_GET = Command(subjects.SESSIONS_GET, "session_events", SessionRef, SessionView)
SESSIONS_LIST = Command(subjects.SESSIONS_LIST, "session_events", ListSessions, SessionsReply)
SESSIONS_FORK = Command(subjects.SESSIONS_FORK, "session_events", ForkSession, SessionForkedReply)
EVENTS_APPEND = Command(subjects.EVENTS_APPEND, "session_events", AppendEvent, AppendedReply)
EVENTS_APPEND_MANY = Command(
    subjects.EVENTS_APPEND_MANY, "session_events", AppendMany, AppendManyReply
)
EVENTS_GET = Command(subjects.EVENTS_GET, "session_events", GetEvents, EventsReply)
EVENTS_LIST = Command(subjects.EVENTS_LIST, "session_events", ListEvents, EventsReply)
EVENTS_QUERY = Command(subjects.EVENTS_QUERY, "session_events", QueryEvents, EventsReply)
HANDOFFS_OFFER = Command(subjects.HANDOFFS_OFFER, "handoff", OfferHandoff, OfferReply)
HANDOFFS_OFFER_MANY = Command(subjects.HANDOFFS_OFFER_MANY, "handoff", OfferMany, OfferManyReply)
HANDOFFS_ACCEPT = Command(subjects.HANDOFFS_ACCEPT, "handoff", HandoffDecision, AcceptReply)
HANDOFFS_REJECT = Command(subjects.HANDOFFS_REJECT, "handoff", HandoffDecision, HandoffReply)
HANDOFFS_COMPLETE = Command(subjects.HANDOFFS_COMPLETE, "handoff", HandoffDecision, HandoffReply)
HANDOFFS_LIST = Command(subjects.HANDOFFS_LIST, "handoff", ListHandoffs, HandoffsReply)
AGENTS_ACTIVATE = Command(subjects.AGENTS_ACTIVATE, "handoff", ActivateAgent, ActivationReply)
AGENTS_ACTIVE = Command(subjects.AGENTS_ACTIVE, "handoff", ActiveAgents, ActiveAgentsReply)
LLM_TURN = Command(subjects.LLM_TURN, "metering", LlmTurn, TurnReply)
LLM_STREAM = Command(subjects.LLM_STREAM, "metering", LlmStream, TurnReply)
LLM_CANCEL = Command(subjects.LLM_CANCEL, "metering", CancelTurn, CancelReply)
BINDINGS_SET = Command(subjects.BINDINGS_SET, "metering", SetBinding, BindingSetReply)
BINDINGS_LIST = Command(subjects.BINDINGS_LIST, "metering", ListBindings, BindingsReply)
BINDINGS_RESOLVE = Command(subjects.BINDINGS_RESOLVE, "metering", ResolveBinding, ResolvedBinding)
USAGE_SUMMARY = Command(subjects.USAGE_SUMMARY, "metering", UsageSummaryRequest, UsageSummaryReply)
LIMITS_SET = Command(subjects.LIMITS_SET, "metering", SetLimits, LimitsSetReply)
LIMITS_STATUS = Command(subjects.LIMITS_STATUS, "metering", LimitsStatusRequest, LimitsStatus)
PSYCHOLOGIST_REANALYZE = Command(
    subjects.PSYCHOLOGIST_REANALYZE, "psychologist", Reanalyze, AnalysisOutcome
)
HYPOTHESES_ACCEPT = Command(
    subjects.HYPOTHESES_ACCEPT, "psychologist", HypothesisDecision, HypothesisReply
)
HYPOTHESES_DISMISS = Command(
    subjects.HYPOTHESES_DISMISS, "psychologist", HypothesisDecision, HypothesisReply
)
HYPOTHESES_LIST = Command(subjects.HYPOTHESES_LIST, "psychologist", ListHypotheses, HypothesesReply)

COMMANDS: list[Command[Any, Any]] = [
    SESSIONS_OPEN,
    SESSIONS_CLOSE,
    SESSIONS_TERMINATE,
    SESSIONS_HEARTBEAT,
    SESSIONS_GET,
    SESSIONS_LIST,
    SESSIONS_FORK,
    EVENTS_APPEND,
    EVENTS_APPEND_MANY,
    EVENTS_GET,
    EVENTS_LIST,
    EVENTS_QUERY,
    HANDOFFS_OFFER,
    HANDOFFS_OFFER_MANY,
    HANDOFFS_ACCEPT,
    HANDOFFS_REJECT,
    HANDOFFS_COMPLETE,
    HANDOFFS_LIST,
    AGENTS_ACTIVATE,
    AGENTS_ACTIVE,
    LLM_TURN,
    LLM_STREAM,
    LLM_CANCEL,
    BINDINGS_SET,
    BINDINGS_LIST,
    BINDINGS_RESOLVE,
    USAGE_SUMMARY,
    LIMITS_SET,
    LIMITS_STATUS,
    PSYCHOLOGIST_REANALYZE,
    HYPOTHESES_ACCEPT,
    HYPOTHESES_DISMISS,
    HYPOTHESES_LIST,
]


# --- What is published besides commands and events -----------------------------------
# Deltas, turn ends, notices and dead letters: declared once here, so the AsyncAPI
# document and the reference describe each, and a service's permission to publish one
# (`ACCESS` below) names the declaration rather than a subject of its own.

# Tokens an address shows where its publisher fills in a value.
PROJECT = "{project_id}"
SESSION = "{session_id}"


@dataclass(frozen=True)
class Publication:
    """A subject published outside request/reply and beside the log's events."""

    # Its name in the AsyncAPI document and the reference.
    title: str
    # The subject, a `{token}` where each message names its own value.
    address: str
    description: str
    # The model of its JSON body; None when the body is not one (said in `description`).
    body: type[Message] | None
    # The stream that keeps it; None: core NATS only, heard by whoever listens then.
    stream: streams.StreamSpec | None

    @property
    def filter(self) -> str:
        """The address as a subject filter, each `{token}` a `*`: what a publisher is
        allowed and a listener subscribes to."""
        tokens = self.address.split(".")
        return ".".join("*" if token.startswith("{") else token for token in tokens)


TURN_DELTA = Publication(
    "agent.delta",
    subjects.delta_subject(PROJECT, SESSION),
    "A streaming turn's text, token by token, as `cmd.llm.stream` publishes it.",
    TurnDelta,
    streams.DELTAS,
)
TURN_DONE = Publication(
    "agent.done",
    subjects.done_subject(PROJECT, SESSION),
    "An agent's turn ended: its response event, or the error code of its agent.error.",
    AgentDone,
    streams.DELTAS,
)
STREAM_BEAT = Publication(
    "metering.alive",
    subjects.alive_subject("{key}"),
    "A beat while metering handles a `cmd.llm.stream` that named this subject; its body is "
    "the turn's id (a caller's streams may share the subject).",
    None,
    None,
)
LEASE_HOLDER = Publication(
    "criativo.holder",
    subjects.holder_subject("{holder}"),
    "A request to the Criativo process `{holder}`, whose id a session's lease carries: it "
    "answers while it lives. A replica waiting for the session asks it; NATS answering "
    '"no responders" (twice, a reconnect apart) means the process is gone, and its lease is '
    "taken at once instead of after the bucket's TTL. The bodies are empty.",
    None,
    None,
)
BINDINGS_CHANGED = Publication(
    "metering.bindings_changed",
    subjects.BINDINGS_CHANGED,
    "A binding was set or removed: every metering replica reloads its binding cache. "
    "The body is empty.",
    None,
    None,
)
TURN_CANCELLED = Publication(
    "metering.turn_cancelled",
    subjects.TURN_CANCELLED,
    "A cancel one metering replica received (`cmd.llm.cancel`), told to every replica: the "
    "one running the turn stops its provider stream.",
    CancelTurn,
    None,
)
DEAD_LETTER = Publication(
    "deadletter",
    subjects.dead_letter_subject("{consumer}"),
    "A message the durable consumer `{consumer}` gave up on (out of deliveries, or never "
    "parseable), its body as it was delivered; the headers `Agentbus-Dead-Letter-Reason` "
    "and `Agentbus-Original-Subject` say why and where it came from (the kit's consumer, "
    "`servicekit.consumer`, sends it).",
    None,
    streams.DEAD_LETTERS,
)
PUBLICATIONS = [
    TURN_DELTA,
    TURN_DONE,
    STREAM_BEAT,
    LEASE_HOLDER,
    BINDINGS_CHANGED,
    TURN_CANCELLED,
    DEAD_LETTER,
]


# --- Who may use the bus (docs/architecture.md) --------------------------------------
# Every service's traffic besides the commands it serves (those are read off COMMANDS
# above), declared once; `servicekit.permissions` derives each NATS user from it. A
# subject a service uses that is not declared here is refused by the server, so this
# list is kept honest by the whole test suite running on the secured server.


@dataclass(frozen=True)
class Durable:
    """A durable JetStream consumer a service owns: its name and its stream."""

    name: str
    stream: str


@dataclass(frozen=True)
class Access:
    """What one service does on the bus, beyond serving its own commands."""

    service: str
    # Commands of other services it sends (request/reply).
    calls: tuple[str, ...] = ()
    # Subjects it publishes outside request/reply: events, deltas, notices.
    publishes: tuple[str, ...] = ()
    # Core NATS subscriptions: live feeds and notices.
    subscribes: tuple[str, ...] = ()
    # Its durable consumers (JetStream consumer API, acks, dead letters).
    durables: tuple[Durable, ...] = ()
    # Streams it reads through short-lived consumers of its own (the gateway's catch-up).
    reads: tuple[str, ...] = ()
    # NATS KV buckets it reads and writes (`streams.BUCKETS`); `provision` creates them.
    buckets: tuple[str, ...] = ()
    # Services whose NATS micro info (`$SRV.INFO.<service>`) it asks: what they announce
    # in their metadata (metering: its provider, for the "offline model" notice).
    info_of: tuple[str, ...] = ()


# Who may spend and on which model: an operator's to read and change (the `ops` user, the
# CLI), never a person's (a token reaches the bus only through the gateway, which cannot).
OPERATOR_COMMANDS = (
    subjects.BINDINGS_SET,
    subjects.BINDINGS_LIST,
    subjects.LIMITS_SET,
    subjects.LIMITS_STATUS,
    subjects.USAGE_SUMMARY,
)

EVERY_EVENT = tuple(subjects.event_filter(t) for t in EventType)
EVERY_DELTA = (TURN_DELTA.filter, TURN_DONE.filter)
# Events, deltas and turn ends are all `<a>.<b>.<project>.<session>`: a session's whole
# feed is one subscription `*.*.<p>.<s>` (the gateway's). No command, inbox, ack or
# notice subject has four tokens.
SESSION_FEED = "*.*.*.*"

CRIATIVO_INPUTS = Durable("criativo-inputs", streams.EVENTS.name)
HANDOFF_CLOSINGS = Durable("handoff-session-closings", streams.EVENTS.name)
PSYCHOLOGIST_CLOSINGS = Durable("psychologist-session-closings", streams.EVENTS.name)
# What a consumer of closings filters on (`HANDOFF_CLOSINGS`, `PSYCHOLOGIST_CLOSINGS`).
SESSION_CLOSINGS_FILTER = tuple(subjects.event_filter(t) for t in SESSION_CLOSINGS)
CRIATIVO_LEASES = streams.LEASES.name

# Agents reach a provider only through metering (`cmd.llm.turn|stream`); a consumer
# confirms what it was delivered with the log (`cmd.events.get`) before acting.
ACCESS = [
    Access(
        "session_events",
        # The log is the one publisher of events: appending is the only way in.
        publishes=EVERY_EVENT,
    ),
    Access(
        "handoff",
        calls=(
            subjects.EVENTS_APPEND,
            subjects.EVENTS_APPEND_MANY,  # its outbox relay (servicekit.outbox.CommandSender)
            subjects.EVENTS_GET,
            subjects.SESSIONS_GET,
        ),
        durables=(HANDOFF_CLOSINGS,),
    ),
    Access(
        "metering",
        # Deltas and beats go where the caller names, within their subjects only.
        publishes=(
            TURN_DELTA.filter,
            STREAM_BEAT.filter,
            BINDINGS_CHANGED.filter,
            TURN_CANCELLED.filter,
        ),
        subscribes=(BINDINGS_CHANGED.filter, TURN_CANCELLED.filter),
    ),
    Access(
        "psychologist",
        calls=(
            subjects.EVENTS_APPEND,
            subjects.EVENTS_APPEND_MANY,
            subjects.EVENTS_GET,
            subjects.EVENTS_LIST,
            subjects.EVENTS_QUERY,
            subjects.SESSIONS_GET,
            subjects.LLM_TURN,
            subjects.LLM_STREAM,
            # a reanalysis over a limit is refused, not queued to fail later
            subjects.LIMITS_STATUS,
        ),
        durables=(PSYCHOLOGIST_CLOSINGS,),
    ),
    Access(
        "criativo",
        calls=(
            subjects.EVENTS_APPEND,
            subjects.EVENTS_APPEND_MANY,
            subjects.EVENTS_GET,
            subjects.EVENTS_LIST,
            subjects.SESSIONS_TERMINATE,
            subjects.HANDOFFS_OFFER,
            subjects.LLM_TURN,
            subjects.LLM_STREAM,
        ),
        # Asks a lease's holder whether it lives (criativo.presence), and answers as one.
        publishes=(TURN_DONE.filter, LEASE_HOLDER.filter),
        # The beats of the streams it waits on: their liveness (harness.client).
        subscribes=(STREAM_BEAT.filter, LEASE_HOLDER.filter),
        durables=(CRIATIVO_INPUTS,),
        buckets=(CRIATIVO_LEASES,),
    ),
    Access(
        "gateway",
        # No event subject to publish and no `cmd.llm.turn|stream`: the gateway turns a
        # person's actions into commands and relays what the log publishes. It may
        # cancel a turn (the Stop button): that only ends spending.
        calls=(
            subjects.SESSIONS_OPEN,
            subjects.SESSIONS_CLOSE,
            subjects.SESSIONS_HEARTBEAT,
            subjects.SESSIONS_GET,
            subjects.SESSIONS_LIST,
            subjects.SESSIONS_FORK,
            subjects.EVENTS_APPEND,
            subjects.EVENTS_LIST,
            # confirms the live events it shows, many sessions' at once (provenance)
            subjects.EVENTS_GET,
            subjects.AGENTS_ACTIVATE,
            subjects.HANDOFFS_ACCEPT,
            subjects.HANDOFFS_REJECT,
            subjects.HANDOFFS_LIST,
            subjects.HYPOTHESES_ACCEPT,
            subjects.HYPOTHESES_DISMISS,
            subjects.HYPOTHESES_LIST,
            subjects.PSYCHOLOGIST_REANALYZE,
            subjects.BINDINGS_LIST,
            subjects.USAGE_SUMMARY,
            subjects.LIMITS_STATUS,
            subjects.LLM_CANCEL,
        ),
        subscribes=(SESSION_FEED,),
        reads=(streams.DELTAS.name,),
        info_of=(LLM_TURN.service,),
    ),
]


def access_of(service: str) -> Access:
    """The declared access of one service."""
    for access in ACCESS:
        if access.service == service:
            return access
    raise KeyError(f"no access declared for service {service!r}")


def publishers_of(publication: Publication) -> list[str]:
    """The services that publish `publication`: those whose access names it, and for dead
    letters every owner of a durable (its consumer's grant, `servicekit.permissions`)."""
    if publication is DEAD_LETTER:
        return [access.service for access in ACCESS if access.durables]
    return [access.service for access in ACCESS if publication.filter in access.publishes]


def served_by(service: str) -> list[str]:
    """The command subjects `service` serves."""
    return [c.subject for c in COMMANDS if c.service == service]
