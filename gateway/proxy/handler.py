"""The proxy listener's driver: ``/{upstream}/{path}`` to the upstream's base URL + ``/{path}``.

``Gateway.handle`` drives one request's state machine (``gateway.fencing.request``): the
intake reads what the request line and headers say (``intake``), the machine names the
one step to perform next, a step here performs it (a read of the lease, a slot, the
body, the admission, a wait, the last look before the send, a release) and feeds back
what it found, until the machine answers with a verdict, which is carried out:
forwarded (``forwarding``) or answered by the gateway itself (``answers``). No rule is
decided here: every one is the machine's, the decision table's or ``fence``'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from gateway.config import Settings, UpstreamSettings
from gateway.fencing import fence
from gateway.fencing.decision import EXPECT_UNSUPPORTED, STORE_UNAVAILABLE, Outcome, Verdict
from gateway.fencing.request import Act, Next, RequestMachine
from gateway.observe.metrics import GatewayMetrics, StepTimer
from gateway.proxy import leases
from gateway.proxy.answers import Answers
from gateway.proxy.body import BodyTimeout, read_body, start_body_clock
from gateway.proxy.duplicates import Settles
from gateway.proxy.held import Behind, HeldKey, Releases
from gateway.proxy.intake import begin, outgoing_headers
from gateway.proxy.request import Incoming
from gateway.proxy.waits import gone, until_older_settled, until_settled
from gateway.records.store import GatewayStore, WriteRequest
from gateway.sources import Source
from gateway.upstream import s3
from gateway.upstream.forwarding import Forwarder, upstream_url
from lease_core import exceptions as lease_exc

log = logging.getLogger("fencegate.proxy")

# The lease check ``expect`` made before the client sent the body.
LEASE_CHECKED = web.RequestKey("lease_checked", fence.Admission)
# The request's state machine (``Preference-Applied`` reads its wait).
MACHINE = web.RequestKey("machine", RequestMachine)

Perform = Callable[[Incoming, RequestMachine], Awaitable[Next]]


class Driver:
    """The request path of the proxy's ``Gateway`` (``gateway.proxy.gateway``): its
    stores, slots and answers are the gateway's."""

    settings: Settings
    store: GatewayStore
    metrics: GatewayMetrics
    answers: Answers
    forwarder: Forwarder
    upstreams: dict[str, UpstreamSettings]
    resolving: bool
    sources: dict[str, Source]
    slots: dict[str, int]
    settles: Settles
    behind: Behind
    steps: dict[Act, Perform]
    timer: StepTimer
    draining: asyncio.Event  # the listener shuts down: waits end, answered "never sent"
    releases: Releases  # claims of writes never sent, given back (or owed)

    # -- the request path ---------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Perform the machine's steps (each timed: ``StepTimer``) until it answers, then
        carry out its verdict. The lease comes before a slot and a slot before the body:
        a request without a current lease is refused before its body is read and holds
        no slot while a slow client sends it (separate pools for fenced and unfenced)."""
        start_body_clock(request, self.settings.gateway)
        incoming, machine = self._begin(request)
        try:
            checked = request.get(LEASE_CHECKED)  # by ``expect``, before the body came
            if checked is not None:
                machine.lease_checked(checked)
            step = machine.next()
            while step.act is not Act.ANSWER:
                act, began = step.act, time.perf_counter()
                try:
                    step = await self.steps[act](incoming, machine)
                except BaseException:  # the database, a cancellation, a bug: never sent
                    await self.releases.release_unsent(machine, incoming.key)
                    raise
                self.timer.took(act, began, request, machine)
            assert step.verdict is not None
            return await self._carry_out(incoming, machine, step.verdict)
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
        incoming, machine = self._begin(request)
        if request.headers.get("Expect", "").lower() != "100-continue":
            return await self.answers.refuse(incoming, machine, EXPECT_UNSUPPORTED)
        machine.before_body()
        try:
            step = machine.next()
            while step.act is Act.CHECK_LEASE:
                step = await self._check_lease(incoming, machine)
            if step.verdict is not None and step.verdict.outcome is Outcome.REFUSE:
                return await self._carry_out(incoming, machine, step.verdict)
        except lease_exc.StoreUnavailable:
            return await self.answers.refuse(incoming, machine, STORE_UNAVAILABLE)
        if machine.admission is not None:
            request[LEASE_CHECKED] = machine.admission
        return None

    def _begin(self, request: web.Request) -> tuple[Incoming, RequestMachine]:
        settings = self.settings
        incoming, machine = begin(
            request, settings.gateway, self.upstreams, self.sources, settings.control_listen
        )
        machine.resolving = self.resolving
        request[MACHINE] = machine
        return incoming, machine

    # -- the steps: each performs its I/O and feeds back what it found ------------------

    async def _check_lease(self, incoming: Incoming, machine: RequestMachine) -> Next:
        machine.lease_seen(await leases.lease_now(self.store, incoming))
        return machine.next()

    async def _take_slot(self, incoming: Incoming, machine: RequestMachine) -> Next:
        """One of the pool's slots (fenced writes, unfenced requests), if one is free."""
        fenced = machine.facts.fenced
        pool = "fenced" if fenced else "unfenced"
        limits = self.settings.gateway
        limit = (
            limits.max_concurrent_requests if fenced else limits.max_concurrent_unfenced_requests
        )
        free = self.slots[pool] < limit
        if free:
            self.slots[pool] += 1
        machine.slot_taken(pool if free else None)
        return machine.next()

    def _free_slot(self, machine: RequestMachine) -> None:
        if machine.slot is not None:
            self.slots[machine.slot] -= 1
            machine.slot_given_back()

    async def _read(self, incoming: Incoming, machine: RequestMachine) -> Next:
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
            machine.body_late()
            return machine.next()
        fingerprint = digest.hexdigest() if digest is not None and body is not None else None
        machine.body_read(body, fingerprint)
        return machine.next()

    async def _admit(self, incoming: Incoming, machine: RequestMachine) -> Next:
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
            deadline_in=machine.admitting(),
            retry=upstream.unknown_outcome == "retry",
        )
        # A settle of this key going on here (its answer given): asked before the
        # admission, since once it is written the admission finds the answer stored.
        behind = self.behind.has_key(key)
        asked = time.monotonic()  # the claim's deadline runs from here
        admission = await leases.admit(self.store, incoming, write)
        machine.admitted(
            admission, asked=asked, answered=time.monotonic(), behind=behind, gone=gone(request)
        )
        return machine.next()

    async def _wait_for_first(self, incoming: Incoming, machine: RequestMachine) -> Next:
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
        machine.first_waited(settled, record)
        return machine.next()

    async def _wait_in_order(self, incoming: Incoming, machine: RequestMachine) -> Next:
        """Wait (bounded) for older generations' writes to the job."""
        seconds = self.settings.gateway.ordering_wait_seconds
        with self.metrics.waiting.labels("older").track_inprogress():
            settled = await until_older_settled(
                self.store, self.settles, machine.job_id, machine.generation, seconds, self.draining
            )
        return machine.older_waited(settled)

    async def _read_claim(self, incoming: Incoming, machine: RequestMachine) -> Next:
        """Right before the first byte goes out (nothing is awaited between this and the
        send): the claim and the job's fence, as the database sees them."""
        assert incoming.key is not None and machine.claim is not None
        claim = await self.store.claim(machine.job_id, incoming.key, machine.claim.attempt)
        machine.claim_seen(claim, time.monotonic())
        return machine.next()

    async def _release_step(self, incoming: Incoming, machine: RequestMachine) -> Next:
        assert incoming.key is not None
        await self.releases.release(machine, incoming.key)
        return machine.next()

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
        machine.forwarding()
        headers = outgoing_headers(incoming, machine, fenced=fenced)
        url = upstream_url(upstream, incoming.rest, incoming.query)
        machine.forwarded = headers.copy()  # as kept for a re-send: unsigned
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
            max_replay_body_bytes=self.settings.gateway.max_replay_body_bytes,
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
