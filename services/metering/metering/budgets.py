"""Metering's budget and limit statements: a turn's hold on its run's row and on its
limits' counters, and their settlement. Every statement is parameterised; the CTEs below
are composed from fixed text only."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import asyncpg

from contracts.metering import LimitUse, LlmTurn
from domain.metering import RunBudget, window_end
from domain.metering_turn import Hold, turn_id_reused
from servicekit.db import Connection


def _run_written(seen_version: str | None) -> str:
    """The `run` CTE: the run's new figures, written only on the row as the caller saw it,
    at version `seen_version` (a parameter, e.g. "$7"), or (None) as a new row, unless
    someone created it meanwhile; returns the row's new version."""
    if seen_version is None:
        return """run AS (
       INSERT INTO run_budgets (run_id, budget_micros, spent_micros, reserved_micros, version)
       VALUES ($2, $4, $5, $6, 1)
       ON CONFLICT (run_id) DO NOTHING RETURNING version)"""
    return f"""run AS (
       UPDATE run_budgets SET budget_micros = $4, spent_micros = $5, reserved_micros = $6,
              version = version + 1, updated_at = now()
        WHERE run_id = $2 AND version = {seen_version}
          AND NOT EXISTS (SELECT 1 FROM budget_holds WHERE turn_id = $1)
       RETURNING version)"""


# The compare-and-set reservations (`MeteringRepository.hold_if_unchanged`): a `run` CTE
# writes the run's row only if it is as the caller saw it ($1 turn, $2 run, $3 hold, $4-$6
# the run's new budget, spent and reserved); the claim below is written from its output,
# so never without it. Two shapes of `run`, one claim.
_CLAIM_AFTER_RUN = """,
   claim AS (
       INSERT INTO budget_holds (turn_id, run_id, hold_micros)
       SELECT $1, $2, $3 FROM run
       ON CONFLICT (turn_id) DO NOTHING RETURNING true)
   SELECT (SELECT version FROM run) AS version, EXISTS (SELECT 1 FROM claim) AS claimed"""
# The run's first turn: the row is created, unless someone created it meanwhile.
HOLD_ON_NEW_RUN = "WITH " + _run_written(None) + _CLAIM_AFTER_RUN
# A run whose row the caller saw at version $7.
HOLD_ON_SEEN_RUN = "WITH " + _run_written("$7") + _CLAIM_AFTER_RUN


def _limits_in_force(project: str, person: str, amount: str, tokens: str) -> str:
    """CTEs of the limits in force for a project and a person (may be null; parameters,
    e.g. "$2"): each one's own row, field by field over the default row ('*'), and the
    counters a call of `amount` µUSD and `tokens` tokens would hold in the windows open
    now (UTC)."""
    return f"""
   who(scope, name) AS (VALUES ('project', {project}::text), ('person', {person}::text)),
   caps AS (
       SELECT w.scope, w.name,
              coalesce(own.micros_per_day, dflt.micros_per_day) AS micros_per_day,
              coalesce(own.micros_per_month, dflt.micros_per_month) AS micros_per_month,
              coalesce(own.requests_per_minute, dflt.requests_per_minute) AS requests_per_minute,
              coalesce(own.tokens_per_minute, dflt.tokens_per_minute) AS tokens_per_minute
         FROM who w
         LEFT JOIN limits own ON own.scope = w.scope AND own.name = w.name
         LEFT JOIN limits dflt ON dflt.scope = w.scope AND dflt.name = '*'
        WHERE w.name IS NOT NULL),
   wanted AS (
       SELECT c.scope, c.name, m.metric, m.win, date_trunc(m.win, now(), 'UTC') AS starts,
              m.amount, m.lim
         FROM caps c CROSS JOIN LATERAL (VALUES
              ('micros', 'day', {amount}::bigint, c.micros_per_day),
              ('micros', 'month', {amount}::bigint, c.micros_per_month),
              ('requests', 'minute', 1::bigint, c.requests_per_minute),
              ('tokens', 'minute', {tokens}::bigint, c.tokens_per_minute))
              AS m(metric, win, amount, lim)
        WHERE m.lim IS NOT NULL)"""


# A held turn's ($1) counters: each admitted only if used + held + its share fits under
# the limit, in this one statement (row locks taken in one order: scope, name, metric,
# window), so parallel calls never promise the last cents twice. The hold notes what it
# holds and for whom ($6: `domain.metering_turn.owner_of`), and the replica and the call it
# holds for ($7-$12: `HeldCall`). The caller's transaction is
# rolled back when any counter refused: a call holds on all of them or on none.
def _counters_held(condition: str) -> str:
    """The `held` CTE: the `wanted` counters the call fits under, held (`condition`: SQL
    that must also be true, e.g. that the turn was claimed)."""
    return f""",
   held AS (
       INSERT INTO usage_counters AS c (scope, name, metric, win, starts, held, "limit")
       SELECT scope, name, metric, win, starts, amount, lim FROM wanted
        WHERE amount <= lim AND {condition}
        ORDER BY scope, name, metric, win
       ON CONFLICT (scope, name, metric, win, starts) DO UPDATE
          SET held = c.held + EXCLUDED.held, "limit" = EXCLUDED."limit"
        WHERE c.used + c.held + EXCLUDED.held <= EXCLUDED."limit"
       RETURNING scope, metric, win)"""


# Each limit's counter as the statement's snapshot shows it, and whether the call was held
# on it (`held`).
_COUNTERS_SEEN = """
   SELECT w.scope, w.name, w.metric, w.win, w.starts, w.lim AS "limit", w.amount,
          coalesce(u.used, 0) AS used, coalesce(u.held, 0) AS held,
          EXISTS (SELECT 1 FROM held h
                   WHERE (h.scope, h.metric, h.win) = (w.scope, w.metric, w.win)) AS admitted
     FROM wanted w
     LEFT JOIN usage_counters u USING (scope, name, metric, win, starts)"""
# The order the counters are locked in, and refusals told.
_LOCK_ORDER = """
    ORDER BY scope, metric, win"""

HOLD_LIMITS = (
    "WITH"
    + _limits_in_force("$2", "$3", "$4", "$5")
    + _counters_held("true")
    + """,
   noted AS (
       UPDATE budget_holds
          SET project_id = $2, person = $3, tokens_held = $5, owner = $6,
              counters = (SELECT coalesce(array_agg(scope || '/' || metric || '/' || win), '{}')
                            FROM held),
              replica = $7, kind = $8, provider = $9, model = $10, agent_slug = $11,
              session_id = $12
        WHERE turn_id = $1)"""
    + _COUNTERS_SEEN
    + _LOCK_ORDER
)


def reserve_whole(seen_version: str | None) -> str:
    """A turn's whole reservation in one statement, on the run's row as the caller saw it
    (`_run_written`): the run's hold, the turn's claim noting what it holds and for whom,
    and its share on every limit in force, which `HOLD_LIMITS` takes in a transaction of
    its own. A statement is one transaction, so one round trip: the reservation on the
    path of every first token. Nothing is claimed or held unless the run's row was as
    seen and the turn id free (version NULL: decide again under the row's lock). All or
    nothing: a limit the call does not fit under, or a turn id claimed under another run
    ($1), makes `reservation_whole` (migration 0007) raise, undoing the statement; the
    first refusing limit's counter (`_COUNTERS_SEEN`) is the error's detail.

    $1 turn, $2 run, $3 hold, $4-$6 the run's new budget, spent and reserved, $7 project,
    $8 person, $9 tokens held, $10 owner, $11-$16 the call (`HeldCall`), `seen_version`."""
    return (
        "WITH "
        + _run_written(seen_version)
        + ","
        + _limits_in_force("$7", "$8", "$3", "$9")
        + """,
   claim AS (
       INSERT INTO budget_holds (turn_id, run_id, hold_micros, project_id, person,
                                 tokens_held, owner, counters, replica, kind, provider,
                                 model, agent_slug, session_id)
       SELECT $1, $2, $3, $7, $8, $9, $10,
              (SELECT coalesce(array_agg(scope || '/' || metric || '/' || win), '{}')
                 FROM wanted),
              $11, $12, $13, $14, $15, $16
         FROM run
       ON CONFLICT (turn_id) DO NOTHING RETURNING true)"""
        + _counters_held("EXISTS (SELECT 1 FROM claim)")
        + """,
   refused AS (
       SELECT * FROM ("""
        + _COUNTERS_SEEN
        + """) c
        WHERE NOT admitted AND EXISTS (SELECT 1 FROM claim)"""
        + _LOCK_ORDER
        + """
        LIMIT 1)
   SELECT (SELECT version FROM run) AS version,
          reservation_whole(
              CASE WHEN EXISTS (SELECT 1 FROM run) AND NOT EXISTS (SELECT 1 FROM claim)
                   THEN 'turn_id_reused'
                   WHEN EXISTS (SELECT 1 FROM refused) THEN 'limit_refused' END,
              (SELECT row_to_json(refused)::text FROM refused)) AS whole"""
    )


# The reservation in one statement, on a run without a row yet, and on a row seen at
# version $17.
RESERVE_ON_NEW_RUN = reserve_whole(None)
RESERVE_ON_SEEN_RUN = reserve_whole("$17")
# The reasons `reservation_whole` raises with (its error's message).
TURN_ID_REUSED = "turn_id_reused"
LIMIT_REFUSED = "limit_refused"

# What the limits in force have used in the windows open now.
LIMITS_STATUS = (
    "WITH"
    + _limits_in_force("$1", "$2", "0", "0")
    + """
   SELECT w.scope, w.name, w.metric, w.win, w.starts, w.lim AS "limit", w.amount,
          coalesce(u.used, 0) AS used, coalesce(u.held, 0) AS held
     FROM wanted w
     LEFT JOIN usage_counters u USING (scope, name, metric, win, starts)
    ORDER BY w.scope, w.metric, w.win"""
)


def settle_counters(cost: str, tokens: str) -> str:
    """The CTEs that settle the counters of the hold a `hold` CTE returned (its
    hold_micros, project_id, person, tokens_held, counters, created_at): each counter's
    share moves from held to used at the call's real `cost` and `tokens` (parameters,
    e.g. "$14"). Locked in the same order as `HOLD_LIMITS` takes them."""
    return f""",
   counter_rows AS MATERIALIZED (
       SELECT c.scope, c.name, c.metric, c.win, c.starts, h.hold_micros, h.tokens_held
         FROM usage_counters c, hold h
        WHERE c.scope || '/' || c.metric || '/' || c.win = ANY (h.counters)
          AND c.name = CASE c.scope WHEN 'project' THEN h.project_id ELSE h.person END
          AND c.starts = date_trunc(c.win, h.created_at, 'UTC')
        ORDER BY c.scope, c.name, c.metric, c.win
          FOR UPDATE OF c),
   counted AS (
       UPDATE usage_counters c
          SET held = c.held - CASE r.metric WHEN 'micros' THEN r.hold_micros
                                            WHEN 'requests' THEN 1 ELSE r.tokens_held END,
              used = c.used + CASE r.metric WHEN 'micros' THEN {cost}::bigint
                                            WHEN 'requests' THEN 1 ELSE {tokens}::bigint END
         FROM counter_rows r
        WHERE (c.scope, c.name, c.metric, c.win, c.starts)
              = (r.scope, r.name, r.metric, r.win, r.starts)
       RETURNING c.scope, c.name, c.metric, c.win, c.used, c.held, c."limit")"""


HOLD_RETURNING = "hold_micros, project_id, person, tokens_held, counters, created_at"


@dataclass(frozen=True)
class HeldCall:
    """The replica that holds a hold and the call it holds for: what a survivor needs to
    write the call's usage row when that replica dies between the call and its bill."""

    replica: str | None
    kind: str
    provider: str
    model: str
    agent_slug: str
    session_id: UUID | None

    def noted(self) -> tuple[str | None, str, str, str, str, UUID | None]:
        """What the hold notes of the call, in the columns' order."""
        return (self.replica, self.kind, self.provider, self.model, self.agent_slug,
                self.session_id)  # fmt: skip


# The usage row of a hold settled without its call's bill (its replica died): billed at
# the hold, the call's worst case, since what it really used died with the replica.
# `hold` is the settled hold's CTE, returning its turn and call besides `HOLD_RETURNING`.
USAGE_FROM_HOLD = """,
   usage AS (
       INSERT INTO token_usage (turn_id, run_id, kind, provider, model, agent_slug,
           project_id, session_id, input_tokens, output_tokens, cache_write_5m_tokens,
           cache_write_1h_tokens, cache_read_tokens, cost_micros, status, error_code,
           error_message, started_at, finished_at, billed_at_hold)
       SELECT turn_id, run_id, coalesce(kind, 'turn'), coalesce(provider, 'unknown'),
              coalesce(model, 'unknown'), coalesce(agent_slug, 'unknown'),
              coalesce(project_id, 'unknown'), session_id, 0, 0, 0, 0, 0, hold_micros,
              'error', 'replica_lost',
              'the metering replica running this call died before billing it: billed at '
              || 'its hold, the worst case (the call may not have reached the provider)',
              created_at, now(), true
         FROM hold
       ON CONFLICT (turn_id) DO NOTHING)"""

# A replica's advisory lock, held for its life on a connection of its own: Postgres frees
# it when that connection ends, with the process, so a survivor that can take it knows
# the replica is gone (`ReplicaLock`, `metering.sweeper`).
REPLICA_LOCK_KEY = "hashtextextended('metering.replica:' || $1, 0)"


@dataclass(frozen=True)
class StoredRun:
    """A run's budget as its row holds it, and the row's version (bumped by every write)."""

    budget: RunBudget
    version: int


# Runs whose row each replica remembers (`RememberedRuns`): a few hundred bytes each.
REMEMBERED_RUNS = 10_000


class RememberedRuns:
    """Run rows as this replica last wrote them, by run id, least recently written first:
    a run's next turn is decided on its row and written in one statement if the row is
    still the same (`reserve_whole_in`); only the most recent runs are kept."""

    def __init__(self, size: int = REMEMBERED_RUNS) -> None:
        self._size = size
        self._runs: dict[str, StoredRun] = {}

    def get(self, run_id: str) -> StoredRun | None:
        return self._runs.get(run_id)

    def forget(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def remember(self, run_id: str, stored: StoredRun) -> None:
        self._runs.pop(run_id, None)
        self._runs[run_id] = stored
        if len(self._runs) > self._size:
            del self._runs[next(iter(self._runs))]  # the least recently written


@dataclass(frozen=True)
class CounterUse:
    """A limit's counter as a bill left it."""

    scope: str
    name: str
    metric: str
    window: str
    used: int
    held: int
    limit: int


def stored_run_of(row: asyncpg.Record) -> StoredRun:
    budget = RunBudget(row["budget_micros"], row["spent_micros"], row["reserved_micros"])
    return StoredRun(budget, row["version"])


async def hold_if_unchanged_in(
    conn: Connection,
    run_id: str,
    turn_id: str,
    amount: int,
    seen: StoredRun | None,
    run: RunBudget,
) -> int | None:
    """Claim the turn id with its hold and save `run`, in one statement, only if the row is
    still as `seen` (None: the run has no row yet) and the turn id is unclaimed; the row's
    new version, or None when nothing was written.

    The claim depends on the row's update, so a claim is never written without its
    reservation; a concurrent claim of the same turn id bumped the version too (`hold`,
    this statement), so the update cannot succeed beside it."""
    figures = (turn_id, run_id, amount, run.budget, run.spent, run.reserved)
    if seen is None:
        row = await conn.fetchrow(HOLD_ON_NEW_RUN, *figures)
    else:
        row = await conn.fetchrow(HOLD_ON_SEEN_RUN, *figures, seen.version)
    assert row is not None
    if row["version"] is not None and not row["claimed"]:
        # The turn id is claimed under another run: a caller reused it for another request.
        raise turn_id_reused(turn_id)
    version: int | None = row["version"]
    return version


class LimitRefused(Exception):
    """Undoes a reservation: a limit the turn does not fit under refused it."""

    def __init__(self, use: LimitUse) -> None:
        super().__init__(use)
        self.use = use


async def reserve_whole_in(
    conn: Connection | asyncpg.Pool,
    cmd: LlmTurn,
    hold: Hold,
    call: HeldCall,
    seen: StoredRun | None,
    run: RunBudget,
) -> int | None:
    """The turn's whole reservation (`reserve_whole`) on the run's row as `seen` (None: it
    had no row); the row's new version, or None when nothing was written (the row is no
    longer as seen, or the turn id is claimed). Raises `LimitRefused` and
    `turn_id_reused`, having written nothing."""
    figures = (cmd.turn_id, cmd.run_id, hold.micros, run.budget, run.spent, run.reserved,
               cmd.project_id, cmd.person, hold.tokens, hold.owner, *call.noted())  # fmt: skip
    try:
        if seen is None:
            row = await conn.fetchrow(RESERVE_ON_NEW_RUN, *figures)
        else:
            row = await conn.fetchrow(RESERVE_ON_SEEN_RUN, *figures, seen.version)
    except asyncpg.exceptions.RaiseError as exc:
        if exc.message == TURN_ID_REUSED:
            raise turn_id_reused(cmd.turn_id) from None
        if exc.message == LIMIT_REFUSED:
            raise LimitRefused(refused_limit(exc.detail or "")) from None
        raise
    assert row is not None
    version: int | None = row["version"]
    return version


def refused_limit(detail: str) -> LimitUse:
    """The limit `reservation_whole` refused a turn on, from its error's detail."""
    row = json.loads(detail)
    return limit_use({**row, "starts": datetime.fromisoformat(row["starts"])})


def limit_use(row: asyncpg.Record | Mapping[str, Any]) -> LimitUse:
    """A limit in force and its open window's use, as `_limits_in_force`'s rows give it."""
    return LimitUse(
        scope=row["scope"],
        name=row["name"],
        metric=row["metric"],
        window=row["win"],
        limit=row["limit"],
        used=row["used"],
        held=row["held"],
        resets_at=window_end(row["win"], row["starts"]),
    )


class BudgetTransaction:
    """The statements that run while one run's budget row is locked."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    async def hold_limits(
        self,
        turn_id: str,
        project_id: str,
        person: str | None,
        amount: int,
        tokens: int,
        owner: str,
        call: HeldCall | None = None,
    ) -> list[LimitUse]:
        """Hold the turn's share on every limit in force for the project and the person,
        noting `call` on the hold; the limits it did not fit under (then nothing may be
        committed: the caller rolls back). The turn's hold must be claimed in this
        transaction first."""
        noted = call.noted() if call is not None else (None,) * 6
        rows = await self._conn.fetch(
            HOLD_LIMITS, turn_id, project_id, person, amount, tokens, owner, *noted
        )
        return [limit_use(r) for r in rows if not r["admitted"]]

    async def lock_run(self, run_id: str) -> RunBudget:
        """The run's budget, created empty on its first turn, locked until commit."""
        return (await self.lock_stored_run(run_id)).budget

    async def lock_stored_run(self, run_id: str) -> StoredRun:
        """`lock_run`, with the row's version.

        One statement: the no-op update of an existing row takes its row lock."""
        row = await self._conn.fetchrow(
            """INSERT INTO run_budgets (run_id) VALUES ($1)
               ON CONFLICT (run_id) DO UPDATE SET run_id = EXCLUDED.run_id
               RETURNING budget_micros, spent_micros, reserved_micros, version""",
            run_id,
        )
        assert row is not None
        return stored_run_of(row)

    async def save_run(self, run_id: str, run: RunBudget) -> int:
        """Save the locked run; returns the row's new version."""
        version: int = await self._conn.fetchval(
            """UPDATE run_budgets SET budget_micros = $2, spent_micros = $3, reserved_micros = $4,
                      version = version + 1, updated_at = now()
                WHERE run_id = $1
               RETURNING version""",
            run_id,
            run.budget,
            run.spent,
            run.reserved,
        )
        return version

    async def hold(self, run_id: str, turn_id: str, amount: int, run: RunBudget) -> int | None:
        """Claim the turn id with its hold and save the run that holds it, in one statement;
        the row's new version, or None (nothing written) when the turn id is already claimed."""
        version: int | None = await self._conn.fetchval(
            """WITH claim AS (
                   INSERT INTO budget_holds (turn_id, run_id, hold_micros) VALUES ($1, $2, $3)
                   ON CONFLICT (turn_id) DO NOTHING RETURNING true)
               UPDATE run_budgets SET budget_micros = $4, spent_micros = $5,
                      reserved_micros = $6, version = version + 1, updated_at = now()
                WHERE run_id = $2 AND EXISTS (SELECT 1 FROM claim)
               RETURNING version""",
            turn_id,
            run_id,
            amount,
            run.budget,
            run.spent,
            run.reserved,
        )
        return version

    async def settle_hold(self, turn_id: str) -> int | None:
        """Settle a hold whose call was never billed at what it holds: the hold, its limits'
        counters (at the tokens it held) and the call's usage row (`USAGE_FROM_HOLD`);
        returns what it held (None if settled before, by its bill or another survivor)."""
        held: int | None = await self._conn.fetchval(
            """WITH hold AS (
                   UPDATE budget_holds SET status = 'settled', cost_micros = hold_micros,
                          settled_at = now()
                    WHERE turn_id = $1 AND status = 'held'
                   RETURNING turn_id, run_id, kind, provider, model, agent_slug, session_id, """
            + HOLD_RETURNING
            + ")"
            + settle_counters("r.hold_micros", "r.tokens_held")
            + USAGE_FROM_HOLD
            + """
               SELECT hold_micros FROM hold""",
            turn_id,
        )
        return held

    async def holds_of(self, replica: str) -> list[Any]:
        """The live holds a replica made (call it only while holding its lock: it is gone)."""
        return list(
            await self._conn.fetch(
                """SELECT turn_id, run_id, hold_micros FROM budget_holds
                    WHERE status = 'held' AND replica = $1 ORDER BY created_at""",
                replica,
            )
        )

    async def abandoned_holds(self, older_than_seconds: float, limit: int = 100) -> list[Any]:
        """Holds still live long after any call could have ended (the replica that made
        them died mid-call). Not locked here: the sweep locks each run first, in the
        same order as a reservation, and settles only a hold that is still live."""
        return list(
            await self._conn.fetch(
                """SELECT turn_id, run_id, hold_micros FROM budget_holds
                    WHERE status = 'held' AND created_at < now() - make_interval(secs => $1)
                    ORDER BY created_at LIMIT $2""",
                older_than_seconds,
                limit,
            )
        )
