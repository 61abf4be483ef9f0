"""Two gateway replicas on one PostgreSQL answer as one: each replica has its own
engine (connection pool), its own apps and no shared memory; only the database is
shared. Duplicates split across replicas reach the upstream once, a reclaim on one
replica fences the other, and generation order holds across them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.config import Settings
from gateway.proxy.gateway import Gateway, create_proxy_app
from gateway.service.server import create_control_app
from lease_core.db import create_engine
from lease_core.store import LeaseStore
from tests.gateway_helpers import ok, problem, until_admitted, until_in_flight
from tests.support import FakeClock, Stack, Upstream, upstream_config

pytestmark = pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)


@pytest.fixture
async def make_replica(
    aiohttp_client: Callable[..., Any], database_url: str, clock: FakeClock
) -> AsyncIterator[Callable[..., Any]]:
    """``await make_replica(**settings)``: one more gateway process on the database."""
    assert database_url.startswith("postgresql")
    replicas: list[tuple[Stack, Any]] = []

    async def make(**overrides: Any) -> Stack:
        settings = Settings(database_url=database_url, **overrides)
        engine = create_engine(database_url)
        store = LeaseStore(engine, clock=clock)
        gateway = Gateway(settings, store)
        control: TestClient[Any, Any] = await aiohttp_client(
            create_control_app(settings, store, gateway)
        )
        proxy: TestClient[Any, Any] = await aiohttp_client(create_proxy_app(gateway))
        stack = Stack(control, proxy)
        replicas.append((stack, engine))
        return stack

    yield make
    for stack, engine in replicas:
        await stack.control.close()
        await stack.proxy.close()
        await engine.dispose()


@pytest.mark.parametrize("count", [2, 3])
async def test_100_duplicates_split_across_replicas_reach_the_upstream_once(
    make_replica: Any, upstream: Upstream, count: int
) -> None:
    config = {"upstreams": [upstream_config(upstream)]}
    replicas = [await make_replica(**config) for _ in range(count)]
    a, b = replicas[0], replicas[1]
    upstream.delay = 0.2
    upstream.body = b'{"id": "ch_once"}'
    lease = await a.lease("job-1")

    async def one(replica: Stack) -> tuple[int, Any, bytes]:
        resp = await replica.write("/pay/charges", lease, key="once", body={"amount": 5})
        return resp.status, resp.headers, await resp.read()

    results = await asyncio.gather(*(one(replicas[i % count]) for i in range(100)))
    assert len(upstream.received) == 1
    kinds = {"forwarded": 0, "replay": 0, "in-progress": 0}
    for status, headers, body in results:
        if status == 201:
            kind = "replay" if headers.get("Idempotent-Replayed") == "true" else "forwarded"
            kinds[kind] += 1
            assert body == b'{"id": "ch_once"}'
        else:
            assert status == 409, body
            assert b'"reason":"request-in-progress"' in body
            assert headers["Retry-After"]
            kinds["in-progress"] += 1
    assert kinds["forwarded"] == 1
    assert sum(kinds.values()) == 100
    # The forwarded answer's record is written behind it: until then another replica
    # answers a duplicate request-in-progress (docs/limits.md); once written, every
    # replica replays it.
    for replica in replicas:
        await replica.written()
    for replica in replicas:
        resp = await replica.write("/pay/charges", lease, key="once", body={"amount": 5})
        assert resp.headers["Idempotent-Replayed"] == "true"
        assert await resp.read() == b'{"id": "ch_once"}'
    assert len(upstream.received) == 1
    # Both replicas read the same audit, once every replica has written its entries.
    for replica in replicas:
        await replica.written()
    assert await a.audit() == await b.audit()


async def test_a_reclaim_on_one_replica_fences_the_other(
    make_replica: Any, upstream: Upstream, clock: FakeClock
) -> None:
    config = {"upstreams": [upstream_config(upstream)]}
    a, b = await make_replica(**config), await make_replica(**config)
    first = await a.lease("job-1", owner="w1", ttl=10)
    await ok(await b.write("/pay/c", first, key="step-1"))
    await b.written()  # the answer's record, written behind it, before a reads it
    clock.advance(11)
    second = await a.lease("job-1", owner="w2", ttl=10)
    doc = await problem(await b.write("/pay/c", first, key="step-2"), 409, "stale-generation")
    assert (doc["generation"], doc["highest_generation"]) == (1, 2)
    await b.written()  # its audit entry, written behind its answer, before a's below
    # The new worker's duplicate of step-1 on the other replica is a replay.
    resp = await a.write("/pay/c", second, key="step-1")
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "true"
    await ok(await b.write("/pay/c", second, key="step-2"))
    doc = await problem(await a.write("/pay/c", first, key="step-3"), 409, "stale-generation")
    assert [r["generation"] for r in upstream.received] == ["1", "2"]
    await a.written()  # its audit entry, written behind its answer
    [stale_b, stale_a] = await b.audit(reason="stale-generation")
    assert stale_a["idempotency_key"] == "step-2" and stale_b["idempotency_key"] == "step-3"


@pytest.mark.parametrize("count", [2, 3])
async def test_generation_order_holds_across_replicas(
    make_replica: Any, upstream: Upstream, clock: FakeClock, engine: AsyncEngine, count: int
) -> None:
    """Workers take turns on one job, leasing through one replica and writing through
    the other, each turn while the previous generation's write is still in flight."""
    config = {
        "upstreams": [upstream_config(upstream, timeout_seconds=2)],
        "gateway": {"ordering_wait_seconds": 3},
    }
    replicas = [await make_replica(**config) for _ in range(count)]
    upstream.delay = 0.15
    writes = []
    started = time.monotonic()
    for turn in range(5):
        if turn:
            clock.advance(1.5)
        lease = await replicas[turn % count].lease("job-1", owner=f"w{turn}", ttl=1)
        via = replicas[(turn + 1) % count]
        writes.append(asyncio.ensure_future(via.write("/pay/w", lease, key=f"w{turn}")))
        await until_admitted(engine, "job-1", f"w{turn}")
    forwarded = []
    for turn, answer in enumerate(await asyncio.gather(*writes)):
        if answer.status == 201:
            await ok(answer)
            forwarded.append(turn + 1)
        elif (await answer.json(content_type=None)).get("reason") == "lease-expired":
            # judged after the clock passed its lease, before the next grant (see
            # test_interleaved_generations_reach_the_upstream_in_order)
            await problem(answer, 409, "lease-expired")
        else:  # superseded while it waited for the older write
            await problem(answer, 409, "stale-generation")
    generations = [int(r["generation"]) for r in upstream.received]
    assert generations == forwarded
    assert generations == sorted(set(generations))
    assert generations[0] == 1 and generations[-1] == 5
    assert upstream.max_in_flight == 1
    assert time.monotonic() - started >= len(generations) * upstream.delay


async def test_the_newer_generation_on_one_replica_waits_for_the_older_on_the_other(
    make_replica: Any, upstream: Upstream, clock: FakeClock
) -> None:
    a = await make_replica(
        upstreams=[upstream_config(upstream, timeout_seconds=2)],
        gateway={"ordering_wait_seconds": 2},
    )
    b = await make_replica(
        upstreams=[upstream_config(upstream, timeout_seconds=2)],
        gateway={"ordering_wait_seconds": 0.1},
    )
    upstream.delay = 0.5
    old = await a.lease("job-1", owner="w1", ttl=1)
    old_write = asyncio.ensure_future(a.write("/pay/w", old, key="old"))
    await until_in_flight(upstream)
    clock.advance(1.5)
    new = await b.lease("job-1", owner="w2", ttl=10)
    # B's wait is short: it times out instead of overtaking A's write.
    await problem(await b.write("/pay/w", new, key="new"), 503, "ordering-timeout")
    # A's wait is long enough.
    new_write = asyncio.ensure_future(a.write("/pay/w", new, key="new"))
    await ok(await old_write)
    await ok(await new_write)
    assert [(r["generation"], r["key"]) for r in upstream.received] == [("1", "old"), ("2", "new")]
    assert upstream.max_in_flight == 1


async def test_an_unknown_outcome_on_one_replica_is_held_on_the_other(
    make_replica: Any, upstream: Upstream
) -> None:
    config = {"upstreams": [upstream_config(upstream)]}
    a, b = await make_replica(**config), await make_replica(**config)
    lease = await a.lease("job-1")
    upstream.status = 504
    await ok(await a.write("/pay/c", lease, key="k"), 504)
    upstream.status = 201
    await problem(await b.write("/pay/c", lease, key="k"), 409, "outcome-unknown")
    resp = await b.control.get("/admin/unknown-outcomes")
    assert [i["key"] for i in (await resp.json())["items"]] == ["k"]
    resp = await b.control.post(
        "/admin/unknown-outcomes/resolve",
        json={"job_id": "job-1", "key": "k", "applied": True, "status": 201, "body": "done"},
    )
    assert resp.status == 200
    resp = await a.write("/pay/c", lease, key="k")
    assert resp.headers["Idempotent-Replayed"] == "true" and await resp.read() == b"done"
    assert len(upstream.received) == 1
