"""The log's commands: load, decide with `domain.log_rules`, persist with the outbox, reply."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from uuid import uuid4

from contracts import catalog
from contracts.common import ErrorBody, ErrorCode
from contracts.events import (
    ChatMessage,
    EventType,
    SessionClosed,
    SessionClosedAbnormally,
    SessionForked,
    SessionOpened,
)
from contracts.session_events import (
    AppendedReply,
    AppendEvent,
    AppendMany,
    AppendManyReply,
    AppendOutcome,
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
from domain import log_rules
from domain.errors import DomainError
from servicekit.endpoint import error_body
from servicekit.service import Service
from servicekit.telemetry import inject_headers
from session_events.group_commit import GroupCommit, Pending
from session_events.repository import (
    BranchOf,
    ExistingBranch,
    LogRepository,
    LogTransaction,
    NewEvent,
    SessionState,
    next_event,
)

SERVICE = "session_events"
VERSION = "0.1.0"
svc = Service(
    SERVICE,
    VERSION,
    "The append-only session event log.",
    schema="session_events",
    migrations=["session_events.migrations"],
)


def _already_closed(session: SessionState) -> DomainError:
    return DomainError(
        ErrorCode.SESSION_CLOSED,
        f"session {session.id} is already {session.status}; nothing was changed",
        session_id=str(session.id),
        status=session.status,
    )


async def close_session(
    tx: LogTransaction, session: SessionState, reason: str | None, closed_by: str | None
) -> SessionClosedReply:
    """End an open session: status, reason and the closing event, in the caller's transaction."""
    if not session.is_open:
        raise _already_closed(session)
    if reason is None:
        status, event_type = "closed", EventType.SESSION_CLOSED
        payload = SessionClosed(closed_by=closed_by).model_dump(mode="json")
    else:
        status, event_type = "closed_abnormally", EventType.SESSION_CLOSED_ABNORMALLY
        payload = SessionClosedAbnormally(reason=reason).model_dump(mode="json")
    await tx.close(session, status, reason)
    event = await tx.append(session, event_type, closed_by or "system:session-events", payload)
    return SessionClosedReply(session_id=session.id, status=status, event_id=event.id)


@svc.command(catalog.SESSIONS_OPEN)
async def open_session(cmd: OpenSession, repo: LogRepository) -> SessionOpenedReply:
    async with repo.transaction() as tx:
        session = await tx.create_session(cmd.project_id, cmd.opened_by)
        payload = SessionOpened(opened_by=cmd.opened_by).model_dump(mode="json")
        event = await tx.append(session, EventType.SESSION_OPENED, cmd.opened_by, payload)
    return SessionOpenedReply(session_id=session.id, event_id=event.id)


@svc.command(catalog.SESSIONS_FORK)
async def fork(cmd: ForkSession, repo: LogRepository) -> SessionForkedReply:
    """A branch in one transaction: the new session, `session.forked`, the parent's
    events up to `at_seq` copied, and the person's message, all through the outbox.

    The parent stays locked until the branch commits, so its prefix is read as it stands
    and a repeat with the same fork id waits, then finds the branch and answers it. The
    rules are checked first, so a repeat is answered only to whom the fork is allowed."""
    async with repo.transaction() as tx:
        parent = await tx.fork_facts(cmd.session_id)
        log_rules.check_fork(parent, cmd.session_id, cmd.project_id, cmd.forked_by, cmd.at_seq)
        earlier = await tx.branch(cmd.session_id, cmd.fork_id)
        if earlier is not None:
            return _repeated_fork(cmd, earlier)
        originals = await tx.events_up_to(cmd.session_id, cmd.at_seq)
        branch = await tx.create_session(
            cmd.project_id, cmd.forked_by, BranchOf(cmd.session_id, cmd.at_seq, cmd.fork_id)
        )
        forked = SessionForked(
            parent_session_id=cmd.session_id, at_seq=cmd.at_seq, forked_by=cmd.forked_by
        )
        new = [next_event(branch, EventType.SESSION_FORKED, cmd.forked_by, _dumped(forked))]
        for copy in log_rules.copy_prefix(originals, iter(uuid4, None)):
            branch.last_seq = new[-1].seq
            new.append(
                next_event(
                    branch,
                    copy.type,
                    copy.actor,
                    copy.payload,
                    copy.causation_id,
                    event_id=copy.id,
                    copied_from=copy.copied_from,
                )
            )
        branch.last_seq = new[-1].seq
        message = ChatMessage(text=cmd.text)
        new.append(next_event(branch, EventType.CHAT_MESSAGE, cmd.forked_by, _dumped(message)))
        await tx.write([NewEvent(e) for e in new])
    return SessionForkedReply(
        session_id=branch.id,
        parent_session_id=cmd.session_id,
        at_seq=cmd.at_seq,
        forked_event_id=new[0].id,
        message_event_id=new[-1].id,
    )


def _dumped(payload: SessionForked | ChatMessage) -> dict[str, Any]:
    return payload.model_dump(mode="json")


def _repeated_fork(cmd: ForkSession, earlier: ExistingBranch) -> SessionForkedReply:
    """The branch an earlier request with this fork id made; refused when this request
    asks for another fork point or another message."""
    if (earlier.at_seq, earlier.text) != (cmd.at_seq, cmd.text):
        raise DomainError(
            ErrorCode.IDEMPOTENCY_CONFLICT,
            f"fork id {cmd.fork_id!r} already made branch {earlier.session_id} of session "
            f"{cmd.session_id} at event {earlier.at_seq} with another message; use a new fork "
            "id for another branch",
            fork_id=cmd.fork_id,
            session_id=str(earlier.session_id),
        )
    return SessionForkedReply(
        session_id=earlier.session_id,
        parent_session_id=cmd.session_id,
        at_seq=earlier.at_seq,
        forked_event_id=earlier.forked_event_id,
        message_event_id=earlier.message_event_id,
        duplicate=True,
    )


def pending_append(cmd: AppendEvent, trace: Mapping[str, str] | None = None) -> Pending:
    """The append, once its shape is valid (type, payload, size), ready for its batch
    (group_commit), where the session's rules are applied and it is written; `trace`:
    the request's trace context, when the caller already has it."""
    event_type = log_rules.parse_event_type(cmd.type)
    parsed = log_rules.validate_payload(event_type, cmd.payload)
    # Measured as stored: UTF-8 bytes of the normalised payload.
    log_rules.check_payload_size(len(parsed.model_dump_json().encode()))
    payload = parsed.model_dump(mode="json")
    return GroupCommit.pending(
        cmd.session_id, event_type, cmd.actor, payload, cmd.causation_id, cmd.idempotency_key, trace
    )


@svc.command(catalog.EVENTS_APPEND)
async def append(cmd: AppendEvent, appender: GroupCommit) -> AppendedReply:
    return await appender.append(pending_append(cmd))


@svc.command(catalog.EVENTS_APPEND_MANY)
async def append_many(cmd: AppendMany, appender: GroupCommit) -> AppendManyReply:
    """`append` for each event, in order and in shared batches; each is checked and
    answered on its own (an outbox relay sends its claim so, one request for many)."""
    checked: list[Pending | ErrorBody] = []
    trace = inject_headers()  # one request: one trace for all its events
    for item in cmd.events:
        try:
            checked.append(pending_append(item, trace))
        except DomainError as refused:
            checked.append(error_body(refused, catalog.EVENTS_APPEND_MANY.subject))
    written = iter(await appender.append_chain([p for p in checked if isinstance(p, Pending)]))
    return AppendManyReply(
        results=[
            AppendOutcome(error=c) if isinstance(c, ErrorBody) else _outcome(next(written))
            for c in checked
        ]
    )


def _outcome(written: AppendedReply | Exception) -> AppendOutcome:
    if isinstance(written, AppendedReply):
        return AppendOutcome(**written.model_dump())
    return AppendOutcome(error=error_body(written, catalog.EVENTS_APPEND_MANY.subject))


@svc.command(catalog.EVENTS_GET)
async def get_events(cmd: GetEvents, repo: LogRepository) -> EventsReply:
    events = await repo.events_by_id(cmd.event_ids)
    found = {e.id for e in events}
    return EventsReply(events=events, missing=[i for i in cmd.event_ids if i not in found])


@svc.command(catalog.EVENTS_LIST)
async def list_events(cmd: ListEvents, repo: LogRepository) -> EventsReply:
    events = await repo.events_after(cmd.session_id, cmd.after_seq, cmd.limit)
    if not events and not await repo.session_exists(cmd.session_id):
        raise log_rules.session_not_found(cmd.session_id)
    return EventsReply(events=events)


@svc.command(catalog.EVENTS_QUERY)
async def query_events(cmd: QueryEvents, repo: LogRepository) -> EventsReply:
    types = [log_rules.known_event_type(t).value for t in cmd.types]
    return EventsReply(events=await repo.events_of_project(cmd.project_id, types, cmd.limit))


@svc.command(catalog.SESSIONS_HEARTBEAT)
async def heartbeat(cmd: SessionRef, repo: LogRepository) -> HeartbeatReply:
    at = await repo.heartbeat(cmd.session_id)
    if at is None:
        view = await repo.session(cmd.session_id)
        if view is None:
            raise log_rules.session_not_found(cmd.session_id)
        raise DomainError(
            ErrorCode.SESSION_CLOSED,
            f"session {cmd.session_id} is {view.status}",
            session_id=str(cmd.session_id),
            status=view.status,
        )
    return HeartbeatReply(session_id=cmd.session_id, last_heartbeat_at=at)


@svc.command(catalog.SESSIONS_CLOSE)
async def close(cmd: CloseSession, repo: LogRepository) -> SessionClosedReply:
    async with repo.transaction() as tx:
        session = await tx.lock_session(cmd.session_id)
        return await close_session(tx, session, None, cmd.closed_by)


@svc.command(catalog.SESSIONS_TERMINATE)
async def terminate(cmd: TerminateSession, repo: LogRepository) -> SessionClosedReply:
    async with repo.transaction() as tx:
        session = await tx.lock_session(cmd.session_id)
        return await close_session(tx, session, cmd.reason, None)


@svc.command(catalog.SESSIONS_LIST)
async def list_sessions(cmd: ListSessions, repo: LogRepository) -> SessionsReply:
    return SessionsReply(
        sessions=await repo.sessions_of_project(cmd.project_id, cmd.limit, cmd.forked_from)
    )


@svc.command(catalog.SESSIONS_GET)
async def get_session(cmd: SessionRef, repo: LogRepository) -> SessionView:
    view = await repo.session(cmd.session_id)
    if view is None:
        raise log_rules.session_not_found(cmd.session_id)
    return view
