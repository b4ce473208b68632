"""The psychologist's costs outside the model: context assembly and batch validation for
sessions of 20, 1,000 and 10,000 events, and analyses per minute with 50 sessions
closing at once (scripted provider, no text delay: the model costs nothing here).

Baselines measured in the same run: a raw NATS request/reply hop and a raw asyncpg
`SELECT 1`, so the figures read as ratios on a drifting shared machine.

Servers: NATS_URL / DATABASE_URL when set, otherwise embedded ones in a temp dir. Every
service runs in this process (session_events, metering, psychologist).

    .venv/bin/python bench/psychologist.py
"""

# ruff: noqa: E402 - the path is fixed before the workspace packages are imported.
from __future__ import annotations

import sys
from pathlib import Path

# `python bench/psychologist.py` puts bench/ first on the path, where this file and
# bench/metering.py would shadow the `psychologist` and `metering` packages.
import benchkit  # from this folder, before it leaves the path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

import asyncpg
import nats
import uvloop

from contracts import subjects
from contracts.metering import ToolUseBlock
from contracts.session_events import (
    AppendedReply,
    AppendEvent,
    CloseSession,
    OpenSession,
    SessionClosedReply,
    SessionOpenedReply,
)
from harness import MeteringClient
from metering.app import main as metering_main
from metering.providers.scripted import DEFAULT_SCRIPT, ScriptedProvider
from metering.settings import MeteringSettings
from psychologist.analysis import Analyst, emit_hypotheses_tool
from psychologist.app import main as psychologist_main
from psychologist.context import AnalysisContext, render
from psychologist.repository import PsychologistRepository
from psychologist.settings import PsychologistSettings
from servicekit.client import call
from servicekit.db import create_pool
from servicekit.logs import configure_logging
from servicekit.sessionlog import SessionLogClient
from session_events.app import main as log_main
from session_events.settings import LogSettings
from testkit.services import running_service

SIZES = (20, 1_000, 10_000)
CONCURRENT_SESSIONS = 50
REPEATS = 5


async def timed(fn: Callable[[], Awaitable[Any]], repeats: int = REPEATS) -> float:
    """The median seconds of `repeats` runs of `fn`."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


async def append_many(nc: Any, session_id: uuid.UUID, count: int, width: int = 64) -> None:
    """`count` chat messages, `width` appends in flight at a time."""
    sem = asyncio.Semaphore(width)

    async def one(i: int) -> None:
        async with sem:
            await call(
                nc,
                subjects.EVENTS_APPEND,
                AppendEvent(
                    session_id=session_id,
                    type="chat.message",
                    actor="user:bench",
                    payload={"text": f"mensagem {i} sobre o app de receitas"},
                ),
                AppendedReply,
            )

    await asyncio.gather(*(one(i) for i in range(count)))


async def rendered(ctx: AnalysisContext) -> str:
    """The prompt of `ctx`, as an awaitable for `timed`."""
    return render(ctx)


async def open_session(nc: Any, project: str) -> uuid.UUID:
    reply = await call(
        nc,
        subjects.SESSIONS_OPEN,
        OpenSession(project_id=project, opened_by="user:bench"),
        SessionOpenedReply,
    )
    return reply.session_id


async def baselines(nc: Any, pool: asyncpg.Pool) -> tuple[float, float]:
    async def echo(msg: Any) -> None:
        await msg.respond(b"ok")

    sub = await nc.subscribe("bench.echo", cb=echo)
    hop = await timed(lambda: nc.request("bench.echo", b"x", timeout=5), repeats=200)
    await sub.unsubscribe()
    select = await timed(lambda: pool.fetchval("SELECT 1"), repeats=200)
    return hop, select


async def run() -> None:
    configure_logging("bench", "WARNING", "console")
    with benchkit.servers("bench-psy-") as srv:
        nats_url, database_url = srv.nats_url, srv.admin_url
        nc = await nats.connect(nats_url)
        fast: dict[str, Any] = {
            "nats_url": nats_url,
            "database_url": database_url,
            "outbox_poll_seconds": 0.2,
        }
        provider = ScriptedProvider(DEFAULT_SCRIPT.model_copy(update={"token_delay_ms": 0.0}))
        async with AsyncExitStack() as services:
            await services.enter_async_context(
                running_service(log_main(LogSettings(**fast)), nc, "session_events")
            )
            await services.enter_async_context(
                running_service(
                    metering_main(MeteringSettings(provider="scripted", **fast), provider=provider),
                    nc,
                    "metering",
                )
            )
            await services.enter_async_context(
                running_service(psychologist_main(PsychologistSettings(**fast)), nc, "psychologist")
            )
            await benchkit.lift_limits(nc)
            pool = await create_pool(database_url, "psychologist", 1, 4)
            hop, select = await baselines(nc, pool)
            print(
                f"baseline: NATS request/reply hop {hop * 1e3:.3f} ms, "
                f"asyncpg SELECT 1 {select * 1e3:.3f} ms"
            )

            analyst = Analyst(
                PsychologistRepository(pool), SessionLogClient(nc), MeteringClient(nc)
            )
            log_ = SessionLogClient(nc)
            print(
                "events   prepare(read+triage) ms  render ms  prompt KiB  validate(20 ids) ms  "
                "prepare/hop  validate/hop"
            )
            for size in SIZES:
                # Kept open: the bench measures assembly, not an analysis of the session.
                session_id = await open_session(nc, f"bench-{size}")
                await append_many(nc, session_id, size - 1)
                prepared = await analyst.prepare(session_id, "manual")
                prepare_s = await timed(partial(analyst.prepare, session_id, "manual"))
                prompt = render(prepared.ctx)
                render_s = await timed(partial(rendered, prepared.ctx))
                cited = [str(e.id) for e in prepared.ctx.events[-20:]]
                hypotheses = {
                    "hypotheses": [
                        {
                            "target_agent": "criativo",
                            "statement": "bench",
                            "confidence": 50,
                            "evidence_event_ids": cited[i : i + 5],
                            "termination_analysis": "bench",
                        }
                        for i in range(0, 20, 5)
                    ]
                }
                # As the model asks for it: the tool's handler takes the whole tool call.
                tool = emit_hypotheses_tool(log_, session_id, prepared.ctx.termination)
                batch = ToolUseBlock(id="bench", name=tool.name, input=hypotheses)
                result = await tool.handler(batch)
                assert not result.is_error, result.content
                validate_s = await timed(partial(tool.handler, batch))
                print(
                    f"{size:>6}   {prepare_s * 1e3:>24.1f}  {render_s * 1e3:>9.1f}  "
                    f"{len(prompt.encode()) / 1024:>10.0f}  {validate_s * 1e3:>19.2f}  "
                    f"{prepare_s / hop:>11.0f}x  {validate_s / hop:>11.1f}x"
                )

            # 50 sessions closing at once, each of a few messages (the light tier).
            sessions = [await open_session(nc, "bench-burst") for _ in range(CONCURRENT_SESSIONS)]
            for s in sessions:
                await append_many(nc, s, 4)
            started = time.perf_counter()
            await asyncio.gather(
                *(
                    call(
                        nc, subjects.SESSIONS_CLOSE, CloseSession(session_id=s), SessionClosedReply
                    )
                    for s in sessions
                )
            )
            while (
                await pool.fetchval(
                    "SELECT count(*) FROM psychologist_analyses WHERE project_id = 'bench-burst'"
                )
                < CONCURRENT_SESSIONS
            ):
                await asyncio.sleep(0.02)
            elapsed = time.perf_counter() - started
            print(
                f"{CONCURRENT_SESSIONS} sessions closing at once: all analysed in {elapsed:.2f} s "
                f"= {CONCURRENT_SESSIONS / elapsed * 60:.0f} analyses/minute "
                f"({PsychologistSettings().analysis_workers} workers, one replica; "
                f"{elapsed / CONCURRENT_SESSIONS / hop:.0f}x a NATS hop per analysis)"
            )
            await pool.close()
        await nc.close()


def main() -> None:
    uvloop.run(run())


if __name__ == "__main__":
    main()
