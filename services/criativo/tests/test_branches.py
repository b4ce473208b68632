"""Criativo in a branch (`cmd.sessions.fork`): the branch's conversation is rebuilt from
its own log, the copied history is read and never answered again, only the new message
is; the parent's turn in flight ends in the parent."""

from __future__ import annotations

import uuid

from nats.aio.client import Client

from contracts import catalog
from contracts.events import Event, EventType
from contracts.session_events import ForkSession, SessionForkedReply
from metering.providers.base import ProviderRequest
from servicekit.client import call
from testkit.probes import wait_for

from .conftest import Driver


async def fork(bus: Driver, session: uuid.UUID, at_seq: int, text: str) -> SessionForkedReply:
    request = ForkSession(
        session_id=session,
        project_id=bus.project,
        at_seq=at_seq,
        text=text,
        forked_by="user:ana",
        fork_id=uuid.uuid4().hex,
    )
    return await call(bus.nc, catalog.SESSIONS_FORK.subject, request, SessionForkedReply)


def asked(bus: Driver, message: uuid.UUID) -> ProviderRequest:
    """The first model request answering `message` (the turn's prompt, before tools)."""
    return next(
        r
        for r in bus.provider.requests
        if isinstance(r.messages[-1].content, str) and str(message) in r.messages[-1].content
    )


def as_parent(text: str, log: list[Event]) -> str:
    """`text` with each copy's id written as the id of the parent's event it copies."""
    for e in log:
        if e.copied_from is not None:
            text = text.replace(str(e.id), str(e.copied_from))
    return text


def seq_of(log: list[Event], event_id: uuid.UUID) -> int:
    return next(e.seq for e in log if e.id == event_id)


async def settled(nc: Client) -> None:
    """Wait until Criativo handled every input on the stream."""

    async def idle() -> bool:
        info = await nc.jetstream().consumer_info("EVENTS", "criativo-inputs")
        return bool(info.num_pending == 0 and info.num_ack_pending == 0)

    await wait_for(idle, what="criativo-inputs to be handled")


async def test_a_branch_prompt_is_the_parents_up_to_the_fork_then_the_new_message(
    bus: Driver,
) -> None:
    parent = await bus.open()
    first = await bus.say(parent, "uma padaria")
    await bus.outcome(parent, first)
    second = await bus.say(parent, "para vizinhos")
    await bus.outcome(parent, second)
    parent_log = await bus.events(parent)

    # Edit the second message: the branch keeps what came before it.
    branch = await fork(bus, parent, seq_of(parent_log, second) - 1, "para escritórios")
    answer = await bus.outcome(branch.session_id, branch.message_event_id)
    assert answer.type is EventType.AGENT_RESPONSE and answer.copied_from is None

    branch_log = await bus.events(branch.session_id)
    before, after = asked(bus, second), asked(bus, branch.message_event_id)
    assert as_parent(after.system, branch_log) == before.system  # the same rules recorded
    assert [(m.role, as_parent(str(m.content), branch_log)) for m in after.messages[:-1]] == [
        (m.role, str(m.content)) for m in before.messages[:-1]
    ]
    assert after.messages[-1].content == f"[message {branch.message_event_id}]\npara escritórios"

    # Retry the branch's answer: a branch of the branch, the same text sent again.
    twig = await fork(
        bus, branch.session_id, seq_of(branch_log, branch.message_event_id) - 1, "para escritórios"
    )
    await bus.outcome(twig.session_id, twig.message_event_id)
    twig_log = await bus.events(twig.session_id)
    again = asked(bus, twig.message_event_id)
    assert [as_parent(str(m.content), twig_log) for m in again.messages[:-1]] == [
        str(m.content) for m in after.messages[:-1]
    ]

    # Only the new messages were answered: no copy was asked of the model again.
    await settled(bus.nc)
    for log in (branch_log, twig_log):
        copies = {e.id for e in log if e.copied_from is not None}
        assert not any(
            str(c) in str(r.messages[-1].content) for r in bus.provider.requests for c in copies
        )
    fresh = [e for e in await bus.events(branch.session_id, "agent.") if e.copied_from is None]
    assert [e.causation_id for e in fresh] == [branch.message_event_id]
    assert await bus.events(parent) == parent_log


async def test_a_fork_during_a_parent_turn_leaves_that_turn_to_the_parent(bus: Driver) -> None:
    parent = await bus.open()
    seen = await bus.watch(parent)
    slow = await bus.say(parent, "KILLME devagar")
    await wait_for(lambda: seen.deltas, what="the parent's turn to stream")

    # The branch keeps the message whose answer is still being written.
    branch = await fork(bus, parent, seq_of(await bus.events(parent), slow), "outra pergunta")
    in_parent = await bus.outcome(parent, slow)
    await bus.outcome(branch.session_id, branch.message_event_id)
    await settled(bus.nc)

    assert in_parent.type is EventType.AGENT_RESPONSE and not in_parent.payload["stopped"]
    branch_log = await bus.events(branch.session_id)
    [copy] = [e for e in branch_log if e.copied_from == slow]
    assert not [e for e in branch_log if e.causation_id == copy.id]  # never answered here
    assert {
        e.causation_id for e in branch_log if e.type.domain == "agent" and not e.copied_from
    } == {branch.message_event_id}
    # The branch's model read the copy as a message not answered, then its own.
    prompt = asked(bus, branch.message_event_id).messages
    assert [m.content for m in prompt[-3:-1]] == [
        f"[message {copy.id}]\nKILLME devagar",
        "[This message has not been answered.]",
    ]
    branch_ids = {e.id for e in branch_log}
    assert not [e for e in await bus.events(parent) if e.causation_id in branch_ids]
