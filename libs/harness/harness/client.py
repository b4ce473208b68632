"""The harness's only way to a model: metering's commands, over NATS.

A metering replica SIGKILLed mid-turn never replies. The request alone would wait out
its whole timeout (minutes) while a person, or a held closing, waits with it; so a turn
that cannot be alive any more is given up as lost (`TurnLost`), and the `ToolLoop`
tries it again at once under the turn's next retry id (`<turn_id>.r1`…):
- a streaming turn has a liveness signal, its own deltas on `delta_subject`. Given
  `silence_seconds`, the client follows them while it waits: that long without a delta
  and without the reply after the stream began means the replica is gone
  (`StreamSilent`). Before the first delta the same holds after `start_seconds` from
  the request (a replica killed between taking the turn and its first delta: issue 13's
  chaos run hung there for the request's 600 s). A model may think before it writes,
  so `start_seconds` is the longer bound; a live turn given up that way still ends in
  metering and is billed, and only the retry's answer is used.
- a whole-reply turn has no signal but its reply: no reply within `timeout` means lost.
The lost id stays claimed in metering until its sweeper settles the hold, so the client
remembers it: a re-run of the same input skips it rather than wait on "turn in progress".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from uuid import UUID

from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from contracts.metering import CancelReply, CancelTurn, LlmStream, LlmTurn, TurnReply
from servicekit.client import CommandFailed, call

# A model turn can take minutes (long outputs, provider retries); metering bills it
# whether or not we are still waiting, so waiting long costs nothing extra.
TURN_TIMEOUT_SECONDS = 600.0
STREAM_SILENT = "stream_silent"
TURN_LOST = "turn_lost"
LOST_REMEMBERED = 10_000


class TurnLost(CommandFailed):
    """No reply, and no sign of life, for longer than a live turn stays silent: the
    metering replica running it is gone (its id stays claimed there)."""

    def __init__(self, turn_id: str, why: str, code: str = TURN_LOST) -> None:
        super().__init__(code, f"turn {turn_id}: {why}")
        self.turn_id = turn_id


class StreamSilent(TurnLost):
    """A stream silent too long, before or after its first delta."""

    def __init__(self, turn_id: str, seconds: float, started: bool = True) -> None:
        since = "after the stream began" if started else "since the request (no delta at all)"
        super().__init__(
            turn_id, f"no delta and no reply for {seconds:.0f} s {since}", STREAM_SILENT
        )


class MeteringClient:
    """Sends turns to metering; a refusal or failure raises `servicekit.client.CommandFailed`."""

    def __init__(
        self,
        nc: Client,
        timeout: float = TURN_TIMEOUT_SECONDS,
        silence_seconds: float | None = None,
        start_seconds: float | None = None,
    ) -> None:
        """`start_seconds` (default: twice `silence_seconds`) bounds the wait for a stream's
        first delta; `timeout` bounds any turn's wait for its reply."""
        self._nc = nc
        self._timeout = timeout
        self._silence = silence_seconds
        self._start = start_seconds if start_seconds is not None else 2 * (silence_seconds or 0)
        # Turn ids seen going silent: still claimed by the dead replica in metering, so a
        # re-run (the same input retried after an outage) goes to the next retry id at
        # once instead of waiting on "in progress". Insertion-ordered, the oldest dropped.
        self._lost: dict[str, None] = {}

    async def turn(self, cmd: LlmTurn) -> TurnReply:
        """One whole-reply turn (`cmd.llm.turn`); no reply within `timeout`: `TurnLost`."""
        self._skip_lost(cmd.turn_id)
        try:
            return await call(self._nc, subjects.LLM_TURN, cmd, TurnReply, timeout=self._timeout)
        except TimeoutError:  # nats-py's request timeout is one
            raise self._lose(TurnLost(cmd.turn_id, f"no reply in {self._timeout:.0f} s")) from None

    async def stream(self, cmd: LlmStream) -> TurnReply:
        """One streaming turn (`cmd.llm.stream`): deltas go to `cmd.delta_subject`; a
        stream silent for `start_seconds` before its first delta, or `silence_seconds`
        after one, raises `StreamSilent`."""
        if self._silence is None:
            return await call(self._nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=self._timeout)
        self._skip_lost(cmd.turn_id)
        request = call(self._nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=self._timeout)
        asked = time.monotonic()
        last_delta: float | None = None

        async def heard(msg: Msg) -> None:
            nonlocal last_delta
            with contextlib.suppress(ValueError, TypeError):
                if json.loads(msg.data).get("turn_id") == cmd.turn_id:
                    last_delta = time.monotonic()

        sub = await self._nc.subscribe(cmd.delta_subject, cb=heard)
        waiting = asyncio.ensure_future(request)
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=self._silence / 4)
                if done:
                    return waiting.result()
                now = time.monotonic()
                if last_delta is None and now - asked > self._start:
                    raise self._lose(StreamSilent(cmd.turn_id, self._start, started=False))
                if last_delta is not None and now - last_delta > self._silence:
                    raise self._lose(StreamSilent(cmd.turn_id, self._silence))
        except TimeoutError:  # nats-py's request timeout is one
            raise self._lose(TurnLost(cmd.turn_id, f"no reply in {self._timeout:.0f} s")) from None
        finally:
            waiting.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _skip_lost(self, turn_id: str) -> None:
        """A turn id given up earlier is still claimed in metering: go to the next one."""
        if turn_id in self._lost:
            raise TurnLost(turn_id, "given up earlier (its metering replica died)")

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
