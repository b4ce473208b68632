"""Issue 11 item 2: the psychologist spends money only on a closing the log confirms.

Forged `session.closed` events of a valid shape are published straight onto JetStream's
EVENTS subjects; they are acked and ignored (no analysis, no model call, no usage
billed), the service keeps answering, and a real closing after them is still analysed.
"""

from __future__ import annotations

import uuid

from contracts import subjects
from contracts.events import EventType
from contracts.psychologist import HypothesesReply, ListHypotheses
from psychologist.handlers import CONSUMER
from servicekit import provenance
from servicekit.client import call
from testkit.forgeries import forged_closing, forgeries_acked, publish_forged
from testkit.probes import wait_for

from .conftest import Driver


async def test_forged_closings_are_ignored_and_a_real_one_is_still_analysed(bus: Driver) -> None:
    s = await bus.session_with(3)  # still open
    opened = (await bus.events(s))[0]
    ignored = sum(provenance.FORGED_EVENTS.values())
    forgeries = [
        forged_closing(bus.project, s),  # the session is still open
        forged_closing(bus.project, uuid.uuid4()),  # no such session
        # a real event's id and session, retyped as a closing by another actor
        forged_closing(bus.project, s, id=opened.id, seq=1),
        forged_closing(bus.project, s, id=opened.id, seq=1, actor=opened.actor),
    ]

    for event in forgeries:
        await publish_forged(bus.nc, event)

    await wait_for(
        lambda: sum(provenance.FORGED_EVENTS.values()) >= ignored + len(forgeries),
        what="every forgery ignored",
    )
    await forgeries_acked(bus.nc, bus.db, CONSUMER, "psychologist")
    assert bus.provider.requests == []
    assert (await bus.usage()).total_calls == 0
    assert await bus.analyses(s) == []
    assert [e.type for e in await bus.events(s)] == [EventType.SESSION_OPENED] + [
        EventType.CHAT_MESSAGE
    ] * 3
    listed = await call(
        bus.nc, subjects.HYPOTHESES_LIST, ListHypotheses(project_id=bus.project), HypothesesReply
    )
    assert listed.groups == []  # and the service still answers

    await bus.close(s)

    completed = await bus.outcome(s)
    assert completed.type == EventType.ANALYSIS_COMPLETED
    assert len(await bus.analyses(s)) == 1
    assert bus.provider.requests != []
