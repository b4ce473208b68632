"""ADR 0182 against the real handoff service, real NATS and real Postgres."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from nats.aio.client import Client

from contracts import subjects
from contracts.events import EventType
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
    OfferMany,
    OfferManyReply,
    OfferTarget,
)
from servicekit.client import CommandFailed, call
from testkit.probes import wait_for

from .conftest import Driver, offered_id

SUPERSEDED = EventType.HANDOFF_SUPERSEDED.value
OFFERED = EventType.HANDOFF_OFFERED.value
T = TypeVar("T")


async def accept(bus: Driver, handoff_id: uuid.UUID, session_id: uuid.UUID) -> AcceptReply:
    return await call(
        bus.nc,
        subjects.HANDOFFS_ACCEPT,
        HandoffDecision(handoff_id=handoff_id, session_id=session_id, actor="user:ana"),
        AcceptReply,
    )


async def activate(bus: Driver, session_id: uuid.UUID, agent: str, via: str) -> ActivationReply:
    return await call(
        bus.nc,
        subjects.AGENTS_ACTIVATE,
        ActivateAgent(project_id=bus.project, session_id=session_id, agent=agent, via=via),
        ActivationReply,
    )


# --- ADR 0182 decision 2, case by case ---------------------------------------------------


async def test_no_pending_offer_creates_one_with_its_event(bus: Driver) -> None:
    s = await bus.open()
    brief = await bus.artifact(s)
    reply = await bus.offer(s, "po", brief)

    assert reply.outcome == "created"
    [row] = await bus.rows("po")
    assert (row["id"], row["status"], row["artifact_id"]) == (offered_id(reply), "offered", brief)
    [event] = await bus.events(s, "handoff.")
    assert event.type == EventType.HANDOFF_OFFERED
    assert event.payload["handoff_id"] == str(offered_id(reply))
    assert event.actor == "agent:criativo"
    assert event.causation_id == brief


@pytest.mark.parametrize("again_with", ["no-artifact", "same-artifact"])
async def test_same_session_without_a_new_artifact_returns_the_pending_one(
    bus: Driver, again_with: str
) -> None:
    s = await bus.open()
    brief = await bus.artifact(s)
    first = await bus.offer(s, "po", brief)
    again = await bus.offer(s, "po", None if again_with == "no-artifact" else brief)

    assert again.outcome == "ja_oferecido"
    assert offered_id(again) == offered_id(first)
    assert len(await bus.rows("po")) == 1
    assert [e.type for e in await bus.events(s, "handoff.")] == [EventType.HANDOFF_OFFERED]


async def test_a_new_artifact_in_the_same_session_supersedes_the_pending_one(bus: Driver) -> None:
    s = await bus.open()
    old = await bus.offer(s, "po", await bus.artifact(s, "brief v1"))
    new = await bus.offer(s, "po", await bus.artifact(s, "brief v2"))

    assert new.outcome == "substituiu_oferta"
    rows = {r["id"]: r for r in await bus.rows("po")}
    assert rows[offered_id(old)]["status"] == "superseded"
    assert rows[offered_id(old)]["superseded_by"] == offered_id(new)
    assert rows[offered_id(new)]["status"] == "offered"
    events = await bus.events(s, "handoff.")
    assert [e.type.value for e in events] == [OFFERED, OFFERED, SUPERSEDED]
    assert events[2].payload == {
        "handoffId": str(offered_id(old)),
        "toAgent": "po",
        "motivo": "nova_oferta",
        "substitutaId": str(offered_id(new)),
    }
    assert events[2].actor == "system:handoff-lifecycle"


async def test_a_pending_offer_in_another_session_is_superseded_there_even_if_closed(
    bus: Driver,
) -> None:
    elsewhere = await bus.open()
    old = await bus.offer(elsewhere, "po")
    await bus.close(elsewhere)
    here = await bus.open()
    new = await bus.offer(here, "po")

    assert new.outcome == "substituiu_oferta"
    [superseded] = await bus.events(elsewhere, SUPERSEDED)
    assert superseded.payload["handoffId"] == str(offered_id(old))
    assert superseded.payload["substitutaId"] == str(offered_id(new))
    assert [e.type.value for e in await bus.events(here, "handoff.")] == [OFFERED]


# --- concurrency -------------------------------------------------------------------------


async def test_fifty_identical_offers_at_once_write_one_offer_and_one_event(bus: Driver) -> None:
    s = await bus.open()
    replies = await asyncio.gather(*(bus.offer(s, "po") for _ in range(50)))

    assert sorted(r.outcome for r in replies).count("created") == 1
    assert {offered_id(r) for r in replies} == {offered_id(replies[0])}
    [row] = await bus.rows("po")
    assert row["status"] == "offered"
    assert len(await bus.events(s, OFFERED)) == 1


async def test_twenty_offers_with_different_artifacts_leave_one_offered(bus: Driver) -> None:
    s = await bus.open()
    artifacts = [await bus.artifact(s, f"brief {i}") for i in range(20)]
    await asyncio.gather(*(bus.offer(s, "po", a) for a in artifacts))

    rows = await bus.rows("po")
    assert len(rows) == 20
    assert sorted(r["status"] for r in rows).count("offered") == 1
    assert len(await bus.events(s, OFFERED)) == 20
    superseded = await bus.events(s, SUPERSEDED)
    assert sorted(e.payload["handoffId"] for e in superseded) == sorted(
        str(r["id"]) for r in rows if r["status"] == "superseded"
    )


async def test_offers_to_different_targets_never_wait_on_each_other(bus: Driver) -> None:
    s = await bus.open()
    async with bus.db.acquire() as holder, holder.transaction():
        await holder.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", f"handoff:{bus.project}:po"
        )
        to_po = asyncio.create_task(bus.offer(s, "po"))
        to_arquiteto = await bus.offer(s, "arquiteto")  # completes while po's lock is held
        assert to_arquiteto.outcome == "created"
        assert not to_po.done()
    assert (await to_po).outcome == "created"


async def offer_committed_while_waiting(
    bus: Driver, decision: Coroutine[Any, Any, T]
) -> tuple[T, uuid.UUID]:
    """Run `decision` (an offer to `po`) while this test holds po's lock; once it waits for
    the lock, commit an `offered` row to po as a concurrent offer would, then release.
    Returns the decision's reply and the id of the row committed under it."""
    committed = uuid.uuid4()
    async with bus.db.acquire() as holder, holder.transaction():
        await holder.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", f"handoff:{bus.project}:po"
        )
        task = asyncio.create_task(decision)
        await wait_for(
            lambda: holder.fetchval(
                """SELECT count(*) FROM pg_stat_activity
                    WHERE datname = current_database() AND application_name = 'handoff'
                      AND wait_event_type = 'Lock' AND wait_event = 'advisory'"""
            ),
            what="the offer waiting for po's lock",
        )
        await holder.execute(
            """INSERT INTO handoff.handoffs
                      (id, project_id, session_id, from_agent, to_agent, status)
               VALUES ($1, $2, $3, 'criativo', 'po', 'offered')""",
            committed,
            bus.project,
            await bus.open(),
        )
    return await task, committed


async def test_an_offer_reads_its_target_as_it_is_once_the_lock_is_granted(bus: Driver) -> None:
    """The read follows the lock, not the statement's start: a read with the snapshot
    taken before the wait would miss the holder's offer and leave two `offered`."""
    s = await bus.open()
    reply, committed = await offer_committed_while_waiting(bus, bus.offer(s, "po"))

    assert reply.outcome == "substituiu_oferta"
    rows = {r["id"]: r for r in await bus.rows("po")}
    assert [i for i, r in rows.items() if r["status"] == "offered"] == [offered_id(reply)]
    assert rows[committed]["status"] == "superseded"
    assert rows[committed]["superseded_by"] == offered_id(reply)


async def test_offer_many_reads_each_target_as_it_is_once_its_lock_is_granted(
    bus: Driver,
) -> None:
    s = await bus.open()
    many = OfferMany(
        project_id=bus.project,
        session_id=s,
        from_agent="criativo",
        targets=[OfferTarget(to_agent="po")],
    )
    reply, committed = await offer_committed_while_waiting(
        bus, call(bus.nc, subjects.HANDOFFS_OFFER_MANY, many, OfferManyReply)
    )

    assert reply.offered == []
    assert [(a.to_agent, a.handoff_id) for a in reply.jaAtendidos] == [("po", committed)]
    assert [r["id"] for r in await bus.rows("po")] == [committed]


# --- active agents and activation --------------------------------------------------------


async def test_an_offer_to_an_active_agent_is_refused_and_writes_nothing(bus: Driver) -> None:
    s = await bus.open()
    pending = await bus.offer(s, "po")
    await accept(bus, offered_id(pending), s)
    rows_before = len(await bus.rows("po"))
    events_before = len(await bus.events(s))

    other = await bus.open()
    with pytest.raises(CommandFailed) as refused:
        await bus.offer(other, "po", await bus.artifact(other))
    assert refused.value.code == "agente_ja_ativo"
    assert "'po' is already active" in refused.value.message
    assert refused.value.details["active_session_id"] == str(s)
    assert len(await bus.rows("po")) == rows_before
    assert len(await bus.events(s)) == events_before
    assert await bus.events(other, "handoff.") == []


async def test_accepting_activates_the_target_and_supersedes_its_offers_everywhere(
    bus: Driver,
) -> None:
    s1, s2, s3 = await bus.open(), await bus.open(), await bus.open()
    o1 = await bus.offer(s1, "po")
    # Old duplicates (from before the rule) must converge too: insert two more by hand.
    await bus.db.execute(
        "INSERT INTO handoff.handoffs (id, project_id, session_id, from_agent, to_agent, status)"
        " VALUES ($1, $2, $3, 'criativo', 'po', 'offered'), ($4, $2, $5, 'criativo', 'po',"
        " 'offered')",
        uuid.uuid4(),
        bus.project,
        s2,
        uuid.uuid4(),
        s3,
    )
    [current] = [r for r in await bus.rows("po") if r["session_id"] == s3]

    reply = await accept(bus, current["id"], s3)

    assert reply.handoff.status == "accepted"
    assert (reply.activation.agent, reply.activation.via) == ("po", "accept")
    [in_s2] = [r["id"] for r in await bus.rows("po") if r["session_id"] == s2]
    assert sorted(reply.superseded) == sorted([offered_id(o1), in_s2])
    statuses = {r["id"]: r["status"] for r in await bus.rows("po")}
    assert sorted(statuses.values()) == ["accepted", "superseded", "superseded"]
    for session in (s1, s2):
        [event] = await bus.events(session, SUPERSEDED)
        assert event.payload["motivo"] == "agente_ativado"
        assert event.payload["substitutaId"] == str(current["id"])
    assert [e.type.value for e in await bus.events(s3)][-2:] == [
        "handoff.accepted",
        "agent.activated",
    ]
    active = await call(
        bus.nc, subjects.AGENTS_ACTIVE, ActiveAgents(project_id=bus.project), ActiveAgentsReply
    )
    assert [(a.agent, a.session_id) for a in active.activations] == [("po", s3)]


@pytest.mark.parametrize("via", ["user", "direct", "execution"])
async def test_every_activation_path_supersedes_pending_offers_to_the_agent(
    bus: Driver, via: str
) -> None:
    waiting = await bus.open()
    offer = await bus.offer(waiting, "criativo", src="po")
    here = await bus.open()

    reply = await activate(bus, here, "criativo", via)

    assert reply.superseded == [offered_id(offer)]
    [event] = await bus.events(waiting, SUPERSEDED)
    assert (event.payload["motivo"], event.payload["substitutaId"]) == ("agente_ativado", None)
    [activated] = await bus.events(here, "agent.activated")
    assert activated.payload == {"agent": "criativo", "via": via, "handoff_id": None}
    again = await activate(bus, here, "criativo", via)
    assert again.already_active and again.superseded == []
    assert len(await bus.events(here, "agent.activated")) == 1


async def test_the_execution_activates_a_sub_agent_superseding_its_internal_offers(
    bus: Driver,
) -> None:
    waiting = await bus.open()
    internal = await bus.offer(waiting, "dev-auth", src="dev-lead")
    here = await bus.open()

    reply = await activate(bus, here, "dev-auth", "execution")

    assert reply.superseded == [offered_id(internal)]
    [event] = await bus.events(waiting, SUPERSEDED)
    assert event.payload["motivo"] == "agente_ativado"
    with pytest.raises(CommandFailed) as refused:
        await activate(bus, await bus.open(), "dev-billing", "direct")
    assert refused.value.code == "activation_refused"


async def test_an_agent_without_an_accepted_handoff_is_not_activated(bus: Driver) -> None:
    s = await bus.open()
    for via in ("direct", "execution", "user"):
        with pytest.raises(CommandFailed) as refused:
            await activate(bus, s, "po", via)
        assert refused.value.code == "activation_refused"
    assert await bus.events(s, "agent.") == []


async def test_accepting_in_a_closed_session_is_refused(bus: Driver) -> None:
    s = await bus.open()
    offer = await bus.offer(s, "po")
    await bus.close(s)
    with pytest.raises(CommandFailed) as refused:
        await accept(bus, offered_id(offer), s)
    assert refused.value.code == "session_closed"
    [row] = await bus.rows("po")
    assert row["status"] == "offered"


async def test_closing_a_session_ends_the_activity_in_it(bus: Driver) -> None:
    s = await bus.open()
    await activate(bus, s, "criativo", "user")
    await bus.close(s)

    async def nobody_active() -> bool:
        reply = await call(
            bus.nc, subjects.AGENTS_ACTIVE, ActiveAgents(project_id=bus.project), ActiveAgentsReply
        )
        return reply.activations == []

    await wait_for(nobody_active, what="the closing to end criativo's activation")
    later = await bus.open()
    assert (await bus.offer(later, "criativo", src="po")).outcome == "created"


async def test_transitions_outside_the_table_are_refused(bus: Driver) -> None:
    s = await bus.open()
    offer = await bus.offer(s, "po")
    decision = HandoffDecision(handoff_id=offered_id(offer), session_id=s, reason="not now")
    rejected = await call(bus.nc, subjects.HANDOFFS_REJECT, decision, HandoffReply)
    assert rejected.handoff.status == "rejected"
    for subject in (subjects.HANDOFFS_ACCEPT, subjects.HANDOFFS_REJECT, subjects.HANDOFFS_COMPLETE):
        with pytest.raises(CommandFailed) as refused:
            await call(bus.nc, subject, decision, HandoffReply)
        assert refused.value.code == "invalid_transition"
    [event] = await bus.events(s, "handoff.rejected")
    assert event.payload["reason"] == "not now"


async def test_an_accepted_handoff_completes(bus: Driver) -> None:
    s = await bus.open()
    offer = await bus.offer(s, "po")
    await accept(bus, offered_id(offer), s)
    done = await call(
        bus.nc,
        subjects.HANDOFFS_COMPLETE,
        HandoffDecision(handoff_id=offered_id(offer), session_id=s),
        HandoffReply,
    )
    assert done.handoff.status == "completed"
    assert len(await bus.events(s, "handoff.completed")) == 1


# --- offer_many and if_absent (decisions 6 and 7) ----------------------------------------


async def offer_many(bus: Driver, s: uuid.UUID, src: str, *targets: str) -> OfferManyReply:
    request = OfferMany(
        project_id=bus.project,
        session_id=s,
        from_agent=src,
        targets=[OfferTarget(to_agent=t) for t in targets],
    )
    return await call(bus.nc, subjects.HANDOFFS_OFFER_MANY, request, OfferManyReply)


async def test_offer_many_twice_offers_only_what_is_missing(bus: Driver) -> None:
    s = await bus.open()
    first = await offer_many(bus, s, "arquiteto", "infra", "dev-lead")
    second = await offer_many(bus, s, "arquiteto", "infra", "dev-lead")

    assert first.outcome == "created"
    assert sorted(h.to_agent for h in first.offered) == ["dev-lead", "infra"]
    assert (second.outcome, second.offered) == ("ja_oferecido", [])
    assert sorted((s.to_agent, s.motivo) for s in second.jaAtendidos) == [
        ("dev-lead", "ja_oferecido"),
        ("infra", "ja_oferecido"),
    ]
    assert len(await bus.events(s, OFFERED)) == 2

    await accept(bus, next(h.id for h in first.offered if h.to_agent == "infra"), s)
    await call(
        bus.nc,
        subjects.HANDOFFS_REJECT,
        HandoffDecision(
            handoff_id=next(h.id for h in first.offered if h.to_agent == "dev-lead"), session_id=s
        ),
        HandoffReply,
    )
    third = await offer_many(bus, s, "arquiteto", "infra", "dev-lead")
    assert [h.to_agent for h in third.offered] == ["dev-lead"]  # only the missing one
    assert [(s.to_agent, s.motivo) for s in third.jaAtendidos] == [("infra", "agente_ja_ativo")]


async def test_offer_many_naming_a_target_twice_offers_it_once(bus: Driver) -> None:
    reply = await offer_many(bus, await bus.open(), "criativo", "po", "po")

    [offered] = reply.offered
    assert [(a.to_agent, a.motivo, a.handoff_id) for a in reply.jaAtendidos] == [
        ("po", "ja_oferecido", offered.id)
    ]
    assert [r["id"] for r in await bus.rows("po")] == [offered.id]


async def test_if_absent_offers_only_to_a_target_neither_offered_nor_active(bus: Driver) -> None:
    s = await bus.open()
    created = await bus.offer(s, "arquiteto", src="appsec", mode="if_absent")
    assert (created.outcome, created.skipped) == ("created", None)

    pending = await bus.offer(s, "arquiteto", await bus.artifact(s), src="appsec", mode="if_absent")
    assert (pending.outcome, pending.skipped) == ("ja_oferecido", "ja_oferecido")
    assert pending.handoff is not None and pending.handoff.id == offered_id(created)

    await accept(bus, offered_id(created), s)
    active = await bus.offer(s, "arquiteto", src="appsec", mode="if_absent")
    assert (active.handoff, active.skipped) == (None, "agente_ja_ativo")
    assert len(await bus.rows("arquiteto")) == 1
    assert len(await bus.events(s, OFFERED)) == 1


# --- listing and bad input ---------------------------------------------------------------


async def test_list_filters_by_session_and_status(bus: Driver) -> None:
    s1, s2 = await bus.open(), await bus.open()
    await bus.offer(s1, "po")
    await bus.offer(s2, "po")
    everything = await call(
        bus.nc, subjects.HANDOFFS_LIST, ListHandoffs(project_id=bus.project), HandoffsReply
    )
    assert [h.status for h in everything.handoffs] == ["superseded", "offered"]
    only_s2 = await call(
        bus.nc,
        subjects.HANDOFFS_LIST,
        ListHandoffs(project_id=bus.project, session_id=s2),
        HandoffsReply,
    )
    assert [h.session_id for h in only_s2.handoffs] == [s2]
    superseded = await call(
        bus.nc,
        subjects.HANDOFFS_LIST,
        ListHandoffs(project_id=bus.project, status="superseded"),
        HandoffsReply,
    )
    assert [h.session_id for h in superseded.handoffs] == [s1]


async def test_bad_requests_get_precise_codes_and_write_nothing(bus: Driver, nc: Client) -> None:
    s = await bus.open()
    other_project = await bus.open("another-project")

    async def raw(subject: str, body: object) -> str:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        reply = json.loads((await nc.request(subject, data, timeout=5)).data)
        return str(reply["error"]["code"])

    offer = {
        "project_id": bus.project,
        "session_id": str(s),
        "from_agent": "criativo",
        "to_agent": "po",
    }
    cases = [
        (subjects.HANDOFFS_OFFER, b"{nope", "malformed_json"),
        (subjects.HANDOFFS_OFFER, {**offer, "mode": "sometimes"}, "invalid_request"),
        (subjects.HANDOFFS_OFFER, {**offer, "to_agent": "Not A Slug"}, "invalid_request"),
        (
            subjects.HANDOFFS_OFFER,
            {k: v for k, v in offer.items() if k != "to_agent"},
            "invalid_request",
        ),
        (subjects.HANDOFFS_OFFER, {**offer, "to_agent": "marketing"}, "unknown_agent"),
        (subjects.HANDOFFS_OFFER, {**offer, "to_agent": "staff"}, "target_not_allowed"),
        (subjects.HANDOFFS_OFFER, {**offer, "to_agent": "dev-auth"}, "target_not_allowed"),
        (subjects.HANDOFFS_OFFER, {**offer, "session_id": str(uuid.uuid4())}, "session_not_found"),
        (
            subjects.HANDOFFS_OFFER,
            {**offer, "session_id": str(other_project)},
            "session_not_in_project",
        ),
        (
            subjects.HANDOFFS_OFFER,
            {**offer, "artifact_id": str(uuid.uuid4())},
            "artifact_not_found",
        ),
        (
            subjects.HANDOFFS_ACCEPT,
            {"handoff_id": str(uuid.uuid4()), "session_id": str(s)},
            "handoff_not_found",
        ),
        (
            subjects.AGENTS_ACTIVATE,
            {"project_id": bus.project, "session_id": str(s), "agent": "po", "via": "magic"},
            "invalid_request",
        ),
        (subjects.HANDOFFS_LIST, {"project_id": "has.dots"}, "invalid_request"),
    ]
    for subject, body, code in cases:
        assert await raw(subject, body) == code, (subject, body)

    assert await bus.rows("po") == []
    assert await bus.events(s, "handoff.") == []
    assert (await bus.offer(s, "po")).outcome == "created"  # and it still answers


async def test_a_handoff_is_accepted_only_in_its_own_session(bus: Driver) -> None:
    s, elsewhere = await bus.open(), await bus.open()
    offer = await bus.offer(s, "po")
    with pytest.raises(CommandFailed) as refused:
        await accept(bus, offered_id(offer), elsewhere)
    assert refused.value.code == "handoff_not_in_session"
