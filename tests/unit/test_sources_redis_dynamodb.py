"""The ``redis`` and ``dynamodb`` lease sources without I/O: their settings, the token
shapes, the lock values of the Redis recipe and the namespacing of their jobs."""

from __future__ import annotations

from typing import Any

import pytest

from fencegate_client.dynamodb_lock import DynamoDbLock
from fencegate_client.redis_lock import RedisLock, fence_of, lock_keys
from gateway.config import DynamoDbSourceSettings, RedisSourceSettings, Settings
from gateway.sources import DynamoDbSource, RedisSource, build, split_token

RANDOM = "0123456789abcdef" * 2


def settings(*sources: dict[str, Any]) -> Settings:
    return Settings(database_url="sqlite+aiosqlite:////tmp/x.db", lease_sources=list(sources))


def redis_source(**extra: Any) -> dict[str, Any]:
    return {"name": "locks", "kind": "redis", "url": "redis://127.0.0.1:6379/0", **extra}


def ddb_source(**extra: Any) -> dict[str, Any]:
    return {"name": "ddb", "kind": "dynamodb", "table": "locks", "region": "us-east-1", **extra}


def test_the_kinds_are_told_apart() -> None:
    s = settings(redis_source(), ddb_source(endpoint_url="http://127.0.0.1:5000"))
    redis, ddb = s.lease_sources
    assert isinstance(redis, RedisSourceSettings) and redis.timeout_seconds == 2
    assert isinstance(ddb, DynamoDbSourceSettings) and ddb.endpoint_url == "http://127.0.0.1:5000"
    assert settings(ddb_source()).lease_sources[0].endpoint_url is None  # type: ignore[union-attr]
    assert set(build(s.lease_sources)) == {"locks", "ddb"}


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (redis_source(url="http://127.0.0.1:6379"), "url"),
        (redis_source(url=""), "url"),
        (redis_source(timeout_seconds=0), "timeout"),
        (redis_source(user="x"), "user"),  # not a key (username is)
        (ddb_source(table="x"), "table"),
        (ddb_source(table="a b c"), "table"),
        (ddb_source(region="US East"), "region"),
        (ddb_source(endpoint_url="127.0.0.1:5000"), "endpoint_url"),
        ({"name": "ddb", "kind": "dynamodb", "table": "locks"}, "region"),
    ],
)
def test_bad_settings_are_named(source: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings(source)


def test_redis_token_shapes() -> None:
    source = RedisSource(RedisSourceSettings(**redis_source()))
    assert source.well_formed(f"order-42:1.{RANDOM}")
    assert source.well_formed(f"orders:eu:42:17.{RANDOM}")  # a lock name may hold ":"
    for bad in (
        f"1.{RANDOM}",
        f":1.{RANDOM}",
        "order-42:1",
        f"order-42:0.{RANDOM}",
        f"order-42:01.{RANDOM}",
        f"order-42:1.{RANDOM.upper()}",
        f"order-42:1.{RANDOM}0",
        f"a\nb:1.{RANDOM}",
        "x" * 1100 + f":1.{RANDOM}",
    ):
        assert not source.well_formed(bad), bad


def test_redis_lock_values_and_keys() -> None:
    assert fence_of(f"42.{RANDOM}") == 42
    assert fence_of("42") is None and fence_of(f"-1.{RANDOM}") is None
    # Both keys in one hash slot (Redis Cluster), whatever the name holds.
    assert lock_keys("a}b") == ("fencegate:lock:{a}b}", "fencegate:fence:{a}b}")


def test_dynamodb_token_shapes() -> None:
    source = DynamoDbSource(DynamoDbSourceSettings(**ddb_source()))
    assert source.well_formed(f"locks/order-42:1.{RANDOM}")
    assert source.well_formed(f"locks/orders/eu:42:7.{RANDOM}")  # the key may hold "/", ":"
    # A fence past the database's integer is well formed: refused at intake, saying so.
    assert source.well_formed(f"locks/a:{2**63}.{RANDOM}")
    for bad in (
        "locks/order-42",
        "locks:1",
        "/order-42:1",
        "locks/:1",
        "locks/a:0",
        "locks/a:x",
        "locks/order-42:1",  # no record version (an older client's token)
        f"locks/a:0.{RANDOM}",
        f"locks/a:1.{RANDOM[:-1]}",
    ):
        assert not source.well_formed(bad), bad


def test_tokens_name_their_source() -> None:
    sources = build(settings(redis_source(), ddb_source()).lease_sources)
    found = split_token(f"locks:order-42:1.{RANDOM}", sources)
    assert found is not None and found == (sources["locks"], f"order-42:1.{RANDOM}")
    found = split_token(f"ddb:locks/order-42:3.{RANDOM}", sources)
    assert found is not None and found == (sources["ddb"], f"locks/order-42:3.{RANDOM}")


def test_the_helpers_refuse_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="ttl"):
        RedisLock(None, "a", ttl_seconds=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name"):
        RedisLock(None, "", ttl_seconds=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key"):
        DynamoDbLock(None, "locks", "a\nb", ttl_seconds=1)
    with pytest.raises(ValueError, match="ttl"):
        DynamoDbLock(None, "locks", "a", ttl_seconds=float("inf"))
