"""Fenced Celery tasks (``fencegate_client.celery``) in a real Celery worker process on a
real broker (Redis), against a real ``fencegate serve`` and a real upstream.

The worker (``celery -A tests.e2e.celery_app worker --pool=solo``) consumes a queue of
its own on a Redis server of this run (started here, or ``FENCEGATE_TEST_REDIS_URL``);
the test sends tasks by name and reads their outcome from the result backend, the job's
from the lease API and each write from the upstream. Redis missing: skipped on a
developer's machine, failed in CI.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fencegate_client import step_key
from tests.e2e.test_client import (
    FencegateProcess,
    RecordingUpstream,
    clean_env,
    control_call,
    free_port,
)
from tests.support import RedisServer, redis_unavailable

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
WORKER_TOKEN = "celery-worker-token-0123456789"
ADMIN_TOKEN = "celery-admin-token-0123456789"
TASKS = "tests.e2e.celery_app"


@pytest.fixture(scope="session")
def broker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The broker (and result backend) of this test run: ``FENCEGATE_TEST_REDIS_URL`` when
    set (its database as given; the queue names are unique per run), else a private
    ``redis-server`` started here (``tests.support.RedisServer``). Without either: skipped
    on a developer's machine, failed in CI."""
    try:
        import redis
    except ImportError as error:  # the celery extra is missing
        redis_unavailable(f"the redis library is not installed ({error})")
        raise
    given = os.environ.get("FENCEGATE_TEST_REDIS_URL")
    server = None if given else RedisServer(tmp_path_factory.mktemp("redis"))
    url = f"{server.url}/0" if server is not None else str(given)
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=2)
        client.ping()
        client.close()
    except redis.RedisError as error:
        if server is not None:
            server.stop()
        redis_unavailable(f"{url}: {type(error).__name__}: {error}")
    try:
        yield url
    finally:
        if server is not None:
            server.stop()


@pytest.fixture(scope="module")
def upstream_api() -> Iterator[RecordingUpstream]:
    api = RecordingUpstream().start()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, upstream_api: RecordingUpstream
) -> Iterator[FencegateProcess]:
    folder = tmp_path_factory.mktemp("fencegate-celery")
    control_port, proxy_port = free_port(), free_port()
    config = folder / "fencegate.toml"
    config.write_text(
        f"""
database_url = "sqlite+aiosqlite:///fencegate.db"
proxy_listen = "127.0.0.1:{proxy_port}"
control_listen = "127.0.0.1:{control_port}"

[auth]
worker_tokens = ["{WORKER_TOKEN}"]
admin_tokens = ["{ADMIN_TOKEN}"]

[[upstreams]]
name = "pay"
url = "{upstream_api.url}"

[[upstreams]]
name = "payments"  # examples/celery_app.py's
url = "{upstream_api.url}"
""",
        encoding="utf-8",
    )
    process = FencegateProcess(
        config, control_port=control_port, proxy_port=proxy_port, env=clean_env()
    )
    try:
        process.start()
        yield process
    finally:
        process.stop()


class CeleryWorker:
    """``celery -A APP worker --pool=solo`` (or ``threads``, two of them) as a child
    process; the app names its queue."""

    def __init__(
        self, app: str, *, env: dict[str, str], log: Path, cwd: Path = ROOT, pool: str = "solo"
    ) -> None:
        self.log_path = log
        self.process: subprocess.Popen[bytes] | None = None
        self.app, self.env, self.cwd, self.pool = app, env, cwd, pool

    def start(self, timeout: float = 60) -> CeleryWorker:
        name = f"fg-{uuid.uuid4().hex[:8]}@%h"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "celery", "-A", self.app, "worker"),
                    *(f"--pool={self.pool}", "--concurrency=2"),
                    *("-n", name, "--loglevel=INFO", "--without-heartbeat"),
                    *("--without-mingle", "--without-gossip"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the celery worker exited early:\n{self.log()}")
            if " ready." in self.log():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the celery worker did not become ready:\n{self.log()}")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGCONT)  # in case a test left it stopped
        self.process.terminate()  # warm shutdown
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def worker_env(server: FencegateProcess, broker_url: str, queue: str) -> dict[str, str]:
    return clean_env(
        FG_CELERY_BROKER=broker_url,
        FG_CELERY_QUEUE=queue,
        CONTROL_URL=server.control_url,
        GATEWAY_URL=server.proxy_url,
        WORKER_TOKEN=WORKER_TOKEN,
    )


@pytest.fixture(scope="module")
def queue() -> str:
    return f"fencegate-celery-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def worker(
    server: FencegateProcess,
    broker_url: str,
    queue: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[CeleryWorker]:
    log = tmp_path_factory.mktemp("celery-worker") / "worker.log"
    started = CeleryWorker(TASKS, env=worker_env(server, broker_url, queue), log=log).start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def sender(broker_url: str, queue: str) -> Iterator[Any]:
    """A Celery app in the test process that sends tasks by name and reads results."""
    from celery import Celery

    app = Celery("fencegate_celery_sender", broker=broker_url, backend=broker_url)
    app.conf.update(task_default_queue=queue, broker_connection_retry_on_startup=True)
    try:
        yield app
    finally:
        app.close()


def send(sender: Any, task: str, *args: Any, **kwargs: Any) -> Any:
    return sender.send_task(f"{TASKS}.{task}", args=args, kwargs=kwargs)


def outcome(result: Any, worker: CeleryWorker, timeout: float = 60) -> tuple[str, Any]:
    """The task's final state and value (its exception, for a failure)."""
    try:
        value = result.get(timeout=timeout, propagate=False)
    except Exception as error:  # a timeout: show what the worker said
        raise AssertionError(f"{error!r}; the worker's log:\n{worker.log()}") from error
    return str(result.state), value


def job_of(server: FencegateProcess, job_id: str) -> dict[str, Any]:
    status, job = control_call(server, "GET", f"/v1/jobs/{job_id}", token=WORKER_TOKEN)
    assert status == 200, job
    assert isinstance(job, dict)
    return job


def audit_reasons(server: FencegateProcess, job_id: str) -> list[str]:
    status, doc = control_call(
        server, "GET", f"/admin/rejections?job_id={job_id}", token=ADMIN_TOKEN
    )
    assert status == 200, doc
    return [item["reason"] for item in doc["items"]]


def writes(api: RecordingUpstream, job_id: str) -> list[tuple[str, str | None, int]]:
    """(path, key, generation) of each write that reached the upstream for the job."""
    return [(c["path"], c["key"], int(c["generation"])) for c in api.for_job(job_id)]


def wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# -- the tests -----------------------------------------------------------------------------


def test_a_fenced_task_writes_each_step_once_and_completes_its_named_job(
    worker: CeleryWorker, sender: Any, server: FencegateProcess, upstream_api: RecordingUpstream
) -> None:
    order = f"order-{uuid.uuid4().hex[:8]}"
    state, value = outcome(send(sender, "charge_order", order, 700), worker)
    assert state == "SUCCESS", value
    assert value["retries"] == 0
    charge_key, receipt_key = step_key(order, "charge"), step_key(order, "receipt")
    generation = value["generation"]
    assert writes(upstream_api, order) == [
        ("/charges", charge_key, generation),  # through httpx's FencedTransport
        ("/receipts", receipt_key, generation),  # through requests' fenced session
    ]
    assert all("Fencing-Token" not in c["headers"] for c in upstream_api.for_job(order))
    job = job_of(server, order)
    assert job["state"] == "completed" and job["result"] == value
    assert job["owner"].startswith("celery:") and job["generation"] == generation

    # The same job sent again (a redelivery after it was done): not run, nothing written,
    # the task answers the job's stored result.
    state, again = outcome(send(sender, "charge_order", order, 700), worker)
    assert state == "SUCCESS" and again == value
    assert len(upstream_api.for_job(order)) == 2


def test_a_job_held_by_another_lease_is_retried_after_a_ttl(
    worker: CeleryWorker, sender: Any, server: FencegateProcess, upstream_api: RecordingUpstream
) -> None:
    """Another worker holds the order's job (a 1 s lease it never renews): the run is
    retried after the task's TTL (5 s), when that lease has lapsed, and then completes."""
    order = f"order-{uuid.uuid4().hex[:8]}"
    status, held = control_call(
        server,
        "PUT",
        f"/v1/jobs/{order}/lease",
        {"owner": "elsewhere", "ttl_seconds": 1},
        token=WORKER_TOKEN,
    )
    assert status == 201, held
    state, value = outcome(send(sender, "charge_order", order, 300), worker)
    assert state == "SUCCESS", value
    assert value["retries"] == 1 and value["generation"] > held["generation"]
    assert [generation for *_, generation in writes(upstream_api, order)] == [
        value["generation"]
    ] * 2
    assert re.search(r"Retry in 5(\.0)?s: LeaseHeld", worker.log())


def test_runs_in_the_threads_pool_each_fence_with_their_own_lease(
    server: FencegateProcess,
    broker_url: str,
    sender: Any,
    upstream_api: RecordingUpstream,
    tmp_path: Path,
) -> None:
    """Two runs at once in one process (``--pool=threads``): each write carries its own
    run's lease and step key (the current lease is per thread)."""
    queue = f"fencegate-threads-{uuid.uuid4().hex[:10]}"
    env = worker_env(server, broker_url, queue)
    threads = CeleryWorker(TASKS, env=env, log=tmp_path / "worker.log", pool="threads")
    orders = [f"order-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    threads.start()
    try:
        results = [
            sender.send_task(f"{TASKS}.charge_order", args=(order, 100, 1.0), queue=queue)
            for order in orders
        ]
        values = [outcome(result, threads) for result in results]
    finally:
        threads.stop()
    for order, (state, value) in zip(orders, values, strict=True):
        assert state == "SUCCESS", value
        generation = value["generation"]
        assert writes(upstream_api, order) == [
            ("/charges", step_key(order, "charge"), generation),
            ("/receipts", step_key(order, "receipt"), generation),
        ]
    # They overlapped: each one's receipt came after both charges.
    received = [c["job"] for c in upstream_api.received if c["job"] in orders]
    assert sorted(received[:2]) == sorted(orders) and sorted(received[2:]) == sorted(orders)


def test_a_run_that_outlives_its_lease_is_refused_then_retried_and_each_step_lands_once(
    worker: CeleryWorker, sender: Any, server: FencegateProcess, upstream_api: RecordingUpstream
) -> None:
    """Renewal off (a task option), TTL 1 s: the first run sleeps 2 s between its steps.
    Its late write is refused (``LeaseExpired``, never sent), the task is retried under a
    new generation, its first step is answered from the gateway's store, and each step
    reaches the upstream once."""
    result = send(sender, "stall_without_renewal", 2.0)
    state, value = outcome(result, worker)
    assert state == "SUCCESS", value
    job_id = result.id  # the default job: the task's id, the same in the retry
    assert value["retries"] == 1
    first_generation, retry_generation = 0, value["generation"]
    charges = writes(upstream_api, job_id)
    assert [(path, key) for path, key, _ in charges] == [
        ("/charges", step_key(job_id, "charge")),
        ("/notices", step_key(job_id, "notify")),
    ]
    first_generation = charges[0][2]
    assert charges[1][2] == retry_generation > first_generation
    # The retry's charge was a replay (the upstream saw one); nothing else was refused.
    assert audit_reasons(server, job_id) == ["idempotent-replay"]
    job = job_of(server, job_id)
    assert job["state"] == "completed" and job["result"] == value
    assert "lease on job " + job_id in worker.log() and "lost (lease-expired)" in worker.log()


def test_a_worker_stopped_past_its_lease_is_refused_then_retried(
    worker: CeleryWorker, sender: Any, server: FencegateProcess, upstream_api: RecordingUpstream
) -> None:
    """The whole worker process is stopped (SIGSTOP, renewal thread and all) for longer
    than the TTL (1.5 s) in the middle of a run; when it resumes, its next write is
    refused, the task is retried, and each step lands once."""
    result = send(sender, "pause_between_steps", 3.0)
    job_id = result.id
    wait_for(lambda: len(upstream_api.for_job(job_id)) == 1, 30, "the first step")
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        time.sleep(2.5)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    state, value = outcome(result, worker)
    assert state == "SUCCESS", value
    assert value["retries"] == 1
    (charge, notice) = writes(upstream_api, job_id)
    assert charge[:2] == ("/charges", step_key(job_id, "charge"))
    assert notice == ("/notices", step_key(job_id, "notify"), value["generation"])
    assert value["generation"] > charge[2]
    assert audit_reasons(server, job_id) == ["idempotent-replay"]
    assert job_of(server, job_id)["state"] == "completed"


def test_a_lease_lost_in_every_run_fails_the_task_never_succeeds(
    worker: CeleryWorker, sender: Any, server: FencegateProcess, upstream_api: RecordingUpstream
) -> None:
    result = send(sender, "always_stalls", 1.3)
    state, value = outcome(result, worker)
    assert state == "FAILURE"
    assert type(value).__name__ == "LeaseExpired", value  # after max_retries=1 retry
    assert upstream_api.for_job(result.id) == []
    job = job_of(server, result.id)
    assert job["state"] == "leased" and job["generation"] >= 2  # two runs, both lapsed


def test_a_task_that_raises_fails_its_job_with_the_error(
    worker: CeleryWorker, sender: Any, server: FencegateProcess
) -> None:
    order = uuid.uuid4().hex[:8]
    state, value = outcome(send(sender, "broken", order), worker)
    assert state == "FAILURE" and isinstance(value, KeyError)
    job = job_of(server, f"order-{order}")
    assert job["state"] == "pending" and job["attempts"] == 1
    assert job["error"] == f"KeyError: '{order}'"


def test_celery_is_not_loaded_by_the_package() -> None:
    code = "import json, sys, fencegate_client; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = json.loads(done.stdout)
    for library in ("celery", "kombu", "redis"):
        assert not [m for m in loaded if m == library or m.startswith(library + ".")], library


def test_the_example_app_charges_once_and_a_second_send_is_answered_from_the_job(
    server: FencegateProcess,
    broker_url: str,
    upstream_api: RecordingUpstream,
    tmp_path: Path,
) -> None:
    """examples/celery_app.py as its docstring says: a worker started on it, and the file
    run as a script to send ``charge`` and print its result."""
    env = clean_env(
        CELERY_BROKER_URL=broker_url,
        CELERY_QUEUE=f"fencegate-example-{uuid.uuid4().hex[:10]}",
        CONTROL_URL=server.control_url,
        GATEWAY_URL=server.proxy_url,
        WORKER_TOKEN=WORKER_TOKEN,
    )
    example = CeleryWorker("celery_app", env=env, log=tmp_path / "worker.log", cwd=EXAMPLES)
    order = f"order-{uuid.uuid4().hex[:8]}"
    send_it = [sys.executable, str(EXAMPLES / "celery_app.py"), order, "1500"]
    example.start()
    try:
        done = subprocess.run(
            send_it, env=env, capture_output=True, text=True, timeout=90, cwd=ROOT, check=False
        )
        assert done.returncode == 0, done.stderr + example.log()
        printed = json.loads(done.stdout)
        again = subprocess.run(
            send_it, env=env, capture_output=True, text=True, timeout=90, cwd=ROOT, check=False
        )
        assert again.returncode == 0, again.stderr + example.log()
    finally:
        example.stop()
    (call,) = upstream_api.for_job(order)
    assert call["path"] == "/charges" and call["key"] == step_key(order, "charge")
    assert json.loads(call["body"]) == {"amount": 1500}
    number = upstream_api.received.index(call) + 1  # the upstream's running number
    charge = {"id": f"ch_{number}", "number": number, "path": "/charges"}
    assert printed == {"order": order, "charge": charge}
    job = job_of(server, order)
    assert job["state"] == "completed" and job["result"] == printed
    assert json.loads(again.stdout) == printed  # not run again: the job's stored result
