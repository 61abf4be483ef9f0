"""What a worker is told when the store fails, a duplicate waits, or the gateway shuts
down is true (issue 52), on SQLite and PostgreSQL, with real upstreams and a real failing
database: another process holding SQLite's file locked past the busy timeout, or
PostgreSQL refusing connections with every session cut.

- A write the upstream received is never answered ``store-unavailable`` (sent never):
  its connection cut, it is ``upstream-connection-lost`` (sent maybe), whether or not the
  database could record its unknown outcome.
- A write that never left gives its claim back even when the database refused the
  release at first: once the database answers, the key is free, never "unknown".
- A shutdown ends the wait of a write queued behind an older generation: it is answered
  ``ordering-timeout`` (sent never) before the listener closes, and its claim given back.
- A duplicate that waited gets the stored answer without competing for a forwarding slot.
- An ``Expect`` refusal is audited with its upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.config import Settings
from gateway.proxy.gateway import GATEWAY, Gateway, create_proxy_app
from gateway.records.store import GatewayStore
from gateway.service.server import create_control_app
from lease_core.db import create_engine
from lease_core.store import LeaseStore
from tests.gateway_helpers import ok, problem, replayed, until_admitted, until_in_flight
from tests.support import Stack, Upstream, pg_admin, upstream_config


@contextlib.asynccontextmanager
async def store_broken(database_url: str) -> AsyncIterator[None]:
    """The gateway's database failing for as long as the block lasts: SQLite's file held
    under an exclusive lock by another process (past the gateway's busy timeout);
    PostgreSQL refusing connections, every session of the database cut."""
    if database_url.startswith("sqlite"):
        path = database_url.split("///", 1)[1]
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sqlite3, sys\n"
                f"c = sqlite3.connect({path!r}, isolation_level=None)\n"
                "c.execute('BEGIN EXCLUSIVE')\n"
                "print('locked', flush=True)\n"
                "sys.stdin.read()\n",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert holder.stdout is not None and holder.stdin is not None
        line = await asyncio.to_thread(holder.stdout.readline)
        assert line.strip() == b"locked", line
        try:
            yield
        finally:
            holder.stdin.close()
            await asyncio.to_thread(holder.wait, 10)
            holder.stdout.close()
        return
    database = database_url.rsplit("/", 1)[1]
    await pg_admin(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
    try:
        await pg_admin(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{database}' AND pid <> pg_backend_pid()"
        )
        yield
    finally:
        await pg_admin(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')


async def until_waiting(gateway: Gateway, wait: str, count: int, timeout: float = 10) -> None:
    """Until ``count`` requests wait (``fencegate_gateway_waiting_requests{wait}``)."""
    deadline = time.monotonic() + timeout
    while gateway.metrics.waiting.labels(wait)._value.get() < count:
        assert time.monotonic() < deadline, f"fewer than {count} request(s) waited ({wait})"
        await asyncio.sleep(0.01)


class CuttingUpstream:
    """An upstream that receives a write, breaks the gateway's database (``breaks``),
    then cuts the connection without answering: the write was sent, its outcome is
    unknown, and the gateway's settle of that fails."""

    def __init__(self, breaks: Callable[[], contextlib.AbstractAsyncContextManager[None]]):
        self.breaks = breaks
        self.received: list[str | None] = []
        self.broken: contextlib.AsyncExitStack | None = None
        self.url = ""

    async def handler(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.received.append(request.headers.get("Idempotency-Key"))
        self.broken = contextlib.AsyncExitStack()
        await self.broken.enter_async_context(self.breaks())
        assert request.transport is not None
        request.transport.close()
        return web.Response(status=201)

    async def heal(self) -> None:
        if self.broken is not None:
            await self.broken.aclose()
            self.broken = None


async def test_a_sent_write_is_never_told_the_store_failed(
    make_stack: Callable[..., Awaitable[Stack]],
    aiohttp_server: Callable[..., Any],
    database_url: str,
) -> None:
    """Item 1: the upstream got the write and cut the connection while the database
    failed. The worker is told the truth, sent and outcome unknown, not "store
    unavailable, try again" (which would make a worker with a new key charge twice)."""
    up = CuttingUpstream(lambda: store_broken(database_url))
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", up.handler)
    server = await aiohttp_server(app)
    up.url = str(server.make_url("")).rstrip("/")
    stack = await make_stack(upstreams=[{"name": "pay", "url": up.url}], use_clock=False)
    lease = await stack.lease("job-1")
    try:
        resp = await stack.write("/pay/charges", lease, key="pay-1")
        doc = await problem(resp, 502, "upstream-connection-lost")
        assert doc["sent"] == "maybe"
        assert "Retry-After" not in resp.headers
    finally:
        await up.heal()
    assert up.received == ["pay-1"]
    # Never sent again: the same key is in progress (its record in flight until its
    # deadline, then unknown), never forwarded a second time.
    again = await stack.write("/pay/charges", lease, key="pay-1")
    assert again.status == 409, await again.text()
    assert (await again.json())["reason"] in ("request-in-progress", "outcome-unknown")
    assert up.received == ["pay-1"]


@contextlib.contextmanager
def black_hole() -> Iterator[int]:
    """A port whose connections are never accepted: a listening socket with a backlog of
    one, already full, so a new connection's SYN is dropped and the connect times out
    (nothing of a request is ever sent)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(2):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield port
    finally:
        for sock in (*fillers, listener):
            sock.close()


async def test_a_write_never_sent_gives_its_claim_back_once_the_store_answers(
    make_stack: Callable[..., Awaitable[Stack]], engine: AsyncEngine, database_url: str
) -> None:
    """Item 5's cause, with the store: the upstream never accepts the connection (nothing
    sent) and meanwhile the database fails, so the claim's release is refused. The
    worker is told ``upstream-unavailable`` (sent never, Retry-After); the claim is owed
    and given back by the background loop once the database answers: the key is then
    free, never listed as an unknown outcome."""
    with black_hole() as port:
        stack = await make_stack(
            upstreams=[
                {
                    "name": "pay",
                    "url": f"http://127.0.0.1:{port}",
                    "connect_timeout_seconds": 1.5,
                }
            ],
            use_clock=False,
        )
        gateway = stack.proxy.server.app[GATEWAY]
        lease = await stack.lease("job-1")
        write = asyncio.ensure_future(stack.write("/pay/charges", lease, key="pay-1"))
        await until_admitted(engine, lease["job_id"], "pay-1")
        async with store_broken(database_url):
            resp = await write
            doc = await problem(resp, 502, "upstream-unavailable")
            assert doc["sent"] == "never" and resp.headers["Retry-After"] == "1"
            assert gateway.releases.owed == 1
    deadline = time.monotonic() + 15
    while gateway.releases.owed:
        assert time.monotonic() < deadline, "the owed release was never paid"
        await asyncio.sleep(0.1)
    assert await gateway.store.record(lease["job_id"], "pay-1") is None
    resp = await stack.control.get("/admin/unknown-outcomes")
    assert (await resp.json())["items"] == []


class GraceServer(TestServer):
    """The proxy's test server with a short shutdown grace, as ``fencegate serve``'s
    ``shutdown_timeout_seconds``; handlers are not cancelled when a client leaves."""

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        return web.AppRunner(
            self.app, **{**kwargs, "handler_cancellation": False, "shutdown_timeout": 1.0}
        )


async def test_a_shutdown_answers_a_waiting_write_never_sent_and_frees_its_key(
    aiohttp_client: Callable[..., Any], database_url: str, upstream: Upstream
) -> None:
    """Item 5: a newer generation's write waits behind an older one whose upstream is slow
    (longer than the shutdown's grace). The shutdown answers it ``ordering-timeout``
    (sent never, Retry-After) before the listener closes, and gives its claim back: after
    a restart the key is free, never an unknown outcome."""
    settings = Settings(
        database_url=database_url,
        upstreams=[upstream_config(upstream)],
        gateway={"ordering_wait_seconds": 30},
    )
    engine = create_engine(database_url)
    store = LeaseStore(engine)
    gateway = Gateway(settings, store)
    control: TestClient[Any, Any] = await aiohttp_client(
        create_control_app(settings, store, gateway)
    )
    proxy_server = GraceServer(create_proxy_app(gateway))
    await proxy_server.start_server()
    session = aiohttp.ClientSession()
    stack = Stack(control, None)  # type: ignore[arg-type]
    try:
        upstream.delay = 5.0
        old = await stack.lease("job-1")
        url = str(proxy_server.make_url("/pay/charges"))
        headers = {"Fencing-Token": old["lease_token"], "Idempotency-Key": "old-step"}
        first = asyncio.ensure_future(session.post(url, json={}, headers=headers))
        await until_in_flight(upstream)
        new = await stack.lease("job-1")  # the same owner again: a newer generation
        headers = {"Fencing-Token": new["lease_token"], "Idempotency-Key": "new-step"}
        waiting = asyncio.ensure_future(session.post(url, json={}, headers=headers))
        await until_waiting(gateway, "older", 1)
        closing = asyncio.ensure_future(proxy_server.close())
        resp = await asyncio.wait_for(waiting, 5)
        doc = await problem(resp, 503, "ordering-timeout")
        assert doc["sent"] == "never" and resp.headers["Retry-After"] == "1"
        await closing
        with contextlib.suppress(aiohttp.ClientError):
            (await first).release()
        assert "new-step" not in [r["key"] for r in upstream.received]
        # The never-sent write's key is free: nothing to resolve, nothing in flight.
        assert await GatewayStore(store).record(new["job_id"], "new-step") is None
        # The older write had left (the upstream holds it) when the shutdown cut it off:
        # its key is kept, its outcome unknown, never given back as never sent.
        sent = await GatewayStore(store).record(old["job_id"], "old-step")
        assert sent is not None and sent.state in ("in_flight", "unknown"), sent
    finally:
        await session.close()
        await control.close()
        await proxy_server.close()
        await engine.dispose()


async def test_waiting_duplicates_get_the_stored_answer_without_a_slot(
    make_stack: Callable[..., Awaitable[Stack]], upstream: Upstream
) -> None:
    """Items 3 and 4: with one forwarding slot, a dozen duplicates wait for the first
    attempt (each took the slot for its body, then gave it back and its body up); when
    it settles, every one gets the stored answer: none is ``gateway-overloaded``,
    since an answer from the store needs no forwarding slot."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], gateway={"max_concurrent_requests": 2}
    )
    gateway = stack.proxy.server.app[GATEWAY]
    upstream.delay = 1.5
    lease = await stack.lease("job-1")
    first = asyncio.ensure_future(stack.write("/pay/charges", lease, key="k", body={"n": 1}))
    await until_in_flight(upstream)
    waiters = []
    for count in range(1, 13):
        waiters.append(
            asyncio.ensure_future(
                stack.write(
                    "/pay/charges", lease, key="k", body={"n": 1}, headers={"Prefer": "wait=10"}
                )
            )
        )
        await until_waiting(gateway, "first", count)
    await ok(await first)
    for waiter in waiters:
        await replayed(await waiter)
    assert len(upstream.received) == 1


async def test_an_expect_refusal_is_audited_with_its_upstream(
    make_stack: Callable[..., Awaitable[Stack]], upstream: Upstream
) -> None:
    """Item 7: an ``Expect`` other than ``100-continue`` is refused, and its audit entry
    names the upstream it was for."""
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    resp = await stack.write("/pay/charges", lease, key="k", headers={"Expect": "something"})
    await problem(resp, 400, "invalid-request")
    resp = await stack.control.get("/admin/rejections", params={"reason": "invalid-request"})
    [entry] = (await resp.json())["items"]
    assert entry["upstream"] == "pay"
    assert upstream.received == []


async def test_a_cancelled_wait_gives_its_claim_back(
    make_stack: Callable[..., Awaitable[Stack]], upstream: Upstream
) -> None:
    """Any end of a request before its send gives its claim back, a cancellation too (the
    test server cancels a handler whose client left, as a shutdown past its grace does):
    a newer generation's write waiting behind an older one, its client gone, leaves its
    key free, never in flight until it turns unknown."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], gateway={"ordering_wait_seconds": 30}
    )
    gateway = stack.proxy.server.app[GATEWAY]
    upstream.delay = 5.0
    old = await stack.lease("job-1")
    first = asyncio.ensure_future(stack.write("/pay/charges", old, key="old-step"))
    await until_in_flight(upstream)
    new = await stack.lease("job-1")  # the same owner again: a newer generation
    url = str(stack.proxy.make_url("/pay/charges"))
    headers = {"Fencing-Token": new["lease_token"], "Idempotency-Key": "new-step"}
    async with aiohttp.ClientSession() as session:
        waiting = asyncio.ensure_future(session.post(url, json={}, headers=headers))
        await until_waiting(gateway, "older", 1)
        assert await gateway.store.record(new["job_id"], "new-step") is not None
        waiting.cancel()  # the client leaves: its connection closes
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
    deadline = time.monotonic() + 5
    while await gateway.store.record(new["job_id"], "new-step") is not None:
        assert time.monotonic() < deadline, "the cancelled write's claim was never given back"
        await asyncio.sleep(0.05)
    await ok(await first)
    assert "new-step" not in [r["key"] for r in upstream.received]


async def test_a_write_cancelled_while_waiting_for_a_connection_was_never_sent(
    make_stack: Callable[..., Awaitable[Stack]], upstream: Upstream
) -> None:
    """A write whose forward has begun but which waits for a connection to the upstream
    (all of them busy) has sent nothing yet: cancelled there (its client gone), its key
    is given back, not left in flight to turn unknown."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], gateway={"upstream_connections_per_host": 1}
    )
    gateway = stack.proxy.server.app[GATEWAY]
    upstream.delay = 3.0
    busy = await stack.lease("job-busy")
    first = asyncio.ensure_future(stack.write("/pay/charges", busy, key="busy"))
    await until_in_flight(upstream)
    lease = await stack.lease("job-1")
    url = str(stack.proxy.make_url("/pay/charges"))
    headers = {"Fencing-Token": lease["lease_token"], "Idempotency-Key": "queued"}
    async with aiohttp.ClientSession() as session:
        queued = asyncio.ensure_future(session.post(url, json={}, headers=headers))
        deadline = time.monotonic() + 10
        while await gateway.store.record(lease["job_id"], "queued") is None:
            assert time.monotonic() < deadline, "the queued write was never admitted"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # past the admission: waiting for the one connection
        queued.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await queued
    deadline = time.monotonic() + 5
    while await gateway.store.record(lease["job_id"], "queued") is not None:
        assert time.monotonic() < deadline, "the never-sent write's claim was kept"
        await asyncio.sleep(0.05)
    await ok(await first)
    assert [r["key"] for r in upstream.received] == ["busy"]
