"""Duplicates that wait (``Prefer: wait=N``, RFC 7240), on SQLite and PostgreSQL, with a
real upstream that answers slowly: a retry whose first attempt is still in flight waits
for it and gets its stored answer; at the end of the wait, ``request-in-progress`` as
without the preference. The wait holds no slot and no database connection, ends when
the client goes away, and works across replicas (the first attempt on one, the waiting
retry on another).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.config import Settings
from gateway.proxy.gateway import Gateway, create_proxy_app
from gateway.service.server import create_control_app
from lease_core.db import create_engine
from lease_core.store import LeaseStore
from tests.gateway_helpers import ok, problem, replayed, until_in_flight
from tests.support import Stack, Upstream, upstream_config


class ServeLikeServer(TestServer):
    """A test server whose handlers are not cancelled when their client goes away, as
    under ``fencegate serve`` (aiohttp's test server cancels them)."""

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        return web.AppRunner(self.app, **{**kwargs, "handler_cancellation": False})


@pytest.fixture
async def make_gateway(
    aiohttp_client: Callable[..., Any], database_url: str
) -> AsyncIterator[Callable[..., Any]]:
    """``await make_gateway(pool_size=..., **settings)``: one gateway replica with its
    own engine (connection pool) on the test's database, and its ``Gateway``."""
    made: list[tuple[Stack, Any]] = []

    async def make(*, pool_size: int = 10, **overrides: Any) -> tuple[Stack, Gateway]:
        settings = Settings(database_url=database_url, **overrides)
        engine = create_engine(database_url, pool_size=pool_size)
        store = LeaseStore(engine)
        gateway = Gateway(settings, store)
        control: TestClient[Any, Any] = await aiohttp_client(
            create_control_app(settings, store, gateway)
        )
        proxy: TestClient[Any, Any] = await aiohttp_client(
            ServeLikeServer(create_proxy_app(gateway))
        )
        stack = Stack(control, proxy)
        made.append((stack, engine))
        return stack, gateway

    yield make
    for stack, engine in made:
        await stack.control.close()
        await stack.proxy.close()
        await engine.dispose()


@pytest.fixture
async def fast(aiohttp_server: Callable[..., Any]) -> Upstream:
    """A second upstream that answers at once."""
    up = Upstream()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", up.handler)
    server = await aiohttp_server(app)
    up.url = str(server.make_url("")).rstrip("/")
    return up


WAIT = {"Prefer": "wait=5"}


async def first_in_flight(stack: Stack, upstream: Upstream, lease: Any, key: str = "k") -> Any:
    """The first attempt, sent and reaching the (slow) upstream."""
    first = asyncio.ensure_future(stack.write("/pay/charges", lease, key=key))
    await until_in_flight(upstream)
    return first


async def test_a_waiting_duplicate_gets_the_stored_answer(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    upstream.delay, upstream.body = 0.6, b'{"id": "ch_1"}'
    upstream.headers = {"X-Charge-Id": "ch_1"}
    lease = await stack.lease("job-1")
    first = await first_in_flight(stack, upstream, lease)
    started = time.monotonic()
    again = await stack.write("/pay/charges", lease, key="k", headers=WAIT)
    waited = time.monotonic() - started
    assert await replayed(again) == b'{"id": "ch_1"}'
    assert again.headers["Preference-Applied"] == "wait=5"
    assert again.headers["X-Charge-Id"] == "ch_1"
    assert waited < 4  # woken by the settle, not by the end of the wait
    first_answer = await first
    assert await ok(first_answer) == b'{"id": "ch_1"}'
    assert "Preference-Applied" not in first_answer.headers
    assert len(upstream.received) == 1
    assert [(e["reason"], e["status"]) for e in await stack.audit()] == [("idempotent-replay", 201)]


async def test_at_the_end_of_the_wait_request_in_progress(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    upstream.delay = 2.5
    lease = await stack.lease("job-1")
    first = await first_in_flight(stack, upstream, lease)
    started = time.monotonic()
    again = await stack.write("/pay/charges", lease, key="k", headers={"Prefer": "wait=1"})
    waited = time.monotonic() - started
    await problem(again, 409, "request-in-progress")
    assert again.headers["Retry-After"] == "1"
    assert again.headers["Preference-Applied"] == "wait=1"
    assert 1 <= waited < 2.4
    await ok(await first)
    assert len(upstream.received) == 1


async def test_without_the_preference_nothing_changes(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    upstream.delay = 1.5
    lease = await stack.lease("job-1")
    first = await first_in_flight(stack, upstream, lease)
    for headers in (
        None,
        {"Prefer": "respond-async"},  # another preference only
        {"Prefer": "wait=soon"},  # malformed: ignored
        {"Prefer": "wait=1.5"},
        {"Prefer": "wait=0"},
    ):
        started = time.monotonic()
        again = await stack.write("/pay/charges", lease, key="k", headers=headers)
        await problem(again, 409, "request-in-progress")
        assert "Preference-Applied" not in again.headers
        assert again.headers["Retry-After"] == "1"
        assert time.monotonic() - started < 1
    # The preference changes nothing for a write whose key is not in flight.
    fresh = await stack.write("/pay/charges", lease, key="other", headers=WAIT)
    await ok(fresh)
    assert "Preference-Applied" not in fresh.headers
    await ok(await first)
    replay = await stack.write("/pay/charges", lease, key="k", headers=WAIT)
    await replayed(replay)
    assert "Preference-Applied" not in replay.headers  # answered at once: no wait


async def test_a_first_attempt_that_frees_the_key_tells_the_waiter_to_send_again(
    make_stack: Any, upstream: Upstream
) -> None:
    """The first attempt's answer means "not processed" (503): its key is freed rather
    than stored. The waiter gave its body up when it began to wait (a waiter holds its
    fingerprint, not its body: issue 52), so it is not forwarded: it is told that nothing
    of it was sent (``request-in-progress``, sent never, Retry-After), and sent again it
    is forwarded."""
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    upstream.delay, upstream.status = 0.5, 503
    lease = await stack.lease("job-1")
    first = await first_in_flight(stack, upstream, lease)
    again = await stack.write("/pay/charges", lease, key="k", headers=WAIT)
    doc = await problem(again, 409, "request-in-progress")
    assert doc["sent"] == "never" and again.headers["Retry-After"] == "1"
    assert again.headers["Preference-Applied"] == "wait=5"
    await ok(await first, 503)
    upstream.delay = 0
    await ok(await stack.write("/pay/charges", lease, key="k", headers=WAIT), 503)
    assert len(upstream.received) == 2


@pytest.mark.parametrize("cap", [0, 1])
async def test_the_setting_caps_the_wait(make_stack: Any, upstream: Upstream, cap: int) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], gateway={"max_prefer_wait_seconds": cap}
    )
    upstream.delay = 2.5
    lease = await stack.lease("job-1")
    first = await first_in_flight(stack, upstream, lease)
    started = time.monotonic()
    again = await stack.write("/pay/charges", lease, key="k", headers={"Prefer": "wait=60"})
    waited = time.monotonic() - started
    await problem(again, 409, "request-in-progress")
    if cap:
        assert again.headers["Preference-Applied"] == "wait=1"
        assert 1 <= waited < 2.4
    else:
        assert "Preference-Applied" not in again.headers
        assert waited < 1
    await ok(await first)


async def test_the_wait_holds_no_slot_and_no_database_connection(
    make_gateway: Any, upstream: Upstream, fast: Upstream
) -> None:
    """One connection in the pool and two slots: the first attempt holds one slot
    while it is forwarded, the waiting duplicate none, so writes to another upstream
    go through (admitted and settled on the one connection) while it waits."""
    stack, gateway = await make_gateway(
        pool_size=1,
        upstreams=[upstream_config(upstream), upstream_config(fast, name="fast")],
        gateway={"max_concurrent_requests": 2},
    )
    upstream.delay = 2.0
    lease = await stack.lease("job-1")
    first = await first_in_flight(stack, upstream, lease)
    waiting = asyncio.ensure_future(stack.write("/pay/charges", lease, key="k", headers=WAIT))
    while not len(gateway.settles):  # it is waiting
        await asyncio.sleep(0.005)
    for n in range(5):
        started = time.monotonic()
        await ok(await stack.write("/fast/c", lease, key=f"other-{n}"))
        assert time.monotonic() - started < 0.5
    assert not waiting.done() and gateway.driver.slots["fenced"] == 1  # the first attempt's
    assert await replayed(await waiting) != b""
    await ok(await first)
    assert len(upstream.received) == 1 and len(fast.received) == 5
    assert gateway.driver.slots["fenced"] == 0


async def test_a_client_that_goes_away_ends_the_wait(make_gateway: Any, upstream: Upstream) -> None:
    stack, gateway = await make_gateway(upstreams=[upstream_config(upstream)])
    upstream.delay = 3.0
    lease = await stack.lease("job-1")
    first = await first_in_flight(stack, upstream, lease)
    url = str(stack.proxy.make_url("/pay/charges"))
    headers = {"Fencing-Token": lease["lease_token"], "Idempotency-Key": "k", **WAIT}
    async with aiohttp.ClientSession() as session:
        with pytest.raises(TimeoutError):
            await session.post(
                url, json={"amount": 1}, headers=headers, timeout=aiohttp.ClientTimeout(total=0.5)
            )
    gave_up = time.monotonic()
    while len(gateway.settles):  # the wait ends soon after the client left
        assert time.monotonic() - gave_up < 1, "the wait went on without its client"
        await asyncio.sleep(0.01)
    # Answered (to nobody) and audited, well before the first attempt settled.
    while not (entries := await stack.audit(reason="request-in-progress")):
        assert time.monotonic() - gave_up < 2, "the wait's end was never answered"
        await asyncio.sleep(0.01)
    assert [e["idempotency_key"] for e in entries] == ["k"]
    assert upstream.in_flight == 1
    await ok(await first)
    assert len(upstream.received) == 1


@pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_the_first_attempt_on_one_replica_the_waiting_retry_on_another(
    make_gateway: Any, upstream: Upstream
) -> None:
    config = {"upstreams": [upstream_config(upstream)]}
    (a, _), (b, b_gateway) = await make_gateway(**config), await make_gateway(**config)
    upstream.delay, upstream.body = 1.0, b'{"id": "ch_a"}'
    lease = await a.lease("job-1")
    first = await first_in_flight(a, upstream, lease)
    started = time.monotonic()
    again = await b.write("/pay/charges", lease, key="k", headers=WAIT)
    assert await replayed(again) == b'{"id": "ch_a"}'
    assert again.headers["Preference-Applied"] == "wait=5"
    assert time.monotonic() - started < 3  # found by polling the record, not at the end
    assert await ok(await first) == b'{"id": "ch_a"}'
    # A wait that ends first, on the other replica too.
    upstream.delay = 2.5
    first = await first_in_flight(a, upstream, lease, key="k2")
    again = await b.write("/pay/charges", lease, key="k2", headers={"Prefer": "wait=1"})
    await problem(again, 409, "request-in-progress")
    assert again.headers["Preference-Applied"] == "wait=1"
    assert again.headers["Retry-After"] == "1"
    await ok(await first)
    assert len(upstream.received) == 2
    assert len(b_gateway.settles) == 0
    await b.written()  # b's entries, written behind its answers
    assert [e["reason"] for e in await a.audit()] == ["request-in-progress", "idempotent-replay"]
