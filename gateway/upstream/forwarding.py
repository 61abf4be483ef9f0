"""Sending a request to its upstream and streaming the answer back.

The one client to the upstreams (``upstream.UpstreamClient``) lives here. While
the answer streams to the client, the part needed for replay is kept; how the exchange
ended (not sent, no answer, an answer cut short, "not processed", a whole answer)
decides what becomes of the write's claimed key, which the caller keeps (``EndOfExchange``).
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
from collections.abc import Coroutine
from typing import Any, NamedTuple, Protocol

from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from gateway.config import GatewaySettings, UpstreamSettings
from gateway.fencing.after_forward import Ended, Exchange
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


class KeptAnswer(NamedTuple):
    """What an exchange's end leaves to keep for the key: the answer (or None) and a note
    for the operator where its outcome is unknown."""

    status: int | None = None
    headers: list[tuple[str, str]] | None = None
    body: bytes | None = None
    note: str | None = None


class EndOfExchange(Protocol):
    """The request's side of a forward (``gateway.proxy.held.HeldKey``): told how the
    exchange ended, it does what that means for the write's key (the request's machine
    decides it, the key performs it, a database failure changing nothing of what the
    worker is told), and gives the gateway's own answer where no upstream answer is
    streamed back."""

    async def ended(self, ended: Ended, answer: KeptAnswer | None = None) -> None:
        """How the exchange ended: an ``Exchange`` (not sent, no answer), or the meaning
        of the upstream's answer for the key (``UpstreamSettings.answer_of``). Called
        once, before the answer's last byte goes out, so a duplicate that comes after
        it knows to wait for the record."""

    async def refusal(self) -> web.StreamResponse:
        """The gateway's answer to an exchange that brought no answer to stream back."""


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
        end: EndOfExchange,
        send_left: float | None,
        decided_since: float | None,
    ) -> web.StreamResponse:
        """Send, stream the answer back, and tell ``end`` how the exchange ended (what
        that does to a fenced write's key is the request's to decide). ``send_left``:
        seconds the key's claim still allows; ``decided_since``: when deciding a fenced
        write began (``time.perf_counter``)."""
        metrics = self._forwarding_metrics(upstream.name)
        started = time.perf_counter()
        if decided_since is not None:
            metrics.decision_seconds.observe(started - decided_since)
        metrics.in_flight.inc()
        try:
            answer = await self._request(request, upstream, url, headers, body, end, send_left)
            if answer is None:
                return await end.refusal()
            if _precondition_failed(upstream, headers, answer.status):
                # Not applied (RFC 9110 13.1): not the key's answer, and the worker is
                # told so in the gateway's words rather than in S3's XML.
                answer.close()
                await end.ended(Answer.PRECONDITION_FAILED)
                return await end.refusal()
            # Counted once the upstream has answered, before the answer goes back: a
            # worker process killed right after it answered has counted it.
            metrics.forwarded.inc()
            timing = None
            if self.limits.server_timing and decided_since is not None:
                timing = _Timing(request, decided_since, started, time.perf_counter())
            try:
                return await self._stream(request, upstream, answer, end, timing)
            finally:
                took = time.perf_counter() - started
                metrics.forward_seconds.observe(took)
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
        end: EndOfExchange,
        send_left: float | None,
    ) -> UpstreamResponse | None:
        """The upstream's answer once its head has arrived; else None, ``end`` told how
        the exchange ended (not sent, or sent and no answer)."""
        assert self.client is not None
        total = upstream.timeout_seconds
        if send_left is not None:
            # Judged right before this (the machine fed ``ClaimSeen``), nothing awaited since.
            total = min(total, send_left)
        began: list[bool] = []  # the first byte is about to leave (``sending``)
        try:
            return await self.client.request(
                request.method,
                url,  # forwarded as sent: no re-quoting of the path
                headers.items(),
                body,
                timeout=total,
                connect_timeout=upstream.connect_timeout_seconds,
                sending=lambda: began.append(True),
            )
        except asyncio.CancelledError:
            # Cancelled (a shutdown past its grace, a client gone where handlers are
            # cancelled): before a connection was in hand nothing left, so the key is
            # given back as for any write not sent; after, the outcome is unknown and
            # the claim turns unknown at its deadline.
            if not began:
                await asyncio.shield(end.ended(Exchange.NOT_SENT))
            raise
        except NotSent as error:
            # Not sent: the key is free again (or back to its earlier unknown state).
            _log_not_sent(upstream, url, error)
            timed_out = isinstance(error, ConnectTimeout)
            await end.ended(Exchange.CONNECT_TIMEOUT if timed_out else Exchange.NOT_SENT)
            return None
        except Exception as error:
            # Sent (or maybe sent), but no answer: whether it was applied is unknown.
            # Anything unexpected lands here too, so no claim is left in flight.
            _log_no_answer(upstream, url, error)
            in_time = isinstance(error, NoAnswerInTime)
            await end.ended(
                Exchange.NO_ANSWER_IN_TIME if in_time else Exchange.NO_ANSWER,
                KeptAnswer(note=f"no answer: {why_no_answer(error)}"),
            )
            return None

    async def _stream(
        self,
        request: web.Request,
        upstream: UpstreamSettings,
        upstream_response: UpstreamResponse,
        end: EndOfExchange,
        timing: _Timing | None = None,
    ) -> web.StreamResponse:
        """Stream the answer back, keeping what a replay needs; ``end`` is told what the
        answer means for the key before its last chunk goes out (a final answer's record
        is settled behind it; any other end is kept before the client learns it)."""
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
                await end.ended(
                    upstream.answer_of(status, whole=complete),
                    _kept(status, response_headers, stored, complete),
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


def _kept(
    status: int, headers: list[tuple[str, str]], stored: bytearray | None, complete: bool
) -> KeptAnswer:
    """The upstream's answer as the key keeps it (its body None: over
    ``max_replay_body_bytes``), with the note an unknown outcome shows the operator."""
    note = f"upstream answered {status}" if complete else "the upstream's answer was cut short"
    return KeptAnswer(status, headers, bytes(stored) if stored is not None else None, note)


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


async def settle_quietly(settling: Coroutine[Any, Any, None], *, shielded: bool = True) -> bool:
    """What the exchange's end does to the key (release, settle, hold as unknown),
    performed once any byte may have left: a failure here (the database went away) must
    not change what the worker is told (it was sent, or maybe sent; and never a second
    response on the same connection). The record then stays in flight and turns unknown
    at its deadline. Shielded: a cancellation does not stop it half-way (``shielded``
    False: the caller is a task of its own that nobody cancels, and a shield would only
    cost another task). Whether it was kept."""
    try:
        if shielded:
            await asyncio.shield(settling)
        else:
            await settling
    except lease_exc.StoreUnavailable:
        log.warning("the database is unavailable: the key's record turns unknown at its deadline")
        return False
    except Exception:
        log.exception("could not store the answer; its key turns unknown at its deadline")
        return False
    return True
