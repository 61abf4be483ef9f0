"""Sending a request to its upstream and streaming the answer back.

The one client to the upstreams (``upstream.UpstreamClient``) lives here. While
the answer streams to the client, the part needed for replay is kept; how the exchange
ended (not sent, no answer, an answer cut short, "not processed", a whole answer)
decides what becomes of the write's claimed key, which the caller keeps (``ClaimedKey``).
An exchange that brought no answer to stream back is reported to the caller (``refuse``)
as what happened (``after_forward.Exchange``, or the answer's meaning for the key); the
answer it gets is ``after_forward``'s to choose.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NamedTuple, Protocol

from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from gateway.config import GatewaySettings, UpstreamSettings
from gateway.fencing.after_forward import Ended, Exchange
from gateway.fencing.fence import RecordState
from gateway.fencing.profiles import Answer
from gateway.observe.metrics import FORWARD, STEPS, GatewayMetrics
from gateway.upstream import (
    ConnectTimeout,
    NoAnswerInTime,
    NotSent,
    UpstreamClient,
    UpstreamError,
    UpstreamResponse,
)
from gateway.upstream.hops import HOP_BY_HOP, connection_named
from lease_core import exceptions as lease_exc

# The proxy listener's one logger, as docs/operations.md names it.
log = logging.getLogger("fencegate.proxy")

DROP_FROM_UPSTREAM = HOP_BY_HOP | {"content-length"}


class ForwardingMetrics(NamedTuple):
    """One upstream's series that every forwarded request touches."""

    decision_seconds: Any
    in_flight: Any
    forward_seconds: Any
    forwarded: Any


class ClaimedKey(Protocol):
    """The idempotency key a fenced write holds while it is forwarded: what the way the
    exchange ended does to its record."""

    async def release(self) -> None:
        """Not sent, or "not processed": the key is free again (or back to its earlier
        unknown outcome)."""

    async def settle(
        self,
        state: RecordState,
        *,
        status: int | None,
        headers: list[tuple[str, str]] | None,
        body: bytes | None,
        note: str | None,
    ) -> None:
        """The upstream's answer (or that the outcome is unknown) kept for the key."""

    async def settle_behind(
        self, *, status: int, headers: list[tuple[str, str]], body: bytes | None
    ) -> None:
        """The upstream's final answer, kept for the key: behind the answer, which then
        does not wait for the database, or before its last byte (with
        ``settle_before_answer``, or while too many records are still being written).
        Called before the answer's last byte goes out, so a duplicate that comes after it
        knows to wait for the record."""


Refuse = Callable[[Ended], Awaitable[web.StreamResponse]]


class Forwarder:
    """The client to the upstreams and every forward that goes through it."""

    def __init__(self, limits: GatewaySettings, metrics: GatewayMetrics) -> None:
        self.limits = limits
        self.metrics = metrics
        self.client: UpstreamClient | None = None
        self._by_upstream: dict[str, ForwardingMetrics] = {}
        self._forward_phase = metrics.phase[FORWARD]  # of fenced writes

    @property
    def started(self) -> bool:
        """The proxy listener is up: requests may be sent."""
        return self.client is not None

    async def start(self) -> None:
        # Nothing is re-sent once any byte of a request has left (gateway/upstream/):
        # a fenced PUT that the upstream applied before it cut the connection must not
        # be applied twice; tests/integration asserts it (a cut connection after a PUT
        # or DELETE reaches the upstream once).
        self.client = UpstreamClient(
            connections_per_host=self.limits.upstream_connections_per_host,
            keepalive_seconds=self.limits.upstream_keepalive_seconds,
            max_head_bytes=self.limits.max_upstream_head_bytes,
        )

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def forward(
        self,
        request: web.Request,
        upstream: UpstreamSettings,
        url: str,
        headers: CIMultiDict[str],
        body: io.BytesIO,
        *,
        key: ClaimedKey | None,
        send_left: float | None,
        refuse: Refuse,
        decided_since: float | None,
    ) -> web.StreamResponse:
        """Send, stream the answer back and settle ``key`` (a fenced write's; None for a
        pass-through). ``send_left``: seconds the key's claim still allows;
        ``decided_since``: when deciding a fenced write began (``time.perf_counter``)."""
        metrics = self._forwarding_metrics(upstream.name)
        started = time.perf_counter()
        if decided_since is not None:
            metrics.decision_seconds.observe(started - decided_since)
        metrics.in_flight.inc()
        try:
            answer = await self._request(request, upstream, url, headers, body, key, send_left)
            if isinstance(answer, Exchange):
                return await refuse(answer)
            if key is not None and _precondition_failed(upstream, headers, answer.status):
                # Not applied (RFC 9110 13.1): not the key's answer, and the worker is
                # told so in the gateway's words rather than in S3's XML.
                answer.close()
                await settle_quietly(key.release())
                return await refuse(Answer.PRECONDITION_FAILED)
            timing = None
            if self.limits.server_timing and decided_since is not None:
                timing = _Timing(request, decided_since, started, time.perf_counter())
            try:
                return await self._stream(request, upstream, answer, key, timing)
            finally:
                took = time.perf_counter() - started
                metrics.forward_seconds.observe(took)
                metrics.forwarded.inc()
                if decided_since is not None:
                    self._forward_phase.observe(took)
        finally:
            metrics.in_flight.dec()

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

    async def _request(
        self,
        request: web.Request,
        upstream: UpstreamSettings,
        url: str,
        headers: CIMultiDict[str],
        body: io.BytesIO,
        key: ClaimedKey | None,
        send_left: float | None,
    ) -> UpstreamResponse | Exchange:
        """The upstream's answer once its head has arrived; else the key settled (not
        sent: released; no answer: unknown) and how the exchange ended."""
        assert self.client is not None
        total = upstream.timeout_seconds
        if key is not None and send_left is not None:
            # Judged right before this (``Gateway._judge_at_send``), nothing awaited since.
            total = min(total, send_left)
        try:
            return await self.client.request(
                request.method,
                url,  # forwarded as sent: no re-quoting of the path
                headers.items(),
                body,
                timeout=total,
                connect_timeout=upstream.connect_timeout_seconds,
            )
        except NotSent as error:
            # Not sent: the key is free again (or back to its earlier unknown state).
            _log_not_sent(upstream, url, error)
            if key is not None:
                await settle_quietly(key.release())
            return (
                Exchange.CONNECT_TIMEOUT if isinstance(error, ConnectTimeout) else Exchange.NOT_SENT
            )
        except Exception as error:
            # Sent (or maybe sent), but no answer: whether it was applied is unknown.
            # Anything unexpected lands here too, so no claim is left in flight.
            _log_no_answer(upstream, url, error)
            if key is not None:
                # Kept as unknown if the database lets us; if not, the claim stays in
                # flight and turns unknown at its deadline: either way the worker is told
                # the truth, that it was sent and its outcome is unknown, never that the
                # store failed (which would mean "never sent, send it again").
                await settle_quietly(
                    key.settle(
                        RecordState.UNKNOWN,
                        status=None,
                        headers=None,
                        body=None,
                        note=f"no answer: {why_no_answer(error)}",
                    )
                )
            return (
                Exchange.NO_ANSWER_IN_TIME
                if isinstance(error, NoAnswerInTime)
                else Exchange.NO_ANSWER
            )

    async def _stream(
        self,
        request: web.Request,
        upstream: UpstreamSettings,
        upstream_response: UpstreamResponse,
        key: ClaimedKey | None,
        timing: _Timing | None = None,
    ) -> web.StreamResponse:
        """Stream the answer back, keeping what a replay needs. A final answer's record
        is settled behind it (``ClaimedKey.settle_behind``), started before its last
        chunk goes out; any other end is kept for the key before the client learns it."""
        async with upstream_response:
            response_headers = answer_headers(upstream_response.headers)
            status, reason = upstream_response.status, upstream_response.reason
            relay = _Relay(request, status, reason, response_headers, timing)
            stored: bytearray | None = bytearray()
            replay_limit = self.limits.max_replay_body_bytes
            complete = False
            # The last piece is held back until the upstream's answer has ended and its
            # record's settle has begun: a cut answer must not reach the client whole.
            held = b""
            try:
                async for chunk in upstream_response:
                    if stored is not None:
                        if len(stored) + len(chunk) <= replay_limit:
                            stored += chunk
                        else:
                            stored = None
                    await relay.send(held)
                    held = chunk
                complete = True
            except UpstreamError as error:
                log.warning("upstream %s cut its answer short: %s", upstream.name, error)
            finally:
                if key is not None:
                    await settle_quietly(
                        _kept_for_key(key, upstream, status, response_headers, stored, complete)
                    )
            if complete and relay.out is None and held:
                # The whole body came in one piece: it goes with its head in one write,
                # framed by its length (a streamed answer takes three).
                whole = web.Response(
                    status=status, reason=reason, body=held, headers=CIMultiDict(response_headers)
                )
                if timing is not None:
                    whole.headers["Server-Timing"] = timing.header()
                with contextlib.suppress(ConnectionError, RuntimeError):  # the client left
                    await whole.prepare(request)
                    await whole.write_eof()
                return whole
            out = await relay.started()
            if not relay.client_gone:
                if complete:
                    await relay.send(held)
                    if not relay.client_gone:
                        await out.write_eof()
                elif request.transport is not None:
                    request.transport.close()  # the client must not take a cut body as whole
            return out


class _Relay:
    """The answer on its way to the client: its head is sent once a second piece arrives
    (``started``), and a client that left is noted, not raised."""

    __slots__ = ("client_gone", "headers", "out", "reason", "request", "status", "timing")

    def __init__(
        self,
        request: web.Request,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        timing: _Timing | None = None,
    ) -> None:
        self.request = request
        self.status = status
        self.reason = reason
        self.headers = headers
        self.timing = timing
        self.out: web.StreamResponse | None = None
        self.client_gone = False

    async def started(self) -> web.StreamResponse:
        if self.out is None:
            out = self.out = web.StreamResponse(status=self.status, reason=self.reason)
            for k, v in self.headers:
                out.headers.add(k, v)
            if self.timing is not None:
                out.headers["Server-Timing"] = self.timing.header()
            try:
                await out.prepare(self.request)
            except (ConnectionError, RuntimeError):
                self.client_gone = True
        return self.out

    async def send(self, chunk: bytes) -> None:
        if chunk and not self.client_gone:
            try:
                await (await self.started()).write(chunk)
            except (ConnectionError, RuntimeError):
                self.client_gone = True


class _Timing:
    """A fenced write's ``Server-Timing`` (``gateway.server_timing``): its steps in the
    gateway (``STEPS``, ms), ``upstream`` from the send to the answer's head, and
    ``gateway`` from the request's first step to this answer's head (the steps, the
    upstream, the gateway's own work between them, and a settle before the answer)."""

    __slots__ = ("began", "headed", "request", "sent")

    def __init__(self, request: web.Request, began: float, sent: float, headed: float) -> None:
        self.request, self.began, self.sent, self.headed = request, began, sent, headed

    def header(self) -> str:
        parts = [f"{name};dur={1000 * s:.3f}" for name, s in self.request.get(STEPS, ())]
        parts.append(f"upstream;dur={1000 * (self.headed - self.sent):.3f}")
        parts.append(f"gateway;dur={1000 * (time.perf_counter() - self.began):.3f}")
        return ", ".join(parts)


def _kept_for_key(
    key: ClaimedKey,
    upstream: UpstreamSettings,
    status: int,
    headers: list[tuple[str, str]],
    stored: bytearray | None,
    complete: bool,
) -> Coroutine[Any, Any, None]:
    """What the answer's end does to the key, to be awaited (not yet started)."""
    answer = upstream.answer_of(status, whole=complete)
    if answer is Answer.NOT_PROCESSED:
        # "Not processed, try later": not the key's answer. The key is free again (or
        # back to its earlier unknown outcome), as if not sent.
        return key.release()
    body = bytes(stored) if stored is not None else None
    if answer is Answer.FINAL:
        return key.settle_behind(status=status, headers=headers, body=body)
    # Not the key's answer yet (the resolver and the operator work from it): kept before
    # the client learns of it.
    return key.settle(
        RecordState.UNKNOWN,
        status=status,
        headers=headers,
        body=body,
        note=f"upstream answered {status}" if complete else "the upstream's answer was cut short",
    )


def answer_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The answer's headers that go on to the client: not the hop-by-hop ones, not those
    its ``Connection`` header names, not its framing (the gateway frames its own)."""
    named = connection_named(headers)
    return [
        (k, v) for k, v in headers if k.lower() not in DROP_FROM_UPSTREAM and k.lower() not in named
    ]


def _address(url: str) -> str:
    """``host:port`` of an upstream URL for the log (never its credentials or query)."""
    parsed = URL(url)
    return f"{parsed.host}:{parsed.port}"


def _log_not_sent(upstream: UpstreamSettings, url: str, error: NotSent) -> None:
    log.warning(
        "%s: not sent to %s: %s",
        upstream.name,
        _address(url),
        error,
        extra={"fields": {"upstream": upstream.name, "sent": False}},
    )


def _log_no_answer(upstream: UpstreamSettings, url: str, error: Exception) -> None:
    """An unexpected failure with its traceback; an upstream's failure as the outcome
    it leaves unknown."""
    if not isinstance(error, UpstreamError):
        log.exception("forwarding to %s failed unexpectedly", upstream.name)
    else:
        log.warning(
            "%s: sent to %s, no answer (outcome unknown): %s",
            upstream.name,
            _address(url),
            why_no_answer(error),
            extra={"fields": {"upstream": upstream.name, "sent": True}},
        )


def why_no_answer(error: Exception) -> str:
    """Why there was no answer, for the record's note. A timeout reads ``TimeoutError``
    (not ``NoAnswerInTime``'s message): the note operators see, as docs/protocol.md
    (``GET /admin/unknown-outcomes``) and docs/operations.md (``fencegate outcomes``)
    show it."""
    if isinstance(error, NoAnswerInTime):
        return "TimeoutError"
    return str(error) if isinstance(error, UpstreamError) else type(error).__name__


def _precondition_failed(
    upstream: UpstreamSettings, headers: CIMultiDict[str], status: int
) -> bool:
    """Whether the answer's head says that the write's own precondition (a create only
    once: ``If-None-Match: *``; an update of a known version: ``If-Match``) was not met;
    the rule is ``answer_of``'s."""
    preconditioned = "If-None-Match" in headers or "If-Match" in headers
    answer = upstream.answer_of(status, precondition=preconditioned)
    return answer is Answer.PRECONDITION_FAILED


def upstream_url(upstream: UpstreamSettings, rest: str, query: str) -> str:
    url = f"{upstream.url}/{rest}"
    return f"{url}?{query}" if query else url


async def settle_quietly(settling: Coroutine[Any, Any, None]) -> bool:
    """What the exchange's end does to the key (release, settle, hold as unknown),
    performed once any byte may have left: a failure here (the database went away) must
    not change what the worker is told (it was sent, or maybe sent; and never a second
    response on the same connection). The record then stays in flight and turns unknown
    at its deadline. Shielded: a cancellation does not stop it half-way. Whether it was
    kept."""
    try:
        await asyncio.shield(settling)
    except lease_exc.StoreUnavailable:
        log.warning("the database is unavailable: the key's record turns unknown at its deadline")
        return False
    except Exception:
        log.exception("could not store the answer; its key turns unknown at its deadline")
        return False
    return True
