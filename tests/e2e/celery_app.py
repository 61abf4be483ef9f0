"""The Celery app that ``test_celery.py`` runs in a real worker process
(``celery -A tests.e2e.celery_app worker``). Its broker, queue and Fencegate URLs come
from the environment the test gives the worker; its tasks write through the gateway with
each of the fenced HTTP clients."""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import requests
from celery import Celery

from fencegate_client.celery import FencedTask, fenced, step
from fencegate_client.httpx import FencedTransport
from fencegate_client.requests import fence_session

BROKER = os.environ.get("FG_CELERY_BROKER", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("FG_CELERY_QUEUE", "fencegate-test")
GATEWAY = os.environ.get("GATEWAY_URL", "http://127.0.0.1:8080")

app = Celery("fencegate_celery_test", broker=BROKER, backend=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    fencegate_control_url=os.environ.get("CONTROL_URL", "http://127.0.0.1:8081"),
    fencegate_gateway_url=GATEWAY,
    fencegate_token=os.environ.get("WORKER_TOKEN"),
)

http = httpx.Client(transport=FencedTransport(gateway_url=GATEWAY), timeout=30)
session = fence_session(requests.Session(), gateway_url=GATEWAY)


@app.task(base=FencedTask, bind=True, fence_job="order_id", fence_ttl=5)
def charge_order(self: FencedTask, order_id: str, amount: int, pause: float = 0) -> dict[str, Any]:
    """A named job; one step through httpx, one through requests (``pause`` seconds
    apart)."""
    with step("charge"):
        charge = http.post(f"{GATEWAY}/pay/charges", json={"order": order_id, "amount": amount})
    time.sleep(pause)
    with self.lease.step("receipt"):
        receipt = session.post(f"{GATEWAY}/pay/receipts", json={"order": order_id})
    return {
        "charge": charge.json(),
        "receipt": receipt.json(),
        "generation": self.lease.generation,
        "retries": self.request.retries,
    }


@app.task(base=FencedTask, bind=True, fence_ttl=1, fence_renew=False, max_retries=3)
def stall_without_renewal(self: FencedTask, stall: float) -> dict[str, Any]:
    """The job is the task's id. Renewal is off: the first run outlives its lease between
    its two steps; the retry runs straight through."""
    self.lease.http.post("/pay/charges", step="charge", json={"amount": 1})
    if self.request.retries == 0:
        time.sleep(stall)
    with step("notify"):
        http.post(f"{GATEWAY}/pay/notices", json={"charged": 1})
    return {"generation": self.lease.generation, "retries": self.request.retries}


@app.task(base=FencedTask, bind=True, fence_ttl=1.5, max_retries=3)
def pause_between_steps(self: FencedTask, pause: float) -> dict[str, Any]:
    """Renewed in a thread; the test stops the whole worker process (SIGSTOP) during the
    first run's pause, for longer than the TTL."""
    with step("charge"):
        http.post(f"{GATEWAY}/pay/charges", json={"amount": 2})
    if self.request.retries == 0:
        time.sleep(pause)
    with step("notify"):
        session.post(f"{GATEWAY}/pay/notices", json={"charged": 2})
    return {"generation": self.lease.generation, "retries": self.request.retries}


@app.task(base=FencedTask, bind=True, fence_ttl=1, fence_renew=False, max_retries=1)
def always_stalls(self: FencedTask, stall: float) -> None:
    """Every run outlives its lease before its write: out of retries, the task fails."""
    time.sleep(stall)
    with step("charge"):
        http.post(f"{GATEWAY}/pay/charges", json={"amount": 3})


@fenced(app, fence_job=lambda order_id: f"order-{order_id}", max_retries=0)
def broken(order_id: str) -> None:
    """A task that raises: its job is failed with the error."""
    raise KeyError(order_id)
