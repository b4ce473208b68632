"""Views the web client reads, folded from the log's events."""

from __future__ import annotations

from contracts.events import Event, EventType
from contracts.gateway import SessionsReply, SessionSummary


def sessions_of(events: list[Event]) -> SessionsReply:
    """The sessions named by `session.opened` / `session.closed*` events, newest first."""
    opened: dict[str, Event] = {}
    ended: dict[str, Event] = {}
    for event in events:
        key = str(event.session_id)
        if event.type is EventType.SESSION_OPENED:
            opened[key] = event
        else:
            ended[key] = event
    sessions = []
    for key, start in opened.items():
        end = ended.get(key)
        status = "open"
        if end is not None:
            status = "closed" if end.type is EventType.SESSION_CLOSED else "closed_abnormally"
        sessions.append(
            SessionSummary(
                session_id=start.session_id,
                opened_by=start.actor,
                opened_at=start.created_at,
                status=status,
                closed_at=end.created_at if end else None,
                reason=str(end.payload.get("reason")) if end and "reason" in end.payload else None,
            )
        )
    sessions.sort(key=lambda s: s.opened_at, reverse=True)
    return SessionsReply(sessions=sessions)
