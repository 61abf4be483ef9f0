"""Fencing for the HTTP clients workers already use (``fencegate_client.httpx``,
``.requests``, ``.boto3``) against a real gateway and lease API on SQLite and PostgreSQL,
with a real upstream (an aiohttp server that records what it receives).

Each integration goes through the same story: a write of the current lease is forwarded
once; after a newer generation took the job over, the old lease's late write is refused
by the gateway (audited ``stale-generation``), never reaches the upstream, and is raised
as ``LeaseLost``; the newer lease repeating the step gets the stored answer, so each write
lands once. Sync clients run in a thread while the event loop serves the gateway.
"""

from __future__ import annotations

import asyncio
import io
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import requests

from fencegate_client import errors as exc
from fencegate_client import step_key
from fencegate_client.aio import LeaseClient as AsyncLeaseClient
from fencegate_client.boto3 import fenced_s3_client
from fencegate_client.httpx import AsyncFencedTransport, FencedTransport
from fencegate_client.requests import fence_session
from fencegate_client.sync import LeaseClient
from tests.support import Stack, Upstream, upstream_config


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def base_url(client: Any) -> str:
    return str(client.make_url("")).rstrip("/")


@pytest.fixture
async def stack(make_stack: Callable[..., Any], upstream: Upstream) -> Stack:
    built: Stack = await make_stack(
        upstreams=[upstream_config(upstream), upstream_config(upstream, name="files")],
        use_clock=False,
    )
    return built


def sync_client(stack: Stack) -> LeaseClient:
    return LeaseClient(base_url(stack.control), gateway_url=base_url(stack.proxy))


def httpx_sender(gateway: str, lease: Any) -> tuple[Callable[[str, str], int], Callable[[], None]]:
    http = httpx.Client(transport=FencedTransport(gateway_url=gateway, lease=lease))

    def send(url: str, step: str) -> int:
        answer = http.post(url, json={"n": step}, extensions={"fencegate_step": step})
        return answer.status_code

    return send, http.close


def requests_sender(
    gateway: str, lease: Any
) -> tuple[Callable[[str, str], int], Callable[[], None]]:
    session = fence_session(requests.Session(), gateway_url=gateway, lease=lease)

    def send(url: str, step: str) -> int:
        with lease.step(step):
            return session.post(url, json={"n": step}, timeout=10).status_code

    return send, session.close


SENDERS = {"httpx": httpx_sender, "requests": requests_sender}


def late_write_story(stack: Stack, make: Any) -> tuple[int, int, str]:
    """The story of the module docstring with a sync client; the generations and the job."""
    gateway = base_url(stack.proxy)
    job_id = unique("late")
    with sync_client(stack) as client:
        old = client.acquire(job_id, owner="worker", ttl=30).take()
        assert old is not None
        send_old, close_old = make(gateway, old)
        try:
            assert send_old(f"{gateway}/pay/charges", "charge") == 201
            new = client.acquire(job_id, owner="worker", ttl=30).take()  # a restart
            assert new is not None and new.generation > old.generation
            with pytest.raises(exc.StaleGeneration):
                send_old(f"{gateway}/pay/refunds", "refund")
            assert old.lost.is_set()
            with pytest.raises(exc.StaleGeneration):  # now without asking the gateway
                send_old(f"{gateway}/pay/refunds", "refund")
        finally:
            close_old()
        send_new, close_new = make(gateway, new)
        try:
            assert send_new(f"{gateway}/pay/charges", "charge") == 201  # replayed
            assert send_new(f"{gateway}/pay/refunds", "refund") == 201
        finally:
            close_new()
        new.complete()
        return old.generation, new.generation, job_id


@pytest.mark.parametrize("library", sorted(SENDERS))
async def test_late_write_is_refused_and_raised_as_lease_lost(
    library: str, stack: Stack, upstream: Upstream
) -> None:
    old, new, job_id = await asyncio.to_thread(late_write_story, stack, SENDERS[library])
    assert [(c["path"], c["generation"], c["key"]) for c in upstream.received] == [
        ("/charges", str(old), step_key(job_id, "charge")),
        ("/refunds", str(new), step_key(job_id, "refund")),
    ]
    assert all("Fencing-Token" not in c["headers"] for c in upstream.received)
    audit = await stack.audit(job_id=job_id)
    assert sorted(item["reason"] for item in audit) == ["idempotent-replay", "stale-generation"]


async def test_async_httpx_transport_with_the_asyncio_client(
    stack: Stack, upstream: Upstream
) -> None:
    gateway = base_url(stack.proxy)
    job_id = unique("async")
    transport = AsyncFencedTransport(gateway_url=gateway)  # fences with the current lease
    async with (
        AsyncLeaseClient(base_url(stack.control), gateway_url=gateway) as client,
        httpx.AsyncClient(transport=transport) as http,
    ):
        async with client.acquire(job_id, owner="worker", ttl=30) as old:
            assert old is not None
            with old.step("charge"):
                first = await http.post(f"{gateway}/pay/charges", json={"amount": 5})
            assert first.status_code == 201
            new = await client.acquire(job_id, owner="worker", ttl=30)
            assert new is not None
            with pytest.raises(exc.StaleGeneration), old.step("refund"):
                await http.post(f"{gateway}/pay/refunds", json={"amount": 5})
            assert old.lost.is_set()
        # Outside any lease's block the transport adds nothing: the gateway wants a token.
        bare = await http.post(f"{gateway}/pay/charges", json={"amount": 5})
        assert bare.status_code == 428
        async with new:
            replay = await http.post(
                f"{gateway}/pay/charges",
                json={"amount": 5},
                extensions={"fencegate_step": "charge"},
            )
            assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
            await new.complete()
    assert [(c["path"], c["generation"]) for c in upstream.received] == [
        ("/charges", str(old.generation))
    ]


async def test_the_token_goes_to_the_gateway_only(stack: Stack, upstream: Upstream) -> None:
    """The same client talking to another host (here the upstream itself) sends no
    ``Fencing-Token``: it is a credential for the gateway."""
    gateway = base_url(stack.proxy)

    def work() -> None:
        with sync_client(stack) as client:
            lease = client.acquire(unique("elsewhere"), owner="w", ttl=30).take()
            assert lease is not None
            with (
                httpx.Client(transport=FencedTransport(gateway_url=gateway)) as http,
                fence_session(requests.Session(), gateway_url=gateway) as session,
                lease,
                lease.step("direct"),
            ):
                assert http.post(f"{upstream.url}/direct", json={}).status_code == 201
                assert session.post(f"{upstream.url}/direct", json={}).status_code == 201
                # An explicit key stays as the caller set it.
                own = http.post(f"{gateway}/pay/own", json={}, headers={"Idempotency-Key": "mine"})
                assert own.status_code == 201
                lease.complete()

    await asyncio.to_thread(work)
    direct = [c for c in upstream.received if c["path"] == "/direct"]
    assert len(direct) == 2
    assert all("Fencing-Token" not in c["headers"] for c in direct)
    assert all("Idempotency-Key" not in c["headers"] for c in direct)
    assert [c["key"] for c in upstream.received if c["path"] == "/own"] == ["mine"]


async def test_boto3_put_object_through_the_gateway(stack: Stack, upstream: Upstream) -> None:
    # An S3-like answer to PutObject: 200, an ETag, no body.
    upstream.status, upstream.body, upstream.headers = 200, b"", {"ETag": '"etag-1"'}
    gateway = base_url(stack.proxy)
    job_id = unique("s3")

    def work() -> tuple[int, int]:
        s3 = fenced_s3_client(gateway_url=gateway, upstream="files")
        with sync_client(stack) as client:
            with client.acquire(job_id, owner="uploader", ttl=30) as old:
                assert old is not None
                with old.step("report"):
                    put = s3.put_object(Bucket="reports", Key="2024/07.csv", Body=b"a,b\n1,2\n")
                assert put["ETag"] == '"etag-1"'
                new = client.acquire(job_id, owner="uploader", ttl=30).take()
                assert new is not None
                with pytest.raises(exc.StaleGeneration), old.step("late"):
                    # A file-like body: botocore sends it after "Expect: 100-continue", so
                    # the refusal comes before it, and the connection must not be reused.
                    s3.put_object(Bucket="reports", Key="2024/07.csv", Body=io.BytesIO(b"stale"))
            with new, new.step("report"):
                again = s3.put_object(Bucket="reports", Key="2024/07.csv", Body=b"a,b\n1,2\n")
                assert again["ResponseMetadata"]["HTTPHeaders"]["idempotent-replayed"] == "true"
                new.complete()
        return old.generation, new.generation

    old, _new = await asyncio.to_thread(work)
    (call,) = upstream.received
    assert call["method"] == "PUT" and call["path"] == "/reports/2024/07.csv"
    assert call["body"] == b"a,b\n1,2\n"
    assert call["generation"] == str(old) and call["key"] == step_key(job_id, "report")
    assert "Fencing-Token" not in call["headers"]
    audit = await stack.audit(job_id=job_id)
    assert sorted(item["reason"] for item in audit) == ["idempotent-replay", "stale-generation"]
