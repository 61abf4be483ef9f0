"""Locks held with ZooKeeper's lock recipe (a ``kind = "zookeeper"`` lease source): real
kazoo ``Lock``s against a real ZooKeeper process, a real upstream, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.recipe.lock import Lock

from fencegate_client.zookeeper import lock_token
from tests.gateway_helpers import ok, problem
from tests.support import Upstream, free_port, upstream_config


@pytest.fixture
def workers(zookeeper_hosts: str) -> Iterator[Any]:
    """``await workers()``: a worker's own kazoo client (its own ZooKeeper session)."""
    clients: list[KazooClient] = []

    async def make() -> KazooClient:
        client = KazooClient(hosts=zookeeper_hosts, timeout=5)
        await asyncio.to_thread(client.start, 10)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.stop()
        client.close()


def source(hosts: str, **extra: Any) -> dict[str, Any]:
    return {"name": "zk", "kind": "zookeeper", "hosts": [hosts], **extra}


def token(lock: Lock) -> dict[str, Any]:
    return {"lease_token": lock_token(lock, source="zk")}


def lock_path() -> str:
    return f"/locks/order-{uuid.uuid4().hex[:8]}"


async def czxid(client: KazooClient, lock: Lock) -> int:
    stat = await asyncio.to_thread(client.exists, f"{lock.path}/{lock.node}")
    return int(stat.czxid)


async def test_two_workers_take_the_lock_in_turn(
    make_stack: Any, upstream: Upstream, workers: Any, zookeeper_hosts: str
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[source(zookeeper_hosts)]
    )
    path = lock_path()
    job = f"zk/{path}"
    zk_a, zk_b = await workers(), await workers()
    lock_a = zk_a.Lock(path, "worker-a")
    assert await asyncio.to_thread(lock_a.acquire, True, 10)
    gen_a = await czxid(zk_a, lock_a)
    token_a = token(lock_a)
    await ok(await stack.write("/pay/charges", token_a, key="step-1"))

    # A stalls past its session (its ephemeral node goes with the session); B takes the
    # lock.
    await asyncio.to_thread(zk_a.stop)
    lock_b = zk_b.Lock(path, "worker-b")
    assert await asyncio.to_thread(lock_b.acquire, True, 10)
    gen_b = await czxid(zk_b, lock_b)
    assert gen_b > gen_a

    # A wakes up and writes late, before B wrote anything: refused.
    doc = await problem(
        await stack.write("/pay/charges", token_a, key="step-2", body={"n": 2}),
        409,
        "stale-generation",
    )
    assert (doc["job_id"], doc["highest_generation"]) == (job, gen_b)
    # B repeats A's step (replayed, not sent again) and goes on.
    resp = await stack.write("/pay/charges", token(lock_b), key="step-1")
    assert resp.headers.get("Idempotent-Replayed") == "true"
    await ok(await stack.write("/pay/charges", token(lock_b), key="step-2", body={"n": 2}))
    # A tries once more: still refused.
    await problem(
        await stack.write("/pay/charges", token_a, key="step-3", body={"n": 3}),
        409,
        "stale-generation",
    )
    # The upstream saw each step once, in generation order, under the namespaced job.
    assert [(r["headers"]["Fencing-Job"], r["generation"]) for r in upstream.received] == [
        (job, str(gen_a)),
        (job, str(gen_b)),
    ]
    # Releasing the lock ends B's token at once (nothing is cached).
    token_b = token(lock_b)
    await asyncio.to_thread(lock_b.release)
    await problem(await stack.write("/pay/charges", token_b, key="step-3"), 409, "lease-ended")
    assert len(upstream.received) == 2
    reasons = [e["reason"] for e in await stack.audit(job_id=job)]
    assert reasons == ["lease-ended", "stale-generation", "idempotent-replay", "stale-generation"]
    replay = (await stack.audit(job_id=job, reason="idempotent-replay"))[0]
    assert replay["owner"] == "worker-b"  # the lock's identifier, the node's data
    # The audit and the metrics name the source.
    assert [e["job_id"] for e in await stack.audit(source="zk")] == [job] * 4
    metrics = await (await stack.control.get("/metrics")).text()
    series = "fencegate_gateway_source_decisions_total"
    assert f'{series}{{reason="forwarded",source="zk"}} 2.0' in metrics
    assert f'{series}{{reason="stale-generation",source="zk"}} 2.0' in metrics
    assert f'{series}{{reason="lease-ended",source="zk"}} 1.0' in metrics


async def test_a_waiting_contender_is_refused_and_fences_nobody(
    make_stack: Any, upstream: Upstream, workers: Any, zookeeper_hosts: str
) -> None:
    """A contender's node is newer (a higher czxid) than the holder's: admitted, it
    would fence the holder off, though it never held the lock."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[source(zookeeper_hosts)]
    )
    path = lock_path()
    zk_a, zk_b = await workers(), await workers()
    holder = zk_a.Lock(path, "holder")
    assert await asyncio.to_thread(holder.acquire, True, 10)
    waiter = zk_b.Lock(path, "waiter")
    waiting = asyncio.ensure_future(asyncio.to_thread(waiter.acquire, True, 30))
    for _ in range(100):  # until its node is there (kazoo creates it, then waits)
        if len(await asyncio.to_thread(holder.contenders)) == 2:
            break
        await asyncio.sleep(0.05)
    assert waiter.node is not None and not waiter.is_acquired
    waiting_token = {"lease_token": f"zk:{path}/{waiter.node}"}
    await problem(await stack.write("/pay/x", waiting_token, key="w"), 403, "invalid-fencing-token")
    await ok(await stack.write("/pay/x", token(holder), key="h"))
    # The holder lets go; the contender now holds the lock, and its token is current.
    await asyncio.to_thread(holder.release)
    assert await asyncio.wait_for(waiting, 30)
    await ok(await stack.write("/pay/x", token(waiter), key="w"))
    assert [r["headers"]["Idempotency-Key"] for r in upstream.received] == ["h", "w"]
    await asyncio.to_thread(waiter.release)


async def test_forged_and_foreign_tokens_are_invalid(
    make_stack: Any, upstream: Upstream, workers: Any, zookeeper_hosts: str
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[source(zookeeper_hosts)]
    )
    path = lock_path()
    zk = await workers()
    lock = zk.Lock(path, "holder")
    assert await asyncio.to_thread(lock.acquire, True, 10)
    node = lock.node
    guid = uuid.uuid4().hex
    for bad in (
        f"zk:{path}/{guid}__lock__0000000099",  # a sequence number not given out yet
        f"zk:/locks/never-{guid[:8]}/{guid}__lock__0000000000",  # no such lock
        f"zk:{path}/{guid}__rlock__0000000000",  # a read lock's node: not accepted
        f"zk:{path}/{node[:-1]}",  # not a lock node's name
        f"zk:{path}//{node}",
        f"zk:locks/{node}",  # not an absolute path
        f"other:{path}/{node}",  # a source that is not configured
        f"{path}/{node}",  # no source at all
    ):
        await problem(
            await stack.write("/pay/x", {"lease_token": bad}, key="k"),
            403,
            "invalid-fencing-token",
        )
    assert upstream.received == []
    await ok(await stack.write("/pay/x", token(lock), key="k"))


async def test_an_unreachable_zookeeper_forwards_nothing(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream)],
        lease_sources=[source(f"127.0.0.1:{free_port()}", timeout_seconds=0.5)],
    )
    guid = uuid.uuid4().hex
    await problem(
        await stack.write("/pay/x", {"lease_token": f"zk:/locks/a/{guid}__lock__0000000000"}),
        503,
        "store-unavailable",
    )
    assert upstream.received == []
