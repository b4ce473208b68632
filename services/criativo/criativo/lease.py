"""One place at a time per session, across replicas: a lease in NATS KV.

Every replica pulls from one shared durable consumer, so two messages of a session
can land on two replicas. Before a turn, the actor takes the session's lease: a KV
key created only if absent (`kv.create`, compare-and-set on the last revision), that
expires with the bucket's TTL unless renewed, so a replica that dies holding it
frees it within one TTL. The holder renews it while the turn runs and deletes it
(with its revision, so never someone else's) when done. A replica that finds the
key taken waits for it; the caller keeps its message in progress meanwhile.

Taking the lease is on the path of every turn's first token, so it is one round trip:
a replica remembers the revision of the delete marker it left when it released a
session, and takes the session again by updating from that revision. A key someone
else wrote since (or that expired) no longer matches, and the lease is taken as
above (`kv.create` reads the marker and writes behind it: three round trips).

Either of two takings also tells the holder that no other replica can have held the
session lately (`hold` yields True, "alone"): resuming from this replica's own release
(the key untouched since, so nobody held it in between), and a first taking, a create
the bucket accepts as the key's first write (no lease, no release marker: no holder
within the bucket's TTL, which ages out markers as it does leases). So the first input
of a session is taken in one round trip too, and its log read may go out beside it.

A replica that dies holding a lease leaves it behind, and the session's input cannot
run anywhere until it is freed. The TTL frees it, but a person would wait it out. So the
lease names the process that holds it (`criativo.presence`), and a replica that finds a
session taken asks that process whether it is still there: one that is gone (NATS finds
nobody listening for it, twice, a reconnect apart) has its lease taken over at once, by
a compare-and-set on the revision that was read, so a holder that renewed meanwhile
keeps it. A holder that is alive, however slow, is waited for as before.

If renewing fails (the TTL ran out during a stall, or the holder was cut off from NATS
long enough to be taken for gone, and another replica took over), the turn goes on: the
log's idempotency keys still keep one response per message, metering runs a turn id
once, and the loss is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from uuid import UUID

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from contracts import streams
from criativo.presence import Presence
from servicekit.bus import Bucket
from servicekit.logs import get_logger
from servicekit.patience import is_unavailable

log = get_logger(__name__)

BUCKET = streams.LEASES.name
RETRY_SECONDS = 0.02
# How soon a renewal or release JetStream did not answer is tried again, and how many
# times a release is.
RENEW_RETRY_SECONDS = 0.5
RELEASE_ATTEMPTS = 5
# Sessions whose release this replica remembers (the most recent ones).
REMEMBERED_RELEASES = 10_000
# How often a replica waiting for a session asks whether its holder is still there (a
# read of the key and a request): once at the first refusal, then while it waits.
ASK_HOLDER_EVERY_SECONDS = 1.0


async def open_leases(nc: Client, js: JetStreamContext, instance: str) -> SessionLeases:
    """This process's leases, in the bucket `agentbus provision` made (its TTL is the
    bucket's), answering for its presence on `nc`; `BucketNotProvisioned` when there is
    no bucket."""
    bucket = await Bucket.open(js, BUCKET)
    return SessionLeases(bucket, await Presence.started(nc, instance))


class SessionLeases:
    """Leases on sessions, held by this process, in `bucket` (`open_leases`)."""

    def __init__(self, bucket: Bucket, presence: Presence) -> None:
        self._bucket = bucket
        self._presence = presence
        # By session key: the revision of the delete marker this replica's release left.
        self._released: dict[str, int] = {}

    @property
    def holder(self) -> bytes:
        """What this process writes in the leases it takes: its instance and its id."""
        return self._presence.holder

    @contextlib.asynccontextmanager
    async def hold(self, session_id: UUID) -> AsyncIterator[bool]:
        """Hold the session's lease for the block; waits while another replica holds it.

        Yields whether this replica has the session alone: resumed from its own release,
        or taken where the key had no trace; no other holder since the block was asked
        for, nor within the TTL before."""
        key = str(session_id)
        revision, alone = await self._acquire(key)
        state = {"revision": revision}
        done = asyncio.Event()
        renewer = asyncio.create_task(self._renew(key, state, done))
        try:
            yield alone
        finally:
            # Told to stop, not cancelled: a cancel that lands as a renewal's ack arrives
            # can be swallowed (asyncio.wait_for before Python 3.12, inside nats-py's
            # request), leaving a renewer that never ends and a `hold` that never
            # returns; and a renewal cut short leaves a stale revision to delete with.
            # Either leaves a session stuck for good.
            done.set()
            try:
                await renewer
            except asyncio.CancelledError:  # we are being stopped: so is the renewer
                renewer.cancel()
                raise
            await self._release_soon(key, state["revision"])

    async def _release_soon(self, key: str, revision: int) -> None:
        """Release, asking again while JetStream does not answer (a node just died): a
        lease left behind holds the session's next input until it expires (the TTL).

        A renewal or a release JetStream wrote but left unanswered moves the key past
        `revision`: a key gone is released already, and a key in this replica's name is
        released at the revision it has."""
        refused: BadRequestError | None = None
        for attempt in range(1, RELEASE_ATTEMPTS + 1):
            try:
                await self._release(key, revision)
                return
            except BadRequestError as exc:  # the key is not at `revision` any more
                refused = exc
                entry = await self._entry(key)
                if entry is None:
                    log.info("lease_release_found_applied", session_id=key)
                    return
                if entry.value != self.holder or entry.revision is None:
                    log.warning("lease_release_failed", session_id=key, error=repr(exc))
                    return  # taken since: not ours to delete
                revision = entry.revision
                # Still ours, yet refused: writes of ours are still landing (seen just
                # after a cluster regained quorum, under load). Let the key settle.
                await asyncio.sleep(RETRY_SECONDS * 2**attempt)  # 0.04, 0.08 … 0.64 s
            except Exception as exc:
                if not is_unavailable(exc) or attempt == RELEASE_ATTEMPTS:
                    log.warning("lease_release_failed", session_id=key, error=repr(exc))
                    return
                await asyncio.sleep(RENEW_RETRY_SECONDS)
        # The leader still shows the key in this replica's name, yet refused every delete
        # conditioned on its revision. Seen on the 3-node test cluster just after it
        # regained quorum: `err_code=10164 'wrong last sequence'`, nats-server's answer
        # while it holds an earlier compare-and-set of the subject in flight (a renewal
        # proposed during the outage), for longer than these attempts. Only this replica
        # writes its name, and no other can take the key while it is there (a create
        # needs it absent, a take-over its holder gone, and this one is answering), so
        # the lease is still ours: delete it unconditionally rather than leave the
        # session's next input waiting for the TTL.
        try:
            await self._release(key, None)
        except Exception as exc:
            log.warning(
                "lease_release_failed",
                session_id=key,
                error=repr(exc),
                last_refusal=str(refused),  # code, err_code, description (repr has none)
                revision=revision,
            )
            return
        log.info(
            "lease_released_unconditionally",
            session_id=key,
            last_refusal=str(refused),
            revision=revision,
        )

    async def _entry(self, key: str) -> KeyValue.Entry | None:
        """The key as the bucket's leader has it now, what a refused write was checked
        against (`Bucket.latest`); None when it is absent, deleted or expired."""
        return await self._bucket.latest(key)

    async def _release(self, key: str, revision: int | None) -> None:
        """Delete the key if it is still at our `revision` (what `kv.delete(key, last=…)`
        writes; None: whatever it is at), remembering the marker's revision, which
        `kv.delete` does not return."""
        marker = await self._bucket.delete(key, last=revision)
        self._released.pop(key, None)
        self._released[key] = marker
        if len(self._released) > REMEMBERED_RELEASES:
            del self._released[next(iter(self._released))]

    async def _acquire(self, key: str) -> tuple[int, bool]:
        """The lease's revision, and whether it was taken alone: resumed from our own
        release, or the key's first write in the bucket (`hold`)."""
        released = self._released.pop(key, None)
        if released is not None:
            with contextlib.suppress(KeyWrongLastSequenceError):  # written since: as below
                return await self._bucket.update(key, self.holder, last=released), True
        # Revision 0: the subject holds no message at all, neither a lease nor a release.
        with contextlib.suppress(KeyWrongLastSequenceError):  # it has one: as below
            return await self._bucket.update(key, self.holder, last=0), True
        asked = -ASK_HOLDER_EVERY_SECONDS  # when the holder was last asked whether it lives
        while True:
            try:
                return await self._bucket.create(key, self.holder), False
            except KeyWrongLastSequenceError:
                # Held elsewhere: until released or expired, or its holder is gone.
                if time.monotonic() - asked >= ASK_HOLDER_EVERY_SECONDS:
                    asked = time.monotonic()
                    taken = await self._take_from_the_gone(key)
                    if taken is not None:
                        return taken, False
                await asyncio.sleep(RETRY_SECONDS)
            except KeyNotFoundError:
                # nats-py's `create` reads the key back after a refused create, to tell a
                # live lease from a delete marker. On an R3 bucket that read may be served
                # by a replica that is behind, or the lease was released (its marker aged
                # out) in between: not found. Either way, try again: otherwise the input
                # fails and waits out the consumer's backoff, minutes.
                await asyncio.sleep(RETRY_SECONDS)

    async def _take_from_the_gone(self, key: str) -> int | None:
        """The lease's revision once taken over from a holder that is gone; None while the
        holder lives (or cannot be told gone), or when the key moved since it was read (a
        renewal: the holder lives; a release or another taker: the loop tries again)."""
        entry = await self._entry(key)
        if entry is None or entry.revision is None or entry.value in (None, self.holder):
            return None
        if not await self._presence.gone(entry.value):
            return None
        try:
            revision = await self._bucket.update(key, self.holder, last=entry.revision)
        except KeyWrongLastSequenceError:
            return None
        log.warning("lease_taken_over", session_id=key, holder=entry.value.decode(errors="replace"))
        return revision

    async def _renewed(self, key: str, revision: int) -> int:
        """The lease's revision once renewed from `revision`. A renewal whose write landed
        but whose answer was lost (a node restarting, a timeout under load) leaves the key
        past `revision` in this replica's name, which only this replica writes: still its
        lease, at the key's revision. Anyone else's name, or no key, is a lease lost."""
        try:
            return await self._bucket.update(key, self.holder, last=revision)
        except KeyWrongLastSequenceError:
            entry = await self._entry(key)
            if entry is None or entry.value != self.holder or entry.revision is None:
                raise
            if entry.revision == revision:
                # Refused, yet the key is where this replica left it: nats-server holds an
                # earlier compare-and-set of it in flight (err_code 10164, seen after a
                # cluster regained quorum; see `_release_soon`). Taking the revision as
                # renewed would write nothing, and the TTL would run out under the turn.
                # No other replica writes the key while it is there and this one answers
                # for itself (`_take_from_the_gone`): renew it as is.
                renewed = await self._bucket.put(key, self.holder)
                log.info("lease_renewed_unconditionally", session_id=key, revision=renewed)
                return renewed
            log.info("lease_renewal_found_applied", session_id=key, revision=entry.revision)
            return entry.revision

    async def _renew(self, key: str, state: dict[str, int], done: asyncio.Event) -> None:
        wait = self._bucket.ttl / 3
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), wait)
                return
            try:
                state["revision"] = await self._renewed(key, state["revision"])
            except Exception as exc:
                # A cluster node down (no stream response, a 503, a timeout) is not a lease
                # taken: ask again soon, while the lease still has time to live. Giving up
                # there would let the lease expire under a running turn, free for another
                # replica.
                if is_unavailable(exc):
                    log.warning("lease_renewal_unavailable", session_id=key, error=repr(exc))
                    wait = RENEW_RETRY_SECONDS
                    continue
                log.error("lease_lost", session_id=key, error=repr(exc))
                return
            if wait != self._bucket.ttl / 3:  # back after an outage
                log.info("lease_renewed", session_id=key, revision=state["revision"])
            wait = self._bucket.ttl / 3
