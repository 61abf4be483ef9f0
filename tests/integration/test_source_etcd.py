"""Locks held through etcd's lock API (a ``kind = "etcd"`` lease source), against a real
etcd process and a real upstream, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import aiohttp
import pytest

from tests.gateway_helpers import ok, problem
from tests.support import Upstream, upstream_config


def b64(value: str) -> str:
    return base64.b64encode(value.encode()).decode()


class Etcd:
    """A worker's side of etcd: leases and the lock API, over etcd's JSON gateway."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url, self.session = url, session

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(self.url + path, json=body) as resp:
            assert resp.status == 200, await resp.text()
            answer: dict[str, Any] = await resp.json(content_type=None)
            return answer

    async def grant(self, ttl: int) -> str:
        return str((await self.call("/v3/lease/grant", {"TTL": ttl}))["ID"])

    async def lock(self, name: str, lease: str) -> str:
        """The lock key, once the lock is held (etcd's Lock RPC blocks until then)."""
        answer = await self.call("/v3/lock/lock", {"name": b64(name), "lease": lease})
        return base64.b64decode(answer["key"]).decode()

    async def unlock(self, key: str) -> None:
        await self.call("/v3/lock/unlock", {"key": b64(key)})

    async def revoke(self, lease: str) -> None:
        await self.call("/v3/lease/revoke", {"ID": lease})

    async def put(self, key: str, lease: str) -> None:
        await self.call("/v3/kv/put", {"key": b64(key), "value": b64(""), "lease": lease})

    async def revision(self, key: str) -> int:
        kvs = (await self.call("/v3/kv/range", {"key": b64(key)}))["kvs"]
        return int(kvs[0]["create_revision"])

    async def until_expired(self, lease: str, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while int((await self.call("/v3/lease/timetolive", {"ID": lease})).get("TTL", 0)) > 0:
            assert time.monotonic() < deadline, "the lease never expired"
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.2)  # and its keys deleted with it


@pytest.fixture
async def etcd(etcd_url: str) -> Any:
    async with aiohttp.ClientSession() as session:
        yield Etcd(etcd_url, session)


def source(etcd_url: str, **extra: Any) -> dict[str, Any]:
    return {"name": "etcd", "kind": "etcd", "endpoints": [etcd_url], "cache_seconds": 0, **extra}


def token(key: str) -> dict[str, Any]:
    return {"lease_token": f"etcd:{key}"}


def lock_name() -> str:
    return f"/locks/order-{uuid.uuid4().hex[:8]}"


async def test_two_workers_take_the_lock_in_turn(
    make_stack: Any, upstream: Upstream, etcd: Etcd, etcd_url: str
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[source(etcd_url)]
    )
    name = lock_name()
    job = f"etcd/{name}"
    lease_a = await etcd.grant(2)
    key_a = await etcd.lock(name, lease_a)
    gen_a = await etcd.revision(key_a)
    await ok(await stack.write("/pay/charges", token(key_a), key="step-1"))

    # A pauses past its lease (no keep-alive); B takes the lock.
    await etcd.until_expired(lease_a)
    lease_b = await etcd.grant(30)
    key_b = await etcd.lock(name, lease_b)
    gen_b = await etcd.revision(key_b)
    assert gen_b > gen_a

    # A wakes up and writes late, before B wrote anything: refused.
    doc = await problem(
        await stack.write("/pay/charges", token(key_a), key="step-2", body={"n": 2}),
        409,
        "stale-generation",
    )
    assert (doc["job_id"], doc["highest_generation"]) == (job, gen_b)
    # B repeats A's step (replayed, not sent again) and goes on.
    resp = await stack.write("/pay/charges", token(key_b), key="step-1")
    assert resp.headers.get("Idempotent-Replayed") == "true"
    await ok(await stack.write("/pay/charges", token(key_b), key="step-2", body={"n": 2}))
    # A tries once more: still refused.
    await problem(
        await stack.write("/pay/charges", token(key_a), key="step-3", body={"n": 3}),
        409,
        "stale-generation",
    )
    # The upstream saw each step once, in generation order, under the namespaced job.
    assert [(r["headers"]["Fencing-Job"], r["generation"]) for r in upstream.received] == [
        (job, str(gen_a)),
        (job, str(gen_b)),
    ]
    # Releasing the lock ends B's token (its etcd lease lives on).
    await etcd.unlock(key_b)
    await problem(await stack.write("/pay/charges", token(key_b), key="step-3"), 409, "lease-ended")
    # A revoked (or expired) session with nobody newer: lease-expired.
    await etcd.revoke(lease_b)
    await problem(
        await stack.write("/pay/charges", token(key_b), key="step-3"), 409, "lease-expired"
    )
    assert len(upstream.received) == 2
    reasons = [e["reason"] for e in await stack.audit(job_id=job)]
    assert reasons == [
        "lease-expired",
        "lease-ended",
        "stale-generation",
        "idempotent-replay",
        "stale-generation",
    ]


async def test_the_cache_never_admits_a_generation_below_the_fence(
    make_stack: Any, upstream: Upstream, etcd: Etcd, etcd_url: str
) -> None:
    """A held lock is believed for cache_seconds; a newer holder's write raised the
    fence meanwhile, and the admission refuses the older generation all the same."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[source(etcd_url, cache_seconds=10)]
    )
    name = lock_name()
    lease_a = await etcd.grant(30)
    key_a = await etcd.lock(name, lease_a)
    await ok(await stack.write("/pay/x", token(key_a), key="a1"))  # read and cached
    await etcd.revoke(lease_a)
    key_b = await etcd.lock(name, await etcd.grant(30))
    await ok(await stack.write("/pay/x", token(key_b), key="b1"))
    await problem(await stack.write("/pay/x", token(key_a), key="a2"), 409, "stale-generation")
    assert len(upstream.received) == 2


async def test_a_lock_read_as_held_is_believed_only_for_cache_seconds(
    make_stack: Any, upstream: Upstream, etcd: Etcd, etcd_url: str
) -> None:
    """A lock lost after the gateway read it as held (its lease revoked, and nobody newer
    has written) is refused once ``cache_seconds`` have passed since that read."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[source(etcd_url, cache_seconds=0.3)]
    )
    lease = await etcd.grant(30)
    key = await etcd.lock(lock_name(), lease)
    await ok(await stack.write("/pay/x", token(key), key="k1"))  # read and cached
    await etcd.revoke(lease)
    await asyncio.sleep(0.5)
    await problem(await stack.write("/pay/x", token(key), key="k2"), 409, "lease-expired")
    assert len(upstream.received) == 1


async def test_tokens_that_hold_no_lock_are_invalid(
    make_stack: Any, upstream: Upstream, etcd: Etcd, etcd_url: str
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[source(etcd_url)]
    )
    name = lock_name()
    holder = await etcd.lock(name, await etcd.grant(30))
    # A key still waiting for the lock (a higher revision than the holder's) must not
    # fence the holder off: it never held the lock.
    waiter_lease = await etcd.grant(30)
    waiter = f"{name}/{int(waiter_lease):x}"
    await etcd.put(waiter, waiter_lease)
    for bad in (waiter, "no-slash", f"{name}/not-hex", f"{name}/"):
        await problem(
            await stack.write("/pay/x", token(bad), key="k"), 403, "invalid-fencing-token"
        )
    assert upstream.received == []
    await ok(await stack.write("/pay/x", token(holder), key="k"))


async def test_an_unreachable_etcd_forwards_nothing(make_stack: Any, upstream: Upstream) -> None:
    from tests.support import free_port

    stack = await make_stack(
        upstreams=[upstream_config(upstream)],
        lease_sources=[source(f"http://127.0.0.1:{free_port()}", timeout_seconds=1)],
    )
    await problem(
        await stack.write("/pay/x", token("/locks/a/1f"), key="k"), 503, "store-unavailable"
    )
    assert upstream.received == []
