#!/usr/bin/env python3
"""A Celery app with a fenced task (needs ``fencegate[celery]``).

``charge(order_id, amount)`` is a ``FencedTask`` whose job is its order: each run holds
the order's lease (renewed in a thread while it runs) and charges through the gateway
with a plain ``httpx.Client`` fenced by ``FencedTransport``, as the step "charge". The
job is completed with the task's result. A run that loses its lease (a stalled worker)
is retried by Celery under a new lease; the retried charge gets the gateway's stored
answer, so the customer is charged once.

Start a worker, then send a task (from the repository root; Redis as the broker):

    export CELERY_BROKER_URL=redis://127.0.0.1:6379/0 \\
        CONTROL_URL=http://127.0.0.1:8081 GATEWAY_URL=http://127.0.0.1:8080
    celery --workdir examples -A celery_app worker --pool=solo
    python examples/celery_app.py ORDER_ID [AMOUNT]   # sends charge, prints its result
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import httpx
from celery import Celery

from fencegate_client.celery import FencedTask, step
from fencegate_client.httpx import FencedTransport

BROKER = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
GATEWAY = os.environ.get("GATEWAY_URL", "http://127.0.0.1:8080")

app = Celery("shop", broker=BROKER, backend=BROKER)
app.conf.update(
    task_default_queue=os.environ.get("CELERY_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    # Where the lease API and the gateway are; the worker token when auth is on.
    fencegate_control_url=os.environ.get("CONTROL_URL", "http://127.0.0.1:8081"),
    fencegate_gateway_url=GATEWAY,
    fencegate_token=os.environ.get("WORKER_TOKEN"),
)

# The task's HTTP client, fenced: requests to the gateway carry the running task's lease.
http = httpx.Client(transport=FencedTransport(gateway_url=GATEWAY), timeout=30)


# An explicit name: the same whether this file is the worker's module or the sender (__main__).
@app.task(name="shop.charge", base=FencedTask, fence_job="order_id", fence_ttl=30, max_retries=5)
def charge(order_id: str, amount: int) -> dict[str, Any]:
    with step("charge"):  # Idempotency-Key: the same in every retry of this order
        answer = http.post(f"{GATEWAY}/payments/charges", json={"amount": amount})
    answer.raise_for_status()
    charged: dict[str, Any] = answer.json()
    return {"order": order_id, "charge": charged}


def main(order_id: str, amount: str = "1500") -> int:
    result = charge.delay(order_id, int(amount))
    print(json.dumps(result.get(timeout=60)))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
