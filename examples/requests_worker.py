#!/usr/bin/env python3
"""Fencing a ``requests`` session a worker already has (needs ``fencegate[requests]``,
which also brings httpx: the lease itself is taken with ``fencegate_client.sync``).

Takes the lease on job JOB_ID and charges it through the gateway with a
``requests.Session`` on which ``fence_session`` mounted a ``FencedAdapter`` for the
gateway's URL: inside the lease's block and a ``lease.step(...)`` block, every request to
the gateway carries the lease's ``Fencing-Token`` and the step's ``Idempotency-Key``.
Exit 3 when the lease is lost.

    CONTROL_URL=... GATEWAY_URL=... python examples/requests_worker.py JOB_ID
"""

from __future__ import annotations

import os
import sys

import requests

from fencegate_client import LeaseLost
from fencegate_client.requests import fence_session
from fencegate_client.sync import LeaseClient

GATEWAY = os.environ.get("GATEWAY_URL", "http://127.0.0.1:8080")


def main(job_id: str) -> int:
    http = fence_session(requests.Session(), gateway_url=GATEWAY)
    control = os.environ.get("CONTROL_URL", "http://127.0.0.1:8081")
    with http, LeaseClient(control, token=os.environ.get("WORKER_TOKEN")) as client:
        try:
            with client.acquire(job_id, owner="requests-worker", ttl=30) as lease:
                assert lease is not None  # acquire always answers a lease (or raises)
                with lease.step("charge"):
                    answer = http.post(
                        f"{GATEWAY}/payments/charges", json={"amount": 2500}, timeout=30
                    )
                answer.raise_for_status()
                lease.complete({"charge": answer.json()})
        except LeaseLost as lost:
            print(f"lease lost ({lost.reason}): stopping", file=sys.stderr)
            return 3
    print(f"job {job_id} completed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
