"""The proxy listener: ``/{upstream}/{path}`` to the upstream's base URL + ``/{path}``.

Fenced writes are admitted (``store.admit``: one transaction before forwarding), forwarded
with header hygiene, streamed back to the client while the part needed for replay is
kept, and settled (one statement after). Everything else is answered here with a
problem document and audited.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from lease_core import exceptions as lease_exc
from lease_core import tokens
from lease_core.problems import problem_response
from lease_core.store import LeaseStore

from . import fence
from .audit import Audit, AuditEntry, audit_path
from .config import Settings, UpstreamSettings
from .fence import Action, Reason, Record, RecordState
from .logs import REQUEST_ID, request_id_middleware
from .store import Admission, GatewayStore, WriteRequest

log = logging.getLogger("fencegate.proxy")

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Proxy-Connection",
    )
)
# Never forwarded from the client: the credential, what we set ourselves, what aiohttp sets.
DROP_FROM_CLIENT = HOP_BY_HOP | {
    "fencing-token",
    "fencing-job",
    "fencing-generation",
    "host",
    "content-length",
    "expect",
}
DROP_FROM_UPSTREAM = HOP_BY_HOP | {"content-length"}
PROTECTED = frozenset({"fencing-token", "idempotency-key"})
# Upstream answers that do not tell whether the side effect happened.
UNKNOWN_STATUSES = frozenset({502, 504})
DEADLINE_MARGIN = 5.0
ORDERING_POLL = 0.02
LARGE_BODY = 1024 * 1024  # above this, hand aiohttp a stream, not bytes


@dataclass(slots=True)
class Ctx:
    """What is known about one request so far (for the answer and its audit entry)."""

    request: web.Request
    upstream: UpstreamSettings | None = None
    key: str | None = None
    fingerprint: str | None = None
    admission: Admission | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    forwarded: bool = False
    body: bytes | None = None
    send_by: float | None = None  # time.monotonic() after which a claimed write stays unsent


class ForwardingMetrics(NamedTuple):
    """One upstream's series that every forwarded request touches."""

    decision_seconds: Any
    in_flight: Any
    forward_seconds: Any
    forwarded: Any


class Target(NamedTuple):
    upstream: UpstreamSettings
    rest: str
    query: str
    token_hash: str | None  # None: not a fenced method, passes through


class BodyTimeouts(NamedTuple):
    deadline: float  # loop time by which the whole body must have arrived
    idle: float  # longest wait for the next part of it


class BodyTimeout(Exception):
    """The request body did not arrive in time."""


BODY_TIMEOUTS = web.RequestKey("body_timeouts", BodyTimeouts)
# The lease check ``expect`` made before the client sent the body.
LEASE_CHECKED = web.RequestKey("lease_checked", Admission)


class Gateway:
    """The proxy's state: settings, stores and the one client session."""

    def __init__(self, settings: Settings, lease_store: LeaseStore) -> None:
        self.settings = settings
        self.store = GatewayStore(lease_store)
        self.audit = Audit(lease_store, settings.gateway)
        self.metrics = lease_store.metrics
        self._by_upstream: dict[str, ForwardingMetrics] = {}
        self.upstreams = {u.name: u for u in settings.upstreams}
        self.session: aiohttp.ClientSession | None = None
        # Slots in use: fenced writes past the lease check (max_concurrent_requests) and
        # unfenced requests (max_concurrent_unfenced_requests).
        self.active = 0
        self.active_unfenced = 0

    def reload(self, settings: Settings) -> None:
        """Take new upstreams (SIGHUP). Settings that need a restart are reported."""
        for key in ("database_url", "proxy_listen", "control_listen", "auth", "lease", "gateway"):
            if getattr(settings, key) != getattr(self.settings, key):
                log.warning("reload: %s changed; it takes effect after a restart", key)
        self.upstreams = {u.name: u for u in settings.upstreams}
        self.settings = self.settings.model_copy(update={"upstreams": settings.upstreams})
        log.info("reload: %d upstream(s): %s", len(self.upstreams), ", ".join(self.upstreams))

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=self.settings.gateway.upstream_connections_per_host
            ),
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    # -- answering ourselves ------------------------------------------------------------

    async def reject(
        self,
        ctx: Ctx,
        reason: Reason,
        *,
        detail: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> web.Response:
        info = fence.REASONS[reason]
        extra = self._problem_extra(ctx)
        self._count(ctx, reason.value)
        log.info(
            "answered %s %d",
            reason.value,
            info.status,
            extra={
                "fields": {
                    "reason": reason.value,
                    "status": info.status,
                    "upstream": ctx.upstream.name if ctx.upstream else None,
                    **{k: v for k, v in extra.items() if v is not None},
                }
            },
        )
        await self._audit(ctx, reason.value, info.status, extra)
        return problem_response(
            status=info.status,
            reason=reason.value,
            title=info.title,
            detail=detail or info.detail,
            headers=headers,
            **extra,
            **ctx.extra,
        )

    async def replay(self, ctx: Ctx, record: Record) -> web.Response:
        if record.body is None:  # applied, but the answer was too large to keep
            ctx.extra["stored_status"] = record.status
            return await self.reject(ctx, Reason.REPLAY_UNAVAILABLE)
        self._count(ctx, Reason.IDEMPOTENT_REPLAY.value)
        await self._audit(
            ctx, Reason.IDEMPOTENT_REPLAY.value, record.status or 0, self._problem_extra(ctx)
        )
        headers = CIMultiDict(record.headers or [])
        headers["Idempotent-Replayed"] = "true"
        return web.Response(status=record.status or 200, headers=headers, body=record.body or b"")

    def _count(self, ctx: Ctx, reason: str) -> None:
        self.metrics.decisions.labels(ctx.upstream.name if ctx.upstream else "-", reason).inc()

    @staticmethod
    def _problem_extra(ctx: Ctx) -> dict[str, Any]:
        if ctx.admission is None:
            return {}
        return fence.problem_extra(ctx.admission.presented, ctx.admission.highest)

    async def _audit(self, ctx: Ctx, reason: str, status: int, extra: dict[str, Any]) -> None:
        request = ctx.request
        presented = ctx.admission.presented if ctx.admission else None
        await self.audit.record(
            AuditEntry(
                reason=reason,
                status=status,
                method=request.method,
                path=audit_path(
                    request.raw_path, ctx.upstream.audit_query_params if ctx.upstream else ()
                ),
                job_id=presented.job_id if presented else None,
                generation=presented.generation if presented else None,
                highest_generation=extra.get("highest_generation"),
                owner=presented.owner if presented else None,
                upstream=ctx.upstream.name if ctx.upstream else None,
                idempotency_key=ctx.key if ctx.key and not fence.is_anonymous(ctx.key) else None,
                client=request.remote,
                fingerprint=ctx.fingerprint,
                body=ctx.body if self.settings.gateway.audit_bodies else None,
            )
        )

    # -- the request path ---------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Checks that need no body first; then, for a fenced write whose body is still
        arriving, the lease (read-only), so that a request without a current lease is
        refused before its body is read and never holds a slot while a slow client
        sends it. Only then is a slot taken: fenced and unfenced requests have separate
        pools, and every body must arrive in time (``_chunks``)."""
        ctx = Ctx(request)
        limits = self.settings.gateway
        request[BODY_TIMEOUTS] = BodyTimeouts(
            asyncio.get_running_loop().time() + limits.body_timeout_seconds,
            limits.body_idle_timeout_seconds,
        )
        try:
            target = await self._preflight(ctx)
            if isinstance(target, web.StreamResponse):
                return target
            fenced_write = target.token_hash is not None
            if fenced_write:
                ctx.admission = request.get(LEASE_CHECKED)  # by ``expect``, before the body
                if ctx.admission is None and not request.content.is_eof():
                    refusal = await self._check_lease(ctx, target)
                    if refusal is not None:
                        return refusal
            # A body that has all arrived cannot hold a slot for long: its lease is
            # checked by ``store.admit``, the one statement that decides.
            if fenced_write:
                if self.active >= limits.max_concurrent_requests:
                    return await self._overloaded(ctx)
                self.active += 1
            else:
                if self.active_unfenced >= limits.max_concurrent_unfenced_requests:
                    return await self._overloaded(ctx)
                self.active_unfenced += 1
            try:
                return await self._handle(ctx, target)
            finally:
                if fenced_write:
                    self.active -= 1
                else:
                    self.active_unfenced -= 1
        except lease_exc.StoreUnavailable:
            return await self.reject(ctx, Reason.STORE_UNAVAILABLE, headers={"Retry-After": "1"})
        except BodyTimeout:
            return await self._body_timeout(ctx)

    async def _body_timeout(self, ctx: Ctx) -> web.StreamResponse:
        """Nothing was claimed yet (the body is read before ``admit``). The answer is sent
        and the connection closed at once: aiohttp would otherwise keep reading the rest
        of the slow body (its lingering close) before closing."""
        response = await self.reject(ctx, Reason.BODY_TIMEOUT)
        response.force_close()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.prepare(ctx.request)
            await response.write_eof()
        ctx.request.protocol.force_close()
        return response

    async def _overloaded(self, ctx: Ctx) -> web.Response:
        return await self.reject(ctx, Reason.OVERLOADED, headers={"Retry-After": "1"})

    async def _check_lease(self, ctx: Ctx, target: Target) -> web.Response | None:
        """Read-only: a refusal when the token has no current lease, else None."""
        assert target.token_hash is not None
        ctx.admission = await self.store.check_lease(target.token_hash)
        reason = fence.lease_reason(ctx.admission.presented, ctx.admission.now)
        return None if reason is None else await self.reject(ctx, reason)

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: every refusal that needs no body (a stale token, a
        declared length over the limit) is given before the client sends the body."""
        ctx = Ctx(request)
        if request.headers.get("Expect", "").lower() != "100-continue":
            return await self.reject(
                ctx, Reason.INVALID_REQUEST, detail="Only Expect: 100-continue is supported."
            )
        try:
            target = await self._preflight(ctx)
            if isinstance(target, web.StreamResponse):
                return target
            if target.token_hash is not None:
                refusal = await self._check_lease(ctx, target)
                if refusal is not None:
                    return refusal
            limit = target.upstream.max_body_bytes
            if request.content_length is not None and request.content_length > limit:
                ctx.extra["max_body_bytes"] = limit
                return await self.reject(ctx, Reason.BODY_TOO_LARGE)
        except lease_exc.StoreUnavailable:
            return await self.reject(ctx, Reason.STORE_UNAVAILABLE, headers={"Retry-After": "1"})
        if ctx.admission is not None:
            request[LEASE_CHECKED] = ctx.admission
        if request.version >= aiohttp.HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    async def _preflight(self, ctx: Ctx) -> Target | web.StreamResponse:
        """The checks that need neither the body nor the database, in the table's order."""
        request = ctx.request
        target = self._target(request)
        if isinstance(target, str):
            return await self._refuse_framing(ctx, target)
        framing = _framing_problem(request)
        if framing is not None:
            return await self._refuse_framing(ctx, framing)
        name, rest, query = target
        ctx.upstream = upstream = self.upstreams.get(name)
        if upstream is None:
            return await self.reject(
                ctx, Reason.UNKNOWN_UPSTREAM, detail=f"No upstream named {name[:100]!r}."
            )
        if request.method not in upstream.fenced_methods:
            return Target(upstream, rest, query, None)

        presented_tokens = request.headers.getall("Fencing-Token", [])
        if not presented_tokens:
            return await self.reject(ctx, Reason.MISSING_FENCING_TOKEN)
        if len(presented_tokens) > 1:
            return await self.reject(
                ctx, Reason.INVALID_REQUEST, detail="Send exactly one Fencing-Token header."
            )
        token = presented_tokens[0].strip()
        if not tokens.is_well_formed(token):
            return await self.reject(ctx, Reason.INVALID_FENCING_TOKEN)
        if connection_named(request.headers) & PROTECTED:
            return await self.reject(
                ctx,
                Reason.INVALID_REQUEST,
                detail="The Connection header must not name Fencing-Token or Idempotency-Key.",
            )
        key_headers = request.headers.getall("Idempotency-Key", [])
        key = None
        if len(key_headers) == 1:
            key = fence.parse_key(key_headers[0], self.settings.gateway.max_idempotency_key_length)
        if key is None and (key_headers or upstream.require_idempotency_key):
            return await self.reject(ctx, Reason.MISSING_IDEMPOTENCY_KEY)
        ctx.key = key or fence.anonymous_key()
        return Target(upstream, rest, query, tokens.hash_token(token))

    async def _settle_quietly(self, settling: Coroutine[Any, Any, None]) -> None:
        """Store an answer whose response has already started: a failure here (the
        database went away) must not turn into a second response on the same connection.
        The record then stays in flight and turns unknown at its deadline."""
        try:
            await asyncio.shield(settling)
        except Exception:
            log.exception("could not store the answer; its key turns unknown at its deadline")

    async def _refuse_framing(self, ctx: Ctx, detail: str) -> web.StreamResponse:
        """A malformed or ambiguous request: refused, and the connection closed so that
        nothing sent after it on the connection is ever read as a request."""
        response = await self.reject(ctx, Reason.INVALID_REQUEST, detail=detail)
        response.force_close()
        return response

    async def _handle(self, ctx: Ctx, target: Target) -> web.StreamResponse:
        request = ctx.request
        upstream, rest, query, token_hash = target
        if token_hash is None:
            return await self._pass_through(ctx, upstream, rest, query)
        assert ctx.key is not None

        ctx.body = body = await self._read_body(request, upstream)
        if body is None:  # over the limit: but a lease refusal comes first in the table
            ctx.admission = await self.store.check_lease(token_hash)
            reason = fence.lease_reason(ctx.admission.presented, ctx.admission.now)
            ctx.extra["max_body_bytes"] = upstream.max_body_bytes
            return await self.reject(ctx, reason or Reason.BODY_TOO_LARGE)

        ctx.fingerprint = fence.fingerprint(request.method, upstream.name, rest, query, body)
        deadline_in = (
            self.settings.gateway.ordering_wait_seconds
            + upstream.timeout_seconds
            + upstream.connect_timeout_seconds
            + DEADLINE_MARGIN
        )
        # The claim's deadline runs from here; past it, other replicas treat the record as
        # unknown and may move on, so this replica must not forward any more.
        ctx.send_by = time.monotonic() + deadline_in - DEADLINE_MARGIN
        ctx.admission = admission = await self.store.admit(
            WriteRequest(
                token_hash=token_hash,
                key=ctx.key,
                fingerprint=ctx.fingerprint,
                upstream=upstream.name,
                method=request.method,
                path=rest,
                deadline_in=deadline_in,
            )
        )
        reason = fence.lease_reason(admission.presented, admission.now)
        if reason is not None:
            return await self.reject(ctx, reason)
        assert admission.presented is not None
        job_id, generation = admission.presented.job_id, admission.presented.generation

        attempt, back_to, older = admission.attempt, None, admission.older_in_flight
        if not admission.claimed:
            record = admission.record
            if record is None:  # its record vanished between our claim and our read
                return await self.reject(
                    ctx, Reason.REQUEST_IN_PROGRESS, headers={"Retry-After": "1"}
                )
            verdict = fence.record_verdict(
                record, ctx.fingerprint, admission.now, upstream.unknown_outcome
            )
            if verdict.action is Action.REPLAY:
                return await self.replay(ctx, record)
            if verdict.action is Action.REJECT:
                assert verdict.reason is not None
                retry = (
                    {"Retry-After": "1"} if verdict.reason is Reason.REQUEST_IN_PROGRESS else None
                )
                return await self.reject(ctx, verdict.reason, headers=retry)
            attempt = await self.store.take_over(job_id, ctx.key, record, generation, deadline_in)
            if attempt is None:
                return await self.reject(
                    ctx, Reason.REQUEST_IN_PROGRESS, headers={"Retry-After": "1"}
                )
            back_to = record
            older = await self.store.older_in_flight(job_id, generation)
        assert attempt is not None

        if older:
            if not await self._wait_for_older(job_id, generation):
                await self.store.release(job_id, ctx.key, attempt, back_to)
                return await self.reject(ctx, Reason.ORDERING_TIMEOUT, headers={"Retry-After": "1"})
            # While we waited, a newer generation may have been granted or admitted:
            # then this write must not go out after all.
            now_seen = await self.store.check_lease(token_hash)
            reason = fence.lease_reason(now_seen.presented, now_seen.now)
            if reason is None and (now_seen.highest or 0) > generation:
                reason = Reason.STALE_GENERATION
            if reason is not None:
                await self.store.release(job_id, ctx.key, attempt, back_to)
                ctx.admission = now_seen
                return await self.reject(ctx, reason)

        url = _upstream_url(upstream, rest, query)
        headers = forward_headers(request, upstream, job_id, generation)
        return await self._forward(ctx, upstream, url, headers, body, attempt, back_to)

    def _target(self, request: web.Request) -> tuple[str, str, str] | str:
        """(upstream name, rest of the path, raw query), or why the target is refused."""
        if request.method == "CONNECT":
            return "CONNECT is not supported: this is not an open proxy."
        raw = request.raw_path
        if not raw.startswith("/"):
            return "Absolute-form targets are not supported: this is not an open proxy."
        path, _, query = raw.partition("?")
        name, _, rest = path[1:].partition("/")
        name = unquote(name)
        decoded = unquote(rest)
        # Encoded or not, nothing may climb out of the upstream's base path.
        if any(segment in (".", "..") for segment in decoded.replace("\\", "/").split("/")):
            return "Dot-segments are not allowed in the path."
        if "\\" in decoded:
            return "Backslashes are not allowed in the path."
        return name, rest, query

    async def _read_body(self, request: web.Request, upstream: UpstreamSettings) -> bytes | None:
        """The whole body, or None when it is over the upstream's limit."""
        limit = upstream.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return None
        chunks, size = [], 0
        async for chunk in _chunks(request):
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _wait_for_older(self, job_id: str, generation: int) -> bool:
        """Wait (bounded) until no older generation's write to this job is in flight."""
        deadline = time.monotonic() + self.settings.gateway.ordering_wait_seconds
        while time.monotonic() < deadline:
            await asyncio.sleep(ORDERING_POLL)
            if not await self.store.older_in_flight(job_id, generation):
                return True
        return False

    async def _pass_through(
        self, ctx: Ctx, upstream: UpstreamSettings, rest: str, query: str
    ) -> web.StreamResponse:
        body = await self._read_body(ctx.request, upstream)
        if body is None:
            ctx.extra["max_body_bytes"] = upstream.max_body_bytes
            return await self.reject(ctx, Reason.BODY_TOO_LARGE)
        headers = forward_headers(ctx.request, upstream, None, None)
        return await self._forward(
            ctx, upstream, _upstream_url(upstream, rest, query), headers, body, None, None
        )

    async def _forward(
        self,
        ctx: Ctx,
        upstream: UpstreamSettings,
        url: str,
        headers: CIMultiDict[str],
        body: bytes,
        attempt: str | None,
        back_to: Record | None,
    ) -> web.StreamResponse:
        metrics = self._forwarding_metrics(upstream.name)
        started = time.perf_counter()
        if ctx.admission is not None:
            metrics.decision_seconds.observe(started - ctx.started)
        metrics.in_flight.inc()
        try:
            return await self._send(ctx, upstream, url, headers, body, attempt, back_to)
        finally:
            metrics.in_flight.dec()
            if ctx.forwarded:
                metrics.forward_seconds.observe(time.perf_counter() - started)
                metrics.forwarded.inc()

    def _forwarding_metrics(self, name: str) -> ForwardingMetrics:
        """An upstream's labelled series, looked up once (``labels()`` takes a lock and
        builds a key on every call; this runs on every forwarded request)."""
        found = self._by_upstream.get(name)
        if found is None:
            m = self.metrics
            found = self._by_upstream[name] = ForwardingMetrics(
                decision_seconds=m.decision_seconds.labels(name),
                in_flight=m.in_flight.labels(name),
                forward_seconds=m.forward_seconds.labels(name),
                forwarded=m.decisions.labels(name, "forwarded"),
            )
        return found

    async def _send(
        self,
        ctx: Ctx,
        upstream: UpstreamSettings,
        url: str,
        headers: CIMultiDict[str],
        body: bytes,
        attempt: str | None,
        back_to: Record | None,
    ) -> web.StreamResponse:
        """Send to the upstream, stream the answer back, settle the key's record."""
        assert self.session is not None
        request = ctx.request
        presented = ctx.admission.presented if ctx.admission else None
        key = ctx.key or ""
        job_id = presented.job_id if presented else ""
        total = upstream.timeout_seconds
        if attempt is not None and ctx.send_by is not None:
            remaining = ctx.send_by - time.monotonic()
            if remaining <= 0:
                # Stalled (a paused process, a slow database) past the claim's deadline:
                # a newer generation may have gone out meanwhile. Never send late.
                await self.store.release(job_id, key, attempt, back_to)
                return await self.reject(
                    ctx,
                    Reason.ORDERING_TIMEOUT,
                    detail="This write was held past its claim's deadline before it could be "
                    "forwarded; it was not sent. Retry it.",
                    headers={"Retry-After": "1"},
                )
            total = min(total, remaining)
        timeout = aiohttp.ClientTimeout(total=total, sock_connect=upstream.connect_timeout_seconds)
        try:
            upstream_response = await self.session.request(
                request.method,
                URL(url, encoded=True),  # forwarded as sent: no re-quoting of the path
                headers=headers,
                data=io.BytesIO(body) if len(body) > LARGE_BODY else (body or None),
                allow_redirects=False,
                timeout=timeout,
            )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as error:
            # Not sent: the key is free again (or back to its earlier unknown state).
            if attempt is not None:
                await self.store.release(job_id, key, attempt, back_to)
            reason = (
                Reason.UPSTREAM_TIMEOUT
                if isinstance(error, aiohttp.ConnectionTimeoutError)
                else Reason.UPSTREAM_UNAVAILABLE
            )
            return await self.reject(ctx, reason)
        except Exception as error:
            # Sent (or maybe sent), but no answer: whether it was applied is unknown.
            # Anything unexpected lands here too, so no claim is left in flight.
            if not isinstance(error, TimeoutError | aiohttp.ClientError):
                log.exception("forwarding to %s failed unexpectedly", upstream.name)
            if attempt is not None:
                await self.store.settle(
                    job_id,
                    key,
                    attempt,
                    state=RecordState.UNKNOWN,
                    status=None,
                    headers=None,
                    body=None,
                    note=f"no answer: {type(error).__name__}",
                )
            reason = (
                Reason.UPSTREAM_TIMEOUT
                if isinstance(error, TimeoutError)
                else Reason.UPSTREAM_UNAVAILABLE
            )
            return await self.reject(ctx, reason)

        ctx.forwarded = True
        async with upstream_response:
            named = connection_named(upstream_response.headers)
            response_headers = [
                (k, v)
                for k, v in upstream_response.headers.items()
                if k.lower() not in DROP_FROM_UPSTREAM and k.lower() not in named
            ]
            out = web.StreamResponse(
                status=upstream_response.status, reason=upstream_response.reason
            )
            for k, v in response_headers:
                out.headers.add(k, v)
            stored: bytearray | None = bytearray()
            replay_limit = self.settings.gateway.max_replay_body_bytes
            client_gone = False
            complete = False
            # The last chunk is held back until the record is settled: a client that has
            # the whole answer and retries at once must find the answer stored.
            held = b""

            async def send(chunk: bytes) -> None:
                nonlocal client_gone
                if chunk and not client_gone:
                    try:
                        await out.write(chunk)
                    except (ConnectionError, RuntimeError):
                        client_gone = True

            try:
                await out.prepare(request)
            except (ConnectionError, RuntimeError):
                client_gone = True
            try:
                async for chunk in upstream_response.content.iter_any():
                    if stored is not None:
                        if len(stored) + len(chunk) <= replay_limit:
                            stored += chunk
                        else:
                            stored = None
                    await send(held)
                    held = chunk
                complete = True
            except (TimeoutError, aiohttp.ClientError) as error:
                log.warning("upstream %s cut its answer short: %s", upstream.name, error)
            finally:
                if attempt is not None:
                    known = complete and upstream_response.status not in UNKNOWN_STATUSES
                    await self._settle_quietly(
                        self.store.settle(
                            job_id,
                            key,
                            attempt,
                            state=RecordState.COMPLETED if known else RecordState.UNKNOWN,
                            status=upstream_response.status,
                            headers=response_headers,
                            body=bytes(stored) if stored is not None else None,
                            note=None
                            if known
                            else (
                                f"upstream answered {upstream_response.status}"
                                if complete
                                else "the upstream's answer was cut short"
                            ),
                        )
                    )
            if not client_gone:
                if complete:
                    await send(held)
                    if not client_gone:
                        await out.write_eof()
                elif request.transport is not None:
                    request.transport.close()  # the client must not take a cut body as whole
            return out


def connection_named(headers: CIMultiDictProxy[str]) -> set[str]:
    """The header names a ``Connection`` header lists (hop-by-hop for this message)."""
    return {h.strip().lower() for v in headers.getall("Connection", []) for h in v.split(",")}


def _framing_problem(request: web.Request) -> str | None:
    """Body framing we refuse rather than guess at (request smuggling lives here)."""
    codings = [
        c.strip().lower()
        for v in request.headers.getall("Transfer-Encoding", [])
        for c in v.split(",")
        if c.strip()
    ]
    if not codings:
        return None
    if request.version < aiohttp.HttpVersion11:
        return "Transfer-Encoding is not allowed in HTTP/1.0."
    if codings != ["chunked"]:
        return "Only Transfer-Encoding: chunked is supported."
    return None


async def _chunks(request: web.Request) -> AsyncIterator[bytes]:
    """The body as it arrives, within the request's ``BodyTimeouts`` (``BodyTimeout``)."""
    content = request.content
    timeouts = request.get(BODY_TIMEOUTS)
    while True:
        if timeouts is None or content.is_eof():  # all here: no read can wait
            chunk = await content.readany()
        else:
            wait = min(timeouts.idle, timeouts.deadline - asyncio.get_running_loop().time())
            try:
                if wait <= 0:
                    raise TimeoutError
                async with asyncio.timeout(wait):
                    chunk = await content.readany()
            except TimeoutError:
                raise BodyTimeout from None
        if not chunk:
            return
        yield chunk


def _upstream_url(upstream: UpstreamSettings, rest: str, query: str) -> str:
    url = f"{upstream.url}/{rest}"
    return f"{url}?{query}" if query else url


def forward_headers(
    request: web.Request, upstream: UpstreamSettings, job_id: str | None, generation: int | None
) -> CIMultiDict[str]:
    """Client headers minus hop-by-hop, the credential and what we set; plus fencing
    headers, forwarding headers and the upstream's own configured headers."""
    incoming: CIMultiDictProxy[str] = request.headers
    named = connection_named(incoming)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        lower = name.lower()
        if lower in DROP_FROM_CLIENT or lower in named or lower.startswith("x-forwarded-"):
            continue
        out.add(name, value)
    if job_id is not None and generation is not None:
        out["Fencing-Job"] = job_id
        out["Fencing-Generation"] = str(generation)
    previous = incoming.get("X-Forwarded-For")
    remote = request.remote or "unknown"
    out["X-Forwarded-For"] = f"{previous}, {remote}" if previous else remote
    out["X-Forwarded-Proto"] = request.scheme
    out["X-Request-Id"] = REQUEST_ID.get()
    for name, secret in upstream.set_headers.items():
        out[name] = secret.get_secret_value()
    return out


GATEWAY = web.AppKey("gateway", Gateway)


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
    app[GATEWAY] = gateway

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", gateway.handle, expect_handler=gateway.expect)
    return app
