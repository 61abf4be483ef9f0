"""Lock items with a fence in DynamoDB (a ``kind = "dynamodb"`` lease source), against
moto's server mode (DynamoDB's wire protocol, started here) and a real upstream, on
SQLite and PostgreSQL; the worker side is ``fencegate_client.dynamodb_lock``."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest

from fencegate_client.dynamodb_lock import DynamoDbLock, create_table
from fencegate_client.errors import LeaseHeld
from tests.gateway_helpers import ok, problem
from tests.support import MotoServer, Upstream, free_port, upstream_config

TABLE = "locks"
CREDENTIALS = {"aws_access_key_id": "test", "aws_secret_access_key": "test"}


@pytest.fixture(scope="module")
def dynamodb_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = MotoServer(tmp_path_factory.mktemp("moto"))
    client = boto3.client(
        "dynamodb", endpoint_url=server.url, region_name="us-east-1", **CREDENTIALS
    )
    create_table(client, TABLE)
    yield server.url
    server.stop()


@pytest.fixture
def ddb(dynamodb_url: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A worker's DynamoDB client; the gateway's credentials come from botocore's default
    chain (here the environment)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "gateway")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "gateway")
    return boto3.client(
        "dynamodb", endpoint_url=dynamodb_url, region_name="us-east-1", **CREDENTIALS
    )


def source(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": "ddb",
        "kind": "dynamodb",
        "table": TABLE,
        "region": "us-east-1",
        "endpoint_url": url,
        **extra,
    }


def token(text: str) -> dict[str, Any]:
    return {"lease_token": text}


def lock_key() -> str:
    return f"order-{uuid.uuid4().hex[:8]}"


def taken(ddb: Any, key: str, ttl: float = 30) -> DynamoDbLock:
    lock = DynamoDbLock(ddb, TABLE, key, ttl_seconds=ttl)
    assert lock.acquire()
    return lock


async def test_two_workers_take_the_lock_in_turn(
    make_stack: Any, upstream: Upstream, ddb: Any, dynamodb_url: str
) -> None:
    stack = await make_stack(
        use_clock=False,
        upstreams=[upstream_config(upstream)],
        lease_sources=[source(dynamodb_url)],
    )
    key = lock_key()
    job = f"ddb/{TABLE}/{key}"
    a = taken(ddb, key, ttl=1)
    assert a.token == f"ddb:{TABLE}/{key}:1.{a.record_version}"
    await ok(await stack.write("/pay/charges", token(a.token), key="step-1"))

    # A pauses past its lock's expiry; B takes the lock (refused while A's is live).
    assert not DynamoDbLock(ddb, TABLE, key, ttl_seconds=30).acquire()
    await asyncio.sleep(1.2)
    b = taken(ddb, key)
    assert b.fence == 2

    doc = await problem(
        await stack.write("/pay/charges", token(a.token), key="step-2", body={"n": 2}),
        409,
        "stale-generation",
    )
    assert (doc["job_id"], doc["generation"], doc["highest_generation"]) == (job, 1, 2)
    resp = await stack.write("/pay/charges", token(b.token), key="step-1")
    assert resp.headers.get("Idempotent-Replayed") == "true"
    await ok(await stack.write("/pay/charges", token(b.token), key="step-2", body={"n": 2}))
    await problem(
        await stack.write("/pay/charges", token(a.token), key="step-3"), 409, "stale-generation"
    )
    assert [(r["headers"]["Fencing-Job"], r["generation"]) for r in upstream.received] == [
        (job, "1"),
        (job, "2"),
    ]
    assert all("Fencing-Token" not in r["headers"] for r in upstream.received)
    # Releasing ends B's token at once (nothing is cached); the item keeps its fence.
    assert b.release()
    await problem(
        await stack.write("/pay/charges", token(b.token), key="step-3"), 409, "lease-ended"
    )
    assert len(upstream.received) == 2
    item = ddb.get_item(TableName=TABLE, Key={"lock_key": {"S": key}}, ConsistentRead=True)
    assert item["Item"]["fence"] == {"N": "2"} and "expires_at" not in item["Item"]
    entries = await stack.audit(job_id=job)
    assert [e["reason"] for e in entries] == [
        "lease-ended",
        "stale-generation",
        "idempotent-replay",
        "stale-generation",
    ]
    assert {e["source"] for e in entries} == {"ddb"}
    metrics = await (await stack.control.get("/metrics")).text()
    assert 'reason="stale-generation",source="ddb"} 2.0' in metrics


async def test_an_expired_lock_item_refuses_its_token(
    make_stack: Any, upstream: Upstream, ddb: Any, dynamodb_url: str
) -> None:
    stack = await make_stack(
        use_clock=False,
        upstreams=[upstream_config(upstream)],
        lease_sources=[source(dynamodb_url)],
    )
    lock = taken(ddb, lock_key(), ttl=0.5)
    assert lock.extend(0.5)
    await asyncio.sleep(0.8)
    assert not lock.extend()  # lost
    await problem(await stack.write("/pay/x", token(lock.token), key="k"), 409, "lease-expired")
    assert upstream.received == []


async def test_forged_and_foreign_tokens_are_invalid(
    make_stack: Any, upstream: Upstream, ddb: Any, dynamodb_url: str
) -> None:
    stack = await make_stack(
        use_clock=False,
        upstreams=[upstream_config(upstream)],
        lease_sources=[source(dynamodb_url)],
    )
    key = lock_key()
    holder = taken(ddb, key)
    v = holder.record_version
    for bad in (
        f"ddb:{TABLE}/{key}:2.{v}",  # a fence the item never reached
        f"ddb:{TABLE}/never-taken:1.{v}",
        f"ddb:other-table/{key}:1.{v}",  # only the configured table is read
        f"ddb:{TABLE}/{key}:0.{v}",
        f"ddb:{TABLE}/{key}:01.{v}",
        f"ddb:{TABLE}/{key}:1",  # no record version
        f"ddb:{TABLE}/{key}",
        f"ddb:{key}:1.{v}",
        f"other:{TABLE}/{key}:1.{v}",
    ):
        await problem(
            await stack.write("/pay/x", token(bad), key="k"), 403, "invalid-fencing-token"
        )
    assert upstream.received == []
    await ok(await stack.write("/pay/x", token(holder.token), key="k"))


async def test_a_fence_that_went_backwards_is_refused_with_the_reason(
    make_stack: Any, upstream: Upstream, ddb: Any, dynamodb_url: str
) -> None:
    stack = await make_stack(
        use_clock=False,
        upstreams=[upstream_config(upstream)],
        lease_sources=[source(dynamodb_url)],
    )
    key = lock_key()
    for step in ("one", "two"):
        with DynamoDbLock(ddb, TABLE, key, ttl_seconds=30) as lock:
            await ok(await stack.write("/pay/x", token(lock.token), key=step))
    ddb.delete_item(TableName=TABLE, Key={"lock_key": {"S": key}})
    with DynamoDbLock(ddb, TABLE, key, ttl_seconds=30) as again:
        assert again.fence == 1
        doc = await problem(
            await stack.write("/pay/x", token(again.token), key="three"), 409, "stale-generation"
        )
    assert (doc["generation"], doc["highest_generation"]) == (1, 2)
    assert "fence went backwards" in doc["detail"]
    assert [r["generation"] for r in upstream.received] == ["1", "2"]


async def test_an_unreachable_dynamodb_forwards_nothing(
    make_stack: Any, upstream: Upstream, ddb: Any
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream)],
        lease_sources=[source(f"http://127.0.0.1:{free_port()}", timeout_seconds=1)],
    )
    await problem(
        await stack.write("/pay/x", token(f"ddb:{TABLE}/a:1.{'0' * 32}"), key="k"),
        503,
        "store-unavailable",
    )
    assert upstream.received == []


def test_the_lock_is_a_context_manager(ddb: Any) -> None:
    key = lock_key()
    with DynamoDbLock(ddb, TABLE, key, ttl_seconds=30, source="q") as lock:
        assert lock.token == f"q:{TABLE}/{key}:1.{lock.record_version}"
        with pytest.raises(LeaseHeld), DynamoDbLock(ddb, TABLE, key, ttl_seconds=30):
            pass
    assert not lock.release()  # already released
    with DynamoDbLock(ddb, TABLE, key, ttl_seconds=30) as again:
        assert again.fence == 2
