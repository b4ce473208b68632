"""The whole system the way a deployment runs it, while things die.

A 3-node JetStream cluster (`servicekit.embedded.start_nats_cluster`: routes on loopback,
`sync_interval: always`, every stream on 3 nodes), the embedded Postgres, and two
supervised processes of every service (`devstack.stack.Supervised`, as `agentbus up
--replicas 2 --nats-cluster 3` runs them); metering answers from a scripted model that
logs each of its calls (`bench/chaoskit/chaos_metering.py`).

N simulated people, each in a project of their own, go **through the gateway WebSocket**
(either replica) through the whole story: open a session, start Criativo, six messages
(two of them rules, two typed in bursts while a turn runs), two deliberate reconnects
that resume with `after_seq`, readiness, accept (even people) or reject (odd) the offer
to `po`, close. A person whose socket drops reconnects as the web client does (its
back-off, by the numbers `services/gateway/web/connection.js` declares) and resumes; a
frame left unanswered is sent again only when the log shows it did not happen.

The run is two rounds of N people: a calm one, then one under chaos, whose driver
SIGKILLs random service replicas (every service `--kills` times), SIGKILLs one NATS node
and starts it again 10 s later, restarts both gateway replicas (SIGTERM: every client
reconnects and resumes) and pauses Postgres for 3 s (SIGSTOP/SIGCONT). When a gateway
replica serves again after its death or restart is noted beside the blows.

Checked at the end, from the log and the databases, each with its evidence when broken
(exit code 1):
- every chat message answered exactly once (one `agent.response` caused by it);
- per person, the events received over the WebSocket equal the log's, in order, none
  missing, none twice (up to the session's closing);
- one brief per readiness, one offer to `po` per brief;
- every closed session analysed exactly once (one `psychologist.analysis_completed`
  or `_failed`);
- every call the model logged has its `token_usage` row: a call whose metering replica
  was SIGKILLed mid-call too, billed at its hold by a surviving or restarted replica
  (`billed_at_hold`, shown apart); no budget hold left live;
- no live turn run twice: none given up for its replica's silence while that replica
  still ran it to the end (then retried under its retry id, and billed twice);
- no run budget overspent; every outbox drained; no dead letter.

Figures: sessions, events, kills, the longest time from a kill to the next answer any
person received, answer latency (chat sent → its `agent.response` received) under chaos
against the calm round, and the slowest answers taken apart: the blows around each, and
where it waited (from the model's call log and the log's times: before its first model
call, between a call whose metering replica was killed and the call that replaced it,
from its last call to the log, from the log to the WebSocket, with the person's
connection attempts meanwhile).

    .venv/bin/python bench/chaos.py [--people 100] [--kills 2] [--seed 13]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nats
import psutil
from nats.aio.client import Client
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

import benchkit as bk
from devstack.services import ServiceSpec, discover
from devstack.stack import Supervised, provision, replica_env
from servicekit.bus import Credentials, identity_options, server_urls
from servicekit.embedded import NatsCluster, free_ports, start_nats_cluster, start_postgres
from servicekit.natsconf import accounts_block, load_or_create_secrets
from servicekit.permissions import ADMIN, PROVISION, USERS

HERE = Path(__file__).resolve().parent
SECRET = "chaos-secret-" + "x" * 40
REPLICAS = 2
NATS_NODES = 3
NATS_DOWN_SECONDS = 10.0
PG_PAUSE_SECONDS = 3.0
ANSWER_PATIENCE = 600.0  # how long a person waits for one answer before the run fails
FRAME_PATIENCE = 120.0  # a frame unanswered this long: the socket is given up
STALL_SECONDS = 20.0  # the log ahead of an open socket this long: the relay stalled
CALLS = "AGENTBUS_CHAOS_CALLS_PATH"
MESSAGES = [  # (text, sent right after the previous one: a burst while its turn runs)
    ("I want an app for the bakery on my street", False),
    ("RULE: orders placed after 6pm are delivered the next day", False),
    ("and customers pay when they pick the bread up", True),
    ("what would the first screen show?", False),
    ("RULE: a customer may hold at most three open orders", False),
    ("also, a loyalty stamp for every tenth order", True),
]
ARRIVED = "_arrived"  # when a person received an event (kept beside the event)
# The web client a person here stands for: they reconnect as it does, by its own numbers.
CLIENT = HERE.parent / "services" / "gateway" / "web" / "connection.js"


def client_constant(name: str) -> float:
    """A number the web client declares (`const NAME = 10_000;`), in seconds from its ms."""
    found = re.search(rf"^const {name} = ([0-9_]+);", CLIENT.read_text(), re.MULTILINE)
    if found is None:
        raise LookupError(f"{CLIENT} declares no {name}")
    return int(found.group(1).replace("_", "")) / 1000


FIRST_RETRY = client_constant("FIRST_RETRY_MS")
MAX_RETRY = client_constant("MAX_RETRY_MS")
JOIN_TIMEOUT = client_constant("JOIN_TIMEOUT_MS")


def retry_delay(failures: int, random: float, most: float | None = None) -> float:
    """The web client's `retryDelay`: the wait before the next try after `failures` tries
    since the socket was last live, `random` in [0, 1); `most`: another ceiling than its
    own (`--storm`)."""
    ceiling = min(MAX_RETRY if most is None else most, FIRST_RETRY * 2.0**failures)
    return ceiling / 2 + random * ceiling / 2


def storm(ceilings: list[float], people: int = 100, runs: int = 40) -> list[str]:
    """`people` who lost their gateway at once, trying again by the client's schedule
    until one serves again after an outage of a few seconds to half a minute: how long
    after it the slowest tenth still waits, and how many arrive in the busiest second
    (what a starting gateway takes). The same with a lower ceiling (the trade: back
    sooner, and arriving faster). Simulated, seeded: a schedule's figures, not a run's."""
    lines = [
        f"reconnect storm, {people} people, {runs} draws each: the slowest tenth's wait after "
        "the outage / the busiest second's arrivals"
    ]
    for outage in (1.0, 2.0, 4.0, 6.0, 9.0, 15.0, 30.0):
        cells = []
        for most in ceilings:
            waits, peaks = [], []
            for draw in range(runs):
                back = _returns(people, outage, random.Random(draw), most)
                waits.append(back[int(0.9 * people) - 1] - outage)
                peaks.append(max(bisect.bisect_left(back, t + 1.0) - i for i, t in enumerate(back)))
            wait, peak = statistics.mean(waits), statistics.mean(peaks)
            cells.append(f"ceiling {most:4.1f} s: {wait:4.1f} s / {peak:4.1f}")
        lines.append(f"  outage {outage:4.1f} s   " + "   ".join(cells))
    return lines


def _returns(people: int, outage: float, rng: random.Random, most: float) -> list[float]:
    """When each person's first try after `outage` seconds lands, in order."""
    back = []
    for _ in range(people):
        at, failures = 0.0, 0
        while at < outage:
            at += retry_delay(failures, rng.random(), most)
            failures += 1
        back.append(at)
    return sorted(back)


RECONNECT_AFTER = {2, 4}  # drop the socket and resume after these messages (1-based)


@dataclass(frozen=True)
class Answer:
    """One chat message (its text as sent) and when it was sent and its answer arrived."""

    text: str
    sent: float
    arrived: float

    @property
    def latency(self) -> float:
        return self.arrived - self.sent


class Lost(Exception):
    """The socket closed before the frame was answered."""


class Refused(Exception):
    """The gateway answered a frame with an error frame."""

    def __init__(self, frame: dict[str, Any]) -> None:
        super().__init__(f"{frame.get('code')}: {frame.get('message')}")
        self.code = str(frame.get("code"))


@dataclass
class Person:
    """One simulated person and everything they saw over the WebSocket."""

    index: int
    project: str
    token: str
    ports: list[int]
    events: list[dict[str, Any]] = field(default_factory=list)  # in arrival order
    duplicates: list[int] = field(default_factory=list)  # seqs received twice
    gaps: list[tuple[int, int]] = field(default_factory=list)  # (expected, got)
    latencies: list[float] = field(default_factory=list)  # chat sent → its answer
    answers: list[Answer] = field(default_factory=list)  # each answer's text and times
    connects: int = 0
    failures: int = 0  # tries since the socket was last live, as the web client counts them
    # Each connection attempt: when it began and ended, and how ("joined", "connect
    # ConnectionRefusedError", "join Lost"…): where an answer waited on the socket.
    trail: list[tuple[float, float, str]] = field(default_factory=list)
    session_id: str = ""
    failure: str | None = None
    _ws: ClientConnection | None = None
    # Frames sent and not answered yet, by ref, with the socket each was sent on.
    _answers: dict[str, tuple[ClientConnection, asyncio.Future[dict[str, Any]]]] = field(
        default_factory=dict
    )
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    # The log's last seq of a session (read from Postgres: the truth), to tell a quiet
    # session from a socket that stopped relaying; and the stalls seen that way.
    log_seq: Callable[[str], Awaitable[int]] | None = None
    stalls: list[str] = field(default_factory=list)
    close_at_once: bool = False
    _behind_since: float | None = None

    @property
    def last_seq(self) -> int:
        return int(self.events[-1]["seq"]) if self.events else 0

    async def url(self) -> str:
        """The next replica's socket, with a single-use ticket traded for the token there."""
        port = self.ports[(self.index + self.connects) % len(self.ports)]
        async with httpx.AsyncClient(timeout=10) as http:
            reply = await http.post(
                f"http://127.0.0.1:{port}/api/projects/{self.project}/ws-ticket",
                headers={"authorization": f"Bearer {self.token}"},
            )
        reply.raise_for_status()
        return f"ws://127.0.0.1:{port}/ws?ticket={reply.json()['ticket']}"

    # -- the connection -----------------------------------------------------------------

    async def connect(self, lost: bool = True) -> None:
        """(Re)connect to a gateway replica and join the session after the last event seen,
        as the web client does (`services/gateway/web/connection.js`): after a lost socket,
        a failed try or a join unanswered for `JOIN_TIMEOUT`, it waits `retry_delay` first;
        a first connection or a reload (`lost=False`) tries at once."""
        if lost:
            await self._back_off()
        while True:
            self.connects += 1
            began = time.time()
            try:
                ws = await connect(await self.url(), max_size=None, open_timeout=10)
            except (OSError, InvalidHandshake, InvalidStatus, TimeoutError, httpx.HTTPError) as exc:
                self.trail.append((began, time.time(), f"connect {type(exc).__name__}"))
                await self._back_off()
                continue
            self._ws = ws
            reader = asyncio.create_task(self._read(ws))
            join = {"type": "join", "session_id": self.session_id, "after_seq": self.last_seq}
            try:
                await self._send(ws, join, JOIN_TIMEOUT)
                self.trail.append((began, time.time(), "joined"))
                self.failures = 0
                return
            except (Lost, Refused, TimeoutError) as exc:
                self.trail.append((began, time.time(), f"join {type(exc).__name__}"))
                reader.cancel()
                await ws.close()
                await self._back_off()

    async def _back_off(self) -> None:
        await asyncio.sleep(retry_delay(self.failures, random.random()))
        self.failures += 1

    async def drop(self) -> None:
        """Close the socket deliberately (a tab reloaded) and resume on the other replica."""
        if self._ws is not None:
            await self._ws.close()
        await self.connect(lost=False)

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for raw in ws:
                frame = json.loads(raw)
                kind = frame["type"]
                if kind == "event":
                    self._event(frame["event"])
                elif kind in ("ack", "error") and frame.get("ref") in self._answers:
                    _, future = self._answers.pop(frame["ref"])
                    if not future.done():
                        future.set_result(frame)
        except ConnectionClosed:
            pass
        finally:
            if self._ws is ws:
                self._ws = None
            # Only this socket's frames are lost: a reader ending late (after the person
            # reconnected) must not fail the frames sent on the new socket.
            for ref, (sent_on, future) in list(self._answers.items()):
                if sent_on is ws:
                    del self._answers[ref]
                    if not future.done():
                        future.set_exception(Lost())
            self._changed.set()

    def _event(self, event: dict[str, Any]) -> None:
        seq = int(event["seq"])
        if seq <= self.last_seq:
            self.duplicates.append(seq)
            return
        if seq != self.last_seq + 1:
            self.gaps.append((self.last_seq + 1, seq))
        event[ARRIVED] = time.time()
        self.events.append(event)
        self._changed.set()

    async def _send(
        self, ws: ClientConnection, frame: dict[str, Any], patience: float = FRAME_PATIENCE
    ) -> dict[str, Any]:
        ref = uuid.uuid4().hex
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._answers[ref] = (ws, future)
        try:
            await ws.send(json.dumps({**frame, "ref": ref}))
            reply = await asyncio.wait_for(future, patience)
        except ConnectionClosed:
            # Forget the socket here: the reader that would do it cannot run while a
            # caller retries (a send on a closed socket fails without yielding).
            if self._ws is ws:
                self._ws = None
            raise Lost() from None
        except TimeoutError:
            if patience >= FRAME_PATIENCE:  # a join's shorter patience is the client's own
                self.stalls.append(
                    f"p{self.index}: {frame['type']} unanswered for {patience:.0f} s "
                    f"(connection {self.connects})"
                )
            await ws.close()
            raise Lost() from None
        finally:
            self._answers.pop(ref, None)
            # The reader may have failed the frame (`Lost`) while the send itself was
            # failing: that outcome is known, so it is read here rather than left for
            # asyncio to report as "Future exception was never retrieved".
            if future.done() and not future.cancelled():
                future.exception()
        if reply["type"] == "error":
            raise Refused(reply)
        result: dict[str, Any] = reply["result"]
        return result

    async def act(
        self, frame: dict[str, Any], done: Callable[[], dict[str, Any] | None] | None = None
    ) -> dict[str, Any]:
        """Send `frame` until it is answered. After a lost socket it is sent again only if
        `done()` (asked once the resumed join has caught up) finds no trace of it in the log;
        a dependency still restarting is waited out."""
        while True:
            if self._ws is None:
                await self.connect()
                if done is not None and (found := done()) is not None:
                    return found
            ws = self._ws
            assert ws is not None
            try:
                return await self._send(ws, frame)
            except Lost:
                continue
            except Refused as exc:
                if exc.code not in ("dependency_unavailable", "unavailable", "timeout"):
                    raise
                await asyncio.sleep(1.0)

    async def wait_event(self, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The first event received that matches, reconnecting whenever the socket drops."""
        deadline = time.monotonic() + ANSWER_PATIENCE
        while True:
            found = next((e for e in self.events if match(e)), None)
            if found is not None:
                return found
            if self._ws is None:
                await self.connect()
                continue
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("waited too long for an event")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 5.0))
            if await self._stalled():
                await self.drop()  # what a watchful client does: resume from the log

    async def _stalled(self) -> bool:
        """True when the log has had events past the last one received for STALL_SECONDS
        while the socket stayed open (the gateway stopped relaying): recorded as a stall."""
        if self.log_seq is None or self._ws is None:
            return False
        latest = await self.log_seq(self.session_id)
        now = time.monotonic()
        if latest <= self.last_seq:
            self._behind_since = None
            return False
        if self._behind_since is None:
            self._behind_since = now
            return False
        if now - self._behind_since < STALL_SECONDS:
            return False
        self.stalls.append(
            f"p{self.index}: seq {self.last_seq + 1}..{latest} in the log, not received "
            f"for {now - self._behind_since:.0f} s on an open socket (connection {self.connects})"
        )
        self._behind_since = None
        return True

    def find(self, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        return next((e for e in self.events if match(e)), None)

    # -- the story ----------------------------------------------------------------------

    async def story(self, base_url: str) -> None:
        try:
            await self._story(base_url)
        except Exception as exc:  # reported with the invariants, never fatal to the others
            self.failure = f"{type(exc).__name__}: {exc}"
        finally:
            if self._ws is not None:
                await self._ws.close()

    async def _story(self, base_url: str) -> None:
        self.session_id = await self._open(base_url)
        await self.connect(lost=False)
        with contextlib.suppress(Refused):  # already active after a lost ack
            await self.act({"type": "start_agent", "agent": "criativo"})
        await self.wait_event(lambda e: e["type"] == "agent.activated")
        pending: list[tuple[str, str, float]] = []
        for number, (text, burst) in enumerate(MESSAGES, 1):
            if not burst:
                await self._answered(pending)
                pending = []
            sent = time.time()
            said = f"{text} (p{self.index})"
            reply = await self.act({"type": "chat", "text": said, "client_msg_id": f"m{number}"})
            pending.append((str(reply["event_id"]), said, sent))
            if number in RECONNECT_AFTER:
                await self.drop()
        await self._answered(pending)

        def readiness() -> dict[str, Any] | None:
            return self.find(lambda e: e["type"] == "criativo.readiness_confirmed")

        ready = await self.act({"type": "confirm_readiness", "client_msg_id": "ready-1"}, readiness)
        ready_id = str(ready.get("event_id") or ready.get("id"))
        await self.wait_event(
            lambda e: e["type"] == "artifact.product_brief" and e["causation_id"] == ready_id
        )
        offer = await self.wait_event(
            lambda e: e["type"] == "handoff.offered" and e["payload"]["to_agent"] == "po"
        )
        handoff_id = offer["payload"]["handoff_id"]
        verdict = "accept" if self.index % 2 == 0 else "reject"

        def decided() -> dict[str, Any] | None:
            return self.find(
                lambda e: (
                    e["type"] == f"handoff.{verdict}ed" and e["payload"]["handoff_id"] == handoff_id
                )
            )

        try:
            await self.act({"type": f"{verdict}_handoff", "handoff_id": handoff_id}, decided)
        except Refused as exc:
            # Sent again after a lost socket, before the decision reached the log (the
            # handoff's row commits before its event is appended): decided already. The
            # wait below proves it was this person's decision.
            if exc.code != "invalid_transition":
                raise
        await self.wait_event(lambda e: decided() is not None)
        if verdict == "accept" and not self.close_at_once:
            # PO's activation reaches the log through handoff's outbox; a closing that
            # overtakes it gets it refused (conversation in a closed session) and dead-
            # lettered: `--close-at-once` shows that race, reported apart.
            await self.wait_event(
                lambda e: e["type"] == "agent.activated" and e["payload"].get("agent") == "po"
            )

        def closed() -> dict[str, Any] | None:
            return self.find(lambda e: e["type"] == "session.closed")

        try:
            await self.act({"type": "close_session"}, closed)
        except Refused as exc:
            if exc.code != "session_closed":  # closed by this frame, sent before the loss
                raise
        await self.wait_event(lambda e: e["type"] == "session.closed")

    async def _answered(self, pending: list[tuple[str, str, float]]) -> None:
        for message_id, said, sent in pending:
            answer = await self.wait_event(answer_to(message_id))
            self.latencies.append(float(answer[ARRIVED]) - sent)
            self.answers.append(Answer(said, sent, float(answer[ARRIVED])))

    async def _open(self, base_url: str) -> str:
        """Open a session over HTTP, on whichever gateway answers."""
        delay = 0.2
        async with httpx.AsyncClient(timeout=30) as http:
            for attempt in range(1000):
                port = self.ports[(self.index + attempt) % len(self.ports)]
                url = f"{base_url}:{port}/api/projects/{self.project}/sessions"
                with contextlib.suppress(httpx.HTTPError):
                    reply = await http.post(url, headers={"authorization": f"Bearer {self.token}"})
                    if reply.status_code == 201:
                        return str(reply.json()["session_id"])
                await asyncio.sleep(delay)
                delay = min(delay * 2, 3.0)
        raise TimeoutError("no gateway opened a session")


def mint_tokens(projects: list[str]) -> list[str]:
    """A token per project from the gateway's own `mint`, in a child process: bench/gateway.py,
    beside this script, shadows the `gateway` package on this script's path."""
    code = (
        "import sys; from gateway.auth import mint\n"
        "for p in sys.argv[2:]: print(mint(sys.argv[1], p, 'person'))"
    )
    argv = [sys.executable, "-P", "-c", code, SECRET, *projects]
    return subprocess.check_output(argv, text=True).split()


def answer_to(message_id: str) -> Callable[[dict[str, Any]], bool]:
    """Matches the `agent.response` caused by the message `message_id`."""
    return lambda e: e["type"] == "agent.response" and e["causation_id"] == message_id


# -- the system under test ------------------------------------------------------------------


@dataclass
class System:
    """The servers and every supervised service replica of one run."""

    state: Path
    cluster: NatsCluster
    database_url: str
    pgdata: Path
    supervised: list[Supervised]
    gateway_ports: list[int]
    calls_path: Path

    def replicas(self, service: str) -> list[Supervised]:
        return [s for s in self.supervised if s.spec.name == service]

    def postgres_pids(self) -> list[int]:
        """The postmaster and every backend (all must stop for the database to pause)."""
        postmaster = int((self.pgdata / "postmaster.pid").read_text().split()[0])
        parent = psutil.Process(postmaster)
        return [postmaster, *(c.pid for c in parent.children(recursive=True))]


def consecutive_free_ports(count: int) -> int:
    """A port P with P … P + count - 1 all free (the gateway replicas' ports)."""
    for _ in range(100):
        (base,) = free_ports(1)
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    held.enter_context(_bound(port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports")


@contextlib.contextmanager
def _bound(port: int) -> Any:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))
        yield probe


async def start_system(stack: contextlib.AsyncExitStack, state: Path) -> tuple[System, Client]:
    """The 3-node cluster, Postgres, the streams (R3), two replicas of every service."""
    secrets = load_or_create_secrets(state / "nats-secrets.json", USERS)
    cluster = start_nats_cluster(state, NATS_NODES, accounts_block(secrets))
    stack.callback(cluster.stop)
    pg = start_postgres(state)
    stack.callback(pg.stop)
    await provision(cluster.url, Credentials(PROVISION, secrets[PROVISION]), 3)
    calls_path = state / "model-calls.jsonl"
    gateway_port = consecutive_free_ports(REPLICAS)
    env = {
        **os.environ,
        "NATS_URL": cluster.url,
        "DATABASE_URL": pg.url,
        "AGENTBUS_STREAM_REPLICAS": "3",
        "AGENTBUS_LOG_LEVEL": "WARNING",
        "AGENTBUS_LOG_FORMAT": "json",
        "AGENTBUS_GATEWAY_SECRET": SECRET,
        "AGENTBUS_GATEWAY_PORT": str(gateway_port),
        "AGENTBUS_OUTBOX_POLL_SECONDS": "0.2",
        # The psychologist gives up a model turn whose metering replica died after a
        # minute instead of three (the scripted model answers in seconds), so its
        # analysis completes within the settle.
        "AGENTBUS_TURN_LOST_SECONDS": "60",
        CALLS: str(calls_path),
        # Only the folder of the logging model: bench/ holds scripts named like services.
        "PYTHONPATH": str(HERE / "chaoskit"),
        "PYTHONSAFEPATH": "1",
    }
    specs = [
        ServiceSpec(s.name, "chaos_metering") if s.name == "metering" else s for s in discover()
    ]
    supervised = []
    for spec in specs:
        own = {**env, "NATS_USER": spec.name, "NATS_PASSWORD": secrets[spec.name]}
        web = gateway_port if spec.name == "gateway" else None
        for i in range(1, REPLICAS + 1):
            log = state / f"{spec.name}-{i}.log"
            supervised.append(Supervised(spec, replica_env(own, spec.name, i, web), i, log))
    tasks = [asyncio.create_task(s.run()) for s in supervised]

    async def stop_services() -> None:
        await asyncio.gather(*(s.stop() for s in supervised))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    stack.push_async_callback(stop_services)
    nc = await nats.connect(
        server_urls(cluster.url),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
        **identity_options(Credentials(ADMIN, secrets[ADMIN])),
    )
    stack.push_async_callback(nc.close)
    for spec in specs:
        await wait_replicas(nc, spec.name, REPLICAS)
    await bk.lift_limits(nc)
    ports = [gateway_port + i for i in range(REPLICAS)]
    system = System(state, cluster, pg.url, state / "pg", supervised, ports, calls_path)
    return system, nc


async def wait_replicas(nc: Client, service: str, count: int, timeout: float = 180) -> None:
    """Until `count` instances of `service` answer `$SRV.PING`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        found = set()
        await nc.publish(f"$SRV.PING.{service}", b"", reply=inbox)
        with contextlib.suppress(nats.errors.TimeoutError, TimeoutError):
            while True:
                msg = await sub.next_msg(timeout=0.5)
                if msg.data:
                    found.add(json.loads(msg.data)["id"])
        await sub.unsubscribe()
        if len(found) >= count:
            return
    raise TimeoutError(f"{service}: fewer than {count} replicas answered in {timeout}s")


# -- chaos ----------------------------------------------------------------------------------


@dataclass
class Blow:
    """One thing the driver did, and when."""

    at: float
    what: str
    kind: str  # kill | nats | gateway | postgres
    pid: int | None = None  # the process SIGKILLed, for a replica


async def drive_chaos(
    system: System,
    rng: random.Random,
    kills_per_service: int,
    gap: float,
    only: str | None = None,
) -> list[Blow]:
    """SIGKILL random replicas (each service `kills_per_service` times), one NATS node
    (back after 10 s), both gateways restarted, Postgres paused 3 s; one blow per `gap`.
    With `only`, just the SIGKILLs of that service's replicas: the waits one kind of
    death causes, apart from the others'."""
    services = [only] if only else sorted({s.spec.name for s in system.supervised})
    plan = [("kill", name) for name in services for _ in range(kills_per_service)]
    if only is None:
        plan += [("nats", ""), ("gateway", ""), ("postgres", "")]
    rng.shuffle(plan)
    blows: list[Blow] = []
    background: list[asyncio.Task[None]] = []
    for kind, name in plan:
        await asyncio.sleep(gap)
        if kind == "kill":
            # Both replicas may be restarting (the gateways, just after their restart), or
            # the one chosen may end between being chosen and the blow (a gateway in its
            # own restart exits on its own): the blow waits for a replica that is up rather
            # than be skipped, so every service loses one to SIGKILL.
            hit = await _sigkill_a_replica(system, name, rng)
            if hit is None:
                continue
            victim, pid = hit
            blows.append(Blow(time.time(), f"SIGKILL {name}-{victim.replica}", kind, pid))
            if name == "gateway":
                background.append(asyncio.create_task(_serving_again(system, victim, pid, blows)))
        elif kind == "nats":
            node = rng.randrange(NATS_NODES)
            system.cluster.kill_node(node)
            blows.append(Blow(time.time(), f"SIGKILL nats node {node + 1}", kind))
            background.append(asyncio.create_task(_nats_back(system, node, blows)))
        elif kind == "gateway":
            for s in system.replicas("gateway"):
                if (stopped := s.pid) is not None:
                    os.kill(stopped, signal.SIGTERM)
                    background.append(
                        asyncio.create_task(_serving_again(system, s, stopped, blows))
                    )
            blows.append(Blow(time.time(), "restart both gateways (SIGTERM)", kind))
        else:
            pids = system.postgres_pids()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            blows.append(Blow(time.time(), f"SIGSTOP Postgres ({len(pids)} processes)", kind))
            await asyncio.sleep(PG_PAUSE_SECONDS)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    await asyncio.gather(*background)
    return blows


async def _sigkill_a_replica(
    system: System, name: str, rng: random.Random
) -> tuple[Supervised, int] | None:
    """SIGKILL one running replica of `name`, waiting up to a minute for one to be up;
    the replica and the pid killed, or None when none came up."""
    for _ in range(300):
        alive = [s for s in system.replicas(name) if s.pid is not None]
        if alive:
            victim = rng.choice(alive)
            pid = victim.pid
            assert pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                return victim, pid
        await asyncio.sleep(0.2)
    return None


async def _serving_again(
    system: System, gateway: Supervised, stopped: int, blows: list[Blow]
) -> None:
    """When a gateway replica whose process `stopped` was killed or told to stop serves
    again (`/healthz` answers from its next process): its supervisor's restart delay and
    its start-up, what a person waits for once both replicas are down. Kept as a blow, so
    the slowest answers show it."""
    port = system.gateway_ports[gateway.replica - 1]
    began = time.time()
    async with httpx.AsyncClient(timeout=1.0) as http:
        while time.time() - began < 120:
            if gateway.pid not in (None, stopped):  # the next process: is it serving?
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200:
                        what = f"gateway-{gateway.replica} serving again"
                        blows.append(
                            Blow(time.time(), f"{what} ({time.time() - began:.1f} s)", "back")
                        )
                        return
            await asyncio.sleep(0.05)


async def _nats_back(system: System, node: int, blows: list[Blow]) -> None:
    await asyncio.sleep(NATS_DOWN_SECONDS)
    await asyncio.to_thread(system.cluster.start_node, node)
    blows.append(Blow(time.time(), f"nats node {node + 1} started again", "nats-back"))


# -- one round ------------------------------------------------------------------------------


@dataclass
class Round:
    name: str
    people: list[Person]
    seconds: float
    blows: list[Blow] = field(default_factory=list)

    @property
    def latencies(self) -> list[float]:
        return sorted(x for p in self.people for x in p.latencies)


async def run_round(
    system: System,
    pool: asyncpg.Pool,
    name: str,
    count: int,
    chaos: Callable[[], Any] | None = None,
    close_at_once: bool = False,
) -> Round:
    projects = [f"chaos-{name}-{i}" for i in range(count)]

    async def log_seq(session_id: str) -> int:
        seq = await pool.fetchval(
            "SELECT last_seq FROM session_events.sessions WHERE id = $1::uuid", session_id
        )
        return int(seq or 0)

    people = [
        Person(
            i, project, token, system.gateway_ports, log_seq=log_seq, close_at_once=close_at_once
        )
        for i, (project, token) in enumerate(zip(projects, mint_tokens(projects), strict=True))
    ]

    async def start(person: Person) -> None:
        await asyncio.sleep(person.index * 0.05)  # arrivals spread a little
        await person.story("http://127.0.0.1")

    began = time.perf_counter()
    stories = asyncio.gather(*(start(p) for p in people))
    blows: list[Blow] = []
    if chaos is not None:
        blows, _ = await asyncio.gather(chaos(), stories)
    else:
        await stories
    return Round(name, people, time.perf_counter() - began, blows)


# -- invariants -----------------------------------------------------------------------------


@dataclass
class Verdict:
    broken: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)

    def check(self, name: str, evidence: list[str]) -> None:
        if evidence:
            shown = "; ".join(evidence[:8]) + (
                f" (+{len(evidence) - 8} more)" * (len(evidence) > 8)
            )
            self.broken.append(f"{name}: {shown}")
        else:
            self.held.append(name)


async def settle(pool: asyncpg.Pool, sessions: list[str], timeout: float = 300) -> None:
    """Wait until every closed session is analysed, every outbox is empty and no budget
    hold is live (a SIGKILLed metering replica's, until a survivor settles it): the
    effects the invariants look at; a bounded wait, whatever is missing then is reported."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = await pool.fetchrow(
            """SELECT count(DISTINCT session_id) FILTER (WHERE type IN
                      ('psychologist.analysis_completed', 'psychologist.analysis_failed')),
                      count(DISTINCT session_id) FILTER (WHERE type LIKE 'session.closed%')
                 FROM session_events.events WHERE session_id = ANY($1::uuid[])""",
            sessions,
        )
        analysed, closed = (counts[0], counts[1]) if counts else (0, 0)
        waiting = sum(
            [
                await pool.fetchval(f"SELECT count(*) FROM {s}.outbox")
                for s in await outbox_schemas(pool)
            ]
        )
        waiting += await pool.fetchval(
            "SELECT count(*) FROM metering.budget_holds WHERE status = 'held'"
        )
        if analysed >= closed and waiting == 0:  # a session left open is reported apart
            return
        await asyncio.sleep(1)


async def outbox_schemas(pool: asyncpg.Pool) -> list[str]:
    rows = await pool.fetch(
        "SELECT table_schema FROM information_schema.tables WHERE table_name = 'outbox'"
    )
    return sorted(r["table_schema"] for r in rows)


async def check(pool: asyncpg.Pool, rounds: list[Round], calls: list[dict[str, Any]]) -> Verdict:
    verdict = Verdict()
    people = [p for r in rounds for p in r.people]
    verdict.check(
        "every person finished the story",
        [f"p{p.index}@{p.project}: {p.failure}" for p in people if p.failure],
    )
    sessions = [p.session_id for p in people if p.session_id]
    events = await pool.fetch(
        """SELECT id::text, session_id::text, seq, type, causation_id::text, payload
             FROM session_events.events WHERE session_id = ANY($1::uuid[])
            ORDER BY session_id, seq""",
        sessions,
    )
    by_session: dict[str, list[Any]] = defaultdict(list)
    for e in events:
        by_session[e["session_id"]].append(e)

    caused = Counter((e["causation_id"], e["type"]) for e in events)
    verdict.check(
        "every chat message answered exactly once",
        [
            f"message {e['id']} answered {caused[(e['id'], 'agent.response')]} times"
            f" ({caused[(e['id'], 'agent.error')]} errors)"
            for e in events
            if e["type"] == "chat.message" and caused[(e["id"], "agent.response")] != 1
        ],
    )

    mismatches = []
    for p in people:
        if not p.session_id:
            continue
        log = by_session[p.session_id]
        closing = next((e["seq"] for e in log if e["type"] == "session.closed"), None)
        seen = [(int(e["seq"]), str(e["id"])) for e in p.events]
        upto = closing if closing is not None else (seen[-1][0] if seen else 0)
        want = [(int(e["seq"]), e["id"]) for e in log if e["seq"] <= upto]
        got = [x for x in seen if x[0] <= upto]
        if p.duplicates or p.gaps or got != want:
            missing = sorted(set(want) - set(got))[:3]
            mismatches.append(
                f"p{p.index}: {len(got)} received vs {len(want)} logged, "
                f"duplicates {p.duplicates[:5]}, gaps {p.gaps[:3]}, "
                f"missing {missing}"
            )
    verdict.check("WebSocket events equal the log (no gap, no duplicate)", mismatches)
    verdict.check(
        f"no open socket left behind the log for {STALL_SECONDS:.0f} s",
        [stall for p in people for stall in p.stalls],
    )

    briefs = [e for e in events if e["type"] == "artifact.product_brief"]
    verdict.check(
        "one brief per readiness",
        [
            f"readiness {e['id']}: {caused[(e['id'], 'artifact.product_brief')]} briefs"
            for e in events
            if e["type"] == "criativo.readiness_confirmed"
            and caused[(e["id"], "artifact.product_brief")] != 1
        ],
    )
    offers = Counter(
        _payload(e)["artifact_id"]
        for e in events
        if e["type"] == "handoff.offered" and _payload(e)["to_agent"] == "po"
    )
    verdict.check(
        "one offer to po per brief",
        [f"brief {b['id']}: {offers[b['id']]} offers" for b in briefs if offers[b["id"]] != 1],
    )

    analyses = Counter(
        e["session_id"]
        for e in events
        if e["type"] in ("psychologist.analysis_completed", "psychologist.analysis_failed")
    )
    closed = {e["session_id"] for e in events if e["type"].startswith("session.closed")}
    verdict.check(
        "every closed session analysed exactly once",
        [f"session {s}: {analyses[s]} analyses" for s in sorted(closed) if analyses[s] != 1],
    )

    verdict.check("every model call billed", await unbilled_calls(pool, calls))
    verdict.check("no live turn run twice", await live_turns_run_twice(pool))

    overspent = await pool.fetch(
        """SELECT run_id, budget_micros, spent_micros FROM metering.run_budgets
            WHERE budget_micros IS NOT NULL AND spent_micros > budget_micros"""
    )
    verdict.check(
        "no budget overspent",
        [f"{r['run_id']}: spent {r['spent_micros']} of {r['budget_micros']}" for r in overspent],
    )
    schemas = await outbox_schemas(pool)
    waiting = [
        f"{s}: {n} rows"
        for s in schemas
        if (n := await pool.fetchval(f"SELECT count(*) FROM {s}.outbox"))
    ]
    verdict.check("outboxes drained", waiting)
    dead = []
    for s in schemas:
        for r in await pool.fetch(f"SELECT consumer, subject, reason FROM {s}.dead_letters"):
            dead.append(f"{s}.{r['consumer']} {r['subject']}: {r['reason']}")
    verdict.check("no dead letter", dead)
    return verdict


async def unbilled_calls(pool: asyncpg.Pool, calls: list[dict[str, Any]]) -> list[str]:
    """Why the model's calls and metering's bills disagree, if they do.

    Every call has its `token_usage` row: one whose metering replica was SIGKILLed
    between the call and the bill is billed at its hold by a survivor or by the replica
    restarted (`billed_at_hold`). A replica killed after its hold and before calling
    leaves a row billed at its hold with no call: the only rows allowed beyond the calls.
    No hold may be left live."""
    usage, at_hold = await pool.fetchrow(
        "SELECT count(*), count(*) FILTER (WHERE billed_at_hold) FROM metering.token_usage"
    ) or (0, 0)
    live = await pool.fetchval("SELECT count(*) FROM metering.budget_holds WHERE status = 'held'")
    evidence = []
    if len(calls) > usage:
        evidence.append(
            f"{len(calls) - usage} of {len(calls)} calls the model logged without a "
            f"token_usage row ({usage} rows, {at_hold} of them billed at the hold)"
        )
    if usage - len(calls) > at_hold:
        evidence.append(
            f"{usage} token_usage rows for {len(calls)} calls, more than the {at_hold} "
            "billed at a hold whose call may not have happened"
        )
    if live:
        evidence.append(f"{live} budget holds still live (never billed nor settled)")
    if not evidence and at_hold:
        print(
            f"  ({at_hold} calls whose metering replica was SIGKILLed before billing them: "
            "billed at their hold by a survivor or the restarted replica)"
        )
    return evidence


async def answers_logged(pool: asyncpg.Pool, sessions: list[str]) -> dict[str, float]:
    """When each chat message's answer reached the log, by the message's text."""
    rows = await pool.fetch(
        """SELECT m.payload->>'text' AS text, extract(epoch FROM a.created_at) AS at
             FROM session_events.events a
             JOIN session_events.events m ON m.id = a.causation_id
            WHERE a.type = 'agent.response' AND a.session_id = ANY($1::uuid[])""",
        sessions,
    )
    return {r["text"]: float(r["at"]) for r in rows}


async def live_turns_run_twice(pool: asyncpg.Pool) -> list[str]:
    """Turns given up while their metering replica still ran them: the turn billed `ok`
    from its own call, and its retry (`<turn_id>.r<N>`) billed too. A caller gives a
    turn up after its replica's silence; one that only seemed silent is run twice."""
    rows = await pool.fetch(
        """SELECT r.turn_id FROM metering.token_usage r
             JOIN metering.token_usage t ON t.turn_id = regexp_replace(r.turn_id, '\\.r[0-9]+$', '')
            WHERE r.turn_id ~ '\\.r[0-9]+$' AND t.status = 'ok' AND NOT t.billed_at_hold"""
    )
    return [f"{r['turn_id']}: its turn was billed ok, and it ran again" for r in rows]


def tail_of(
    storm: Round, calls: list[dict[str, Any]], logged: dict[str, float], slowest: int = 8
) -> list[str]:
    """The slowest answers under chaos taken apart: where each waited, read from the
    model's call log (the person's words each call answers), the answer's time in the log
    (`logged`, by the person's words), the person's connection attempts, and the blows
    meanwhile."""
    killed = {b.pid: b for b in storm.blows if b.kind == "kill" and b.pid}
    answers = sorted(
        ((a, p) for p in storm.people for a in p.answers), key=lambda x: -x[0].latency
    )[:slowest]
    lines = []
    for a, p in answers:
        mine = sorted(
            (
                c
                for c in calls
                if c["agent"] == "criativo"
                and a.text in c.get("says", "")
                and a.sent <= c["at"] <= a.arrived
            ),
            key=lambda c: float(c["at"]),
        )
        waits = []
        if not mine:
            waits.append("no model call logged for it")
        else:
            waits.append(f"{mine[0]['at'] - a.sent:.1f} s to its first model call")
            for before, after in itertools.pairwise(mine):
                gap = after["at"] - before["at"]
                blow = killed.get(before["pid"])
                if blow is not None and before["at"] <= blow.at <= after["at"]:
                    waits.append(
                        f"{gap:.1f} s from a call on {blow.what.removeprefix('SIGKILL ')} "
                        f"(killed {blow.at - before['at']:.1f} s into it) to its next call"
                    )
                elif gap > 2:
                    waits.append(f"{gap:.1f} s between two calls")
            end, to = (logged[a.text], "log") if a.text in logged else (a.arrived, "answer")
            waits.append(f"{end - mine[-1]['at']:.1f} s from its last call to the {to}")
        if a.text in logged:
            waits.append(f"{a.arrived - logged[a.text]:.1f} s from the log to the WebSocket")
        attempts = [t for t in p.trail if t[1] >= a.sent and t[0] <= a.arrived]
        if attempts:
            kinds = Counter(t[2] for t in attempts)
            spent = sum(t[1] - t[0] for t in attempts)
            waits.append(
                f"{len(attempts)} connection attempts ({spent:.1f} s in them: "
                + ", ".join(f"{n}x {k}" for k, n in kinds.most_common())
                + ")"
            )
        around = [
            f"{b.what} at {b.at - a.sent:+.1f} s"
            for b in storm.blows
            if a.sent - 5 <= b.at <= (logged.get(a.text) or a.arrived)
        ]
        lines.append(
            f"  p{p.index} {a.latency:5.1f} s: {'; '.join(waits)}. "
            f"Blows: {', '.join(around) or 'none'}"
        )
    return lines


def _payload(event: Any) -> dict[str, Any]:
    payload = event["payload"]
    return json.loads(payload) if isinstance(payload, str) else dict(payload)


# -- figures --------------------------------------------------------------------------------


def longest_kill_to_answer(blows: list[Blow], people: list[Person]) -> tuple[float, str]:
    """The longest time from a blow to the next answer any person received after it."""
    answers = sorted(
        float(e[ARRIVED]) for p in people for e in p.events if e["type"] == "agent.response"
    )
    worst, which = 0.0, "-"
    for blow in blows:
        # a blow before the first answer only delays the start: nothing was answered yet
        if blow.kind in ("nats-back", "back") or not answers or blow.at < answers[0]:
            continue
        after = next((a for a in answers if a > blow.at), None)
        if after is not None and after - blow.at > worst:
            worst, which = after - blow.at, blow.what
    return worst, which


def latency_line(name: str, values: list[float], base: list[float] | None = None) -> str:
    qs = (0.5, 0.9, 0.99)
    cells = "  ".join(f"p{int(q * 100)} {bk.percentile(values, q) * 1000:7.0f} ms" for q in qs)
    text = f"  {name:<22} {cells}  max {max(values, default=0) * 1000:7.0f} ms  n={len(values)}"
    if base:
        ratios = "/".join(
            f"{bk.ratio(bk.percentile(values, q), bk.percentile(base, q)):.2f}" for q in qs
        )
        text += f"  ratio p50/p90/p99 {ratios}"
    return text


async def run(
    people: int,
    kills: int,
    seed: int,
    gap: float,
    calm: bool,
    close_at_once: bool,
    keep: Path | None = None,
    only: str | None = None,
) -> int:
    rng = random.Random(seed)
    random.seed(seed)
    with contextlib.ExitStack() as folders:
        if keep is None:
            state = Path(
                folders.enter_context(tempfile.TemporaryDirectory(prefix="agentbus-chaos-"))
            )
        else:
            state = keep  # made by `main`, before the loop runs
        async with contextlib.AsyncExitStack() as stack:
            t0 = time.perf_counter()
            system, _ = await start_system(stack, state)
            print(
                f"chaos: 3-node JetStream cluster (R3, sync always), Postgres, "
                f"{REPLICAS} replicas of {len(system.supervised) // REPLICAS} services; "
                f"up in {time.perf_counter() - t0:.0f} s; {people} people per round, "
                f"seed {seed}; {bk.load_average()}",
                flush=True,
            )
            pool = await asyncpg.create_pool(system.database_url, min_size=1, max_size=4)
            stack.push_async_callback(pool.close)
            rounds = []
            if calm:
                rounds.append(await run_round(system, pool, "calm", people, None, close_at_once))
                print(f"calm round: {rounds[-1].seconds:.0f} s", flush=True)

            async def chaos() -> list[Blow]:
                return await drive_chaos(system, rng, kills, gap, only)

            rounds.append(await run_round(system, pool, "chaos", people, chaos, close_at_once))
            storm = rounds[-1]
            print(f"chaos round: {storm.seconds:.0f} s", flush=True)
            sessions = [p.session_id for r in rounds for p in r.people if p.session_id]
            await settle(pool, sessions)
            calls = [
                json.loads(line)
                for line in (await asyncio.to_thread(system.calls_path.read_text)).splitlines()
                if line
            ]
            verdict = await check(pool, rounds, calls)
            logged = await answers_logged(pool, sessions)
            restarts = {f"{s.spec.name}-{s.replica}": s.restarts for s in system.supervised}
            total_events = await pool.fetchval(
                "SELECT count(*) FROM session_events.events WHERE session_id = ANY($1::uuid[])",
                sessions,
            )
        frames = sum(len(p.events) for r in rounds for p in r.people)
        kinds = Counter(b.kind for b in storm.blows)
        print(
            f"sessions {len(sessions)}, events in the log {total_events}, "
            f"event frames received {frames}, connection attempts after the first "
            f"{sum(p.connects - 1 for r in rounds for p in r.people)}"
        )
        print(
            f"blows: {kinds['kill']} replica SIGKILLs, {kinds['nats']} NATS node, "
            f"{kinds['gateway']} gateway restart, {kinds['postgres']} Postgres pause; "
            f"service restarts by the supervisor: {sum(restarts.values())}"
        )
        for blow in storm.blows:
            print(f"  +{blow.at - storm.blows[0].at:6.1f} s  {blow.what}")
        worst, which = longest_kill_to_answer(storm.blows, storm.people)
        print(f"longest time from a blow to the next answer: {worst:.1f} s (after {which})")
        print("answer latency (chat sent → its agent.response on the WebSocket):")
        base = rounds[0].latencies if calm else None
        if calm:
            print(latency_line("calm", rounds[0].latencies))
        print(latency_line("during chaos", storm.latencies, base))
        print("the slowest answers under chaos, where they waited:")
        for line in tail_of(storm, calls, logged):
            print(line)
        for name in verdict.held:
            print(f"  held    {name}")
        for broken in verdict.broken:
            print(f"  BROKEN  {broken}")
        print(
            "all invariants held"
            if not verdict.broken
            else f"{len(verdict.broken)} invariant(s) broken"
        )
        return 1 if verdict.broken else 0


def main() -> None:
    global ANSWER_PATIENCE  # the people read it; set once, before they start
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--people", type=int, default=100)
    parser.add_argument("--kills", type=int, default=2, help="SIGKILLs per service")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between blows")
    parser.add_argument("--no-calm", action="store_true", help="skip the calm round")
    parser.add_argument(
        "--only",
        metavar="SERVICE",
        help="only SIGKILL this service's replicas (--kills times): no other blow",
    )
    parser.add_argument(
        "--close-at-once",
        action="store_true",
        help="close right after accepting, without waiting for PO's activation in the log",
    )
    parser.add_argument(
        "--patience",
        type=float,
        default=ANSWER_PATIENCE,
        help="seconds a person waits for one answer before the run fails with the evidence",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        help="a new folder for the run's state, kept afterwards (every replica's log is there)",
    )
    parser.add_argument(
        "--storm",
        action="store_true",
        help="only print the web client's reconnect schedule against lower ceilings, simulated",
    )
    args = parser.parse_args()
    if args.storm:
        print("\n".join(storm([MAX_RETRY, 8.0, 6.0, 5.0])))
        return
    ANSWER_PATIENCE = args.patience
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=False)
    run_args = (args.people, args.kills, args.seed, args.gap, not args.no_calm, args.close_at_once)
    code = asyncio.run(run(*run_args, keep=args.keep, only=args.only))
    sys.exit(code)


if __name__ == "__main__":
    main()
