#!/usr/bin/env python3
"""Fencing an etcd lock (a ``kind = "etcd"`` lease source).

The worker takes a lock through etcd's lock API, over etcd's JSON gateway (grant a lease,
then ``/v3/lock/lock``; ``etcdctl lock`` or a client's ``concurrency.Mutex`` do the same)
and writes through Fencegate with ``Fencing-Token: etcd:<the lock key it got>`` and an
``Idempotency-Key``. The gateway asks etcd whether that key still holds the lock; the
generation is the key's create revision. After the worker unlocks, the same token is
refused ``409 lease-ended``: a write of a worker that let go of its lock never lands.

Run against ``fencegate serve --config examples/lease_sources.toml``, an upstream on
127.0.0.1:9000 (examples/README.md) and etcd:

    python examples/etcd_worker.py [ETCD_URL [GATEWAY_URL]]
"""

from __future__ import annotations

import argparse
import base64
import sys
import time
import uuid
from typing import Any

import httpx


def b64(text: str) -> str:
    """etcd's JSON gateway takes keys and names base64-encoded."""
    return base64.b64encode(text.encode()).decode()


def etcd(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = http.post(path, json=body)
    answer.raise_for_status()
    document: dict[str, Any] = answer.json()
    return document


def write(http: httpx.Client, token: str, key: str, body: dict[str, Any]) -> httpx.Response:
    """A charge through the gateway, fenced by the lock key."""
    answer = http.post(
        "/payments/charges", json=body, headers={"Fencing-Token": token, "Idempotency-Key": key}
    )
    reason = "" if answer.is_success else f" {answer.json()['reason']}"
    print(f"POST /payments/charges (key {key}) -> {answer.status_code}{reason}")
    return answer


def main() -> int:
    parser = argparse.ArgumentParser(description="An etcd lock, fenced.")
    parser.add_argument("etcd_url", nargs="?", default="http://127.0.0.1:2379")
    parser.add_argument("gateway_url", nargs="?", default="http://127.0.0.1:8080")
    args = parser.parse_args()
    name = f"/locks/order-{uuid.uuid4().hex[:8]}"  # the job: a fresh one on every run
    order = {"order": name, "amount": 4200}
    with (
        httpx.Client(base_url=args.etcd_url, timeout=10) as store,
        httpx.Client(base_url=args.gateway_url, timeout=10) as gateway,
    ):
        # A session lease (the lock ends with it), then the lock: blocks until it is ours.
        lease = etcd(store, "/v3/lease/grant", {"TTL": 30})["ID"]
        locked = etcd(store, "/v3/lock/lock", {"name": b64(name), "lease": lease})
        key = base64.b64decode(locked["key"]).decode()
        token = f"etcd:{key}"  # "etcd" is the [[lease_sources]] name in the gateway's config
        print(f"locked {name}: Fencing-Token {token}")

        charged = write(gateway, token, "charge", order)

        etcd(store, "/v3/lock/unlock", {"key": locked["key"]})
        print(f"unlocked {name}")
        # The gateway believes a lock it saw held for cache_seconds (0.5 in the toml):
        # a write sent sooner would still be admitted (docs/lease-sources.md, "The read
        # cache"; cache_seconds = 0 asks etcd every time). Past that, etcd is asked again.
        time.sleep(1)
        late = write(gateway, token, "receipt", order)

        etcd(store, "/v3/lease/revoke", {"ID": lease})  # done with the session
    if charged.is_success and late.status_code == 409 and late.json()["reason"] == "lease-ended":
        return 0
    print("expected a write and then 409 lease-ended", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
