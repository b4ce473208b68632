"""A person takes back or corrects a business rule: the log's rules, against real NATS
and real Postgres. Every refusal is coded and writes nothing."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from nats.aio.client import Client

from contracts import subjects
from contracts.common import ErrorCode
from contracts.events import EventType
from contracts.session_events import AppendedReply, AppendMany, AppendManyReply
from domain.errors import DomainError
from servicekit.client import CommandFailed, call
from servicekit.db import create_pool
from session_events.group_commit import GroupCommit, Pending
from session_events.repository import LogRepository

from .test_fork import fork
from .test_log_service import append, events_of

RULE = EventType.ARTIFACT_BUSINESS_RULE.value
RETRACTED = EventType.ARTIFACT_BUSINESS_RULE_RETRACTED.value
PERSON = "user:ana"


async def said_and_recorded(nc: Client, session: uuid.UUID, title: str) -> uuid.UUID:
    """A person's message and the rule Criativo recorded from it; the rule's id."""
    said = await append(nc, session, EventType.CHAT_MESSAGE.value, payload={"text": title})
    rule = await append(
        nc,
        session,
        RULE,
        actor="agent:criativo",
        payload={"title": title, "statement": f"{title}.", "origin": [str(said.event_id)]},
    )
    return rule.event_id


def correction(rule_id: uuid.UUID, title: str = "Orders close at 19h") -> dict[str, Any]:
    return {
        "title": title,
        "statement": "Orders placed after 19h are for the next day.",
        "origin": [str(uuid.uuid4())],
        "replaces": str(rule_id),
    }


async def refused(
    nc: Client, session: uuid.UUID, type_: str, payload: dict[str, Any], actor: str = PERSON
) -> CommandFailed:
    """The refusal of an append, checked to have written nothing."""
    before = len(await events_of(nc, session))
    with pytest.raises(CommandFailed) as failed:
        await append(nc, session, type_, actor=actor, payload=payload)
    assert failed.value.message
    assert len(await events_of(nc, session)) == before
    return failed.value


async def test_a_person_retracts_one_rule_and_corrects_another_once_each(
    nc: Client, open_session: Any
) -> None:
    earlier = (await open_session("bakery")).session_id
    now = (await open_session("bakery")).session_id
    hours = await said_and_recorded(nc, earlier, "Orders close at 18h")
    pickup = await said_and_recorded(nc, now, "Pickup only")

    # A rule of an earlier session of the project is corrected; one of this session retracted.
    fixed = await append(nc, now, RULE, payload=correction(hours))
    gone = await append(nc, now, RETRACTED, payload={"rule_id": str(pickup), "reason": "delivery"})
    assert (fixed.seq, gone.seq) == (4, 5)
    stored = {e.id: e for e in await events_of(nc, now)}
    assert stored[fixed.event_id].actor == PERSON
    assert stored[fixed.event_id].payload["replaces"] == str(hours)
    assert stored[gone.event_id].payload == {"rule_id": str(pickup), "reason": "delivery"}

    # Each is retired once: again, by either means, is `rule_not_standing`.
    for rule_id, retired_by in [(hours, fixed.event_id), (pickup, gone.event_id)]:
        for type_, payload in [(RETRACTED, {"rule_id": str(rule_id)}), (RULE, correction(rule_id))]:
            error = await refused(nc, now, type_, payload)
            assert error.code == ErrorCode.RULE_NOT_STANDING
            assert error.details == {"rule_id": str(rule_id), "retired_by": str(retired_by)}

    # The correction stands: it can be corrected in turn.
    await append(nc, now, RULE, payload=correction(fixed.event_id, "Orders close at 20h"))


@pytest.mark.parametrize("actor", ["agent:criativo", "agent:po", "system:psychologist"])
async def test_only_a_person_retracts_or_corrects(
    nc: Client, open_session: Any, actor: str
) -> None:
    session = (await open_session()).session_id
    rule = await said_and_recorded(nc, session, "Orders close at 18h")

    for type_, payload in [(RETRACTED, {"rule_id": str(rule)}), (RULE, correction(rule))]:
        error = await refused(nc, session, type_, payload, actor=actor)
        assert error.code == ErrorCode.ACTOR_NOT_ALLOWED


async def test_a_rule_of_another_project_or_no_rule_at_all_is_not_found(
    nc: Client, open_session: Any
) -> None:
    mine = (await open_session("bakery")).session_id
    theirs = (await open_session("butcher")).session_id
    their_rule = await said_and_recorded(nc, theirs, "Meat is weighed at the counter")
    a_message = (
        await append(nc, mine, EventType.CHAT_MESSAGE.value, payload={"text": "hi"})
    ).event_id

    for named in (their_rule, a_message, uuid.uuid4()):
        for type_, payload in [(RETRACTED, {"rule_id": str(named)}), (RULE, correction(named))]:
            error = await refused(nc, mine, type_, payload)
            assert error.code == ErrorCode.RULE_NOT_FOUND
            assert error.details == {"rule_id": str(named)}


async def test_two_retractions_of_one_rule_in_one_batch_retire_it_once(
    nc: Client, open_session: Any
) -> None:
    session = (await open_session()).session_id
    rule = await said_and_recorded(nc, session, "Orders close at 18h")
    events = [
        {"session_id": str(session), "type": type_, "actor": PERSON, "payload": payload}
        for type_, payload in [(RETRACTED, {"rule_id": str(rule)}), (RULE, correction(rule))]
    ]

    reply = await call(
        nc,
        subjects.EVENTS_APPEND_MANY,
        AppendMany.model_validate({"events": events}),
        AppendManyReply,
    )

    answers = [(r.seq, r.error.code if r.error else None) for r in reply.results]
    assert answers == [(4, None), (None, ErrorCode.RULE_NOT_STANDING)]
    assert [e.seq for e in await events_of(nc, session)] == [1, 2, 3, 4]


async def test_retractions_racing_from_several_replicas_retire_the_rule_once(
    nc: Client, open_session: Any, database_url: str
) -> None:
    # Each session's appends are guarded by its own seq, and one replica's batch sees its
    # own retractions; the rule, recorded in another session, is guarded across replicas
    # by the log's unique index of retired rules.
    origin = (await open_session("bakery")).session_id
    rule = await said_and_recorded(nc, origin, "Orders close at 18h")
    sessions = [(await open_session("bakery")).session_id for _ in range(8)]
    pool = await create_pool(database_url, "session_events")
    try:
        replicas = [GroupCommit(LogRepository(pool)) for _ in sessions]
        retraction = {"rule_id": str(rule)}
        outcomes = await asyncio.gather(
            *(
                replica.append(
                    Pending(s, EventType.ARTIFACT_BUSINESS_RULE_RETRACTED, PERSON, retraction)
                )
                for replica, s in zip(replicas, sessions, strict=True)
            ),
            return_exceptions=True,
        )
    finally:
        await pool.close()

    written = [o for o in outcomes if isinstance(o, AppendedReply)]
    refusals = [o for o in outcomes if not isinstance(o, AppendedReply)]
    assert len(written) == 1
    assert all(
        isinstance(o, DomainError) and o.code == ErrorCode.RULE_NOT_STANDING for o in refusals
    ), refusals
    retractions = [e for s in sessions for e in await events_of(nc, s) if e.type.value == RETRACTED]
    assert [e.id for e in retractions] == [written[0].event_id]


async def test_a_branch_copies_retirements_and_keeps_each_rule_retired_once(
    nc: Client, open_session: Any
) -> None:
    earlier = (await open_session("bakery")).session_id
    parent = (await open_session("bakery")).session_id
    hours = await said_and_recorded(nc, earlier, "Orders close at 18h")
    pickup = await said_and_recorded(nc, parent, "Pickup only")
    fixed = await append(nc, parent, RULE, payload=correction(hours))
    gone = await append(nc, parent, RETRACTED, payload={"rule_id": str(pickup)})

    # The branch's prefix holds both retirements: the copied correction still names the
    # earlier session's rule (outside the prefix), the copied retraction the copied rule.
    branch = await fork(nc, parent, gone.seq, "Delivery after all", project_id="bakery")
    copies = {e.copied_from: e for e in await events_of(nc, branch.session_id) if e.copied_from}
    assert copies[fixed.event_id].payload["replaces"] == str(hours)
    assert copies[gone.event_id].payload["rule_id"] == str(copies[pickup].id)

    # A rule stays retired once, in the parent, in the branch and across the project.
    for session, rule_id in [(branch.session_id, copies[pickup].id), (parent, pickup)]:
        error = await refused(nc, session, RETRACTED, {"rule_id": str(rule_id)})
        assert error.code == ErrorCode.RULE_NOT_STANDING
    error = await refused(nc, branch.session_id, RULE, correction(hours))
    assert error.code == ErrorCode.RULE_NOT_STANDING
    assert error.details == {"rule_id": str(hours), "retired_by": str(fixed.event_id)}
