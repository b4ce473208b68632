"""Offers to one target decided together (`lifecycle.offer_together`, one transaction)
end exactly as the same offers decided one by one, each in its own transaction: the same
replies, rows and events, in the same order."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest_asyncio

from contracts import subjects
from contracts.handoff import AcceptReply, HandoffDecision, OfferHandoff, OfferReply
from domain.errors import DomainError
from handoff import lifecycle
from handoff.repository import HandoffRepository
from servicekit.client import call
from servicekit.db import create_pool

from .conftest import Driver

# (session, target, artifact, mode) of each offer, in order: to `po` a first offer, its
# double click, another session's (superseding one of this very transaction), an
# if_absent, a new artifact in the same session, its repeat; to `arquiteto`, in between,
# a first offer and another session's.
OFFERS = [
    ("a", "po", None, "replace"),
    ("a", "po", None, "replace"),
    ("c", "arquiteto", None, "replace"),
    ("b", "po", None, "replace"),
    ("c", "po", None, "if_absent"),
    ("a", "arquiteto", None, "replace"),
    ("b", "po", "x", "replace"),
    ("b", "po", "x", "replace"),
]


@pytest_asyncio.fixture(loop_scope="session")
async def repo(bus: Driver, database_url: str) -> AsyncIterator[HandoffRepository]:
    pool = await create_pool(database_url, "handoff", 1, 2)
    yield HandoffRepository(pool)
    await pool.close()


async def commands(bus: Driver, project: str) -> list[OfferHandoff]:
    sessions = {name: await bus.open(project) for name in "abc"}
    artifacts = {"x": uuid.uuid4()}
    return [
        OfferHandoff(
            project_id=project,
            session_id=sessions[s],
            from_agent="criativo",
            to_agent=to,
            artifact_id=artifacts[a] if a else None,
            mode=mode,
        )
        for s, to, a, mode in OFFERS
    ]


async def outcome(
    bus: Driver,
    cmds: Sequence[OfferHandoff],
    replies: Sequence[OfferReply | DomainError | None],
) -> dict[str, Any]:
    """Replies, rows and each session's events, with ids and sessions named by role."""
    names: dict[uuid.UUID | None, str | None] = {None: None}
    for (s, *_), cmd in zip(OFFERS, cmds, strict=True):
        names[cmd.session_id] = s
    for r in replies:
        if isinstance(r, OfferReply) and r.handoff is not None:
            names.setdefault(r.handoff.id, f"h{len(names)}")

    def name(value: Any) -> str | None:
        return names[uuid.UUID(value) if isinstance(value, str) else value]

    project = cmds[0].project_id
    rows = await bus.db.fetch("SELECT * FROM handoff.handoffs WHERE project_id = $1", project)
    events = {}
    for session_id in {c.session_id for c in cmds}:
        events[name(session_id)] = [
            (e.type.value, name(e.payload.get("handoff_id") or e.payload.get("handoffId")),
             name(e.payload.get("substitutaId")))
            for e in await bus.events(session_id, "handoff.")
        ]  # fmt: skip
    return {
        "replies": [
            (r.outcome, r.skipped, r.handoff and (name(r.handoff.id), r.handoff.status,
             name(r.handoff.superseded_by), name(r.handoff.session_id)))
            if isinstance(r, OfferReply) else r and r.code
            for r in replies
        ],
        "rows": sorted(
            (name(r["id"]), r["to_agent"], r["status"], name(r["superseded_by"]),
             name(r["session_id"]))
            for r in rows
        ),
        "events": events,
    }  # fmt: skip


async def test_offers_decided_together_end_as_offers_decided_one_by_one(
    bus: Driver, repo: HandoffRepository
) -> None:
    one_by_one = await commands(bus, f"{bus.project}-one")
    replies: list[OfferReply | DomainError | None] = []
    for cmd in one_by_one:
        async with repo.transaction() as tx:
            replies += await lifecycle.offer_together(tx, [cmd])
    expected = await outcome(bus, one_by_one, replies)

    together = await commands(bus, f"{bus.project}-together")
    async with repo.transaction() as tx:
        replies = await lifecycle.offer_together(tx, together)
    got = await outcome(bus, together, replies)

    assert got == expected
    assert [r[0] for r in expected["replies"]] == [
        "created",
        "ja_oferecido",
        "created",
        "substituiu_oferta",
        "ja_oferecido",
        "substituiu_oferta",
        "substituiu_oferta",
        "ja_oferecido",
    ]
    assert sorted(r[1] for r in expected["rows"] if r[2] == "offered") == ["arquiteto", "po"]


async def test_each_offer_decided_together_gets_its_own_answer(
    bus: Driver, repo: HandoffRepository
) -> None:
    """To an active target a `replace` offer is refused and an `if_absent` one skipped: in
    one transaction each gets its own answer, and nothing is written."""
    project = f"{bus.project}-active"
    s = await bus.open(project)
    pending = await bus.offer(s, "po", project=project)
    assert pending.handoff is not None
    await call(
        bus.nc,
        subjects.HANDOFFS_ACCEPT,
        HandoffDecision(handoff_id=pending.handoff.id, session_id=s, actor="user:ana"),
        AcceptReply,
    )
    replace, if_absent = (await commands(bus, project))[3:5]
    rows_before = await bus.db.fetch(
        "SELECT * FROM handoff.handoffs WHERE project_id = $1", project
    )

    async with repo.transaction() as tx:
        refused, skipped = await lifecycle.offer_together(tx, [replace, if_absent])

    assert isinstance(refused, DomainError) and refused.code == "agente_ja_ativo"
    assert isinstance(skipped, OfferReply) and skipped.skipped == "agente_ja_ativo"
    assert skipped.handoff is None
    rows = await bus.db.fetch("SELECT * FROM handoff.handoffs WHERE project_id = $1", project)
    assert rows == rows_before


async def test_without_waiting_a_target_whose_lock_is_held_is_left_undecided(
    bus: Driver, repo: HandoffRepository
) -> None:
    """The shared transaction waits for no lock: the offer to the held target is answered
    None (it then waits in a transaction of its own), the other one is decided."""
    project = f"{bus.project}-held"
    to_po, to_arquiteto = (await commands(bus, project))[1:3]
    async with bus.db.acquire() as holder, holder.transaction():
        await holder.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", f"handoff:{project}:po"
        )
        async with repo.transaction() as tx:
            left, decided = await lifecycle.offer_together(tx, [to_po, to_arquiteto], wait=False)

    assert left is None
    assert isinstance(decided, OfferReply) and decided.outcome == "created"
    rows = await bus.db.fetch(
        "SELECT to_agent FROM handoff.handoffs WHERE project_id = $1", project
    )
    assert [r["to_agent"] for r in rows] == ["arquiteto"]
