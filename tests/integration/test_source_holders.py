"""A generation names one holder, for every lease source (issue 44): a lock service that
lost its fence counter hands a generation that already wrote to a second holder, and the
gateway refuses that holder (``generation-reissued``) whether the first holder's writes
are finished or still in flight, on both databases and across two replicas. A generation
that does not fit the database's integer is refused at intake, never a 500.

Real redis-server, moto's DynamoDB server and a real upstream; signed tokens made here."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import redis.asyncio
import sqlalchemy as sa
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.ext.asyncio import AsyncEngine

from fencegate_client.dynamodb_lock import DynamoDbLock
from fencegate_client.redis_lock import AsyncRedisLock
from fencegate_client.signed import mint_token
from gateway.records.schema import fences
from tests.gateway_helpers import ok, problem, until_in_flight
from tests.integration.test_source_dynamodb import TABLE
from tests.integration.test_source_dynamodb import ddb as ddb
from tests.integration.test_source_dynamodb import dynamodb_url as dynamodb_url
from tests.integration.test_source_dynamodb import source as ddb_source
from tests.integration.test_source_redis import client as client
from tests.integration.test_source_redis import redis_url as redis_url
from tests.integration.test_source_redis import source as redis_source
from tests.support import Upstream, upstream_config

GENERATION_MAX = 2**63 - 1


def token(text: str) -> dict[str, Any]:
    return {"lease_token": text}


def name() -> str:
    return f"order-{uuid.uuid4().hex[:8]}"


def sent(upstream: Upstream) -> list[tuple[str | None, str | None]]:
    return [(r["key"], r["generation"]) for r in upstream.received]


async def test_redis_a_regrown_counter_reissues_a_generation_and_its_holder_is_refused(
    make_stack: Any, upstream: Upstream, client: redis.asyncio.Redis, redis_url: str
) -> None:
    """The issue's first break: FLUSHALL after generation 2 wrote; the holder of the
    regrown fence 2 was forwarded. Refused now, on the other replica too; fence 3 (a
    generation nobody wrote with) goes on."""
    sources = [redis_source(redis_url)]
    one = await make_stack(upstreams=[upstream_config(upstream)], lease_sources=sources)
    two = await make_stack(upstreams=[upstream_config(upstream)], lease_sources=sources)
    lock = name()
    for step in ("a", "b"):
        async with AsyncRedisLock(client, lock, ttl_seconds=30) as held:
            await ok(await one.write("/pay/x", token(held.token), key=step))
    await client.flushall()
    async with AsyncRedisLock(client, lock, ttl_seconds=30) as again:
        assert again.fence == 1
        await problem(
            await one.write("/pay/x", token(again.token), key="c"), 409, "stale-generation"
        )
    async with AsyncRedisLock(client, lock, ttl_seconds=30) as reissued:
        assert reissued.fence == 2
        for stack in (one, two):
            doc = await problem(
                await stack.write("/pay/x", token(reissued.token), key="e"),
                409,
                "generation-reissued",
            )
            assert (doc["generation"], doc["highest_generation"]) == (2, 2)
            assert "appendonly yes" in doc["detail"], doc["detail"]
    async with AsyncRedisLock(client, lock, ttl_seconds=30) as newer:
        assert newer.fence == 3
        await ok(await two.write("/pay/x", token(newer.token), key="f"))
    assert sent(upstream) == [("a", "1"), ("b", "2"), ("f", "3")]
    await two.audit(job_id=f"locks/{lock}")  # its entries are written behind its answers
    entries = await one.audit(job_id=f"locks/{lock}")
    assert [e["reason"] for e in entries].count("generation-reissued") == 2


async def test_redis_a_restart_while_a_write_is_in_flight_reissues_it_to_nobody(
    make_stack: Any, upstream: Upstream, client: redis.asyncio.Redis, redis_url: str
) -> None:
    """The issue's second break: Redis lost everything while holder A's generation-1
    write was at the upstream; holder C got fence 1 again and was forwarded beside it.
    The barrier only makes older generations wait; the binding refuses C outright."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[redis_source(redis_url)]
    )
    lock = name()
    a = AsyncRedisLock(client, lock, ttl_seconds=30)
    assert await a.acquire() and a.fence == 1
    upstream.delay = 1.0
    first = asyncio.create_task(stack.write("/pay/x", token(a.token), key="a"))
    await until_in_flight(upstream)
    await client.flushall()  # as a restart without an append-only file would
    c = AsyncRedisLock(client, lock, ttl_seconds=30)
    assert await c.acquire() and c.fence == 1 and c.token != a.token
    upstream.delay = 0
    await problem(await stack.write("/pay/x", token(c.token), key="c"), 409, "generation-reissued")
    await ok(await first)
    # A is its generation's holder as far as the gateway knows, but Redis holds fence 1
    # under another value now: A's token is not one of this lock's any more.
    await problem(
        await stack.write("/pay/x", token(a.token), key="a2"), 403, "invalid-fencing-token"
    )
    assert sent(upstream) == [("a", "1")]


async def test_dynamodb_a_deleted_item_reissues_a_generation_and_its_holder_is_refused(
    make_stack: Any, upstream: Upstream, ddb: Any, dynamodb_url: str
) -> None:
    """The item deleted by an operator: the new holder's token used to be byte-identical
    to the old one's. Each acquisition writes a record version that the token carries,
    so the two differ, the new one is refused, and the old one is ended (the item holds
    another version)."""
    stack = await make_stack(
        use_clock=False,
        upstreams=[upstream_config(upstream)],
        lease_sources=[ddb_source(dynamodb_url)],
    )
    key = name()
    old = DynamoDbLock(ddb, TABLE, key, ttl_seconds=30)
    assert old.acquire() and old.fence == 1
    await ok(await stack.write("/pay/x", token(old.token), key="a"))
    ddb.delete_item(TableName=TABLE, Key={"lock_key": {"S": key}})
    new = DynamoDbLock(ddb, TABLE, key, ttl_seconds=30)
    assert new.acquire() and new.fence == 1
    assert new.token != old.token and new.token.startswith(f"ddb:{TABLE}/{key}:1.")
    doc = await problem(
        await stack.write("/pay/x", token(new.token), key="c"), 409, "generation-reissued"
    )
    assert "Never delete lock items" in doc["detail"]
    await problem(await stack.write("/pay/x", token(old.token), key="a2"), 409, "lease-ended")
    assert sent(upstream) == [("a", "1")]


def signing_key() -> tuple[str, str]:
    """A fresh Ed25519 key: (private PEM, public PEM)."""
    key = Ed25519PrivateKey.generate()
    public = (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return private, public


def jwt_source(public: str) -> dict[str, Any]:
    return {
        "name": "queue",
        "kind": "jwt",
        "algorithms": ["EdDSA"],
        "public_keys": [public],
        "issuer": "q",
    }


async def test_signed_tokens_of_two_grants_under_one_generation(
    make_stack: Any, upstream: Upstream
) -> None:
    """Signed tokens name their grant with ``jti``: an issuer that grants generation 4
    twice gets the second grant refused once the first has written."""
    private, public = signing_key()
    stack = await make_stack(
        use_clock=False, upstreams=[upstream_config(upstream)], lease_sources=[jwt_source(public)]
    )

    def grant(**extra: Any) -> str:
        return mint_token(
            private, source="queue", issuer="q", job="j1", generation=4, ttl_seconds=30, **extra
        )

    first, second = grant(grant_id="g-1"), grant()
    await ok(await stack.write("/pay/x", token(first), key="a"))
    await problem(await stack.write("/pay/x", token(second), key="b"), 409, "generation-reissued")
    # The same grant re-minted (a later expiry, the same grant id) is still its holder.
    await ok(await stack.write("/pay/x", token(grant(grant_id="g-1")), key="c"))
    assert sent(upstream) == [("a", "4"), ("c", "4")]


async def test_a_generation_beyond_the_databases_integer_is_refused_at_intake(
    make_stack: Any, upstream: Upstream, ddb: Any, dynamodb_url: str
) -> None:
    """An operator raised a lock item's fence past 2^63 - 1 (DynamoDB's numbers go to 38
    digits): a clear 4xx that names the limit, never a 500. (Redis's INCR stops at
    2^63 - 1; etcd's revisions and ZooKeeper's zxids are 64-bit signed.)"""
    stack = await make_stack(
        use_clock=False,
        upstreams=[upstream_config(upstream)],
        lease_sources=[ddb_source(dynamodb_url)],
    )
    key = name()
    ddb.put_item(
        TableName=TABLE,
        Item={"lock_key": {"S": key}, "fence": {"N": str(GENERATION_MAX)}},
    )
    lock = DynamoDbLock(ddb, TABLE, key, ttl_seconds=30)
    assert lock.acquire() and lock.fence == GENERATION_MAX + 1
    doc = await problem(
        await stack.write("/pay/x", token(lock.token), key="a"), 403, "invalid-fencing-token"
    )
    assert str(GENERATION_MAX) in doc["detail"] and doc["job_id"] == f"ddb/{TABLE}/{key}"
    # A token of a fence that fits, once the item's fence is past the limit: stale, the
    # newer holder's fence unknown (it fits no column of the audit either).
    other = name()
    ddb.put_item(TableName=TABLE, Item={"lock_key": {"S": other}, "fence": {"N": "4"}})
    below = DynamoDbLock(ddb, TABLE, other, ttl_seconds=30)
    assert below.acquire() and below.fence == 5
    ddb.update_item(
        TableName=TABLE,
        Key={"lock_key": {"S": other}},
        UpdateExpression="SET fence = :f",
        ExpressionAttributeValues={":f": {"N": str(GENERATION_MAX + 7)}},
    )
    doc = await problem(
        await stack.write("/pay/x", token(below.token), key="b"), 409, "stale-generation"
    )
    assert doc["generation"] == 5
    entries = await stack.audit(job_id=f"ddb/{TABLE}/{other}")
    assert [e["reason"] for e in entries] == ["stale-generation"]

    assert upstream.received == []


async def test_a_fence_from_before_the_holder_was_kept_is_bound_by_its_next_admission(
    make_stack: Any, upstream: Upstream, engine: AsyncEngine
) -> None:
    """A fence row written before migration 0010 (or by a replica of an older version
    during a rolling upgrade) has no holder: the next admission of its generation binds
    it, and another holder of that generation is refused from then on."""
    private, public = signing_key()
    stack = await make_stack(
        use_clock=False, upstreams=[upstream_config(upstream)], lease_sources=[jwt_source(public)]
    )
    async with engine.begin() as conn:
        await conn.execute(
            sa.insert(fences).values(job_id="queue/j2", generation=7, updated_at=0.0)
        )

    def grant(grant_id: str) -> str:
        return mint_token(
            private,
            source="queue",
            issuer="q",
            job="j2",
            generation=7,
            ttl_seconds=30,
            grant_id=grant_id,
        )

    await ok(await stack.write("/pay/x", token(grant("first")), key="a"))
    await problem(
        await stack.write("/pay/x", token(grant("second")), key="b"), 409, "generation-reissued"
    )
    await ok(await stack.write("/pay/x", token(grant("first")), key="c"))
    assert sent(upstream) == [("a", "7"), ("c", "7")]


async def test_two_holders_racing_on_two_replicas_one_is_forwarded(
    make_stack: Any, upstream: Upstream
) -> None:
    """Two holders of one generation, each through its own replica at the same moment,
    ten jobs: the conditional upsert of the fence row decides, one holder per job."""
    private, public = signing_key()
    config = {"upstreams": [upstream_config(upstream)], "lease_sources": [jwt_source(public)]}
    one = await make_stack(use_clock=False, **config)
    two = await make_stack(use_clock=False, **config)

    def grant(job: str, grant_id: str) -> str:
        return mint_token(
            private,
            source="queue",
            issuer="q",
            job=job,
            generation=1,
            ttl_seconds=30,
            grant_id=grant_id,
        )

    jobs = [f"race-{n}" for n in range(10)]
    answers = await asyncio.gather(
        *(
            stack.write("/pay/x", token(grant(job, holder)), key=f"{job}-{holder}")
            for job in jobs
            for stack, holder in ((one, "a"), (two, "c"))
        )
    )
    statuses = sorted(resp.status for resp in answers)
    assert statuses == [201] * 10 + [409] * 10, statuses
    for resp in answers:
        if resp.status == 409:
            assert (await resp.json())["reason"] == "generation-reissued"
    # One holder per job reached the upstream.
    assert sorted(r["headers"]["Fencing-Job"] for r in upstream.received) == sorted(
        f"queue/{job}" for job in jobs
    )
