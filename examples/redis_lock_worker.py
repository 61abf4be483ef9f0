#!/usr/bin/env python3
"""Fencing a Redis lock (a ``kind = "redis"`` lease source).

Two workers take the same lock in turn with Fencegate's Redis recipe
(``fencegate_client.redis_lock``: the lock's value carries a fence that grows at every
acquisition) and write through Fencegate with ``Fencing-Token: locks:<lock>:<value>``.
A stalls past its lock's TTL; B takes the lock (fence 2) and repeats A's charge (replayed,
not sent again); A's late write is refused ``409 stale-generation``; once B releases, its
own token is refused ``409 lease-ended``.

Run against ``fencegate serve --config examples/lease_sources.toml``, an upstream on
127.0.0.1:9000 (examples/README.md) and redis-server:

    python examples/redis_lock_worker.py [REDIS_URL [GATEWAY_URL]]
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

import httpx
import redis

from fencegate_client.redis_lock import RedisLock


def write(gateway: httpx.Client, who: str, lock: RedisLock, path: str, key: str) -> str:
    """A write through the gateway, fenced by the lock's token."""
    answer = gateway.post(
        f"/payments{path}",
        json={"order": lock.name},
        headers={"Fencing-Token": lock.token, "Idempotency-Key": key},
    )
    outcome = f"{answer.status_code}"
    if answer.headers.get("Idempotent-Replayed") == "true":
        outcome += " (replayed)"
    elif not answer.is_success:
        outcome += f" {answer.json()['reason']}"
    print(f"{who} (fence {lock.fence}): POST /payments{path} -> {outcome}")
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description="A Redis lock, fenced.")
    parser.add_argument("redis_url", nargs="?", default="redis://127.0.0.1:6379/0")
    parser.add_argument("gateway_url", nargs="?", default="http://127.0.0.1:8080")
    args = parser.parse_args()
    name = f"order-{uuid.uuid4().hex[:8]}"  # the job: a fresh lock on every run
    print(f"lock {name}")
    store = redis.Redis.from_url(args.redis_url)
    with httpx.Client(base_url=args.gateway_url, timeout=10) as gateway:
        a = RedisLock(store, name, ttl_seconds=1)  # "locks": the [[lease_sources]] name
        assert a.acquire()
        outcomes = [write(gateway, "A", a, "/charges", "charge")]
        time.sleep(1.5)  # A stalls past its TTL and does not extend
        with RedisLock(store, name, ttl_seconds=30) as b:
            outcomes.append(write(gateway, "B", b, "/charges", "charge"))
            outcomes.append(write(gateway, "B", b, "/receipts", "receipt"))
            outcomes.append(write(gateway, "A", a, "/receipts", "receipt"))
        outcomes.append(write(gateway, "B", b, "/refunds", "refund"))  # released
    store.close()
    expected = ["201", "201 (replayed)", "201", "409 stale-generation", "409 lease-ended"]
    if outcomes == expected:
        return 0
    print(f"expected {expected}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
