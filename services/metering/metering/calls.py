"""Calling the provider, and how the call ended (`domain.metering_turn.Outcome`).

A stream's call runs in a task of its own, registered with the cancels, so that
`cmd.llm.cancel` (metering.cancels) can abort it without touching the turn: a stream
stopped that way is not a failure, its reply is a normal one with `stop_reason:
"cancelled"` and the text published up to the stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass

from nats.aio.client import Client

from contracts.common import ErrorCode
from contracts.metering import LlmStream, LlmTurn
from domain.errors import DomainError
from domain.metering_turn import CANCELLED, Outcome
from metering.cancels import Cancellations
from metering.providers.base import (
    Progress,
    Provider,
    ProviderError,
    ProviderReply,
    ProviderRequest,
)
from metering.publisher import Coalescing, DeltaPublisher
from servicekit.logs import get_logger

log = get_logger(__name__)


def request_of(cmd: LlmTurn, model: str) -> ProviderRequest:
    """The provider's request: the model the binding chose and the turn's conversation."""
    return ProviderRequest(
        model=model,
        agent_slug=cmd.agent_slug,
        system=cmd.system,
        messages=list(cmd.messages),
        tools=list(cmd.tools),
        max_tokens=cmd.max_tokens,
    )


@dataclass(frozen=True)
class Streaming:
    """What a stream's call needs beside its provider: the bus its deltas go out on, the
    running turns a cancel reaches, and how its pieces gather into deltas."""

    nc: Client
    cancels: Cancellations
    coalescing: Coalescing


async def call(
    provider: Provider,
    cmd: LlmTurn,
    request: ProviderRequest,
    progress: Progress,
    streaming: Streaming,
) -> Outcome:
    """Call the provider; a stream publishes its text on its delta subject as it comes."""
    if not isinstance(cmd, LlmStream):
        outcome = await _outcome(provider.complete(request, progress, None), None, cmd.turn_id)
        assert outcome is not None  # only a stream can be stopped
        return outcome
    publisher = DeltaPublisher(
        streaming.nc, cmd.delta_subject, cmd.turn_id, cmd.causation_id, streaming.coalescing
    )
    task = asyncio.ensure_future(provider.complete(request, progress, publisher))
    # A cancel heard before this point stops the task here, before its first step:
    # the provider is then never called.
    cancels = streaming.cancels
    publisher.running = cancels.start(cmd.turn_id, cmd.project_id, cmd.session_id, task)
    try:
        outcome = await _outcome(task, publisher, cmd.turn_id)
        await publisher.flush()
    finally:
        cancels.finish(publisher.running)
    if outcome is not None:
        return outcome
    # Stopped by a cancel: a normal reply holding the text published until then.
    return Outcome(ProviderReply(publisher.content, CANCELLED, request.model), CANCELLED)


def _stopped(publisher: DeltaPublisher | None) -> bool:
    """Whether a cancel stopped this stream (and the command itself is not being cancelled:
    a replica shutting down is not a person pressing Stop)."""
    if publisher is None or not publisher.stopped:
        return False
    task = asyncio.current_task()
    return task is None or task.cancelling() == 0


async def _outcome(
    answering: Awaitable[ProviderReply], publisher: DeltaPublisher | None, turn_id: str
) -> Outcome | None:
    """How the call ended; None when `cmd.llm.cancel` stopped it, whatever the provider
    did while it unwound (an error from the cut connection, even a whole reply)."""
    try:
        reply = await answering
        if not _stopped(publisher):
            return Outcome(reply, "ok")
    except ProviderError as exc:
        if not _stopped(publisher):
            return Outcome(None, "error", DomainError(exc.code, exc.message))
    except asyncio.CancelledError:
        if not _stopped(publisher):
            # Shut down mid-call: bill what the provider produced, then stop.
            error = DomainError(ErrorCode.UNAVAILABLE, "the turn was cancelled; retry it")
            return Outcome(None, CANCELLED, error, shutdown=True)
    except Exception as exc:
        if not _stopped(publisher):
            log.exception("provider_failed", turn_id=turn_id)
            return Outcome(None, "error", DomainError(ErrorCode.PROVIDER_ERROR, repr(exc)))
    return None
