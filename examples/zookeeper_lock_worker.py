#!/usr/bin/env python3
"""Fencing a ZooKeeper lock (a ``kind = "zookeeper"`` lease source).

Two workers take the same lock in turn with ZooKeeper's standard recipe, kazoo's
``Lock`` (an ephemeral sequential node under the lock's path; the lowest holds it), and
write through Fencegate with ``Fencing-Token: zk:<the lock node's path>``
(``fencegate_client.zookeeper.lock_token``) and an ``Idempotency-Key``. The gateway
reads the lock's children: the node present and the lowest holds the lock, and the
generation is the node's ``czxid``.

Worker A locks and charges; A's session ends (as it does when A stalls past its session
timeout: ZooKeeper deletes its node); worker B locks, repeats the charge (replayed, not
sent again) and sends the receipt; A wakes up and sends its receipt: ``409
stale-generation``. B releases the lock: its token is refused ``409 lease-ended``.

Run against ``fencegate serve --config examples/lease_sources.toml``, an upstream on
127.0.0.1:9000 (examples/README.md) and ZooKeeper on 127.0.0.1:2181 (on Debian 12, the
``zookeeper`` package's ``/usr/share/zookeeper/bin/zkServer.sh start-foreground``); it
needs ``fencegate[zookeeper,httpx]``:

    python examples/zookeeper_lock_worker.py [ZOOKEEPER_HOSTS [GATEWAY_URL]]
"""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

import httpx
from kazoo.client import KazooClient
from kazoo.recipe.lock import Lock

from fencegate_client.zookeeper import lock_token

SOURCE = "zk"  # the [[lease_sources]] name in the gateway's config


def take(hosts: str, path: str, worker: str) -> tuple[KazooClient, Lock, str]:
    """A worker's own ZooKeeper session, the lock (blocks until it is ours), its token."""
    client = KazooClient(hosts=hosts, timeout=10)
    client.start(timeout=15)
    lock = client.Lock(path, identifier=worker)
    lock.acquire(timeout=30)
    token = lock_token(lock, source=SOURCE)
    stat = client.exists(f"{lock.path}/{lock.node}")
    print(f"{worker} locked {path} (generation {stat.czxid}): Fencing-Token {token}")
    return client, lock, token


def write(
    http: httpx.Client, worker: str, token: str, path: str, key: str, body: dict[str, Any]
) -> httpx.Response:
    """A write through the gateway, fenced by the lock node."""
    answer = http.post(path, json=body, headers={"Fencing-Token": token, "Idempotency-Key": key})
    if answer.is_success:
        replayed = " (replayed)" if answer.headers.get("Idempotent-Replayed") == "true" else ""
        print(f"{worker}: POST {path} -> {answer.status_code}{replayed}")
    else:
        print(f"{worker}: POST {path} -> {answer.status_code} {answer.json()['reason']}")
    return answer


def main() -> int:
    parser = argparse.ArgumentParser(description="A ZooKeeper lock, fenced.")
    parser.add_argument("zookeeper_hosts", nargs="?", default="127.0.0.1:2181")
    parser.add_argument("gateway_url", nargs="?", default="http://127.0.0.1:8080")
    args = parser.parse_args()
    path = f"/locks/order-{uuid.uuid4().hex[:8]}"  # the job: a fresh one on every run
    order = {"order": path, "amount": 4200}
    with httpx.Client(base_url=args.gateway_url, timeout=10) as gateway:
        zk_a, _, token_a = take(args.zookeeper_hosts, path, "A")
        a_charged = write(gateway, "A", token_a, "/payments/charges", "charge", order)
        zk_a.stop()  # A's session ends; its node goes with it
        zk_a.close()
        print("A's session ended")

        zk_b, lock_b, token_b = take(args.zookeeper_hosts, path, "B")
        try:
            b_charged = write(gateway, "B", token_b, "/payments/charges", "charge", order)
            b_receipt = write(gateway, "B", token_b, "/payments/receipts", "receipt", order)
            a_late = write(gateway, "A", token_a, "/payments/receipts", "receipt", order)
            lock_b.release()
            print("B released the lock")
            b_late = write(gateway, "B", token_b, "/payments/refunds", "refund", order)
        finally:
            zk_b.stop()
            zk_b.close()
    expected = (
        a_charged.status_code == 201
        and b_charged.headers.get("Idempotent-Replayed") == "true"
        and b_receipt.status_code == 201
        and (a_late.status_code, a_late.json()["reason"]) == (409, "stale-generation")
        and (b_late.status_code, b_late.json()["reason"]) == (409, "lease-ended")
    )
    if expected:
        return 0
    print("expected: A charged, B replayed and went on, A stale, B ended", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
