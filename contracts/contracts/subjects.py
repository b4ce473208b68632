"""Every subject of the bus. The only module where a subject string is written."""

from __future__ import annotations

from uuid import UUID

from contracts.events import EventType

# Commands: request/reply on core NATS, one queue group per service.
SESSIONS_OPEN = "cmd.sessions.open"
SESSIONS_CLOSE = "cmd.sessions.close"
SESSIONS_TERMINATE = "cmd.sessions.terminate"
SESSIONS_HEARTBEAT = "cmd.sessions.heartbeat"
SESSIONS_GET = "cmd.sessions.get"
SESSIONS_LIST = "cmd.sessions.list"
SESSIONS_FORK = "cmd.sessions.fork"
EVENTS_APPEND = "cmd.events.append"
EVENTS_APPEND_MANY = "cmd.events.append_many"
EVENTS_GET = "cmd.events.get"
EVENTS_LIST = "cmd.events.list"
EVENTS_QUERY = "cmd.events.query"
# metering
LLM_TURN = "cmd.llm.turn"
LLM_STREAM = "cmd.llm.stream"
# Stops a running stream (the person's Stop button). The one metering command the
# gateway may call: it can only end spending, never start it.
LLM_CANCEL = "cmd.llm.cancel"
BINDINGS_SET = "cmd.bindings.set"
BINDINGS_LIST = "cmd.bindings.list"
BINDINGS_RESOLVE = "cmd.bindings.resolve"
USAGE_SUMMARY = "cmd.usage.summary"
# Spend limits: set by an operator only (the `ops` user, the CLI), read by anyone who
# shows or checks them (the Usage page, a reanalysis before it is queued).
LIMITS_SET = "cmd.limits.set"
LIMITS_STATUS = "cmd.limits.status"
# Core NATS, not a stream: tells every metering replica to reload its binding cache.
BINDINGS_CHANGED = "metering.bindings_changed"
# Core NATS, not a stream: a cancel received by one metering replica, told to all,
# so the replica that runs the turn aborts its provider stream.
TURN_CANCELLED = "metering.turn_cancelled"
# Core NATS, not a stream: `metering.alive.<key>`, the beat of a streaming turn a replica
# is handling (`LlmStream.alive_subject`). Three tokens: no session feed hears it.
ALIVE_PREFIX = "metering.alive."
# Core NATS, request/reply: `criativo.holder.<holder>`, answered by the Criativo process a
# session lease names while it lives (`criativo.presence`). Three tokens: no session feed
# hears it, and no stream keeps it (a request to a process gone gets "no responders").
HOLDER_PREFIX = "criativo.holder."

# handoff
HANDOFFS_OFFER = "cmd.handoffs.offer"
HANDOFFS_OFFER_MANY = "cmd.handoffs.offer_many"
HANDOFFS_ACCEPT = "cmd.handoffs.accept"
HANDOFFS_REJECT = "cmd.handoffs.reject"
HANDOFFS_COMPLETE = "cmd.handoffs.complete"
HANDOFFS_LIST = "cmd.handoffs.list"
AGENTS_ACTIVATE = "cmd.agents.activate"
AGENTS_ACTIVE = "cmd.agents.active"

# psychologist
PSYCHOLOGIST_REANALYZE = "cmd.psychologist.reanalyze"
HYPOTHESES_ACCEPT = "cmd.hypotheses.accept"
HYPOTHESES_DISMISS = "cmd.hypotheses.dismiss"
HYPOTHESES_LIST = "cmd.hypotheses.list"


def event_subject(event_type: EventType, project_id: str, session_id: UUID | str) -> str:
    """`<domain>.<name>.<project_id>.<session_id>`: where a committed event is published."""
    return f"{event_type.value}.{project_id}.{session_id}"


def event_filter(event_type: EventType, project_id: str = "*", session_id: str = "*") -> str:
    """A subject filter for one event type, e.g. every `session.closed` of every project."""
    return f"{event_type.value}.{project_id}.{session_id}"


DELTA_PREFIX = "agent.delta."
DONE_PREFIX = "agent.done."


def delta_subject(project_id: str, session_id: UUID | str) -> str:
    """Where a streaming turn's text deltas go, token by token."""
    return f"{DELTA_PREFIX}{project_id}.{session_id}"


def done_subject(project_id: str, session_id: UUID | str) -> str:
    """Where a streaming turn is closed."""
    return f"{DONE_PREFIX}{project_id}.{session_id}"


def alive_subject(key: str) -> str:
    """Where metering beats while it handles one caller's streaming turn (`key`: the
    caller's, unique to the turn)."""
    return f"{ALIVE_PREFIX}{key}"


def holder_subject(holder: str) -> str:
    """Where the Criativo process `holder` (its id in the leases it writes) answers whether
    it is still there."""
    return f"{HOLDER_PREFIX}{holder}"


# Where exhausted or terminated deliveries are announced (see servicekit.consumer).
DEAD_LETTER_PREFIX = "deadletter"


def dead_letter_subject(consumer: str) -> str:
    """Where the durable consumer `consumer` announces a message it gave up on."""
    return f"{DEAD_LETTER_PREFIX}.{consumer}"


MAX_DELIVERIES_ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>"
MSG_TERMINATED_ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.>"
