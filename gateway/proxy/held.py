"""The idempotency key a forwarded write holds (``forwarding.EndOfExchange``): how the
exchange ended becomes the key's record in the store (settled, released, or held as an
unknown outcome with the request kept for the resolver's re-send), and duplicates that
wait on this replica are woken. ``Behind``: the settles of answers already given."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from gateway.config import GatewaySettings
from gateway.fencing import fence
from gateway.fencing.after_forward import Ended, Fate
from gateway.fencing.decision import Verdict
from gateway.fencing.fence import Admission, Record, RecordState, UnknownOutcome
from gateway.fencing.machine import RequestMachine
from gateway.observe.metrics import SETTLE, GatewayMetrics
from gateway.proxy.incoming import Incoming
from gateway.proxy.resolve import kept_request
from gateway.records.store import GatewayStore, KeptRequest
from gateway.upstream import s3
from gateway.upstream.forwarding import KeptAnswer, settle_quietly
from lease_core import exceptions as lease_exc

log = logging.getLogger("fencegate.proxy")

# How often the claims owed a release (``Owed``) are tried again.
OWED_INTERVAL_SECONDS = 0.5


class Behind:
    """The settles of this replica whose answers have gone out (or are going): a final
    answer is stored behind it, so the client does not wait for the database. A
    duplicate of such a key that this replica admits meanwhile finds it in flight, and
    waits for its settle instead of being told ``request-in-progress``
    (``RequestMachine._may_wait``). Shutdown waits for every one (``flush``). At most ``limit``
    at once: past it the database is not keeping up, and an answer waits for its own
    record again, so the settles waiting cannot grow without bound. A limit of 0 is
    ``gateway.settle_before_answer``: every answer waits for its record."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._tasks: set[asyncio.Future[bool]] = set()
        self._keys: Counter[str] = Counter()  # asked by key alone: before the job is known

    def start(self, key: str, settling: Coroutine[Any, Any, None]) -> None:
        """``settling`` in a task of its own: nothing cancels it (shutdown waits for it,
        ``flush``), so it needs no shield."""
        task = asyncio.ensure_future(settle_quietly(settling, shielded=False))
        self._tasks.add(task)
        self._keys[key] += 1

        def done(_: asyncio.Future[bool]) -> None:
            self._tasks.discard(task)
            self._keys[key] -= 1
            if self._keys[key] <= 0:
                del self._keys[key]

        task.add_done_callback(done)

    @classmethod
    def of(cls, limits: GatewaySettings) -> Behind:
        """None behind with ``settle_before_answer``; else ``max_concurrent_requests``."""
        return cls(0 if limits.settle_before_answer else limits.max_concurrent_requests)

    def full(self) -> bool:
        return len(self._tasks) >= self.limit

    def has_key(self, key: str) -> bool:
        """A settle of ``key`` (of any job: a key's job is known only once admitted) is
        still being written here."""
        return key in self._keys

    async def flush(self) -> None:
        """Until every settle begun is written (or has failed, logged)."""
        while self._tasks:
            await asyncio.gather(*self._tasks)


class Releases:
    """Claims of writes that were never sent (or "not processed"), given back. When the
    database cannot take a release (it is unavailable), the claim is owed: ``pay``
    (every ``OWED_INTERVAL_SECONDS``, one of the control app's background loops) gives
    it back once the database answers again, instead of leaving a write that never left
    to turn into an unknown outcome at its deadline. A release is conditional on the
    claim's attempt, so paying one that another request has since taken over changes
    nothing. At most ``limit`` are owed: past it the oldest is dropped with a warning
    (it turns unknown at its deadline, as it would have without this)."""

    def __init__(self, store: GatewayStore, notify: Callable[[str, str], None], limit: int) -> None:
        self._store, self._notify, self.limit = store, notify, limit
        self._owed: dict[tuple[str, str, str], Record | None] = {}
        # Admissions whose request was cancelled while they ran, and the releases of
        # what they claimed: shutdown waits for them (``finish``).
        self._orphans: set[asyncio.Future[Any]] = set()

    async def admit(self, admitting: Awaitable[Admission | None], key: str) -> Admission | None:
        """The admission's answer. A cancellation of the request while the admission
        is in the database (a shutdown past its grace, a client gone) does not stop it:
        its statement may commit all the same (SQLite's thread waiting for another
        process's lock, a commit on its way to PostgreSQL), and a claim nobody knows of
        would turn into an unknown outcome for a write that was never sent. It runs to
        its end, and what it claimed is given back (or owed)."""
        task = asyncio.ensure_future(admitting)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._orphans.add(task)
            task.add_done_callback(lambda done: self._orphaned(done, key))
            raise

    def _orphaned(self, task: asyncio.Future[Admission | None], key: str) -> None:
        """An admission whose request is gone has ended: its claim, if it made one,
        given back."""
        self._orphans.discard(task)
        if task.cancelled() or task.exception() is not None:
            return  # nothing committed, or nothing known: as any failed admission
        admission = task.result()
        if admission is None or admission.attempt is None or admission.presented is None:
            return
        job_id, attempt, back_to = admission.presented.job_id, admission.attempt, admission.back_to
        release = asyncio.ensure_future(self._give_back_orphan(job_id, key, attempt, back_to))
        self._orphans.add(release)
        release.add_done_callback(self._orphans.discard)

    async def _give_back_orphan(
        self, job_id: str, key: str, attempt: str, back_to: Record | None
    ) -> None:
        try:
            await self._give_back(job_id, key, attempt, back_to)
        except Exception:
            log.exception("a claim not sent could not be released")
        else:
            log.info("gave back the claim of a request cancelled during its admission")

    @property
    def orphans(self) -> int:
        """Admissions of cancelled requests still running, and releases of their claims."""
        return len(self._orphans)

    async def finish(self) -> None:
        """Until every admission of a cancelled request has ended and its claim been
        given back (or owed)."""
        while self._orphans:
            await asyncio.gather(*self._orphans, return_exceptions=True)

    async def release(self, machine: RequestMachine, key: str) -> None:
        """The machine's claim given back now, or owed; either way the request goes on
        to its answer (it was never sent). The machine is told by its driver
        (``Released``), where the machine asked for the release."""
        claim = machine.claim
        assert claim is not None
        await self._give_back(machine.job_id, key, claim.attempt, claim.back_to)

    async def _give_back(self, job_id: str, key: str, attempt: str, back_to: Record | None) -> None:
        try:
            await self._store.release(job_id, key, attempt, back_to)
        except lease_exc.StoreUnavailable:
            log.warning("the database is unavailable: a claim not sent is owed its release")
            self._owe(job_id, key, attempt, back_to)
        else:
            self._notify(job_id, key)

    async def release_unsent(self, machine: RequestMachine, key: str | None) -> None:
        """Whatever ended the request before its forward (the database, a cancellation
        at shutdown, a bug): a claim it holds is given back. Shielded: a cancellation
        does not stop the release half-way."""
        if not machine.unsent_claim or key is None:
            return
        try:
            await asyncio.shield(self.release(machine, key))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("a claim not sent could not be released")

    def _owe(self, job_id: str, key: str, attempt: str, back_to: Record | None) -> None:
        if len(self._owed) >= self.limit:
            dropped = next(iter(self._owed))
            del self._owed[dropped]
            log.warning(
                "more than %d unsent claims owed a release: the oldest (job %s) is left "
                "to turn unknown at its deadline",
                self.limit,
                dropped[0],
            )
        self._owed[(job_id, key, attempt)] = back_to

    @property
    def owed(self) -> int:
        return len(self._owed)

    async def pay(self) -> int:
        """Give back every claim owed, oldest first, until the database fails again
        (``StoreUnavailable`` propagates: the loop tries again next round). How many."""
        paid = 0
        for ident, back_to in list(self._owed.items()):
            job_id, key, attempt = ident
            await self._store.release(job_id, key, attempt, back_to)
            self._owed.pop(ident, None)
            self._notify(job_id, key)
            paid += 1
        if paid:
            log.info("gave back %d unsent claim(s) once the database answered again", paid)
        return paid


class HeldKey:
    """A forward's end of the exchange (``forwarding.EndOfExchange``): the request's
    machine decides what the way the exchange ended does to the key it claimed
    (``after_forward.FATES``); this performs it (release, keep the answer behind it, hold
    it unknown), guarded so that a database failure changes nothing of what the worker
    is told, and feeds back whether the database took it. Also for a pass-through (no
    key: nothing to perform). Ids taken when the forward begins."""

    __slots__ = (
        "_attempt",
        "_behind",
        "_incoming",
        "_job_id",
        "_key",
        "_machine",
        "_max_replay_body_bytes",
        "_refuse",
        "_releases",
        "_settled",
        "_store",
    )

    def __init__(
        self,
        store: GatewayStore,
        incoming: Incoming,
        machine: RequestMachine,
        *,
        releases: Releases,
        refuse: Callable[[Verdict], Awaitable[web.StreamResponse]],
        settled: Callable[[str, str], None],
        behind: Behind,
        max_replay_body_bytes: int,
    ) -> None:
        presented = machine.admission.presented if machine.admission else None
        self._store, self._incoming, self._machine = store, incoming, machine
        self._releases, self._refuse = releases, refuse
        self._settled, self._behind = settled, behind
        self._max_replay_body_bytes = max_replay_body_bytes
        self._job_id = presented.job_id if presented else ""
        self._key = incoming.key or ""
        self._attempt = machine.claim.attempt if machine.claim is not None else ""

    async def ended(self, ended: Ended, answer: KeptAnswer | None = None) -> None:
        fate = self._machine.exchange_ended(ended)
        if fate is None:
            return
        answer = answer or KeptAnswer()
        if fate is Fate.KEEP and not self._behind.full():
            # The common end, a final answer stored behind it: begun here and now, with
            # no await before it, so a cancellation cannot stop it half-way either.
            self._behind.start(self._key, self._keep(answer))
            self._machine.fate_performed(True)
            return
        kept = await settle_quietly(self._perform(fate, answer))
        self._machine.fate_performed(kept)

    async def refusal(self) -> web.StreamResponse:
        return await self._refuse(self._machine.answer_after())

    async def _perform(self, fate: Fate, answer: KeptAnswer) -> None:
        if fate is Fate.RELEASE:
            await self._releases.release(self._machine, self._key)
        elif fate is Fate.HOLD_UNKNOWN:
            await self._settle(RecordState.UNKNOWN, answer)
        else:  # kept before the answer: as configured, or the database is behind (``ended``)
            await self._keep(answer)

    def _keep(self, answer: KeptAnswer) -> Coroutine[Any, Any, None]:
        return self._settle(RecordState.COMPLETED, answer._replace(note=None))

    async def _settle(self, state: RecordState, answer: KeptAnswer) -> None:
        began = time.perf_counter()
        status, headers, body, note = answer
        kept = self._kept() if state is RecordState.UNKNOWN else None
        if kept is not None:
            await self._store.hold_for_resolution(
                self._job_id,
                self._key,
                self._attempt,
                status=status,
                headers=headers,
                body=body,
                note=note,
                request=kept,
            )
        else:
            await self._store.settle(
                self._job_id,
                self._key,
                self._attempt,
                state=state,
                status=status,
                headers=headers,
                body=body,
                note=note,
            )
        metrics = GatewayMetrics.of(self._store.backend.metrics.registry)
        metrics.phase[SETTLE].observe(time.perf_counter() - began)
        self._settled(self._job_id, self._key)

    def _kept(self) -> KeptRequest | None:
        """The request to keep for a re-send by the gateway: only for an upstream that
        resolves unknown outcomes, a write with a key, and a body within
        ``gateway.max_replay_body_bytes`` (a larger one goes to the operator)."""
        incoming, machine = self._incoming, self._machine
        upstream = incoming.upstream
        if (
            upstream is None
            or upstream.unknown_outcome != UnknownOutcome.RESOLVE
            or fence.is_anonymous(self._key)
            or machine.forwarded is None
            or machine.body is None
        ):
            return None
        if upstream.signing is not None and not s3.is_object_write(
            incoming.request.method, incoming.rest, incoming.query
        ):
            return None  # S3: only an object write can be checked by its metadata
        with machine.body.getbuffer() as view:
            size = view.nbytes
        if size > self._max_replay_body_bytes:
            return None
        return kept_request(machine.forwarded, upstream, incoming.query, machine.body.getvalue())
