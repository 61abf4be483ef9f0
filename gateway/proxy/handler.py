"""The proxy listener's driver: ``/{upstream}/{path}`` to the upstream's base URL + ``/{path}``.

``Driver.handle`` drives one request's state machine (``gateway.fencing.machine``): the
intake reads what the request line and headers say (``intake``), the machine names the
one act to perform next, an act here performs it (a read of the lease, a slot, the
body, the admission, a wait, the last look before the send, a release) and its event is
fed back, until the machine answers with a verdict, which is carried out:
forwarded (``forwarding``) or answered by the gateway itself (``answers``). No rule is
decided here: every one is the machine's, the decision table's or ``fence``'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from gateway.config import GatewaySettings, UpstreamSettings
from gateway.fencing import events, fence
from gateway.fencing.decision import EXPECT_UNSUPPORTED, STORE_UNAVAILABLE, Act, Outcome, Verdict
from gateway.fencing.fence import UnknownOutcome
from gateway.fencing.machine import RequestMachine
from gateway.observe.metrics import GatewayMetrics, StepTimer
from gateway.proxy import leases
from gateway.proxy.answers import Answers
from gateway.proxy.body import BodyTimeout, read_body, start_body_clock
from gateway.proxy.duplicates import Settles
from gateway.proxy.held import Behind, HeldKey, Releases
from gateway.proxy.incoming import Incoming
from gateway.proxy.intake import begin, outgoing_headers
from gateway.proxy.waits import gone, until_older_settled, until_settled
from gateway.records.store import GatewayStore, WriteRequest
from gateway.sources import Source
from gateway.upstream import s3
from gateway.upstream.forwarding import Forwarder, upstream_url
from lease_core import exceptions as lease_exc

log = logging.getLogger("fencegate.proxy")

# The request's state machine (``Preference-Applied`` reads its wait), and what its line
# and headers said: made once, by ``expect`` when the request has ``Expect``, else by
# ``handle``.
MACHINE = web.RequestKey("machine", RequestMachine)
INCOMING = web.RequestKey("incoming", Incoming)

# An act performed: the event that says what it found.
Perform = Callable[[Incoming, RequestMachine], Awaitable[events.Event]]


@dataclass(eq=False)
class Driver:
    """The proxy's request path: the gateway (``gateway.proxy.gateway``) makes it with
    what it shares (its stores, answers, forwarder, waits and claims owed a release);
    the slots, the acts and their timer are the driver's own."""

    settings: GatewaySettings
    control_listen: str | None  # named to a lease call sent to the proxy by mistake
    store: GatewayStore
    metrics: GatewayMetrics
    answers: Answers
    forwarder: Forwarder
    sources: dict[str, Source]
    settles: Settles  # duplicates waiting for a key this replica may settle
    behind: Behind  # final answers given, their records still being settled
    draining: asyncio.Event  # the listener shuts down: waits end, answered "never sent"
    releases: Releases  # claims of writes never sent, given back (or owed)
    upstreams: dict[str, UpstreamSettings] = field(default_factory=dict)  # ``route``
    resolving: bool = False  # some upstream's unknown outcomes are the gateway's to resolve
    # Slots in use per pool: fenced writes past the lease check (up to
    # max_concurrent_requests) and unfenced requests (max_concurrent_unfenced_requests).
    slots: dict[str, int] = field(default_factory=lambda: {"fenced": 0, "unfenced": 0})
    acts: dict[Act, Perform] = field(init=False)  # the act the machine asks for: who does it
    timer: StepTimer = field(init=False)  # each act of a fenced write timed

    def __post_init__(self) -> None:
        self.acts = {
            Act.CHECK_LEASE: self._check_lease,
            Act.TAKE_SLOT: self._take_slot,
            Act.READ_BODY: self._read_body,
            Act.ADMIT: self._admit,
            Act.WAIT_FIRST: self._wait_first,
            Act.WAIT_OLDER: self._wait_older,
            Act.READ_CLAIM: self._read_claim,
            Act.RELEASE: self._release,
        }
        self.timer = StepTimer(self.metrics, per_request=self.settings.server_timing)

    def route(self, upstreams: dict[str, UpstreamSettings]) -> None:
        """The upstreams requests go to (at start, and at a reload)."""
        self.upstreams = upstreams
        self.resolving = any(
            u.unknown_outcome == UnknownOutcome.RESOLVE for u in upstreams.values()
        )

    # -- the request path ---------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Perform the acts the machine asks for (each timed: ``StepTimer``) until it
        answers, then carry out its verdict. The lease comes before a slot and a slot
        before the body: a request without a current lease is refused before its body is
        read and holds no slot while a slow client sends it (separate pools for fenced
        and unfenced)."""
        start_body_clock(request, self.settings)
        incoming, machine = request.get(INCOMING), request.get(MACHINE)
        if incoming is None or machine is None:
            incoming, machine = self._begin(request)
        else:  # ``expect`` judged the lease before the body came
            machine.body_coming()
        try:
            step = machine.next()
            while isinstance(step, Act):
                began = time.perf_counter()
                try:
                    event = await self.acts[step](incoming, machine)
                except BaseException:  # the database, a cancellation, a bug: never sent
                    await self.releases.release_unsent(machine, incoming.key)
                    raise
                self.timer.took(step, began, request, machine)
                step = machine.feed(event)
            return await self._carry_out(incoming, machine, step)
        except web.HTTPException:
            raise
        except Exception as error:  # store-unavailable before the send, else internal-error
            if not isinstance(error, lease_exc.StoreUnavailable):
                log.exception("the request failed unexpectedly")
            return await self.answers.refuse(incoming, machine, machine.failed())
        finally:
            self._free_slot(machine)

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: every refusal that needs no body (a stale token, a
        declared length over the limit) is given before the client sends the body, with
        ``Connection: close`` (RFC 9110 10.1.1): a client that got it never sends the
        body, and its next request on that connection must not be read as the body."""
        refusal = await self._refuse_before_body(request)
        if refusal is not None:
            refusal.force_close()
            return refusal
        if request.version >= aiohttp.HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    async def _refuse_before_body(self, request: web.Request) -> web.StreamResponse | None:
        """The machine ``handle`` goes on with (the intake is not run twice), its lease
        looked at; or the refusal."""
        incoming, machine = self._begin(request)
        if request.headers.get("Expect", "").lower() != "100-continue":
            return await self.answers.refuse(incoming, machine, EXPECT_UNSUPPORTED)
        machine.before_body()
        try:
            step = machine.next()
            while step is Act.CHECK_LEASE:
                step = machine.feed(await self._check_lease(incoming, machine))
            if isinstance(step, Verdict) and step.outcome is Outcome.REFUSE:
                return await self._carry_out(incoming, machine, step)
        except lease_exc.StoreUnavailable:
            return await self.answers.refuse(incoming, machine, STORE_UNAVAILABLE)
        request[INCOMING] = incoming
        return None

    def _begin(self, request: web.Request) -> tuple[Incoming, RequestMachine]:
        incoming, machine = begin(
            request, self.settings, self.upstreams, self.sources, self.control_listen,
            resolving=self.resolving,
        )  # fmt: skip
        request[MACHINE] = machine
        return incoming, machine

    # -- the acts: each performs its I/O and says what it found --------------------------

    async def _check_lease(self, incoming: Incoming, machine: RequestMachine) -> events.LeaseSeen:
        return events.LeaseSeen(await leases.lease_now(self.store, incoming))

    async def _take_slot(self, incoming: Incoming, machine: RequestMachine) -> events.SlotTaken:
        """One of the pool's slots (fenced writes, unfenced requests), if one is free."""
        fenced = machine.facts.fenced
        pool = "fenced" if fenced else "unfenced"
        limits = self.settings
        limit = (
            limits.max_concurrent_requests if fenced else limits.max_concurrent_unfenced_requests
        )
        if self.slots[pool] >= limit:
            return events.SlotTaken(None)
        self.slots[pool] += 1
        return events.SlotTaken(pool)

    def _free_slot(self, machine: RequestMachine) -> None:
        if machine.slot is not None:
            self.slots[machine.slot] -= 1
            machine.slot_given_back()

    async def _read_body(self, incoming: Incoming, machine: RequestMachine) -> events.Event:
        """The body, hashed into the fingerprint as it arrives (fenced writes)."""
        upstream = incoming.upstream
        assert upstream is not None
        digest = None
        if machine.facts.fenced:
            digest = fence.fingerprint_hasher(
                incoming.method, upstream.name, incoming.rest, incoming.query
            )
        try:
            body = await read_body(incoming.request, upstream, digest)
        except BodyTimeout:
            return events.BODY_LATE
        fingerprint = digest.hexdigest() if digest is not None and body is not None else None
        return events.BodyRead(body, fingerprint)

    async def _admit(self, incoming: Incoming, machine: RequestMachine) -> events.Admitted:
        """In one transaction: the lease, the fence, the key (claimed, taken over, or
        its record read) and whether an older generation's write is in flight."""
        upstream, request, key = incoming.upstream, incoming.request, incoming.key
        assert upstream is not None and key is not None and machine.fingerprint is not None
        write = WriteRequest(
            token_hash=incoming.token_hash,
            key=key,
            fingerprint=machine.fingerprint,
            upstream=upstream.name,
            method=request.method,
            path=incoming.rest,
            deadline_in=machine.claim_seconds,
            retry=upstream.unknown_outcome == UnknownOutcome.RETRY,
        )
        # A settle of this key going on here (its answer given): asked before the
        # admission, since once it is written the admission finds the answer stored.
        behind = self.behind.has_key(key)
        asked = time.monotonic()  # the claim's deadline runs from here
        admission = await self.releases.admit(leases.admit(self.store, incoming, write), key)
        return events.Admitted(
            admission, asked, time.monotonic(), behind=behind, gone=gone(request)
        )

    async def _wait_first(self, incoming: Incoming, machine: RequestMachine) -> events.FirstSettled:
        """``Prefer: wait``: wait (bounded) for the key's first attempt to settle,
        holding no slot and no database connection (each look at the record takes one
        for a moment). Ends early when the client goes away."""
        assert machine.wait is not None and incoming.key is not None
        self._free_slot(machine)
        with self.metrics.waiting.labels("first").track_inprogress():
            job_id, key, wait = machine.job_id, incoming.key, machine.wait
            settled, record = await until_settled(
                self.store, self.settles, incoming.request, job_id, key, wait, self.draining
            )
        return events.FirstSettled(settled, record)

    async def _wait_older(self, incoming: Incoming, machine: RequestMachine) -> events.OlderSettled:
        """Wait (bounded) for older generations' writes to the job."""
        seconds = self.settings.ordering_wait_seconds
        with self.metrics.waiting.labels("older").track_inprogress():
            settled = await until_older_settled(
                self.store, self.settles, machine.job_id, machine.generation, seconds, self.draining
            )
        return events.OlderSettled(settled)

    async def _read_claim(self, incoming: Incoming, machine: RequestMachine) -> events.ClaimSeen:
        """Right before the first byte goes out (nothing is awaited between this and the
        send): the claim and the job's fence, as the database sees them."""
        assert incoming.key is not None and machine.claim is not None
        claim = await self.store.claim(machine.job_id, incoming.key, machine.claim.attempt)
        return events.ClaimSeen(claim, time.monotonic())

    async def _release(self, incoming: Incoming, machine: RequestMachine) -> events.Event:
        assert incoming.key is not None
        await self.releases.release(machine, incoming.key)
        return events.RELEASED

    # -- carrying out the verdict ---------------------------------------------------------

    async def _carry_out(
        self, incoming: Incoming, machine: RequestMachine, verdict: Verdict
    ) -> web.StreamResponse:
        if verdict.outcome in (Outcome.FORWARD, Outcome.PASS):
            return await self._forward(incoming, machine, fenced=verdict.outcome is Outcome.FORWARD)
        if verdict.outcome is Outcome.REPLAY:
            return await self.answers.replay(incoming, machine, verdict)
        return await self.answers.refuse(incoming, machine, verdict)

    async def _forward(
        self, incoming: Incoming, machine: RequestMachine, *, fenced: bool
    ) -> web.StreamResponse:
        """Forward with the fencing headers (a fenced write) or without (a pass-through);
        a claimed key goes along, to be settled by how the exchange ends."""
        upstream = incoming.upstream
        assert upstream is not None and machine.body is not None
        headers = outgoing_headers(incoming, machine, fenced=fenced)
        url = upstream_url(upstream, incoming.rest, incoming.query)
        machine.forwarding(headers)
        if upstream.signing is not None:
            s3.sign(
                headers, incoming.request.method, url, machine.body.getvalue(), upstream.signing
            )
        end = HeldKey(
            self.store,
            incoming,
            machine,
            releases=self.releases,
            refuse=lambda verdict: self.answers.refuse(incoming, machine, verdict),
            settled=self.settles.notify,
            behind=self.behind,
            max_replay_body_bytes=self.settings.max_replay_body_bytes,
        )
        if fenced and incoming.source_name is not None:
            self.metrics.source_decisions.labels(incoming.source_name, "forwarded").inc()
        return await self.forwarder.forward(
            incoming.request,
            upstream,
            url,
            headers,
            machine.body,
            end=end,
            send_left=machine.send_left,
            decided_since=machine.started if machine.decided else None,
        )
