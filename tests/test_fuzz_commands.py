"""Every `cmd.*` subject of `contracts.catalog.COMMANDS`, fed bad input, against the real
services started as processes (issue 11 item 6).

For each command a plausible request is built from its contract model alone, then
broken in every way an outsider would try: not JSON, wrong types, missing fields, NUL
in every text, 2^63 in every integer, 300 KB strings, 10,000-deep nesting, unknown
fields. Every answer must be a coded error within 5 s and never `internal`; no table of
any service and no stream may change; every service must still answer afterwards.

`cmd.llm.cancel` is served on another branch until it is merged; run `-k "not cancel"`
where it has no responder yet.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import types
import typing
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import date, datetime
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit, urlunsplit

import annotated_types
import asyncpg
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js.errors import NotFoundError, ServerError
from pydantic import BaseModel, StringConstraints

from contracts import streams, subjects
from contracts.catalog import COMMANDS, Command
from contracts.common import ErrorCode, ProjectId
from contracts.events import EventType
from contracts.handoff import OfferHandoff, OfferReply
from contracts.session_events import (
    AppendedReply,
    AppendEvent,
    OpenSession,
    SessionOpenedReply,
)
from servicekit.bus import provision_streams
from servicekit.client import call
from testkit.probes import outbox_drained, wait_for
from testkit.servers import Servers
from testkit.services import ServiceProcess

SERVICES = sorted({c.service for c in COMMANDS})
SCHEMAS = SERVICES
REPLY_SECONDS = 5.0
CODED = {c.value for c in ErrorCode} - {ErrorCode.INTERNAL.value}
# Strings that satisfy the patterns of the contracts' identifier types, tried in order.
PATTERN_SAMPLES = ["fuzz-1", "criativo", "user:fuzz", "_INBOX.fuzz", "metering.alive.fuzz"]


# --- a plausible request, from the contract model alone -------------------------------


def _sample(tp: Any, metadata: list[Any]) -> Any:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extra = get_args(tp)
        return _sample(base, [*metadata, *extra])
    if origin in (Union, types.UnionType):
        return _sample(next(a for a in get_args(tp) if a is not type(None)), metadata)
    if origin is Literal:
        return get_args(tp)[0]
    if origin is list:
        least = max([m.min_length for m in metadata if isinstance(m, annotated_types.MinLen)] + [1])
        return [_sample(get_args(tp)[0], []) for _ in range(least)]
    if origin is dict:
        return {"key": "value"} if get_args(tp)[1] is Any else {}
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return sample_request(tp)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return next(iter(tp)).value
    if tp is str:
        patterns = [m.pattern for m in metadata if isinstance(m, StringConstraints) and m.pattern]
        for candidate in PATTERN_SAMPLES if patterns else ["fuzz text"]:
            if all(re.fullmatch(p, candidate) for p in patterns):
                return candidate
        raise AssertionError(f"no sample string matches {patterns}")
    if tp is bool:
        return False
    if tp is int:
        low = max(
            [m.ge for m in metadata if isinstance(m, annotated_types.Ge) and isinstance(m.ge, int)]
            + [1]
        )
        return low
    if tp is float:
        return 1.0
    if tp is uuid.UUID:
        return str(uuid.uuid4())
    if tp is datetime:
        return "2026-01-01T00:00:00Z"
    if tp is date:
        return "2026-01-01"
    raise AssertionError(f"no sample for {tp!r}")


def sample_request(model: type[BaseModel]) -> dict[str, Any]:
    """Every field of `model` (optional ones too) with a value of its type."""
    hints = typing.get_type_hints(model, include_extras=True)
    return {
        name: _sample(hints[name], list(info.metadata)) for name, info in model.model_fields.items()
    }


def _map_leaves(value: Any, change: Callable[[Any], Any]) -> Any:
    if isinstance(value, dict):
        return {k: _map_leaves(v, change) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_leaves(v, change) for v in value]
    return change(value)


Path_ = tuple[str | int, ...]


def _leaves(value: Any, path: Path_ = ()) -> list[tuple[Path_, Any]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(value, list):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, (*path, i))]
    return [(path, value)]


def _replaced(value: Any, path: Path_, new: Any) -> Any:
    if not path:
        return new
    head, *rest = path
    if isinstance(value, dict):
        return {k: _replaced(v, tuple(rest), new) if k == head else v for k, v in value.items()}
    return [_replaced(v, tuple(rest), new) if i == head else v for i, v in enumerate(value)]


@dataclass(frozen=True)
class Case:
    """One bad request, and what its refusal must say when more than "a coded error"."""

    data: bytes
    code: str | None = None
    field: str | None = None


def bad_requests(command: Command[Any, Any], real: dict[str, Any]) -> dict[str, Case]:
    """Every kind of bad input, by name, for one command.

    `real` replaces sample values by field name (a session that exists, …), so that a
    value the door lets through would reach the database, where it used to break.
    """
    good = _map_keys(sample_request(command.request), real)
    command.request.model_validate(good)  # the base really is plausible

    def encoded(value: Any) -> bytes:
        return json.dumps(value).encode()

    first = next(iter(good))
    cases = {
        "not-json": Case(b"{this is not json", ErrorCode.MALFORMED_JSON),
        "not-utf8": Case(b"\xff\xfe\xfd", ErrorCode.MALFORMED_JSON),
        "empty": Case(b"", ErrorCode.MALFORMED_JSON),
        "json-array": Case(b"[1, 2]", ErrorCode.INVALID_REQUEST),
        "json-string": Case(b'"cmd"', ErrorCode.INVALID_REQUEST),
        "json-null": Case(b"null", ErrorCode.INVALID_REQUEST),
        "wrong-types": Case(encoded({k: [1, 2] for k in good}), ErrorCode.INVALID_REQUEST),
        "lone-surrogate": Case(encoded(good).replace(b'"', b'"\\ud800', 2)),
        "300kb-strings": Case(
            encoded(_map_leaves(good, lambda v: "x" * 300_000 if isinstance(v, str) else v))
        ),
        "10000-deep-arrays": Case(
            encoded({**good, first: None}).replace(b"null", b"[" * 10_000 + b"]" * 10_000, 1),
            ErrorCode.MALFORMED_JSON,
        ),
        "10000-deep-objects": Case(
            encoded({**good, first: None}).replace(
                b"null", b'{"a":' * 10_000 + b"1" + b"}" * 10_000, 1
            ),
            ErrorCode.MALFORMED_JSON,
        ),
        "unknown-field": Case(
            encoded({**good, "zz_unknown_field": 1}), ErrorCode.INVALID_REQUEST, "zz_unknown_field"
        ),
    }
    required = [n for n, f in command.request.model_fields.items() if f.is_required()]
    if required:
        cases["missing-fields"] = Case(b"{}", ErrorCode.INVALID_REQUEST, required[0])
        without = {k: v for k, v in good.items() if k != required[0]}
        cases["one-field-missing"] = Case(encoded(without), ErrorCode.INVALID_REQUEST, required[0])
    # One value at a time, the rest plausible: the refusal must name that field.
    ints = [(p, v) for p, v in _leaves(good) if isinstance(v, int) and not isinstance(v, bool)]
    for path, value in _leaves(good):
        where = ".".join(map(str, path))
        if isinstance(value, str):
            for name, bad in (("nul", f"{value}\u0000"), ("nul-only", "\u0000")):
                data = encoded(_replaced(good, path, bad))
                cases[f"{name}:{where}"] = Case(data, ErrorCode.INVALID_REQUEST, str(path[0]))
    for path, _ in ints:
        where = ".".join(map(str, path))
        for name, number in (("2^63", 2**63), ("-2^63-1", -(2**63) - 1)):
            data = encoded(_replaced(good, path, number))
            cases[f"{name}:{where}"] = Case(data, ErrorCode.INVALID_REQUEST, str(path[0]))
    if not ints:  # no integer field: 2^63 where each field is
        for field in good:
            cases[f"2^63:{field}"] = Case(
                encoded({**good, field: 2**63}), ErrorCode.INVALID_REQUEST
            )
    return cases


def _map_keys(value: Any, real: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        return {k: real[k] if k in real else _map_keys(v, real) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_keys(v, real) for v in value]
    return value


# --- the services, as processes, on a database of their own ---------------------------


async def _counts(db: asyncpg.Pool) -> dict[str, int]:
    tables = await db.fetch(
        "SELECT table_schema, table_name FROM information_schema.tables "
        "WHERE table_schema = ANY($1::text[]) AND table_type = 'BASE TABLE' "
        "AND table_name <> 'schema_migrations'",
        SCHEMAS,
    )
    counts = {}
    for t in tables:
        name = f'"{t["table_schema"]}"."{t["table_name"]}"'
        counts[name] = await db.fetchval(f"SELECT count(*) FROM {name}")
    return counts


async def _stream_counts(nc: Client) -> dict[str, int]:
    js = nc.jetstream()
    return {s.name: (await js.stream_info(s.name)).state.messages for s in streams.ALL}


class Stack:
    """The four services of the catalogue, and what the test reads of them."""

    def __init__(self, nc: Client, db: asyncpg.Pool, real: dict[str, Any]) -> None:
        self.nc = nc
        self.db = db
        # Values of things that exist, put in place of samples by field name.
        self.real = real

    async def written(self) -> dict[str, int]:
        return {**await _counts(self.db), **await _stream_counts(self.nc)}

    async def answering(self) -> list[str]:
        """The services that answer `$SRV.PING` now."""
        alive = []
        for service in SERVICES:
            with contextlib.suppress(Exception):
                await self.nc.request(f"$SRV.PING.{service}", b"", timeout=REPLY_SECONDS)
                alive.append(service)
        return alive


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def stack(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    database = f"t_fuzz_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(servers.database_url)
    await admin.execute(f'CREATE DATABASE "{database}"')
    await admin.close()
    database_url = urlunsplit(urlsplit(servers.database_url)._replace(path=f"/{database}"))
    nc = await nats.connect(servers.nats_url)
    js = nc.jetstream()
    for spec in streams.ALL:
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(spec.name)

    async def provisioned() -> bool:
        try:
            await provision_streams(js, streams.ALL)
        except ServerError:  # the deleted store is still being removed
            return False
        return True

    await wait_for(provisioned, what="streams provisioned")
    # No provider key: metering answers from its offline script, never the internet.
    unset = ("ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env |= {
        "NATS_URL": servers.nats_url,
        "DATABASE_URL": database_url,
        "AGENTBUS_LOG_FORMAT": "json",
        "AGENTBUS_PROVIDER": "scripted",
    }
    logs = Path(tmp_path_factory.mktemp("fuzz-logs"))
    processes = [ServiceProcess(s, env, logs / f"{s}.log").start() for s in SERVICES]
    db = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    assert db is not None
    try:
        for process in processes:
            await process.wait_ready(nc, process.module, timeout=60)
        real = await _things_that_exist(nc)
        # Settled before the battery counts anything: the offer's event is in the log
        # and the log's events are on the stream.
        for schema in ("handoff", "session_events"):
            await outbox_drained(db, schema)
        yield Stack(nc, db, real)
    finally:
        for process in processes:
            process.kill(15)
        await db.close()
        await nc.close()
        admin = await asyncpg.connect(servers.database_url)
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.close()


async def _things_that_exist(nc: Client) -> dict[str, Any]:
    """An open session of the sample project with a message and a pending offer."""
    project = _sample(ProjectId, [])
    opened = await call(
        nc,
        subjects.SESSIONS_OPEN,
        OpenSession(project_id=project, opened_by="user:fuzz"),
        SessionOpenedReply,
    )
    said = await call(
        nc,
        subjects.EVENTS_APPEND,
        AppendEvent(
            session_id=opened.session_id,
            type=EventType.CHAT_MESSAGE.value,
            actor="user:fuzz",
            payload={"text": "hello"},
        ),
        AppendedReply,
    )
    offered = await call(
        nc,
        subjects.HANDOFFS_OFFER,
        OfferHandoff(
            project_id=project,
            session_id=opened.session_id,
            from_agent="criativo",
            to_agent="po",
            artifact_id=said.event_id,
        ),
        OfferReply,
    )
    assert offered.handoff is not None
    return {
        "project_id": project,
        "session_id": str(opened.session_id),
        "handoff_id": str(offered.handoff.id),
        "event_ids": [str(said.event_id)],
        # an append that would be accepted but for the one value a case breaks
        "type": EventType.CHAT_MESSAGE.value,
        "payload": {"text": "hello again"},
        "actor": "user:fuzz",
        "causation_id": None,
    }


# --- the battery -----------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.subject)
async def test_bad_input_gets_a_coded_error_writes_nothing_and_breaks_nothing(
    stack: Stack, command: Command[Any, Any]
) -> None:
    before = await stack.written()
    problems: dict[str, str] = {}

    for name, case in bad_requests(command, stack.real).items():
        try:
            reply = await stack.nc.request(command.subject, case.data, timeout=REPLY_SECONDS)
        except Exception as exc:  # no reply within the time allowed
            problems[name] = f"no reply: {exc!r}"
            continue
        try:
            error = json.loads(reply.data)["error"]
            code, message = error["code"], error["message"]
        except (ValueError, KeyError, TypeError):
            problems[name] = f"not an error reply: {reply.data[:200]!r}"
            continue
        if code not in CODED or (case.code is not None and code != case.code):
            problems[name] = f"code {code!r} (expected {case.code or 'a coded error'}): {message}"
        elif case.field is not None and f"{case.field}" not in message:
            problems[name] = f"the message does not name {case.field!r}: {message}"

    assert problems == {}
    assert await stack.written() == before
    assert await stack.answering() == SERVICES


def test_every_command_has_a_plausible_sample_and_every_case() -> None:
    """The generator itself: a sample each contract accepts, and the cases to break it."""
    real = {"session_id": str(uuid.uuid4())}
    for command in COMMANDS:
        cases = bad_requests(command, real)
        assert len(cases) >= 15, command.subject
        assert len(cases["300kb-strings"].data) > 300_000
        assert cases["10000-deep-arrays"].data.count(b"[") >= 10_000
