"""A metering replica SIGKILLed between a provider call and its bill: the call is still
billed, once, at its hold, by whichever replica finds it first (real processes, real
Postgres)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client

from contracts import subjects
from contracts.metering import ChatMessage, LlmTurn, TurnReply
from metering.budgets import REPLICA_LOCK_KEY
from metering.replicas import ReplicaIdTaken, ReplicaLock
from servicekit.client import call
from testkit.probes import wait_for

DIES = {"AGENTBUS_FAULT_POINTS": "metering.before_bill"}
FAST_SWEEP = {"AGENTBUS_ORPHAN_SWEEP_SECONDS": "0.2"}


def a_turn() -> LlmTurn:
    return LlmTurn(
        run_id=f"run-{uuid.uuid4().hex[:8]}",
        turn_id=f"turn-{uuid.uuid4().hex}",
        agent_slug="writer",
        project_id="proj",
        person="ana",
        messages=[ChatMessage(role="user", content="Hello")],
        max_tokens=100,
    )


async def killed_mid_call(nc: Client, spawn: Any, replica: str) -> LlmTurn:
    """A turn whose replica called the provider and died before writing its bill."""
    doomed = spawn("metering", AGENTBUS_INSTANCE_ID=replica, **DIES)
    await doomed.wait_ready(nc, "metering")
    cmd = a_turn()
    asking = asyncio.ensure_future(call(nc, subjects.LLM_TURN, cmd, TurnReply, timeout=60))
    assert await asyncio.to_thread(doomed.wait_exit) == -9  # died at the crash point
    asking.cancel()
    return cmd


async def the_bill(db: asyncpg.Connection, cmd: LlmTurn) -> list[asyncpg.Record]:
    """The turn's usage rows, once its hold is settled (waited for)."""

    async def settled() -> bool:
        status = await db.fetchval(
            "SELECT status FROM budget_holds WHERE turn_id = $1", cmd.turn_id
        )
        return bool(status == "settled")

    await wait_for(settled, what="the dead replica's hold to be settled")
    return list(await db.fetch("SELECT * FROM token_usage WHERE turn_id = $1", cmd.turn_id))


async def test_survivors_bill_a_dead_replicas_call_once_at_its_hold(
    nc: Client, spawn: Any, database_url: str
) -> None:
    cmd = await killed_mid_call(nc, spawn, "metering-a")
    db = await asyncpg.connect(database_url, server_settings={"search_path": "metering"})
    try:
        hold = await db.fetchrow(
            "SELECT hold_micros, status, replica FROM budget_holds WHERE turn_id = $1",
            cmd.turn_id,
        )
        assert hold is not None and (hold["status"], hold["replica"]) == ("held", "metering-a")
        assert await db.fetchval("SELECT count(*) FROM token_usage") == 0

        # Two survivors race to settle it.
        for name in ("metering-b", "metering-c"):
            spawn("metering", AGENTBUS_INSTANCE_ID=name, **FAST_SWEEP)
        [row] = await the_bill(db, cmd)

        assert row["billed_at_hold"] is True
        assert (row["status"], row["error_code"]) == ("error", "replica_lost")
        assert row["cost_micros"] == hold["hold_micros"]
        assert (row["agent_slug"], row["project_id"], row["kind"]) == ("writer", "proj", "turn")
        run = await db.fetchrow(
            "SELECT spent_micros, reserved_micros FROM run_budgets WHERE run_id = $1", cmd.run_id
        )
        assert run is not None
        assert (run["spent_micros"], run["reserved_micros"]) == (hold["hold_micros"], 0)
        held = await db.fetchval("SELECT coalesce(sum(held), 0) FROM usage_counters")
        assert held == 0  # the limits' counters are released too
    finally:
        await db.close()


async def test_a_replica_restarted_under_its_id_bills_what_it_left_at_start(
    nc: Client, spawn: Any, database_url: str
) -> None:
    cmd = await killed_mid_call(nc, spawn, "metering-a")
    restarted = spawn("metering", AGENTBUS_INSTANCE_ID="metering-a")
    await restarted.wait_ready(nc, "metering")
    db = await asyncpg.connect(database_url, server_settings={"search_path": "metering"})
    try:
        [row] = await the_bill(db, cmd)
        assert row["billed_at_hold"] is True
    finally:
        await db.close()


async def test_a_live_replicas_call_is_left_to_it(
    nc: Client, spawn: Any, database_url: str
) -> None:
    """A survivor never bills the call of a replica that is alive, however long it runs:
    in the same sweep that bills a dead replica's call, it leaves the live one's."""
    db = await asyncpg.connect(database_url)
    try:
        survivor = spawn("metering", AGENTBUS_INSTANCE_ID="metering-b", **FAST_SWEEP)
        await survivor.wait_ready(nc, "metering")
        # metering-a is alive (its lock held, as its process would), metering-z is gone;
        # each holds a call it has not billed.
        await db.execute(f"SELECT pg_advisory_lock({REPLICA_LOCK_KEY})", "metering-a")
        await db.execute(
            """INSERT INTO metering.run_budgets (run_id, reserved_micros) VALUES ('run-1', 800);
               INSERT INTO metering.budget_holds (turn_id, run_id, hold_micros, replica)
               VALUES ('turn-alive', 'run-1', 500, 'metering-a'),
                      ('turn-dead', 'run-1', 300, 'metering-z')"""
        )

        async def swept() -> bool:
            status = await db.fetchval(
                "SELECT status FROM metering.budget_holds WHERE turn_id = 'turn-dead'"
            )
            return bool(status == "settled")

        await wait_for(swept, what="the dead replica's hold to be settled")
        holds = {
            r["turn_id"]: r["status"]
            for r in await db.fetch("SELECT turn_id, status FROM metering.budget_holds")
        }
        assert holds == {"turn-alive": "held", "turn-dead": "settled"}
        billed = [r["turn_id"] for r in await db.fetch("SELECT turn_id FROM metering.token_usage")]
        assert billed == ["turn-dead"]
    finally:
        await db.close()


async def test_a_second_live_process_under_the_same_instance_id_is_refused_at_start(
    database_url: str,
) -> None:
    """Holds are told apart by instance id: a second process under a live one's id would
    never get the lock, and says why instead of waiting for ever."""
    first = ReplicaLock(database_url, "metering-a")
    await first.take()
    try:
        with pytest.raises(ReplicaIdTaken, match="AGENTBUS_INSTANCE_ID"):
            await ReplicaLock(database_url, "metering-a").take(patience_seconds=0.3)
        other = ReplicaLock(database_url, "metering-b")
        await other.take()  # another id is free
        await other.close()
    finally:
        await first.close()
