"""The proxy listener: ``/{upstream}/{path}`` to the upstream's base URL + ``/{path}``.

``Gateway.handle`` is the loop: intake reads the facts the request carries
(``intake``), ``decision.decide`` names the next fact to find out or the verdict, the
steps here find facts out (the lease, a slot, the body, the admission: one transaction
before forwarding, a duplicate's wait for its first attempt (``Prefer: wait``), the wait
for older writes, the last judgement before the send), and the verdict is carried out:
forwarded (``forwarding``) or answered by the gateway itself (``answers``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from gateway import sources
from gateway.config import Settings, UpstreamSettings
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
from gateway.observe.logs import request_id_middleware
from gateway.observe.metrics import GatewayMetrics
from gateway.proxy.answers import Answers
from gateway.proxy.body import BodyTimeout, read_body, start_body_clock
from gateway.proxy.duplicates import DuplicateWait, Settles, prefer_wait
from gateway.proxy.held import BEHIND_WAIT_SECONDS, Behind, HeldKey
from gateway.proxy.intake import forward_headers, intake
from gateway.proxy.request import Claim, Incoming, Progress
from gateway.proxy.resolve import Resolver
from gateway.proxy.waits import gone, until_older_settled, until_settled
from gateway.records.audit import Audit
from gateway.records.store import GatewayStore, WriteRequest
from gateway.sources import ExternalLease, bounded
from gateway.upstream import s3
from gateway.upstream.forwarding import Forwarder, upstream_url
from lease_core import exceptions as lease_exc
from lease_core.store import LeaseStore

log = logging.getLogger("fencegate.proxy")

DEADLINE_MARGIN = 5.0
# An admission answered within this many seconds of being asked is itself the judgement
# right before the send (the fence is the write's own generation, the claim just made):
# no read follows it. A slower one (a stalled process, a commit held back) is judged
# again by a read of the database, as a write that waited for older ones is, and so is
# every write while an upstream resolves unknown outcomes: the resolver may claim an
# older write of the job after the admission's snapshot (``_judge_at_send``).
FRESH_ADMISSION = 0.25

# The lease check ``expect`` made before the client sent the body.
LEASE_CHECKED = web.RequestKey("lease_checked", fence.Admission)
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
        self.resolving = _resolving(self.upstreams)
        # Unknown outcomes re-sent by ``fencegate serve``'s resolver (gateway.proxy.resolve).
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
        # Final answers given, their records still being settled.
        self.behind = Behind.of(settings.gateway)

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
        self.resolving = _resolving(self.upstreams)
        self.settings = self.settings.model_copy(update={"upstreams": settings.upstreams})
        log.info("reload: %d upstream(s): %s", len(self.upstreams), ", ".join(self.upstreams))

    async def start(self) -> None:
        await self.forwarder.start()
        for source in self.sources.values():
            await source.start()

    async def close(self) -> None:
        await self.forwarder.close()
        await self.behind.flush()
        await self.audit.close()
        for source in self.sources.values():
            await source.close()

    # -- the request path ---------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Gather facts until the decision table answers, then carry out its verdict.
        The table asks for the lease before a slot and a slot before the body: a
        request without a current lease is refused before its body is read and never
        holds a slot while a slow client sends it. Fenced and unfenced requests have
        separate pools, and every body must arrive in time (``body.read_body``)."""
        progress = Progress()
        start_body_clock(request, self.settings.gateway)
        incoming, facts = self._intake(request)
        try:
            self._asked_wait(incoming, facts)
            checked = request.get(LEASE_CHECKED)  # by ``expect``, before the body came
            if checked is not None:
                progress.admission = checked
                facts.lease = checked.lease
            while (verdict := decide(facts)).need is not None:
                try:
                    await self._find_out(incoming, progress, facts, verdict.need)
                except lease_exc.StoreUnavailable:
                    await self._release_unsent(incoming, progress)
                    raise
            return await self._carry_out(incoming, progress, verdict)
        except lease_exc.StoreUnavailable:
            return await self.answers.refuse(incoming, progress, STORE_UNAVAILABLE)
        finally:
            self._free_slot(progress)

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
        progress = Progress()
        if request.headers.get("Expect", "").lower() != "100-continue":
            return await self.answers.refuse(Incoming(request), progress, EXPECT_UNSUPPORTED)
        incoming, facts = self._intake(request)
        try:
            facts.slot_free = True  # judged as if: the handler takes its slot for the body
            while (verdict := decide(facts)).need is Step.LEASE:
                await self._check_lease(incoming, progress, facts)
            if verdict.outcome is Outcome.REFUSE:
                return await self._carry_out(incoming, progress, verdict)
        except lease_exc.StoreUnavailable:
            return await self.answers.refuse(incoming, progress, STORE_UNAVAILABLE)
        if progress.admission is not None:
            request[LEASE_CHECKED] = progress.admission
        return None

    # -- the facts: from the request, then from the database ----------------------------

    def _intake(self, request: web.Request) -> tuple[Incoming, Facts]:
        limit = self.settings.gateway.max_idempotency_key_length
        return intake(request, self.upstreams, limit, self.sources)

    def _asked_wait(self, incoming: Incoming, facts: Facts) -> None:
        """``Prefer: wait=N`` (RFC 7240) on a fenced write: how long it may wait for its
        key's first attempt, if that is in flight (capped; a malformed one is ignored)."""
        cap = self.settings.gateway.max_prefer_wait_seconds
        if not facts.fenced or cap == 0:
            return
        asked = prefer_wait(incoming.request.headers.getall("Prefer", []))
        if asked:
            incoming.request[DUPLICATE_WAIT] = DuplicateWait(min(asked, cap))

    async def _find_out(
        self, incoming: Incoming, progress: Progress, facts: Facts, step: Step
    ) -> None:
        if step is Step.LEASE:
            if facts.over_limit is True or not incoming.request.content.is_eof():
                # Over the limit, or its body still on the way: ask the database (a
                # read) before a slot is taken and the body read.
                await self._check_lease(incoming, progress, facts)
                return
            # The body has all arrived, so it cannot hold a slot for long: take one,
            # read it and let the admission (the one statement that decides) tell
            # about the lease, instead of asking twice.
            self._take_slot(progress, facts)
            if facts.slot_free:
                await self._read(incoming, progress, facts)
            if facts.slot_free and facts.over_limit is False and facts.body_in_time:
                await self._admit(incoming, progress, facts)
            else:
                await self._check_lease(incoming, progress, facts)
        elif step is Step.SLOT:
            self._take_slot(progress, facts)
        elif step is Step.BODY:
            await self._read(incoming, progress, facts)
        elif step is Step.ADMISSION:
            await self._admit(incoming, progress, facts)
        elif step is Step.WAIT:
            await self._wait_for_first(incoming, progress, facts)
        elif step is Step.ORDER:
            await self._wait_in_order(incoming, progress, facts)
        else:
            await self._judge_at_send(incoming, progress, facts)

    async def _judge_at_send(self, incoming: Incoming, progress: Progress, facts: Facts) -> None:
        """A claimed write, judged once more after its admission's commit is known and
        right before its first byte goes out (nothing is awaited between this and the
        send), by a read of the database. A replica that stalled since its admission (a
        paused process, a slow commit) must not send once a newer generation has been
        admitted, nor once its claim is so near its deadline that other replicas may stop
        waiting for it (by this process's clock or the database's). An admission that
        answered at once, with no older write in flight and no resolver running, was
        judged by ``_admit`` itself (``FRESH_ADMISSION``)."""
        admission, key, claimed = progress.admission, incoming.key, progress.claim
        assert admission is not None and admission.presented is not None
        assert key is not None and claimed is not None
        job_id, generation = admission.presented.job_id, admission.presented.generation
        assert generation is not None
        claim = await self.store.claim(job_id, key, claimed.attempt)
        on_database = -1.0 if claim.deadline is None else claim.deadline - claim.now
        send_left = min(claimed.send_by - time.monotonic(), on_database - DEADLINE_MARGIN)
        self._judge_send(progress, facts, generation, claim.fence, send_left)
        if facts.at_send is None and claim.older_in_flight:
            # An older write went in flight after the admission's snapshot (the
            # resolver re-claimed one): wait for it as for any older write, then judge
            # again. Each of the two reads its own snapshot after the other's commit
            # or before it, so either this read sees its claim or the resolver sees
            # our fence and does not re-send.
            facts.in_order = facts.at_send = UNKNOWN
        if claim.fence is not None and claim.fence > (admission.highest or 0):
            # A newer generation was admitted meanwhile: the highest known, for the answer.
            progress.admission = replace(admission, highest=claim.fence)

    @staticmethod
    def _judge_send(
        progress: Progress, facts: Facts, generation: int, fenced: int | None, send_left: float
    ) -> None:
        progress.send_left = send_left
        facts.at_send = fence.send_verdict(generation, fenced, send_left)

    async def _check_lease(self, incoming: Incoming, progress: Progress, facts: Facts) -> None:
        admission = await self._lease_now(incoming)
        if admission is None:
            facts.lease = fence.UNKNOWN_TOKEN
            return
        progress.admission = admission
        facts.lease = admission.lease

    async def _lease_now(self, incoming: Incoming) -> fence.Admission | None:
        """Read-only: the lease behind the token as the database (and, for a lease of
        another source, that source) sees it now; None: no such token."""
        if incoming.source is not None:
            external = await self._external(incoming)
            return None if external is None else await self.store.check_external(external)
        if incoming.token_hash is None:
            return None
        return await self.store.check_lease(incoming.token_hash)

    async def _external(self, incoming: Incoming) -> ExternalLease | None:
        """What the token's source says of its lease now (no write), ``bounded``."""
        assert incoming.source is not None and incoming.source_token is not None
        return bounded(await incoming.source.check(incoming.source_token))

    def _free_slot(self, progress: Progress) -> None:
        if progress.slot is not None:
            self.slots[progress.slot] -= 1
            progress.slot = None

    def _take_slot(self, progress: Progress, facts: Facts) -> None:
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
            progress.slot = pool

    async def _read(self, incoming: Incoming, progress: Progress, facts: Facts) -> None:
        """The body, hashed into the fingerprint as it arrives (fenced writes)."""
        upstream, request = incoming.upstream, incoming.request
        assert upstream is not None
        digest = None
        if facts.fenced:
            digest = fence.fingerprint_hasher(
                incoming.method, upstream.name, incoming.rest, incoming.query
            )
        try:
            progress.body = await read_body(request, upstream, digest)
        except BodyTimeout:
            facts.over_limit, facts.body_in_time = False, False
            return
        facts.over_limit, facts.body_in_time = progress.body is None, True
        if digest is not None and progress.body is not None:
            progress.fingerprint = digest.hexdigest()

    async def _admit(self, incoming: Incoming, progress: Progress, facts: Facts) -> None:
        """In one transaction: the lease, the fence, the key (claimed, taken over, or
        its record read) and whether an older generation's write is in flight."""
        upstream, request = incoming.upstream, incoming.request
        assert (
            upstream is not None and incoming.key is not None and progress.fingerprint is not None
        )
        external = None
        if incoming.source is not None:
            external = await self._external(incoming)
            if external is None:
                facts.lease = fence.UNKNOWN_TOKEN
                return
            if external.refused is not None:  # nothing to admit: explain it
                progress.admission = admission = await self.store.check_external(external)
                facts.lease = admission.lease
                return
        else:
            assert incoming.token_hash is not None
        deadline_in = (
            self.settings.gateway.ordering_wait_seconds
            + upstream.timeout_seconds
            + upstream.connect_timeout_seconds
            + DEADLINE_MARGIN
        )
        # The claim's deadline runs from here; past it, other replicas treat the record as
        # unknown and may move on, so this replica must not forward any more.
        asked = time.monotonic()
        send_by = asked + deadline_in - DEADLINE_MARGIN
        write = WriteRequest(
            token_hash=incoming.token_hash,
            key=incoming.key,
            fingerprint=progress.fingerprint,
            upstream=upstream.name,
            method=request.method,
            path=incoming.rest,
            deadline_in=deadline_in,
            retry=upstream.unknown_outcome == "retry",
        )
        # A settle of this key going on here (its answer given): a duplicate found in
        # flight waits for it (``_may_wait``). Asked before the admission: once it is
        # written, the admission finds the answer stored.
        behind = self.behind.has_key(incoming.key)
        if external is not None:
            admission = await self.store.admit_external(external, write)
        else:
            admission = await self.store.admit(write)
        progress.admission = admission
        facts.lease = admission.lease  # judged once, when the store read the answer
        if facts.lease is not None:
            return
        if admission.attempt is not None:
            progress.claim = Claim(admission.attempt, admission.back_to, send_by)
            facts.record = None
            facts.in_order = UNKNOWN if admission.older_in_flight else True
            now = time.monotonic()
            if facts.in_order is True and not self.resolving and now - asked < FRESH_ADMISSION:
                assert admission.presented is not None
                assert admission.presented.generation is not None
                self._judge_send(
                    progress,
                    facts,
                    admission.presented.generation,
                    admission.highest,
                    send_by - now,
                )
            return
        # The key has a record not ours (or gone between claim and read): what it answers.
        progress.record = admission.record
        facts.record = fence.record_reason(
            admission.record, progress.fingerprint, admission.now, upstream.unknown_outcome
        )
        if fence.in_progress(facts.record):
            self._may_wait(incoming, progress, facts, behind=behind)

    def _may_wait(
        self, incoming: Incoming, progress: Progress, facts: Facts, *, behind: bool
    ) -> None:
        """The key is in flight under another request: ``request-in-progress``, unless
        the request asked to wait (``Prefer: wait``) and its wait has time left, or its
        answer has gone out from this replica and its record is being settled here
        (``behind``): then it waits for that, as if it had asked."""
        wait = incoming.request.get(DUPLICATE_WAIT)
        if wait is None and behind:
            wait = DuplicateWait(BEHIND_WAIT_SECONDS, asked=False)
            incoming.request[DUPLICATE_WAIT] = wait
        if wait is None:
            return
        assert progress.admission is not None
        wait.begin(progress.admission.now)
        if wait.left() > 0 and not gone(incoming.request):
            facts.first_settled = UNKNOWN

    async def _wait_for_first(self, incoming: Incoming, progress: Progress, facts: Facts) -> None:
        """``Prefer: wait``: wait (bounded) for the key's first attempt to settle,
        holding no slot and no database connection (each look at the record takes one
        for a moment), then ask for a slot and the admission again: the admission
        decides what the duplicate gets (the stored answer, as a replay). Ends early
        when the client goes away."""
        wait, admission, key = incoming.request[DUPLICATE_WAIT], progress.admission, incoming.key
        assert key is not None
        assert admission is not None and admission.presented is not None
        self._free_slot(progress)
        wait.waited = True
        settled = await until_settled(
            self.store, self.settles, incoming.request, admission.presented.job_id, key, wait
        )
        facts.first_settled = settled
        if settled:
            facts.slot_free = facts.record = UNKNOWN

    async def _wait_in_order(self, incoming: Incoming, progress: Progress, facts: Facts) -> None:
        """Wait (bounded) for older generations' writes; then judge the lease again: a
        newer generation may have been granted or admitted meanwhile."""
        admission = progress.admission
        assert admission is not None and admission.presented is not None
        job_id, generation = admission.presented.job_id, admission.presented.generation
        assert generation is not None
        seconds = self.settings.gateway.ordering_wait_seconds
        if not await until_older_settled(self.store, job_id, generation, seconds):
            facts.in_order = False
            return
        now_seen = await self._lease_now(incoming)
        if now_seen is None:  # its grant was purged meanwhile
            facts.lease, facts.in_order = fence.UNKNOWN_TOKEN, True
            return
        progress.admission = now_seen
        facts.lease = fence.lease_after_wait(now_seen.lease, now_seen.highest, generation)
        facts.in_order = True

    # -- carrying out the verdict ---------------------------------------------------------

    async def _carry_out(
        self, incoming: Incoming, progress: Progress, verdict: Verdict
    ) -> web.StreamResponse:
        if verdict.outcome in (Outcome.FORWARD, Outcome.PASS):
            return await self._forward(
                incoming, progress, fenced=verdict.outcome is Outcome.FORWARD
            )
        if verdict.outcome is Outcome.REPLAY:
            assert progress.record is not None
            return await self.answers.replay(incoming, progress, progress.record)
        if progress.claim is not None:  # our claim on the key: it was not sent, undo it
            await self._release(incoming, progress)
        return await self.answers.refuse(incoming, progress, verdict)

    async def _release_unsent(self, incoming: Incoming, progress: Progress) -> None:
        """The database failed while a claimed write was still being decided on (waiting
        for older writes, the last judgement): it was never sent, so its claim is undone
        if the database lets us, rather than left to count as an unknown outcome once its
        deadline passes."""
        if progress.claim is None:
            return
        try:
            await self._release(incoming, progress)
        except lease_exc.StoreUnavailable:
            log.warning("a claim not sent could not be released (database unavailable)")

    async def _release(self, incoming: Incoming, progress: Progress) -> None:
        claim = progress.claim
        assert claim is not None and incoming.key is not None
        admission = progress.admission
        assert admission is not None and admission.presented is not None
        job_id = admission.presented.job_id
        await self.store.release(job_id, incoming.key, claim.attempt, claim.back_to)
        progress.claim = None
        self.settles.notify(admission.presented.job_id, incoming.key)

    async def _forward(
        self, incoming: Incoming, progress: Progress, *, fenced: bool
    ) -> web.StreamResponse:
        """Forward with the fencing headers (a fenced write) or without (a pass-through);
        a claimed key goes along, to be settled by how the exchange ends."""
        upstream = incoming.upstream
        assert upstream is not None and progress.body is not None
        if fenced:
            presented = progress.admission.presented if progress.admission else None
            assert presented is not None
            headers = forward_headers(
                incoming.request, upstream, presented.job_id, presented.generation, incoming.key
            )
            if upstream.signing is not None:
                s3.drop_metadata(headers)  # only the gateway writes the fencing metadata
            if (
                upstream.signing is not None
                and presented.generation is not None
                and incoming.key is not None
                and not fence.is_anonymous(incoming.key)
                and s3.is_object_write(incoming.request.method, incoming.rest, incoming.query)
            ):
                key_upstream = profiles.upstream_key(presented.job_id, incoming.key)
                s3.stamp(headers, presented.job_id, presented.generation, key_upstream)
        else:
            headers = forward_headers(incoming.request, upstream, None, None, None)
        url = upstream_url(upstream, incoming.rest, incoming.query)
        if upstream.signing is not None and not fenced:
            s3.drop_metadata(headers)
        progress.forwarded = headers.copy()  # as kept for a re-send: unsigned
        if upstream.signing is not None:
            s3.sign(
                headers, incoming.request.method, url, progress.body.getvalue(), upstream.signing
            )
        key = None
        if progress.claim is not None:
            key = HeldKey(
                self.store,
                incoming,
                progress,
                release=lambda: self._release(incoming, progress),
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
            progress.body,
            key=key,
            send_left=progress.send_left,
            refuse=lambda end: self.answers.refuse(
                incoming, progress, answer_after(end, keyed=key is not None)
            ),
            decided_since=progress.started if progress.admission is not None else None,
        )


def _resolving(upstreams: Mapping[str, UpstreamSettings]) -> bool:
    """Some upstream's unknown outcomes are re-sent by the gateway's resolver."""
    return any(u.unknown_outcome == "resolve" for u in upstreams.values())


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
        if wait is not None and wait.waited and wait.asked:
            response.headers["Preference-Applied"] = wait.applied

    app.on_response_prepare.append(preference_applied)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", gateway.handle, expect_handler=gateway.expect)
    return app
