"""The harness's only way to a model: metering's commands, over NATS.

A streaming turn has a liveness signal: its own deltas on `delta_subject`. A metering
replica SIGKILLed mid-turn never replies, and the request alone would wait out its
whole timeout (minutes). Given `silence_seconds`, the client follows the turn's deltas
while it waits: once the stream has started, that long without a delta and without
the reply means the replica is gone, and the call raises `StreamSilent`, which the
`ToolLoop` retries at once under the turn's next retry id (`<turn_id>.r1`…). The lost id
stays claimed in metering until its sweeper settles the hold, so the client remembers
it: a re-run of the same input skips it rather than wait on "turn in progress".
Before the first delta there is nothing to go by (a model may think long before it
writes): that wait stays bounded by the request timeout only.
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
LOST_REMEMBERED = 10_000


class StreamSilent(CommandFailed):
    """A started stream went silent: the metering replica running it is gone."""

    def __init__(self, turn_id: str, seconds: float) -> None:
        super().__init__(
            STREAM_SILENT,
            f"turn {turn_id}: no delta and no reply for {seconds:.0f} s after the stream began",
        )


class MeteringClient:
    """Sends turns to metering; a refusal or failure raises `servicekit.client.CommandFailed`."""

    def __init__(
        self,
        nc: Client,
        timeout: float = TURN_TIMEOUT_SECONDS,
        silence_seconds: float | None = None,
    ) -> None:
        self._nc = nc
        self._timeout = timeout
        self._silence = silence_seconds
        # Turn ids seen going silent: still claimed by the dead replica in metering, so a
        # re-run (the same input retried after an outage) goes to the next retry id at
        # once instead of waiting on "in progress". Insertion-ordered, the oldest dropped.
        self._lost: dict[str, None] = {}

    async def turn(self, cmd: LlmTurn) -> TurnReply:
        """One whole-reply turn (`cmd.llm.turn`)."""
        return await call(self._nc, subjects.LLM_TURN, cmd, TurnReply, timeout=self._timeout)

    async def stream(self, cmd: LlmStream) -> TurnReply:
        """One streaming turn (`cmd.llm.stream`): deltas go to `cmd.delta_subject`; a
        started stream silent for `silence_seconds` raises `StreamSilent`."""
        if self._silence is None:
            return await call(self._nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=self._timeout)
        if cmd.turn_id in self._lost:
            raise StreamSilent(cmd.turn_id, self._silence)
        request = call(self._nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=self._timeout)
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
                if last_delta is not None and time.monotonic() - last_delta > self._silence:
                    self._lost[cmd.turn_id] = None
                    while len(self._lost) > LOST_REMEMBERED:
                        del self._lost[next(iter(self._lost))]
                    raise StreamSilent(cmd.turn_id, self._silence)
        finally:
            waiting.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def cancel(self, turn_id: str, project_id: str, session_id: UUID) -> CancelReply:
        """Stop a running streaming turn of this project's session (`cmd.llm.cancel`).

        The turn's `stream` call then returns normally, with `stop_reason == "cancelled"`
        and the text written up to the stop; `finished` means it had already ended."""
        order = CancelTurn(turn_id=turn_id, project_id=project_id, session_id=session_id)
        return await call(self._nc, subjects.LLM_CANCEL, order, CancelReply)
