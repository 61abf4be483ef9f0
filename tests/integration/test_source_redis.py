"""Locks taken with Fencegate's Redis recipe (a ``kind = "redis"`` lease source), against
a real redis-server (private, in memory only) and a real upstream, on SQLite and
PostgreSQL; the worker side is ``fencegate_client.redis_lock``."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio

from fencegate_client.errors import LeaseHeld
from fencegate_client.redis_lock import AsyncRedisLock, RedisLock
from tests.gateway_helpers import ok, problem
from tests.support import RedisServer, Upstream, free_port, upstream_config


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def source(url: str, **extra: Any) -> dict[str, Any]:
    return {"name": "locks", "kind": "redis", "url": url, **extra}


def token(text: str) -> dict[str, Any]:
    return {"lease_token": text}


def lock_name() -> str:
    return f"order-{uuid.uuid4().hex[:8]}"


async def taken(client: redis.asyncio.Redis, name: str, ttl: float = 30) -> AsyncRedisLock:
    lock = AsyncRedisLock(client, name, ttl_seconds=ttl)
    assert await lock.acquire()
    return lock


async def test_two_workers_take_the_lock_in_turn(
    make_stack: Any, upstream: Upstream, client: redis.asyncio.Redis, redis_url: str
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[source(redis_url)]
    )
    name = lock_name()
    job = f"locks/{name}"
    a = await taken(client, name, ttl=1)
    assert a.fence == 1 and a.token.startswith(f"locks:{name}:1.")
    await ok(await stack.write("/pay/charges", token(a.token), key="step-1"))

    # A pauses past its lock's TTL; B takes the lock (A's acquire is refused meanwhile).
    assert not await AsyncRedisLock(client, name, ttl_seconds=30).acquire()
    await asyncio.sleep(1.2)
    b = await taken(client, name)
    assert b.fence == 2

    # A wakes up and writes late, before B wrote anything: refused.
    doc = await problem(
        await stack.write("/pay/charges", token(a.token), key="step-2", body={"n": 2}),
        409,
        "stale-generation",
    )
    assert (doc["job_id"], doc["generation"], doc["highest_generation"]) == (job, 1, 2)
    # B repeats A's step (replayed, not sent again) and goes on.
    resp = await stack.write("/pay/charges", token(b.token), key="step-1")
    assert resp.headers.get("Idempotent-Replayed") == "true"
    await ok(await stack.write("/pay/charges", token(b.token), key="step-2", body={"n": 2}))
    await problem(
        await stack.write("/pay/charges", token(a.token), key="step-3", body={"n": 3}),
        409,
        "stale-generation",
    )
    # The upstream saw each step once, in generation order, under the namespaced job.
    assert [(r["headers"]["Fencing-Job"], r["generation"]) for r in upstream.received] == [
        (job, "1"),
        (job, "2"),
    ]
    assert all("Fencing-Token" not in r["headers"] for r in upstream.received)
    # Releasing ends B's token at once (nothing is cached).
    assert await b.release()
    await problem(
        await stack.write("/pay/charges", token(b.token), key="step-3"), 409, "lease-ended"
    )
    assert len(upstream.received) == 2
    entries = await stack.audit(job_id=job)
    assert [e["reason"] for e in entries] == [
        "lease-ended",
        "stale-generation",
        "idempotent-replay",
        "stale-generation",
    ]
    assert {e["source"] for e in entries} == {"locks"}
    metrics = await (await stack.control.get("/metrics")).text()
    assert 'reason="stale-generation",source="locks"} 2.0' in metrics


async def test_an_expired_lock_ends_its_token(
    make_stack: Any, upstream: Upstream, client: redis.asyncio.Redis, redis_url: str
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[source(redis_url)]
    )
    lock = await taken(client, lock_name(), ttl=0.3)
    assert await lock.extend(0.3)
    await asyncio.sleep(0.5)
    assert not await lock.extend()  # lost
    await problem(await stack.write("/pay/x", token(lock.token), key="k"), 409, "lease-ended")
    assert upstream.received == []


async def test_forged_and_foreign_tokens_are_invalid(
    make_stack: Any, upstream: Upstream, client: redis.asyncio.Redis, redis_url: str
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[source(redis_url)]
    )
    name = lock_name()
    holder = await taken(client, name)
    forged = [
        f"locks:{name}:1.{'0' * 32}",  # the holder's fence, another random part
        f"locks:{name}:7.{'0' * 32}",  # a fence the counter never reached
        f"locks:never-taken:1.{'0' * 32}",
        f"locks:{name}:1",  # malformed
        f"locks:{name}:01.{'0' * 32}",
        f"locks:{name}",
        f"other:{name}:{holder.value}",  # another source's name
        "etcd:/locks/order-42/694da23c2bd1d005",
    ]
    for bad in forged:
        await problem(
            await stack.write("/pay/x", token(bad), key="k"), 403, "invalid-fencing-token"
        )
    assert upstream.received == []
    await ok(await stack.write("/pay/x", token(holder.token), key="k"))


async def test_a_counter_that_went_backwards_is_refused_with_the_reason(
    make_stack: Any, upstream: Upstream, client: redis.asyncio.Redis, redis_url: str
) -> None:
    """Redis lost the fence counter (here FLUSHALL; a restart without an append-only file
    does the same): the next holder gets generation 1 again, and the fence in the
    database refuses it, saying why and what to configure."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[source(redis_url)]
    )
    name = lock_name()
    for step in ("one", "two"):
        async with AsyncRedisLock(client, name, ttl_seconds=30) as lock:
            await ok(await stack.write("/pay/x", token(lock.token), key=step))
    assert lock.fence == 2
    await client.flushall()
    async with AsyncRedisLock(client, name, ttl_seconds=30) as again:
        assert again.fence == 1
        doc = await problem(
            await stack.write("/pay/x", token(again.token), key="three"), 409, "stale-generation"
        )
    assert (doc["generation"], doc["highest_generation"]) == (1, 2)
    assert "counter went backwards" in doc["detail"] and "appendonly yes" in doc["detail"]
    assert [r["generation"] for r in upstream.received] == ["1", "2"]


async def test_an_unreachable_redis_forwards_nothing(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream)],
        lease_sources=[source(f"redis://127.0.0.1:{free_port()}/0", timeout_seconds=1)],
    )
    await problem(
        await stack.write("/pay/x", token(f"locks:a:1.{'0' * 32}"), key="k"),
        503,
        "store-unavailable",
    )
    assert upstream.received == []


def test_the_sync_lock_is_a_context_manager(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    name = lock_name()
    try:
        with RedisLock(client, name, ttl_seconds=30, source="q") as lock:
            assert lock.token == f"q:{name}:{lock.value}" and lock.fence == 1
            assert lock.extend()
            with pytest.raises(LeaseHeld), RedisLock(client, name, ttl_seconds=30):
                pass
        assert client.get(f"fencegate:lock:{{{name}}}") is None
        assert not lock.release() and not lock.extend()
        with RedisLock(client, name, ttl_seconds=30) as again:
            assert again.fence == 2
    finally:
        client.close()
