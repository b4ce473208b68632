"""Views the web client reads, folded from the log's events."""

from __future__ import annotations

from contracts.gateway import SessionsReply, SessionSummary
from contracts.session_events import ListedSession


def sessions_of(sessions: list[ListedSession]) -> SessionsReply:
    """The log's sessions, as the sessions page lists them (newest first, as given)."""
    return SessionsReply(
        sessions=[
            SessionSummary(
                session_id=s.session_id,
                opened_by=s.opened_by,
                opened_at=s.opened_at,
                status=s.status,
                closed_at=s.closed_at,
                reason=s.termination_reason,
                title=s.title,
                last_event_at=s.last_event_at,
                parent_session_id=s.parent_session_id,
                forked_at_seq=s.forked_at_seq,
            )
            for s in sessions
        ]
    )
