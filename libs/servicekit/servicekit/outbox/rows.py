"""The outbox's rows as a service writes them: the statements that insert them, in the
statement of the caller's effect or alone, and the wake-up that announces them.

Each schema notifies on its own channel (`notify_channel`): a service's relay wakes for
its own rows only, not for every append of every service sharing the database.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from servicekit.telemetry import inject_headers

# A schema's outbox notifies `agentbus_outbox.<schema>` (`notify_channel`).
NOTIFY_CHANNEL_PREFIX = "agentbus_outbox."
# The wake-up of the schema the statement runs in (the first of its search path).
NOTIFY = f"pg_notify('{NOTIFY_CHANNEL_PREFIX}' || current_schema(), '')"
# In its place when the writer wakes its own relay (`with_outbox`).
NO_NOTIFY = "NULL AS pg_notify"


def notify_channel(schema: str) -> str:
    """The channel the outbox of `schema` notifies when a row is written."""
    return NOTIFY_CHANNEL_PREFIX + schema


def queue_statement(first: int, wake: str, returning: str = "") -> str:
    """The outbox insert (and its wake-up, `NOTIFY` or `NO_NOTIFY`) as the tail of a
    `WITH`, parameters `$first`..`$first+4` (see `queue_args`).

    With data-modifying CTEs before it (`Outbox.append_with`), the effect and its
    outbox row are written in one round trip. To read the effect's `RETURNING` rows
    back, name them: `returning="effect"` selects `effect.*`.
    """
    p = [f"${first + i}" for i in range(5)]
    return (
        "queued AS (INSERT INTO outbox (subject, msg_id, body, headers, ordering_key) "
        f"VALUES ({p[0]}, {p[1]}, {p[2]}, {p[3]}, {p[4]})) {_tail(wake, returning)}"
    )


def _tail(wake: str, returning: str) -> str:
    """The final SELECT of a queue statement: the wake-up (a NOTIFY, delivered on commit and
    dropped on rollback: exactly the hint the relay needs, or none), and with `returning`
    the rows of that CTE."""
    return f"SELECT {returning}.*, {wake} FROM {returning}" if returning else f"SELECT {wake}"


def queue_args(
    subject: str,
    msg_id: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    ordering_key: str | None = None,
) -> list[Any]:
    """The parameters of `queue_statement`, in order; the trace context is added here."""
    return [
        subject,
        msg_id,
        body,
        inject_headers(dict(headers or {})),
        ordering_key,
    ]


def without_notify(row: asyncpg.Record) -> dict[str, Any]:
    fields = dict(row)
    fields.pop("pg_notify", None)  # the wake-up, not the caller's
    return fields


@dataclass(frozen=True)
class Queued:
    """One row for `Outbox.send_many_with`: what `send` takes, as a value. `headers`
    None: the current trace context; give them to carry another's (a batch writer
    sends each row with the trace of the request it came from)."""

    subject: str
    msg_id: str
    body: bytes
    ordering_key: str | None = None
    headers: Mapping[str, str] | None = None


def queue_many_statement(first: int, wake: str, returning: str = "") -> str:
    """`queue_statement` for many rows, inserted in the order given (so a key's rows keep
    their order): `$first`, the rows as JSON, each but its body, which is the slice
    `start`, `length` of `$first+1`, every body end to end (`queue_many_args`)."""
    return (
        "queued AS (INSERT INTO outbox (subject, msg_id, body, headers, ordering_key) "
        f"SELECT subject, msg_id, substring(${first + 1}::bytea FROM start FOR length), "
        "headers, ordering_key "
        f"FROM ROWS FROM (json_to_recordset(${first}::json) AS (subject text, msg_id text, "
        "headers jsonb, ordering_key text, start int, length int)) "
        "WITH ORDINALITY AS m(subject, msg_id, headers, ordering_key, start, length, n) "
        f"ORDER BY n) {_tail(wake, returning)}"
    )


def queue_many_args(messages: Sequence[Queued]) -> tuple[list[dict[str, Any]], bytes]:
    """The parameters of `queue_many_statement`. Two values, not five arrays of a value
    per row: asyncpg checks each element of an array against three abstract classes,
    which makes the arrays cost a batch of the log more than its whole statement in
    Postgres (bench/append.py)."""
    rows = []
    start = 1  # substring() counts from 1
    for m in messages:
        headers = dict(m.headers) if m.headers is not None else inject_headers()
        rows.append(
            {
                "subject": m.subject,
                "msg_id": m.msg_id,
                "headers": headers,
                "ordering_key": m.ordering_key,
                "start": start,
                "length": len(m.body),
            }
        )
        start += len(m.body)
    return rows, b"".join(m.body for m in messages)
