"""The worker clients (asyncio and sync) retry a write answered ``request-in-progress``
with ``Prefer: wait=N``, against a real gateway (one replica on the real clock) and a
slow real upstream, on SQLite and PostgreSQL. What the clients send is seen with the
HTTP libraries' own hooks (aiohttp's trace config, httpx's event hooks)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx
import pytest

from fencegate_client import LeaseClient
from fencegate_client import sync as sync_client
from tests.gateway_helpers import until_in_flight
from tests.support import Stack, Upstream, upstream_config


def base_url(client: Any) -> str:
    return str(client.make_url("")).rstrip("/")


def sent_to_gateway(sent: list[dict[str, str]]) -> list[str | None]:
    """The ``Prefer`` header of each write the client sent to the gateway."""
    lowered = [{n.lower(): v for n, v in h.items()} for h in sent]
    return [h.get("prefer") for h in lowered if "fencing-token" in h]


async def aio_client(stack: Stack, sent: list[dict[str, str]], **kwargs: Any) -> LeaseClient:
    async def on_start(_: Any, __: SimpleNamespace, params: Any) -> None:
        sent.append(dict(params.headers))

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_start)
    session = aiohttp.ClientSession(trace_configs=[trace])
    return LeaseClient(
        base_url(stack.control), gateway_url=base_url(stack.proxy), session=session, **kwargs
    )


async def make(make_stack: Callable[..., Any], upstream: Upstream, **gateway: Any) -> Stack:
    built: Stack = await make_stack(
        upstreams=[upstream_config(upstream)], use_clock=False, gateway=gateway
    )
    return built


async def test_the_async_client_waits_for_the_first_attempt(
    make_stack: Callable[..., Any], upstream: Upstream
) -> None:
    stack = await make(make_stack, upstream)
    upstream.delay, upstream.body = 0.8, b'{"id": "ch_1"}'
    sent: list[dict[str, str]] = []
    client = await aio_client(stack, sent)
    try:
        async with client.acquire("job-1", owner="w1", ttl=30) as lease:
            assert lease is not None
            first = asyncio.ensure_future(lease.http.post("/pay/c", step="charge", json={}))
            await until_in_flight(upstream)
            again = await lease.http.post("/pay/c", step="charge", json={})
            assert again.status == 201 and again.replayed and again.body == b'{"id": "ch_1"}'
            assert again.headers["Preference-Applied"] == "wait=4"
            assert (await first).body == b'{"id": "ch_1"}'
    finally:
        await client.session.close()
    # The first send of each write without the preference; the retry with it.
    assert sent_to_gateway(sent) == [None, None, "wait=4"]
    assert len(upstream.received) == 1


async def test_the_async_client_without_retry_wait_gets_the_409(
    make_stack: Callable[..., Any], upstream: Upstream
) -> None:
    stack = await make(make_stack, upstream)
    upstream.delay = 0.8
    sent: list[dict[str, str]] = []
    client = await aio_client(stack, sent, retry_wait=None)
    try:
        async with client.acquire("job-1", owner="w1", ttl=30) as lease:
            assert lease is not None
            first = asyncio.ensure_future(lease.http.post("/pay/c", step="charge", json={}))
            await until_in_flight(upstream)
            again = await lease.http.post("/pay/c", step="charge", json={})
            assert again.status == 409 and again.problem is not None
            assert again.problem["reason"] == "request-in-progress"
            await first
    finally:
        await client.session.close()
    assert sent_to_gateway(sent) == [None, None]


@pytest.mark.parametrize("cap", [0, 1])
async def test_the_async_client_stops_when_the_gateway_does_not_or_no_longer_waits(
    make_stack: Callable[..., Any], upstream: Upstream, cap: int
) -> None:
    """Cap 0: the gateway does not wait, so one retry only. Cap 1 with a first attempt
    that takes longer than the client's retry_wait: retries until retry_wait is spent."""
    stack = await make(make_stack, upstream, max_prefer_wait_seconds=cap)
    upstream.delay = 3.5
    sent: list[dict[str, str]] = []
    client = await aio_client(stack, sent, retry_wait=2.5)
    try:
        async with client.acquire("job-1", owner="w1", ttl=30) as lease:
            assert lease is not None
            first = asyncio.ensure_future(lease.http.post("/pay/c", step="charge", json={}))
            await until_in_flight(upstream)
            again = await lease.http.post("/pay/c", step="charge", json={})
            assert again.status == 409 and again.problem is not None
            assert again.problem["reason"] == "request-in-progress"
            await first
    finally:
        await client.session.close()
    retries = sent_to_gateway(sent)[2:]
    if cap == 0:
        assert retries == ["wait=2"]
        assert "Preference-Applied" not in again.headers
    else:
        assert retries == ["wait=2", "wait=1"]  # the gateway waits 1 s each time
        assert again.headers["Preference-Applied"] == "wait=1"


async def test_the_sync_client_waits_for_the_first_attempt(
    make_stack: Callable[..., Any], upstream: Upstream
) -> None:
    stack = await make(make_stack, upstream)
    upstream.delay, upstream.body = 0.8, b'{"id": "ch_2"}'
    sent: list[dict[str, str]] = []

    def record(request: httpx.Request) -> None:
        sent.append(dict(request.headers))

    def two_threads(retry_wait: float | None) -> tuple[Any, Any]:
        """The first attempt from one thread, the retry from another while it is in
        flight (as a worker whose first attempt it stopped waiting for)."""
        http = httpx.Client(event_hooks={"request": [record]})
        with sync_client.LeaseClient(
            base_url(stack.control),
            gateway_url=base_url(stack.proxy),
            http=http,
            retry_wait=retry_wait,
        ) as client:
            lease = client.acquire(f"job-{retry_wait}", owner="w1", ttl=30).take()
            assert lease is not None
            results: list[Any] = []

            def send() -> None:
                results.append(lease.http.post("/pay/c", step="charge", json={}))

            first = threading.Thread(target=send)
            first.start()
            while upstream.in_flight == 0:
                threading.Event().wait(0.005)
            again = lease.http.post("/pay/c", step="charge", json={})
            first.join()
            lease.release()
        http.close()
        return results[0], again

    first_answer, again = await asyncio.to_thread(two_threads, 5.0)
    assert first_answer.status == 201 and not first_answer.replayed
    assert again.status == 201 and again.replayed and again.body == b'{"id": "ch_2"}'
    assert again.headers["Preference-Applied"] == "wait=4"
    assert sent_to_gateway(sent) == [None, None, "wait=4"]
    sent.clear()
    _, again = await asyncio.to_thread(two_threads, None)
    assert again.status == 409
    assert sent_to_gateway(sent) == [None, None]
    assert len(upstream.received) == 2
