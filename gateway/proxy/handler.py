"""The proxy listener: ``/{upstream}/{path}`` to the upstream's base URL + ``/{path}``.

``Gateway.handle`` is the loop: intake reads the facts the request carries
(``intake``), ``decision.decide`` names the next fact to find out or the verdict, the
steps here find facts out (the lease, a slot, the body, the admission: one transaction
before forwarding, a duplicate's wait for its first attempt (``Prefer: wait``), the wait
for older writes, the last judgement before the send), and the verdict is carried out:
forwarded (``forwarding``) or answered by the gateway itself (``answers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from gateway import sources
from gateway.config import Settings
from gateway.fencing import fence, profiles
from gateway.fencing.after_forward import answer_after
from gateway.fencing.decision import (
    EXPECT_UNSUPPORTED,
    STORE_UNAVAILABLE,
    UNKNOWN,
    Facts,
    Outcome,
    Step,
    Verdict,
    decide,
)
from gateway.fencing.fence import RecordState
from gateway.observe.logs import request_id_middleware
from gateway.observe.metrics import GatewayMetrics
from gateway.proxy.answers import Answers
from gateway.proxy.body import BodyTimeout, read_body, start_body_clock
from gateway.proxy.duplicates import POLL_MAX, DuplicateWait, Settles, prefer_wait
from gateway.proxy.intake import Ctx, forward_headers, intake
from gateway.proxy.resolve import Resolver, kept_request
from gateway.records.audit import Audit
from gateway.records.store import Admission, GatewayStore, KeptRequest, WriteRequest
from gateway.sources import ExternalLease
from gateway.upstream import s3
from gateway.upstream.forwarding import Forwarder, upstream_url
from lease_core import exceptions as lease_exc
from lease_core.store import LeaseStore

log = logging.getLogger("fencegate.proxy")

DEADLINE_MARGIN = 5.0
ORDERING_POLL = 0.02

# The lease check ``expect`` made before the client sent the body.
LEASE_CHECKED = web.RequestKey("lease_checked", Admission)
# The wait a fenced write asked for with ``Prefer: wait=N`` (capped), if any.
DUPLICATE_WAIT = web.RequestKey("duplicate_wait", DuplicateWait)


class Gateway:
    """The proxy's state: settings, stores, the slots, the forwarder (with the one
    client session) and the gateway's own answers."""

    def __init__(self, settings: Settings, lease_store: LeaseStore) -> None:
        self.settings = settings
        self.store = GatewayStore(lease_store)
        self.audit = Audit(lease_store, settings.gateway)
        self.metrics = GatewayMetrics.of(lease_store.metrics.registry)
        self.answers = Answers(self.audit, self.metrics, audit_bodies=settings.gateway.audit_bodies)
        self.forwarder = Forwarder(settings.gateway, self.metrics)
        self.upstreams = {u.name: u for u in settings.upstreams}
        # Unknown outcomes of upstreams with unknown_outcome = "resolve" (gateway.proxy.resolve),
        # re-sent by a background task of ``fencegate serve`` through this session.
        self.resolver = Resolver(
            settings.gateway,
            self.store,
            self.forwarder,
            self.audit,
            self.metrics,
            lambda: self.upstreams,
        )
        # Lease sources other than the gateway's own (``[[lease_sources]]``), by name.
        self.sources = sources.build(settings.lease_sources)
        # Slots in use per pool: fenced writes past the lease check (up to
        # max_concurrent_requests) and unfenced requests (max_concurrent_unfenced_requests).
        self.slots = {"fenced": 0, "unfenced": 0}
        # Duplicates waiting (``Prefer: wait``) for a key this replica may settle.
        self.settles = Settles()

    def reload(self, settings: Settings) -> None:
        """Take new upstreams (SIGHUP). Settings that need a restart are reported."""
        for key in (
            "database_url",
            "proxy_listen",
            "control_listen",
            "auth",
            "lease",
            "gateway",
            "lease_sources",
        ):
            if getattr(settings, key) != getattr(self.settings, key):
                log.warning("reload: %s changed; it takes effect after a restart", key)
        self.upstreams = {u.name: u for u in settings.upstreams}
        self.settings = self.settings.model_copy(update={"upstreams": settings.upstreams})
        log.info("reload: %d upstream(s): %s", len(self.upstreams), ", ".join(self.upstreams))

    async def start(self) -> None:
        await self.forwarder.start()
        for source in self.sources.values():
            await source.start()

    async def close(self) -> None:
        await self.forwarder.close()
        for source in self.sources.values():
            await source.close()

    # -- the request path ---------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Gather facts until the decision table answers, then carry out its verdict.
        The table asks for the lease before a slot and a slot before the body: a
        request without a current lease is refused before its body is read and never
        holds a slot while a slow client sends it. Fenced and unfenced requests have
        separate pools, and every body must arrive in time (``body.read_body``)."""
        ctx = Ctx(request)
        start_body_clock(request, self.settings.gateway)
        try:
            facts = self._intake(ctx)
            self._asked_wait(ctx, facts)
            checked = request.get(LEASE_CHECKED)  # by ``expect``, before the body came
            if checked is not None:
                ctx.admission = checked
                facts.lease = checked.lease
            while (verdict := decide(facts)).need is not None:
                try:
                    await self._find_out(ctx, facts, verdict.need)
                except lease_exc.StoreUnavailable:
                    await self._release_unsent(ctx)
                    raise
            return await self._carry_out(ctx, verdict)
        except lease_exc.StoreUnavailable:
            return await self.answers.refuse(ctx, STORE_UNAVAILABLE)
        finally:
            self._free_slot(ctx)

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
        ctx = Ctx(request)
        if request.headers.get("Expect", "").lower() != "100-continue":
            return await self.answers.refuse(ctx, EXPECT_UNSUPPORTED)
        try:
            facts = self._intake(ctx)
            facts.slot_free = True  # judged as if: the handler takes its slot for the body
            while (verdict := decide(facts)).need is Step.LEASE:
                await self._check_lease(ctx, facts)
            if verdict.outcome is Outcome.REFUSE:
                return await self._carry_out(ctx, verdict)
        except lease_exc.StoreUnavailable:
            return await self.answers.refuse(ctx, STORE_UNAVAILABLE)
        if ctx.admission is not None:
            request[LEASE_CHECKED] = ctx.admission
        return None

    # -- the facts: from the request, then from the database ----------------------------

    def _intake(self, ctx: Ctx) -> Facts:
        return intake(
            ctx, self.upstreams, self.settings.gateway.max_idempotency_key_length, self.sources
        )

    def _asked_wait(self, ctx: Ctx, facts: Facts) -> None:
        """``Prefer: wait=N`` (RFC 7240) on a fenced write: how long it may wait for its
        key's first attempt, if that is in flight (capped; a malformed one is ignored)."""
        cap = self.settings.gateway.max_prefer_wait_seconds
        if not facts.fenced or cap == 0:
            return
        asked = prefer_wait(ctx.request.headers.getall("Prefer", []))
        if asked:
            ctx.request[DUPLICATE_WAIT] = DuplicateWait(min(asked, cap))

    async def _find_out(self, ctx: Ctx, facts: Facts, step: Step) -> None:
        if step is Step.LEASE:
            if facts.over_limit is True or not ctx.request.content.is_eof():
                # Over the limit, or its body still on the way: ask the database (a
                # read) before a slot is taken and the body read.
                await self._check_lease(ctx, facts)
                return
            # The body has all arrived, so it cannot hold a slot for long: take one,
            # read it and let the admission (the one statement that decides) tell
            # about the lease, instead of asking twice.
            self._take_slot(ctx, facts)
            if facts.slot_free:
                await self._read(ctx, facts)
            if facts.slot_free and facts.over_limit is False and facts.body_in_time:
                await self._admit(ctx, facts)
            else:
                await self._check_lease(ctx, facts)
        elif step is Step.SLOT:
            self._take_slot(ctx, facts)
        elif step is Step.BODY:
            await self._read(ctx, facts)
        elif step is Step.ADMISSION:
            await self._admit(ctx, facts)
        elif step is Step.WAIT:
            await self._wait_for_first(ctx, facts)
        elif step is Step.ORDER:
            await self._wait_in_order(ctx, facts)
        else:
            await self._judge_at_send(ctx, facts)

    async def _judge_at_send(self, ctx: Ctx, facts: Facts) -> None:
        """A claimed write, judged once more after its admission's commit is known and
        right before its first byte goes out (nothing is awaited between this and the
        send). A replica that stalled since its admission (a paused process, a slow
        commit) must not send once a newer generation has been admitted, nor once its
        claim is so near its deadline that other replicas may stop waiting for it (by
        this process's clock or the database's)."""
        admission, key, send_by = ctx.admission, ctx.key, ctx.send_by
        assert admission is not None and admission.presented is not None
        assert key is not None and send_by is not None and ctx.attempt is not None
        job_id, generation = admission.presented.job_id, admission.presented.generation
        assert generation is not None
        claim = await self.store.claim(job_id, key, ctx.attempt)
        on_database = -1.0 if claim.deadline is None else claim.deadline - claim.now
        ctx.send_left = min(send_by - time.monotonic(), on_database - DEADLINE_MARGIN)
        facts.at_send = fence.send_verdict(generation, claim.fence, ctx.send_left)
        if facts.at_send is None and claim.older_in_flight:
            # An older write went in flight after the admission's snapshot (the
            # resolver re-claimed one): wait for it as for any older write, then judge
            # again. Each of the two reads its own snapshot after the other's commit
            # or before it, so either this read sees its claim or the resolver sees
            # our fence and does not re-send.
            facts.in_order = facts.at_send = UNKNOWN
        if claim.fence is not None and claim.fence > (admission.highest or 0):
            # A newer generation was admitted meanwhile: the highest known, for the answer.
            ctx.admission = replace(admission, highest=claim.fence)

    async def _check_lease(self, ctx: Ctx, facts: Facts) -> None:
        admission = await self._lease_now(ctx)
        if admission is None:
            facts.lease = fence.UNKNOWN_TOKEN
            return
        ctx.admission = admission
        facts.lease = admission.lease

    async def _lease_now(self, ctx: Ctx) -> Admission | None:
        """Read-only: the lease behind the token as the database (and, for a lease of
        another source, that source) sees it now; None: no such token."""
        if ctx.source is not None:
            external = await self._external(ctx)
            return None if external is None else await self.store.check_external(external)
        if ctx.token_hash is None:
            return None
        return await self.store.check_lease(ctx.token_hash)

    async def _external(self, ctx: Ctx) -> ExternalLease | None:
        """What the token's source says of its lease now (no database write)."""
        assert ctx.source is not None and ctx.source_token is not None
        return await ctx.source.check(ctx.source_token)

    def _free_slot(self, ctx: Ctx) -> None:
        if ctx.slot is not None:
            self.slots[ctx.slot] -= 1
            ctx.slot = None

    def _take_slot(self, ctx: Ctx, facts: Facts) -> None:
        """One of the pool's slots (fenced writes, unfenced requests), if one is free."""
        pool = "fenced" if facts.fenced else "unfenced"
        limits = self.settings.gateway
        limit = (
            limits.max_concurrent_requests
            if facts.fenced
            else limits.max_concurrent_unfenced_requests
        )
        facts.slot_free = self.slots[pool] < limit
        if facts.slot_free:
            self.slots[pool] += 1
            ctx.slot = pool

    async def _read(self, ctx: Ctx, facts: Facts) -> None:
        """The body, hashed into the fingerprint as it arrives (fenced writes)."""
        upstream, request = ctx.upstream, ctx.request
        assert upstream is not None
        digest = None
        if facts.fenced:
            digest = fence.fingerprint_hasher(ctx.method, upstream.name, ctx.rest, ctx.query)
        try:
            ctx.body = await read_body(request, upstream, digest)
        except BodyTimeout:
            facts.over_limit, facts.body_in_time = False, False
            return
        facts.over_limit, facts.body_in_time = ctx.body is None, True
        if digest is not None and ctx.body is not None:
            ctx.fingerprint = digest.hexdigest()

    async def _admit(self, ctx: Ctx, facts: Facts) -> None:
        """In one transaction: the lease, the fence, the key (claimed, taken over, or
        its record read) and whether an older generation's write is in flight."""
        upstream, request = ctx.upstream, ctx.request
        assert upstream is not None and ctx.key is not None and ctx.fingerprint is not None
        external = None
        if ctx.source is not None:
            external = await self._external(ctx)
            if external is None:
                facts.lease = fence.UNKNOWN_TOKEN
                return
            if external.refused is not None:  # nothing to admit: explain it
                ctx.admission = admission = await self.store.check_external(external)
                facts.lease = admission.lease
                return
        else:
            assert ctx.token_hash is not None
        deadline_in = (
            self.settings.gateway.ordering_wait_seconds
            + upstream.timeout_seconds
            + upstream.connect_timeout_seconds
            + DEADLINE_MARGIN
        )
        # The claim's deadline runs from here; past it, other replicas treat the record as
        # unknown and may move on, so this replica must not forward any more.
        ctx.send_by = time.monotonic() + deadline_in - DEADLINE_MARGIN
        write = WriteRequest(
            token_hash=ctx.token_hash,
            key=ctx.key,
            fingerprint=ctx.fingerprint,
            upstream=upstream.name,
            method=request.method,
            path=ctx.rest,
            deadline_in=deadline_in,
            retry=upstream.unknown_outcome == "retry",
        )
        if external is not None:
            admission = await self.store.admit_external(external, write)
        else:
            admission = await self.store.admit(write)
        ctx.admission = admission
        facts.lease = admission.lease  # judged once, when the store read the answer
        if facts.lease is not None:
            return
        ctx.attempt, ctx.back_to = admission.attempt, admission.back_to
        if ctx.attempt is not None:
            facts.record = None
            facts.in_order = UNKNOWN if admission.older_in_flight else True
            return
        # The key has a record that is not ours (or it vanished between our claim and
        # our read): what it answers.
        ctx.record = admission.record
        facts.record = fence.record_reason(
            admission.record, ctx.fingerprint, admission.now, upstream.unknown_outcome
        )
        if fence.in_progress(facts.record):
            self._may_wait(ctx, facts)

    def _may_wait(self, ctx: Ctx, facts: Facts) -> None:
        """The key is in flight under another request: ``request-in-progress``, unless
        the request asked to wait (``Prefer: wait``) and its wait has time left."""
        wait = ctx.request.get(DUPLICATE_WAIT)
        if wait is None:
            return
        assert ctx.admission is not None
        wait.begin(ctx.admission.now)
        if wait.left() > 0 and not _gone(ctx.request):
            facts.first_settled = UNKNOWN

    async def _wait_for_first(self, ctx: Ctx, facts: Facts) -> None:
        """``Prefer: wait``: wait (bounded) for the key's first attempt to settle,
        holding no slot and no database connection (each look at the record takes one
        for a moment), then ask for a slot and the admission again: the admission
        decides what the duplicate gets (the stored answer, as a replay). Ends early
        when the client goes away."""
        wait, admission, key = ctx.request[DUPLICATE_WAIT], ctx.admission, ctx.key
        assert key is not None
        assert admission is not None and admission.presented is not None
        self._free_slot(ctx)
        wait.waited = True
        settled = await self._until_settled(ctx.request, admission.presented.job_id, key, wait)
        facts.first_settled = settled
        if settled:
            facts.slot_free = facts.record = UNKNOWN

    async def _until_settled(
        self, request: web.Request, job_id: str, key: str, wait: DuplicateWait
    ) -> bool:
        """Until the key's record is no longer in flight (settled, released, or past its
        deadline), this replica's settle of the key wakes us, or the wait ends (False)."""
        with self.settles.watch(job_id, key) as watch:
            while True:
                settled = watch.current()
                left = wait.left()
                if left <= 0 or _gone(request):
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(settled.wait(), min(wait.poll, left))
                wait.poll = min(wait.poll * 2, POLL_MAX)
                record = await self.store.record(job_id, key)
                if record is None or record.state is not RecordState.IN_FLIGHT:
                    return True
                if record.deadline <= wait.database_now():
                    return True  # its replica is gone: the admission says what it is now

    async def _wait_in_order(self, ctx: Ctx, facts: Facts) -> None:
        """Wait (bounded) for older generations' writes; then judge the lease again: a
        newer generation may have been granted or admitted meanwhile."""
        admission = ctx.admission
        assert admission is not None and admission.presented is not None
        job_id, generation = admission.presented.job_id, admission.presented.generation
        assert generation is not None
        if not await self._wait_for_older(job_id, generation):
            facts.in_order = False
            return
        now_seen = await self._lease_now(ctx)
        if now_seen is None:  # its grant was purged meanwhile
            facts.lease, facts.in_order = fence.UNKNOWN_TOKEN, True
            return
        ctx.admission = now_seen
        facts.lease = fence.lease_after_wait(now_seen.lease, now_seen.highest, generation)
        facts.in_order = True

    async def _wait_for_older(self, job_id: str, generation: int) -> bool:
        """Wait (bounded) until no older generation's write to this job is in flight."""
        deadline = time.monotonic() + self.settings.gateway.ordering_wait_seconds
        while time.monotonic() < deadline:
            await asyncio.sleep(ORDERING_POLL)
            if not await self.store.older_in_flight(job_id, generation):
                return True
        return False

    # -- carrying out the verdict ---------------------------------------------------------

    async def _carry_out(self, ctx: Ctx, verdict: Verdict) -> web.StreamResponse:
        if verdict.outcome in (Outcome.FORWARD, Outcome.PASS):
            return await self._forward(ctx, fenced=verdict.outcome is Outcome.FORWARD)
        if verdict.outcome is Outcome.REPLAY:
            assert ctx.record is not None
            return await self.answers.replay(ctx, ctx.record)
        if ctx.attempt is not None:  # our claim on the key: it was not sent, undo it
            await self._release(ctx)
        return await self.answers.refuse(ctx, verdict)

    async def _release_unsent(self, ctx: Ctx) -> None:
        """The database failed while a claimed write was still being decided on (waiting
        for older writes, the last judgement): it was never sent, so its claim is undone
        if the database lets us, rather than left to count as an unknown outcome once its
        deadline passes."""
        if ctx.attempt is None:
            return
        try:
            await self._release(ctx)
        except lease_exc.StoreUnavailable:
            log.warning("a claim not sent could not be released (database unavailable)")

    async def _release(self, ctx: Ctx) -> None:
        assert ctx.attempt is not None and ctx.key is not None
        admission = ctx.admission
        assert admission is not None and admission.presented is not None
        await self.store.release(admission.presented.job_id, ctx.key, ctx.attempt, ctx.back_to)
        ctx.attempt = None
        self.settles.notify(admission.presented.job_id, ctx.key)

    async def _forward(self, ctx: Ctx, *, fenced: bool) -> web.StreamResponse:
        """Forward with the fencing headers (a fenced write) or without (a pass-through);
        a claimed key goes along, to be settled by how the exchange ends."""
        upstream = ctx.upstream
        assert upstream is not None and ctx.body is not None
        if fenced:
            presented = ctx.admission.presented if ctx.admission else None
            assert presented is not None
            headers = forward_headers(
                ctx.request, upstream, presented.job_id, presented.generation, ctx.key
            )
            if upstream.signing is not None:
                s3.drop_metadata(headers)  # only the gateway writes the fencing metadata
            if (
                upstream.signing is not None
                and presented.generation is not None
                and ctx.key is not None
                and not fence.is_anonymous(ctx.key)
                and s3.is_object_write(ctx.request.method, ctx.rest, ctx.query)
            ):
                key_upstream = profiles.upstream_key(presented.job_id, ctx.key)
                s3.stamp(headers, presented.job_id, presented.generation, key_upstream)
        else:
            headers = forward_headers(ctx.request, upstream, None, None, None)
        url = upstream_url(upstream, ctx.rest, ctx.query)
        if upstream.signing is not None and not fenced:
            s3.drop_metadata(headers)
        ctx.forwarded = headers.copy()  # as kept for a re-send: unsigned
        if upstream.signing is not None:
            s3.sign(headers, ctx.request.method, url, ctx.body.getvalue(), upstream.signing)
        key = None if ctx.attempt is None else _HeldKey(self, ctx)
        if fenced and ctx.source_name is not None:
            self.metrics.source_decisions.labels(ctx.source_name, "forwarded").inc()
        return await self.forwarder.forward(
            ctx.request,
            upstream,
            url,
            headers,
            ctx.body,
            key=key,
            send_left=ctx.send_left,
            refuse=lambda ended: self.answers.refuse(ctx, answer_after(ended)),
            decided_since=ctx.started if ctx.admission is not None else None,
        )


def _gone(request: web.Request) -> bool:
    """The client has gone away (its connection is closed)."""
    transport = request.transport
    return transport is None or transport.is_closing()


class _HeldKey:
    """The key a forwarded write holds (``forwarding.ClaimedKey``), bound to the store:
    ids taken when the forward begins."""

    __slots__ = ("_attempt", "_ctx", "_gateway", "_job_id", "_key")

    def __init__(self, gateway: Gateway, ctx: Ctx) -> None:
        presented = ctx.admission.presented if ctx.admission else None
        assert ctx.attempt is not None
        self._gateway, self._ctx = gateway, ctx
        self._job_id = presented.job_id if presented else ""
        self._key = ctx.key or ""
        self._attempt = ctx.attempt

    async def release(self) -> None:
        await self._gateway._release(self._ctx)

    async def settle(
        self,
        state: RecordState,
        *,
        status: int | None,
        headers: list[tuple[str, str]] | None,
        body: bytes | None,
        note: str | None,
    ) -> None:
        kept = self._kept() if state is RecordState.UNKNOWN else None
        if kept is not None:
            await self._gateway.store.hold_for_resolution(
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
            await self._gateway.store.settle(
                self._job_id,
                self._key,
                self._attempt,
                state=state,
                status=status,
                headers=headers,
                body=body,
                note=note,
            )
        self._gateway.settles.notify(self._job_id, self._key)

    def _kept(self) -> KeptRequest | None:
        """The request to keep for a re-send by the gateway: only for an upstream that
        resolves unknown outcomes, a write with a key, and a body within
        ``gateway.max_replay_body_bytes`` (a larger one goes to the operator)."""
        ctx = self._ctx
        upstream = ctx.upstream
        if (
            upstream is None
            or upstream.unknown_outcome != "resolve"
            or fence.is_anonymous(self._key)
            or ctx.forwarded is None
            or ctx.body is None
        ):
            return None
        if upstream.signing is not None and not s3.is_object_write(
            ctx.request.method, ctx.rest, ctx.query
        ):
            return None  # S3: only an object write can be checked by its metadata
        with ctx.body.getbuffer() as view:
            size = view.nbytes
        if size > self._gateway.settings.gateway.max_replay_body_bytes:
            return None
        return kept_request(ctx.forwarded, upstream, ctx.query, ctx.body.getvalue())


def create_proxy_app(gateway: Gateway) -> web.Application:
    """The proxy listener's app; it owns the gateway's client session."""

    @web.middleware
    async def unrouted(request: web.Request, handler: Handler) -> web.StreamResponse:
        # CONNECT and ``OPTIONS *`` match no route; they still get the gateway's answer
        # (a problem document, audited) instead of aiohttp's plain 404.
        if request.match_info.http_exception is not None:
            return await gateway.handle(request)
        return await handler(request)

    app = web.Application(middlewares=[request_id_middleware, unrouted])

    async def preference_applied(request: web.Request, response: web.StreamResponse) -> None:
        # RFC 7240: say that the request waited as ``Prefer: wait`` asked, whatever the
        # answer after the wait (a replay, a forward, ``request-in-progress``).
        wait = request.get(DUPLICATE_WAIT)
        if wait is not None and wait.waited:
            response.headers["Preference-Applied"] = wait.applied

    app.on_response_prepare.append(preference_applied)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", gateway.handle, expect_handler=gateway.expect)
    return app
