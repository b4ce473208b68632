"""The harness's only way to a model: metering's commands, over NATS."""

from __future__ import annotations

from uuid import UUID

from nats.aio.client import Client

from contracts import subjects
from contracts.metering import CancelReply, CancelTurn, LlmStream, LlmTurn, TurnReply
from servicekit.client import call

# A model turn can take minutes (long outputs, provider retries); metering bills it
# whether or not we are still waiting, so waiting long costs nothing extra.
TURN_TIMEOUT_SECONDS = 600.0


class MeteringClient:
    """Sends turns to metering; a refusal or failure raises `servicekit.client.CommandFailed`."""

    def __init__(self, nc: Client, timeout: float = TURN_TIMEOUT_SECONDS) -> None:
        self._nc = nc
        self._timeout = timeout

    async def turn(self, cmd: LlmTurn) -> TurnReply:
        """One whole-reply turn (`cmd.llm.turn`)."""
        return await call(self._nc, subjects.LLM_TURN, cmd, TurnReply, timeout=self._timeout)

    async def stream(self, cmd: LlmStream) -> TurnReply:
        """One streaming turn (`cmd.llm.stream`): deltas go to `cmd.delta_subject`."""
        return await call(self._nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=self._timeout)

    async def cancel(self, turn_id: str, project_id: str, session_id: UUID) -> CancelReply:
        """Stop a running streaming turn of this project's session (`cmd.llm.cancel`).

        The turn's `stream` call then returns normally, with `stop_reason == "cancelled"`
        and the text written up to the stop; `finished` means it had already ended."""
        order = CancelTurn(turn_id=turn_id, project_id=project_id, session_id=session_id)
        return await call(self._nc, subjects.LLM_CANCEL, order, CancelReply)
