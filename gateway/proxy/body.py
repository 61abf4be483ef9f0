"""The request body: read once, up to the upstream's limit and within the body timeouts.

A slow client must not hold a slot for ever: the whole body has a deadline and each
part of it an idle limit, both set when the request comes in (``BODY_TIMEOUTS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator
from typing import NamedTuple

from aiohttp import web

from gateway.config import GatewaySettings, UpstreamSettings
from gateway.fencing.decision import http_error
from gateway.fencing.fence import Hasher
from lease_core.problems import Check, problem_response


class BodyTimeouts(NamedTuple):
    deadline: float  # loop time by which the whole body must have arrived
    idle: float  # longest wait for the next part of it


class BodyTimeout(Exception):
    """The request body did not arrive in time."""


BODY_TIMEOUTS = web.RequestKey("body_timeouts", BodyTimeouts)


def start_body_clock(request: web.Request, limits: GatewaySettings) -> None:
    """The body's time runs from the request's arrival, not from the first read of it."""
    request[BODY_TIMEOUTS] = BodyTimeouts(
        asyncio.get_running_loop().time() + limits.body_timeout_seconds,
        limits.body_idle_timeout_seconds,
    )


async def read_body(
    request: web.Request, upstream: UpstreamSettings, digest: Hasher | None = None
) -> io.BytesIO | None:
    """The whole body, or None when it is over the upstream's limit. Each piece goes
    into the fingerprint as it arrives and into one buffer, so a body costs its size
    once (``max_concurrent_requests`` times ``max_body_bytes`` bounds them all)."""
    limit = upstream.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        return None
    buffer, size = io.BytesIO(), 0
    async for chunk in _chunks(request):
        size += len(chunk)
        if size > limit:
            return None
        if digest is not None:
            digest.update(chunk)
        buffer.write(chunk)
    return buffer


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


def body_deadline_check(limits: GatewaySettings) -> Check:
    """The control listener's bodies (lease and admin calls, a few KiB of JSON) must
    arrive within ``body_timeout_seconds`` too: read whole before the handler runs,
    or answered 408 with the connection closed, so a client that sends a head and then
    trickles its body cannot hold a connection and a handler for ever. A check run by
    the listener's ``problem_middleware``."""

    async def check(request: web.Request) -> web.StreamResponse | None:
        if not request.body_exists or request.content.is_eof():
            return None
        try:
            async with asyncio.timeout(limits.body_timeout_seconds):
                await request.read()  # kept by the request for the handler
        except TimeoutError:
            response = problem_response(
                status=408,
                reason=http_error(408),
                title="Request Timeout",
                detail="The request body did not arrive in time (body_timeout_seconds).",
            )
            # Sent at once, then the connection closed: aiohttp would otherwise keep
            # reading the rest of the slow body (its lingering close) first.
            response.force_close()
            with contextlib.suppress(ConnectionError, RuntimeError):
                await response.prepare(request)
                await response.write_eof()
            request.protocol.force_close()
            return response
        return None

    return check
