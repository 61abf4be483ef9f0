#!/usr/bin/env python3
"""A synchronous payment worker (``fencegate_client.sync``, needs ``fencegate[httpx]``).

Claims jobs from the queue ``payments``, charges each through the gateway as the step
"charge" and completes it with the payment API's answer, until the queue is empty. The
lease renews itself in a background thread; a lost lease stops the worker (exit 3).

    CONTROL_URL=http://127.0.0.1:8081 GATEWAY_URL=http://127.0.0.1:8080 \\
        python examples/sync_worker.py [QUEUE]
"""

from __future__ import annotations

import os
import sys

from fencegate_client import LeaseLost
from fencegate_client.sync import LeaseClient


def main(queue: str = "payments") -> int:
    with LeaseClient(
        os.environ.get("CONTROL_URL", "http://127.0.0.1:8081"),
        gateway_url=os.environ.get("GATEWAY_URL", "http://127.0.0.1:8080"),
        token=os.environ.get("WORKER_TOKEN"),
    ) as client:
        try:
            while True:
                with client.claim(queue, owner=f"sync-worker-{os.getpid()}", ttl=30) as lease:
                    if lease is None:
                        return 0  # the queue is empty
                    answer = lease.http.post("/payments/charges", step="charge", json=lease.payload)
                    if answer.problem is not None:  # e.g. outcome-unknown: try again later
                        lease.fail(error=answer.problem["reason"], retry_in=30)
                        continue
                    lease.complete({"charge": answer.json(), "replayed": answer.replayed})
                    print(f"job {lease.job_id} completed", file=sys.stderr)
        except LeaseLost as lost:
            print(f"lease lost ({lost.reason}): stopping", file=sys.stderr)
            return 3


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
