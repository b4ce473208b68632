"""The harness's only way to a model: metering's commands, over NATS.

A streaming turn has a liveness signal: metering beats on a subject the client names
(`LlmStream.alive_subject`) from the moment a replica takes the turn to its reply. A
metering replica SIGKILLed mid-turn stops beating and never replies, and the request
alone would wait out its whole timeout (minutes). Given `silence_seconds`, the client
asks for a beat every quarter of it and listens while it waits: once a replica has
beaten, that long with no beat and no reply means it is gone — before the first delta
as well as after — and the call raises `StreamSilent`, which the `ToolLoop` retries at
once under the turn's next retry id (`<turn_id>.r1`…). A model that thinks long before
writing keeps its replica beating, so it is waited for. Before the first beat there is
little to go by: a replica saturated with turns (its endpoint's concurrency) holds the
request unread, and giving it up then would run the turn twice; so that wait is bounded
by the longer `unheard_seconds` (a replica killed after taking the request and before
its first beat), or else by the request timeout only. The client never reads the
turn's deltas: a beat is noted on arrival, a few per turn, not one per token. All of a
client's streams name one alive subject, subscribed once, and a beat's body is its
turn's id: no subscription made and dropped per turn, which would cost a SUB and an
UNSUB, a subscription task and the server's interest changes on every turn's first token.
The lost id stays claimed in metering until its replica's bill or a survivor settles
it, so the client remembers it: a re-run of the same input skips it rather than wait on
"turn in progress"; unless the caller asks for it again (`ask_again`) to learn whether
its replica still runs it: a live one's turn is "in progress", then answered from its
row, a dead one's ended within seconds (a survivor bills it at its hold).

A whole-reply turn has no beat: no reply within `timeout` is its only sign that the
replica is gone, and the call raises `TurnLost` (which `StreamSilent` is too), retried
the same way; a caller that knows how long its replies take (the psychologist) gives a
timeout shorter than the 600 s default: a closing held that long by a turn whose
metering replica died would leave its session unanalysed for as long. A stream's
request that times out is lost the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from uuid import UUID, uuid4

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from contracts import subjects
from contracts.metering import (
    MAX_ALIVE_EVERY_SECONDS,
    MIN_ALIVE_EVERY_SECONDS,
    TURN_TIMEOUT_SECONDS,
    CancelReply,
    CancelTurn,
    LlmStream,
    LlmTurn,
    TurnReply,
)
from servicekit.client import CommandFailed, call

STREAM_SILENT = "stream_silent"
TURN_LOST = "turn_lost"
LOST_REMEMBERED = 10_000


class TurnLost(CommandFailed):
    """No reply and no sign of life: the metering replica running the turn is gone (its
    id stays claimed there)."""

    def __init__(self, turn_id: str, why: str, code: str = TURN_LOST) -> None:
        super().__init__(code, f"turn {turn_id}: {why}")
        self.turn_id = turn_id


class StreamSilent(TurnLost):
    """A started stream went silent: the metering replica running it is gone."""

    def __init__(self, turn_id: str, seconds: float) -> None:
        why = f"no beat and no reply from metering for {seconds:.0f} s"
        super().__init__(turn_id, why, STREAM_SILENT)


@dataclass
class Heard:
    """When a turn's beat was last heard (`time.monotonic()`; None: not yet), and how many
    streams wait on it (one, unless its turn id is asked for again while it runs)."""

    last: float | None = None
    waiting: int = 0


class Beats:
    """The beats of one client's streams, on one subject subscribed once: each beat's body
    names its turn id, and is noted for the streams waiting on that id."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self.subject = subjects.alive_subject(uuid4().hex)
        self._sub: Subscription | None = None
        self._subscribing = asyncio.Lock()
        # By turn id, as the beat's body carries it.
        self._heard: dict[bytes, Heard] = {}

    @contextlib.asynccontextmanager
    async def listening(self, turn_id: str) -> AsyncIterator[Heard]:
        """Note `turn_id`'s beats while the block runs (subscribed before it starts)."""
        if self._sub is None:
            async with self._subscribing:
                if self._sub is None:
                    self._sub = await self._nc.subscribe(self.subject, cb=self._on_beat)
        key = turn_id.encode()
        heard = self._heard.setdefault(key, Heard())
        heard.waiting += 1
        try:
            yield heard
        finally:
            heard.waiting -= 1
            if not heard.waiting:
                del self._heard[key]

    async def _on_beat(self, msg: Msg) -> None:
        heard = self._heard.get(msg.data)
        if heard is not None:  # else a turn no longer waited on (answered, or given up)
            heard.last = time.monotonic()


class MeteringClient:
    """Sends turns to metering; a refusal or failure raises `servicekit.client.CommandFailed`."""

    def __init__(
        self,
        nc: Client,
        timeout: float = TURN_TIMEOUT_SECONDS,
        silence_seconds: float | None = None,
        unheard_seconds: float | None = None,
    ) -> None:
        """`unheard_seconds`: a stream no replica beat for at all that long after the
        request is lost too (None: only the request's timeout bounds that wait)."""
        self._nc = nc
        self._timeout = timeout
        self._silence = silence_seconds
        self._unheard = unheard_seconds
        # Turn ids seen going silent: still claimed by the dead replica in metering, so a
        # re-run (the same input retried after an outage) goes to the next retry id at
        # once instead of waiting on "in progress". Insertion-ordered, the oldest dropped.
        self._lost: dict[str, None] = {}
        self._beats = Beats(nc)

    async def turn(self, cmd: LlmTurn) -> TurnReply:
        """One whole-reply turn (`cmd.llm.turn`); no reply within `timeout`: `TurnLost`."""
        if cmd.turn_id in self._lost:
            raise TurnLost(cmd.turn_id, "given up earlier (its metering replica died)")
        try:
            return await call(self._nc, subjects.LLM_TURN, cmd, TurnReply, timeout=self._timeout)
        except TimeoutError:  # nats-py's request timeout is one
            raise self._lose(TurnLost(cmd.turn_id, self._no_reply)) from None

    async def stream(self, cmd: LlmStream) -> TurnReply:
        """One streaming turn (`cmd.llm.stream`): deltas go to `cmd.delta_subject`; a turn
        whose metering replica beat, then stayed silent for `silence_seconds`, raises
        `StreamSilent`."""
        if self._silence is None:
            return await call(self._nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=self._timeout)
        if cmd.turn_id in self._lost:
            raise StreamSilent(cmd.turn_id, self._silence)
        every = min(max(self._silence / 4, MIN_ALIVE_EVERY_SECONDS), MAX_ALIVE_EVERY_SECONDS)
        # Copied, not validated again: two trusted values added to a checked command.
        update = {"alive_subject": self._beats.subject, "alive_every_seconds": every}
        cmd = cmd.model_copy(update=update)
        # Listened for before the request goes out on the same connection: the server has
        # the subscription before metering can beat.
        async with self._beats.listening(cmd.turn_id) as heard:
            waiting = asyncio.ensure_future(
                call(self._nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=self._timeout)
            )
            asked = time.monotonic()
            try:
                while True:
                    done, _ = await asyncio.wait({waiting}, timeout=every)
                    if done:
                        return waiting.result()
                    now = time.monotonic()
                    if heard.last is not None and now - heard.last > self._silence:
                        raise self._lose(StreamSilent(cmd.turn_id, self._silence))
                    # Never beaten for: a replica killed after taking the request and
                    # before its first beat, which would leave the person waiting out the
                    # 600 s. A live but saturated replica may hold a request that long
                    # unread; its turn, if it runs, is billed and its answer unused.
                    if (
                        heard.last is None
                        and self._unheard is not None
                        and now - asked > self._unheard
                    ):
                        raise self._lose(StreamSilent(cmd.turn_id, self._unheard))
            except TimeoutError:  # the request's own timeout, never beaten for
                raise self._lose(TurnLost(cmd.turn_id, self._no_reply)) from None
            finally:
                waiting.cancel()

    def ask_again(self, turn_id: str) -> None:
        """Let a turn id given up be asked for again (metering answers whether it runs)."""
        self._lost.pop(turn_id, None)

    @property
    def _no_reply(self) -> str:
        return f"no reply from metering in {self._timeout:.0f} s"

    def _lose(self, lost: TurnLost) -> TurnLost:
        """Remember the lost turn's id (the oldest forgotten first) and return `lost`."""
        self._lost[lost.turn_id] = None
        while len(self._lost) > LOST_REMEMBERED:
            del self._lost[next(iter(self._lost))]
        return lost

    async def cancel(self, turn_id: str, project_id: str, session_id: UUID) -> CancelReply:
        """Stop a running streaming turn of this project's session (`cmd.llm.cancel`).

        The turn's `stream` call then returns normally, with `stop_reason == "cancelled"`
        and the text written up to the stop; `finished` means it had already ended."""
        order = CancelTurn(turn_id=turn_id, project_id=project_id, session_id=session_id)
        return await call(self._nc, subjects.LLM_CANCEL, order, CancelReply)
