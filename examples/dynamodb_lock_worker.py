#!/usr/bin/env python3
"""Fencing a DynamoDB lock item (a ``kind = "dynamodb"`` lease source).

Two workers take the same lock item in turn (``fencegate_client.dynamodb_lock``: a
conditional update raises the item's ``fence`` at every acquisition) and write through
Fencegate with ``Fencing-Token: ddb:locks/<lock key>:<fence>.<record version>``. A
stalls past its expiry; B takes the lock (fence 2) and repeats A's charge (replayed, not
sent again); A's late write is refused ``409 stale-generation``; once B releases, its own
token is refused ``409 lease-ended``.

Run against ``fencegate serve --config examples/lease_sources.toml``, an upstream on
127.0.0.1:9000 (examples/README.md) and DynamoDB (a local one: ``moto_server -p 5000``;
the gateway and this script use the default AWS credentials, any for moto):

    python examples/dynamodb_lock_worker.py [ENDPOINT_URL [GATEWAY_URL]]
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

import boto3
import httpx

from fencegate_client.dynamodb_lock import DynamoDbLock, create_table


def write(gateway: httpx.Client, who: str, lock: DynamoDbLock, path: str, key: str) -> str:
    """A write through the gateway, fenced by the lock item's token."""
    answer = gateway.post(
        f"/payments{path}",
        json={"order": lock.key},
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
    parser = argparse.ArgumentParser(description="A DynamoDB lock item, fenced.")
    parser.add_argument("endpoint_url", nargs="?", default="http://127.0.0.1:5000")
    parser.add_argument("gateway_url", nargs="?", default="http://127.0.0.1:8080")
    args = parser.parse_args()
    ddb = boto3.client("dynamodb", endpoint_url=args.endpoint_url, region_name="us-east-1")
    if "locks" not in ddb.list_tables()["TableNames"]:
        create_table(ddb, "locks")
    key = f"order-{uuid.uuid4().hex[:8]}"  # the job: a fresh lock on every run
    print(f"lock locks/{key}")
    with httpx.Client(base_url=args.gateway_url, timeout=10) as gateway:
        a = DynamoDbLock(ddb, "locks", key, ttl_seconds=1)  # "ddb": the source's name
        assert a.acquire()
        outcomes = [write(gateway, "A", a, "/charges", "charge")]
        time.sleep(1.5)  # A stalls past its expiry and does not extend
        with DynamoDbLock(ddb, "locks", key, ttl_seconds=30) as b:
            outcomes.append(write(gateway, "B", b, "/charges", "charge"))
            outcomes.append(write(gateway, "B", b, "/receipts", "receipt"))
            outcomes.append(write(gateway, "A", a, "/receipts", "receipt"))
        outcomes.append(write(gateway, "B", b, "/refunds", "refund"))  # released
    expected = ["201", "201 (replayed)", "201", "409 stale-generation", "409 lease-ended"]
    if outcomes == expected:
        return 0
    print(f"expected {expected}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
