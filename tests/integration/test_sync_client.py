"""The synchronous worker client (``fencegate_client.sync``) against a real lease API and
a real gateway (one replica on the real clock), on SQLite and PostgreSQL.

The servers run on the test's event loop; the client is synchronous, so each test's
worker code runs in a thread (``asyncio.to_thread``) while the loop serves it, as a
worker process would run beside the gateway. Nothing of ours is mocked.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from fencegate_client import errors as exc
from fencegate_client import step_key
from fencegate_client.sync import Lease, LeaseClient
from tests.support import Stack, Upstream, upstream_config


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def base_url(client: Any) -> str:
    return str(client.make_url("")).rstrip("/")


@pytest.fixture
async def stack(make_stack: Callable[..., Any], upstream: Upstream) -> Stack:
    built: Stack = await make_stack(upstreams=[upstream_config(upstream)], use_clock=False)
    return built


def sync_client(stack: Stack) -> LeaseClient:
    return LeaseClient(base_url(stack.control), gateway_url=base_url(stack.proxy))


def in_thread(work: Callable[[LeaseClient], Any], stack: Stack) -> Any:
    def run() -> Any:
        with sync_client(stack) as client:
            return work(client)

    return asyncio.to_thread(run)


async def test_renewal_in_a_thread_keeps_the_lease_and_each_step_lands_once(
    stack: Stack, upstream: Upstream
) -> None:
    queue = unique("q")

    def work(client: LeaseClient) -> tuple[Lease, dict[str, Any]]:
        job = client.enqueue(queue=queue, payload={"amount": 500})
        # Renewed every third of the TTL: two seconds leave one and a third for a
        # renewal to land on a busy machine (one second failed there once in a run with
        # both cores taken by other processes).
        with client.claim(queue, owner="sync-worker", ttl=2) as lease:
            assert lease is not None and lease.job_id == job["job_id"]
            assert lease.payload == {"amount": 500}
            granted = lease.expires_at
            deadline = time.monotonic() + 5  # two and a half TTLs
            while time.monotonic() < deadline:
                assert lease.held, lease.lost_reason
                time.sleep(0.1)
            assert lease.expires_at != granted
            assert client.get_job(lease.job_id)["state"] == "leased"
            first = lease.http.post("/pay/charges", step="charge", json={"amount": 500})
            again = lease.http.post("/pay/charges", step="charge", json={"amount": 500})
            assert first.status == 201 and not first.replayed
            assert again.status == 201 and again.replayed and again.body == first.body
            done = lease.complete({"charge": first.json()})
            assert done["state"] == "completed" and not lease.held
        return lease, client.get_job(lease.job_id)

    lease, job = await in_thread(work, stack)
    assert job["state"] == "completed"
    (call,) = upstream.received
    assert call["key"] == step_key(lease.job_id, "charge")
    assert call["generation"] == str(lease.generation)
    assert "Fencing-Token" not in call["headers"]
    assert lease._renewer is None  # the thread is gone


async def test_lease_lost_during_renewal_surfaces_as_lease_lost(
    stack: Stack, upstream: Upstream
) -> None:
    job_id = unique("takeover")

    def work(client: LeaseClient) -> None:
        # A TTL of 3 s: renewed every second, the takeover is seen at a renewal long before
        # the lease could lapse on a loaded machine (with 1 s, a renewal that came late
        # was judged a lapse, LeaseExpired, in one CI run).
        with client.acquire(job_id, owner="w", ttl=3) as first:
            assert first is not None
            # The same owner acquiring again (a restarted process): a newer generation.
            second = client.acquire(job_id, owner="w", ttl=30).take()
            assert second is not None and second.generation > first.generation
            assert first.lost.wait(5), "the renewing thread did not notice the takeover"
            assert isinstance(first.lost_reason, exc.StaleGeneration)
            assert not first.held
            with pytest.raises(exc.StaleGeneration):
                first.http.post("/pay/charges", step="charge", json={"amount": 1})
            with pytest.raises(exc.LeaseLost):
                first.complete()
        # Leaving the block did not touch the newer lease.
        job = client.get_job(job_id)
        assert job["state"] == "leased" and job["generation"] == second.generation
        second.release()

    await in_thread(work, stack)
    assert upstream.received == []


async def test_late_write_of_an_expired_lease_is_refused(stack: Stack, upstream: Upstream) -> None:
    job_id = unique("stalled")

    def work(client: LeaseClient) -> None:
        stalled = client.acquire(job_id, owner="slow", ttl=1).take()  # never renewed
        assert stalled is not None
        time.sleep(1.2)
        thief = client.acquire(job_id, owner="fast", ttl=30).take()
        assert thief is not None and thief.generation > stalled.generation
        assert not stalled.held
        with pytest.raises(exc.LeaseExpired):
            stalled.http.post("/pay/charges", step="charge", json={"amount": 1})
        assert stalled.lost.is_set()
        with pytest.raises(exc.LeaseLost):
            stalled.renew()
        answer = thief.http.post("/pay/charges", step="charge", json={"amount": 1})
        assert answer.status == 201 and not answer.replayed
        thief.complete("done")
        assert client.get_job(job_id)["result"] == "done"

    await in_thread(work, stack)
    assert [c["path"] for c in upstream.received] == ["/charges"]


async def test_a_lease_the_gateway_refuses_is_marked_lost(stack: Stack, upstream: Upstream) -> None:
    """Only the gateway can tell a superseded lease apart: the client learns it there."""
    job_id = unique("regrant")

    def work(client: LeaseClient) -> None:
        first = client.acquire(job_id, owner="restarting", ttl=30).take()
        second = client.acquire(job_id, owner="restarting", ttl=30).take()
        assert first is not None and second is not None
        assert first.held  # locally nothing tells
        with pytest.raises(exc.StaleGeneration):
            first.http.post("/pay/charges", step="charge", json={"amount": 9})
        assert first.lost.is_set() and isinstance(first.lost_reason, exc.StaleGeneration)
        second.complete()

    await in_thread(work, stack)
    assert upstream.received == []
    audit = await stack.audit(job_id=job_id)
    assert [item["reason"] for item in audit] == ["stale-generation"]


async def test_leaving_the_block_releases_and_an_error_fails(stack: Stack) -> None:
    queue = unique("q")

    def work(client: LeaseClient) -> None:
        job = client.enqueue(queue=queue)
        with client.claim(queue, owner="w1", ttl=30) as lease:
            assert lease is not None and lease.job_id == job["job_id"]
        assert lease.ended and not lease.held
        after = client.get_job(job["job_id"])
        assert after["state"] == "pending" and after["attempts"] == 0
        with pytest.raises(exc.LeaseEnded):
            lease.check()

        with pytest.raises(KeyError):
            with client.claim(queue, owner="w2", ttl=30) as again:
                assert again is not None and again.generation > lease.generation
                raise KeyError("customer")
        failed = client.get_job(job["job_id"])
        assert failed["state"] == "pending" and failed["attempts"] == 1
        assert failed["error"] == "KeyError: 'customer'"

        empty = unique("empty")
        assert client.claim(empty, owner="w").take() is None
        with client.claim(empty, owner="w") as nothing:
            assert nothing is None

    await in_thread(work, stack)


async def test_lease_api_errors_are_the_shared_exception_classes(stack: Stack) -> None:
    job_id = unique("held")

    def work(client: LeaseClient) -> None:
        holder = client.acquire(job_id, owner="a", ttl=30).take()
        assert holder is not None
        with pytest.raises(exc.LeaseHeld):
            with client.acquire(job_id, owner="b", ttl=30):
                pytest.fail("the block must not run")
        holder.complete()
        with pytest.raises(exc.JobFinished):
            client.acquire(job_id, owner="c").take()
        with pytest.raises(exc.JobNotFound):
            client.get_job(unique("missing"))
        with pytest.raises(exc.JobExists):
            client.enqueue(job_id=job_id)
        with pytest.raises(exc.InvalidRequest):
            client.acquire(unique("ttl"), owner="w", ttl=-1).take()
        no_gateway = LeaseClient(client.control_url, http=client.http)
        lease = no_gateway.acquire(unique("nogw"), owner="w").take()
        assert lease is not None
        with pytest.raises(ValueError, match="gateway_url"):
            lease.http.post("/pay/charges", step="x", json={})
        lease.release()

    await in_thread(work, stack)
