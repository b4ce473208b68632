"""Whether the Criativo process a session lease names is still there.

Every process answers on a subject of its own (`criativo.holder.<id>`), subscribed before
it takes any lease, and writes that id in each lease it takes. A replica waiting for a
session asks the holder. Any answer, or none in time, means it lives: a process stalled
or slow under load keeps its connection, and NATS its interest, so it is never taken for
gone. NATS answering "no responders" means no connection listens there any more: the
process was killed or has stopped (its socket closed, the server dropped its interest),
and the lease it left need not be waited out to its TTL.

A live process is without its subscriptions only while its connection to NATS is down
(its node died): it subscribes again first thing on reconnecting (nats-py), within a
fraction of a second. So the absence is asked again after `GRACE_SECONDS`, and only
twice absent is the holder gone.
"""

from __future__ import annotations

import asyncio
import uuid

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from contracts import subjects
from servicekit.client import listened
from servicekit.logs import get_logger

log = get_logger(__name__)

# Between the two "no responders" that make a holder gone: longer than a live process's
# reconnect to another NATS node (`servicekit.bus.connect`: the next server at once, the
# same one after 0.5 s), short beside the lease's TTL.
GRACE_SECONDS = 1.0
# How long a holder has to answer. No answer in time is a stalled process, not a gone one.
ASK_TIMEOUT_SECONDS = 1.0
# Between a holder's id and the instance it runs as, in a lease's value.
SEPARATOR = b"/"


class Presence:
    """This process's answer to "are you there?", and the question put to other holders."""

    def __init__(self, nc: Client, instance: str) -> None:
        self._nc = nc
        self._id = uuid.uuid4().hex  # this process's, never reused by a restart
        # What the leases this process takes hold: the instance for operators to read
        # (`nats kv get`), the id to ask.
        self.holder = instance.encode() + SEPARATOR + self._id.encode()
        self._sub: Subscription | None = None

    @classmethod
    async def started(cls, nc: Client, instance: str) -> Presence:
        """Answering on its subject (and the server told, so a holder asked right after
        is found): before any lease names it."""
        presence = cls(nc, instance)
        presence._sub = await nc.subscribe(subjects.holder_subject(presence._id), cb=_answer)
        await nc.flush()
        return presence

    async def gone(self, holder: bytes) -> bool:
        """Whether the process that wrote `holder` into a lease is gone: NATS found nobody
        listening on its subject twice, `GRACE_SECONDS` apart. A lease written without an
        id (by an older replica) is never taken for gone: its TTL frees it."""
        _, separator, holder_id = holder.rpartition(SEPARATOR)
        if not separator or not holder_id:
            return False
        subject = subjects.holder_subject(holder_id.decode(errors="replace"))
        for attempt in range(2):
            if attempt:
                await asyncio.sleep(GRACE_SECONDS)
            # Only "nobody listens" counts: no answer in time, or our own connection
            # down, is not known gone.
            if await listened(self._nc, subject, ASK_TIMEOUT_SECONDS) is not False:
                return False
        log.info("lease_holder_gone", holder=holder.decode(errors="replace"))
        return True


async def _answer(msg: Msg) -> None:
    if msg.reply:  # a question; anything else published there is no one's business
        await msg.respond(b"")
