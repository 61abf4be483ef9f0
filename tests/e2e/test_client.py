"""The worker client (``fencegate_client``) against a real ``fencegate serve`` process and a
real upstream.

One server process (SQLite, worker token required) and one recording upstream serve
the whole module; every test works on its own job ids and queues, so they do not see
each other's jobs. Nothing of ours is mocked: the client talks HTTP to the control and
proxy listeners, and the gateway talks HTTP to an aiohttp server in a background thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from fencegate_client import (
    FencedResponse,
    LeaseClient,
    RemoteError,
    error_from_problem,
    step_key,
)
from fencegate_client import errors as exc

FENCEGATE = str(Path(sys.executable).with_name("fencegate"))
WORKER_TOKEN = "e2e-worker-token-0123456789"
PAY_API_KEY = "sk_test_upstream_secret"


# -- helpers (also used by test_examples.py) ----------------------------------------------


def free_port() -> int:
    """A port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without FENCEGATE_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    env.update(extra)
    return env


class RecordingUpstream:
    """A real HTTP API (aiohttp, own event loop in a background thread) that records
    every request and answers 201 with a charge-like JSON document."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.url = ""
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        with self._lock:
            number = len(self.received) + 1
            self.received.append(
                {
                    "method": request.method,
                    "path": request.path_qs,
                    "headers": dict(request.headers),
                    "body": body,
                    "job": request.headers.get("Fencing-Job"),
                    "generation": request.headers.get("Fencing-Generation"),
                    "key": request.headers.get("Idempotency-Key"),
                }
            )
        if request.method == "PUT" and request.path.startswith("/files/"):
            # An S3 PutObject (examples/boto3_upload.py): 200, the object's ETag, no body.
            return web.Response(status=200, headers={"ETag": f'"etag-{number}"'})
        answer = {"id": f"ch_{number}", "number": number, "path": request.path}
        # A lower-case header name, as many servers (and every HTTP/2 hop) send them.
        return web.json_response(answer, status=201, headers={"x-charge-id": f"ch_{number}"})

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            self.url = f"http://127.0.0.1:{port}"
            self._ready.set()
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as error:  # surfaced by start()
            self._error = error
            self._ready.set()

    def start(self) -> RecordingUpstream:
        self._thread = threading.Thread(target=self._run, name="recording-upstream", daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"upstream did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    def for_job(self, job_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self.received if r["job"] == job_id]


class FencegateProcess:
    """``fencegate serve --config FILE`` as a child process."""

    def __init__(
        self, config: Path, *, control_port: int, proxy_port: int, env: dict[str, str]
    ) -> None:
        self.config = config
        self.control_url = f"http://127.0.0.1:{control_port}"
        self.proxy_url = f"http://127.0.0.1:{proxy_port}"
        self.env = env
        self.log_path = config.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> FencegateProcess:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [FENCEGATE, "serve", "--config", str(self.config), "--log-level", "WARNING"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.config.parent,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fencegate serve exited early:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.control_url + "/healthz", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"fencegate serve did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@contextlib.contextmanager
def serving_a_copy(
    config: Path, folder: Path, replacements: dict[str, str], **env: str
) -> Iterator[FencegateProcess]:
    """``fencegate serve`` with a copy of ``config`` in ``folder``, each key of
    ``replacements`` (a line of the file, found exactly once) replaced by its value; a
    database and listeners of its own from the environment."""
    text = config.read_text(encoding="utf-8")
    for original, replacement in replacements.items():
        assert text.count(original) == 1, original
        text = text.replace(original, replacement)
    copy = folder / config.name
    copy.write_text(text, encoding="utf-8")
    control_port, proxy_port = free_port(), free_port()
    process = FencegateProcess(
        copy,
        control_port=control_port,
        proxy_port=proxy_port,
        env=clean_env(
            FENCEGATE_DATABASE_URL=f"sqlite+aiosqlite:///{folder / 'fencegate.db'}",
            FENCEGATE_PROXY_LISTEN=f"127.0.0.1:{proxy_port}",
            FENCEGATE_CONTROL_LISTEN=f"127.0.0.1:{control_port}",
            **env,
        ),
    )
    try:
        process.start()
        yield process
    finally:
        process.stop()


def control_call(
    server: FencegateProcess,
    method: str,
    path: str,
    body: Any = None,
    token: str | None = WORKER_TOKEN,
) -> tuple[int, Any]:
    """One request to the control listener with the standard library (no client code)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.control_url + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as error:
        raw = error.read()
        error.close()
        return error.code, json.loads(raw) if raw else None


# -- fixtures -------------------------------------------------------------------------------


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
    folder = tmp_path_factory.mktemp("fencegate-client")
    control_port, proxy_port = free_port(), free_port()
    config = folder / "fencegate.toml"
    config.write_text(
        f"""
# a relative SQLite path: resolved against this file's folder
database_url = "sqlite+aiosqlite:///fencegate.db"
proxy_listen = "127.0.0.1:{proxy_port}"
control_listen = "127.0.0.1:{control_port}"

[auth]
worker_tokens = ["{WORKER_TOKEN}"]

[lease]
default_ttl_seconds = 5
max_ttl_seconds = 60

[[upstreams]]
name = "pay"
url = "{upstream_api.url}"
set_headers = {{ Authorization = "Bearer ${{PAY_API_KEY}}" }}

[[upstreams]]
name = "mail"
url = "{upstream_api.url}/mail"
require_idempotency_key = false
""",
        encoding="utf-8",
    )
    process = FencegateProcess(
        config,
        control_port=control_port,
        proxy_port=proxy_port,
        env=clean_env(PAY_API_KEY=PAY_API_KEY),
    )
    try:
        process.start()
        yield process
    finally:
        process.stop()
    assert (folder / "fencegate.db").exists()


@pytest.fixture
async def client(server: FencegateProcess) -> AsyncIterator[LeaseClient]:
    async with LeaseClient(
        server.control_url, gateway_url=server.proxy_url, token=WORKER_TOKEN
    ) as lease_client:
        yield lease_client


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


# -- renewal and loss ------------------------------------------------------------------------


async def test_renewal_keeps_lease_alive_past_its_ttl(
    client: LeaseClient, upstream_api: RecordingUpstream
) -> None:
    queue = unique("q")
    job = await client.enqueue(queue=queue, payload={"amount": 500})
    async with client.claim(queue, owner="renewer", ttl=1) as lease:
        assert lease is not None and lease.job_id == job["job_id"]
        assert lease.payload == {"amount": 500}
        granted_expiry = lease.expires_at
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # three TTLs
            assert lease.held, lease.lost_reason
            await asyncio.sleep(0.2)
        assert lease.expires_at != granted_expiry
        seen = await client.get_job(lease.job_id)
        assert seen["state"] == "leased" and seen["generation"] == lease.generation
        # The gateway agrees the lease is current: the write goes through.
        answer = await lease.http.post("/pay/charges", step="charge", json={"amount": 500})
        assert answer.status == 201 and not answer.replayed
        done = await lease.complete({"charge": answer.json()})
        assert done["state"] == "completed"
        assert not lease.held
    job = await client.get_job(lease.job_id)
    assert job["state"] == "completed"
    assert job["result"] == {"charge": answer.json()}
    assert len(upstream_api.for_job(lease.job_id)) == 1


async def test_stalled_event_loop_sets_lost_when_the_lease_lapses(
    client: LeaseClient, upstream_api: RecordingUpstream
) -> None:
    job_id = unique("stall")
    async with client.acquire(job_id, owner="staller", ttl=1) as lease:
        assert lease is not None
        await asyncio.sleep(0.1)  # the renewer is now waiting for its next turn
        time.sleep(1.3)  # a GC pause / stopped VM: the renewer cannot run either
        assert not lease.held
        # Code waiting on ``lease.lost`` to abandon its work must be woken.
        await asyncio.wait_for(lease.lost.wait(), 2)
        assert isinstance(lease.lost_reason, exc.LeaseExpired)
        with pytest.raises(exc.LeaseExpired):
            await lease.http.post("/pay/charges", step="charge", json={"amount": 1})
    assert upstream_api.for_job(job_id) == []
    # The block's exit did not try to release a lease it no longer has: a new owner can
    # take the job right away because the old lease expired.
    async with client.acquire(job_id, owner="next", ttl=5) as taken:
        assert taken is not None and taken.generation > lease.generation
        await taken.complete()


async def test_lease_taken_over_after_expiry_is_lost(
    client: LeaseClient, upstream_api: RecordingUpstream
) -> None:
    job_id = unique("stolen")
    stalled = await client.acquire(job_id, owner="slow", ttl=1)  # never renewed
    assert stalled is not None
    await asyncio.sleep(1.2)
    thief = await client.acquire(job_id, owner="fast", ttl=30)
    assert thief is not None and thief.generation > stalled.generation
    assert not stalled.held
    with pytest.raises(exc.LeaseLost) as lost:
        await stalled.http.post("/pay/charges", step="charge", json={"amount": 1})
    assert isinstance(lost.value, exc.LeaseExpired)
    assert stalled.lost.is_set()
    with pytest.raises(exc.LeaseLost):
        await stalled.renew()
    with pytest.raises(exc.LeaseLost):
        await stalled.complete()
    assert upstream_api.for_job(job_id) == []
    await thief.complete("done")
    assert (await client.get_job(job_id))["result"] == "done"


async def test_new_grant_fences_off_the_old_one_at_the_gateway(
    client: LeaseClient, upstream_api: RecordingUpstream
) -> None:
    job_id = unique("regrant")
    first = await client.acquire(job_id, owner="restarting-worker", ttl=30)
    # The same owner acquiring again (a restarted process) gets a newer generation.
    second = await client.acquire(job_id, owner="restarting-worker", ttl=30)
    assert first is not None and second is not None
    assert second.generation > first.generation
    assert first.held  # locally nothing tells the old lease apart: only the gateway can
    with pytest.raises(exc.StaleGeneration):
        await first.http.post("/pay/charges", step="charge", json={"amount": 900})
    assert first.lost.is_set() and not first.held
    assert isinstance(first.lost_reason, exc.StaleGeneration)
    assert upstream_api.for_job(job_id) == []
    # From now on the old lease fails fast with the same reason, without a request.
    with pytest.raises(exc.StaleGeneration):
        await first.http.post("/pay/charges", step="other", json={"amount": 1})
    with pytest.raises(exc.StaleGeneration):
        await first.complete()

    answer = await second.http.post("/pay/charges", step="charge", json={"amount": 900})
    assert answer.status == 201 and not answer.replayed
    calls = upstream_api.for_job(job_id)
    assert [c["generation"] for c in calls] == [str(second.generation)]
    await second.complete(answer.json())
    assert (await client.get_job(job_id))["state"] == "completed"


async def test_renewer_notices_takeover_and_exit_leaves_the_new_lease_alone(
    client: LeaseClient,
) -> None:
    job_id = unique("takeover")
    async with client.acquire(job_id, owner="w", ttl=1) as first:
        assert first is not None
        second = await client.acquire(job_id, owner="w", ttl=30)
        assert second is not None
        await asyncio.wait_for(first.lost.wait(), 2)  # the next renewal is refused
        assert isinstance(first.lost_reason, exc.StaleGeneration)
    job = await client.get_job(job_id)
    assert job["state"] == "leased" and job["generation"] == second.generation
    await second.release()
    assert (await client.get_job(job_id))["state"] == "pending"


async def test_local_deadline_counts_from_the_request(client: LeaseClient) -> None:
    """The worker must never believe in its lease longer than the server does."""
    asked = time.monotonic()
    lease = await client.acquire(unique("deadline"), owner="w", ttl=1)
    assert lease is not None
    await asyncio.sleep(asked + 1.003 - time.monotonic())
    assert not lease.held


# -- step keys ---------------------------------------------------------------------------------


async def test_retried_step_reuses_its_key_and_gets_the_stored_answer(
    client: LeaseClient, upstream_api: RecordingUpstream
) -> None:
    job_id = unique("steps")
    async with client.acquire(job_id, owner="w", ttl=30) as lease:
        assert lease is not None
        first = await lease.http.post("/pay/charges", step="charge", json={"amount": 700})
        again = await lease.http.post("/pay/charges", step="charge", json={"amount": 700})
        assert first.status == 201 and not first.replayed
        assert again.status == 201 and again.replayed
        assert again.body == first.body and again.json() == first.json()
        calls = upstream_api.for_job(job_id)
        assert len(calls) == 1
        sent = calls[0]["headers"]
        assert sent["Idempotency-Key"] == step_key(job_id, "charge")
        assert "Fencing-Token" not in sent
        assert sent["Authorization"] == f"Bearer {PAY_API_KEY}"  # set by the gateway
        # Header names are case-insensitive, on first answers and on replays alike.
        assert first.headers["X-Charge-Id"] == first.json()["id"]
        assert again.headers["x-charge-id"] == first.json()["id"]

        other = await lease.http.post("/pay/refunds", step="refund", json={"amount": 700})
        assert other.status == 201 and not other.replayed
        assert len(upstream_api.for_job(job_id)) == 2

        # Same step, different request: the gateway refuses; the lease is still fine.
        reused = await lease.http.post("/pay/charges", step="charge", json={"amount": 1})
        assert reused.status == 422
        assert reused.problem is not None
        assert reused.problem["reason"] == "idempotency-key-reused"
        assert lease.held

        explicit = await lease.http.put("/pay/cards/1", key="my-own-key", json={"x": 1})
        assert explicit.status == 201
        assert upstream_api.for_job(job_id)[-1]["key"] == "my-own-key"
        assert upstream_api.for_job(job_id)[-1]["method"] == "PUT"
        await lease.complete()
    assert len(upstream_api.for_job(job_id)) == 3


async def test_step_answer_is_shared_across_generations(
    client: LeaseClient, upstream_api: RecordingUpstream
) -> None:
    queue = unique("q")
    job_id = unique("handover")
    charge = {"amount": 1250, "currency": "EUR"}
    crashed = await client.acquire(job_id, owner="worker-a", ttl=1, queue=queue)
    assert crashed is not None
    charged = await crashed.http.post("/pay/charges", step="charge", json=charge)
    assert charged.status == 201 and not charged.replayed
    # worker-a dies before completing; its lease runs out and worker-b claims the job.
    await asyncio.sleep(1.1)
    async with client.claim(queue, owner="worker-b", ttl=30) as lease:
        assert lease is not None and lease.job_id == job_id
        assert lease.generation > crashed.generation
        repeat = await lease.http.post("/pay/charges", step="charge", json=charge)
        assert repeat.replayed and repeat.status == 201
        assert repeat.json() == charged.json()
        receipt = await lease.http.post("/pay/receipts", step="receipt", json={"to": "x"})
        assert not receipt.replayed
        await lease.complete({"charge": repeat.json()})
    calls = upstream_api.for_job(job_id)
    assert [(c["path"], c["generation"]) for c in calls] == [
        ("/charges", str(crashed.generation)),
        ("/receipts", str(lease.generation)),
    ]
    with pytest.raises(exc.LeaseLost):
        await crashed.http.post("/pay/charges", step="charge-2", json=charge)
    assert len(upstream_api.for_job(job_id)) == 2


async def test_upstream_without_required_key(
    client: LeaseClient, upstream_api: RecordingUpstream
) -> None:
    job_id = unique("mail")
    async with client.acquire(job_id, owner="w", ttl=30) as lease:
        assert lease is not None
        answer = await lease.http.post("/mail/send", json={"to": "a@example.com"})
        assert answer.status == 201 and not answer.replayed
        await lease.complete()
    (call,) = upstream_api.for_job(job_id)
    assert call["path"] == "/mail/send"
    assert call["key"] is None
    assert json.loads(call["body"]) == {"to": "a@example.com"}


async def test_fenced_session_needs_a_gateway_url(server: FencegateProcess) -> None:
    async with LeaseClient(server.control_url, token=WORKER_TOKEN) as control_only:
        lease = await control_only.acquire(unique("nogw"), owner="w", ttl=30)
        assert lease is not None
        with pytest.raises(ValueError, match="gateway_url"):
            await lease.http.post("/pay/charges", step="charge", json={})
        await lease.release()


# -- claim, exit, errors -------------------------------------------------------------------


async def test_claim_on_an_empty_queue_gives_none(client: LeaseClient) -> None:
    queue = unique("empty")
    assert await client.claim(queue, owner="w") is None
    entered = False
    async with client.claim(queue, owner="w") as lease:
        entered = True
        assert lease is None
    assert entered


async def test_leaving_the_block_without_complete_releases_the_job(client: LeaseClient) -> None:
    queue = unique("q")
    job = await client.enqueue(queue=queue, payload={"n": 1})
    async with client.claim(queue, owner="w1", ttl=30) as lease:
        assert lease is not None and lease.job_id == job["job_id"]
    assert lease.ended and not lease.held
    after = await client.get_job(job["job_id"])
    assert after["state"] == "pending"
    assert after["attempts"] == 0  # a release gives the attempt back
    with pytest.raises(exc.LeaseEnded):
        lease.check()
    again = await client.claim(queue, owner="w2", ttl=30)
    assert again is not None and again.job_id == job["job_id"]
    assert again.generation > lease.generation
    await again.release()


async def test_raising_inside_the_block_fails_the_job_with_the_error(
    client: LeaseClient,
) -> None:
    queue = unique("q")
    last = await client.enqueue(queue=queue, max_attempts=1)
    with pytest.raises(RuntimeError, match="card declined"):
        async with client.claim(queue, owner="w", ttl=30) as lease:
            assert lease is not None and lease.job_id == last["job_id"]
            raise RuntimeError("card declined")
    job = await client.get_job(last["job_id"])
    assert job["state"] == "failed"
    assert job["error"] == "RuntimeError: card declined"

    retried = await client.enqueue(queue=queue, max_attempts=3)
    with pytest.raises(KeyError):
        async with client.claim(queue, owner="w", ttl=30) as lease:
            assert lease is not None and lease.job_id == retried["job_id"]
            raise KeyError("customer")
    job = await client.get_job(retried["job_id"])
    assert job["state"] == "pending" and job["attempts"] == 1
    assert job["error"] == "KeyError: 'customer'"


async def test_named_job_held_by_another_lease(client: LeaseClient) -> None:
    job_id = unique("held")
    holder = await client.acquire(job_id, owner="a", ttl=30)
    assert holder is not None
    with pytest.raises(exc.LeaseHeld) as held:
        await client.acquire(job_id, owner="b", ttl=30)
    assert held.value.extra.get("job_id") == job_id
    with pytest.raises(exc.LeaseHeld):
        async with client.acquire(job_id, owner="b", ttl=30):
            pytest.fail("the block must not run")
    await holder.release()
    async with client.acquire(job_id, owner="b", ttl=30) as taken:
        assert taken is not None and taken.generation > holder.generation
        await taken.complete()
    with pytest.raises(exc.JobFinished):
        await client.acquire(job_id, owner="c", ttl=30)


async def test_server_errors_arrive_as_exceptions(
    client: LeaseClient, server: FencegateProcess
) -> None:
    with pytest.raises(exc.JobNotFound):
        await client.get_job(unique("missing"))
    job_id = unique("dup")
    await client.enqueue(job_id=job_id)
    with pytest.raises(exc.JobExists):
        await client.enqueue(job_id=job_id)
    with pytest.raises(exc.InvalidRequest) as bad_ttl:
        await client.acquire(unique("ttl"), owner="w", ttl=61)  # over max_ttl_seconds
    assert bad_ttl.value.extra.get("field") == "ttl_seconds"
    async with LeaseClient(server.control_url, token="not-a-known-token-at-all") as intruder:
        with pytest.raises(exc.Unauthorized):
            await intruder.claim("q", owner="w")
    # And the problem document itself, straight from the server, maps the same way.
    status, doc = control_call(server, "GET", f"/v1/jobs/{unique('missing')}")
    assert status == 404
    assert isinstance(error_from_problem(status, doc), exc.JobNotFound)


@pytest.mark.parametrize(
    ("reason", "cls"),
    [
        ("stale-generation", exc.StaleGeneration),
        ("lease-expired", exc.LeaseExpired),
        ("lease-ended", exc.LeaseEnded),
        ("lease-held", exc.LeaseHeld),
        ("job-not-found", exc.JobNotFound),
        ("job-exists", exc.JobExists),
        ("job-finished", exc.JobFinished),
        ("invalid-request", exc.InvalidRequest),
        ("invalid-lease-token", exc.InvalidLeaseToken),
        ("unauthorized", exc.Unauthorized),
        ("forbidden", exc.Forbidden),
        ("store-unavailable", exc.StoreUnavailable),
    ],
)
def test_error_from_problem_maps_reasons(reason: str, cls: type[exc.LeaseError]) -> None:
    doc = {
        "type": f"https://fencegate.dev/problems/{reason}",
        "title": "t",
        "status": cls.status,
        "detail": "what happened",
        "reason": reason,
        "job_id": "job-1",
        "generation": 3,
    }
    error = error_from_problem(cls.status, doc)
    assert type(error) is cls
    assert error.reason == reason and error.detail == "what happened"
    assert error.extra == {"job_id": "job-1", "generation": 3}
    if issubclass(cls, exc.LeaseLost):
        assert isinstance(error, exc.LeaseLost)


def test_error_from_problem_keeps_unknown_reasons() -> None:
    doc = {"title": "Ordering timeout", "status": 503, "reason": "ordering-timeout"}
    error = error_from_problem(503, doc)
    assert isinstance(error, RemoteError) and not isinstance(error, exc.LeaseLost)
    assert error.remote_status == 503 and error.remote_reason == "ordering-timeout"
    assert error.problem == doc
    assert error.detail == "Ordering timeout"  # no detail: the title stands in
    bare = error_from_problem(502, {})
    assert isinstance(bare, RemoteError) and bare.detail == "HTTP 502"


def test_fenced_response_problem_only_for_gateway_documents() -> None:
    doc = {"type": "about:blank", "status": 409, "reason": "request-in-progress"}
    own = FencedResponse(
        409, {"Content-Type": "application/problem+json"}, json.dumps(doc).encode(), False
    )
    assert own.problem == doc
    upstream = FencedResponse(409, {"Content-Type": "application/json"}, b'{"reason": "x"}', False)
    assert upstream.problem is None
    not_json = FencedResponse(409, {"Content-Type": "application/problem+json"}, b"<", False)
    assert not_json.problem is None


def test_fenced_response_reports_a_lost_lease_only_for_loss_reasons() -> None:
    def answer(reason: str) -> FencedResponse:
        doc = {"status": 409, "reason": reason, "detail": f"because {reason}"}
        headers = {"Content-Type": "application/problem+json"}
        return FencedResponse(409, headers, json.dumps(doc).encode(), False)

    for reason, cls in (
        ("stale-generation", exc.StaleGeneration),
        ("lease-expired", exc.LeaseExpired),
        ("lease-ended", exc.LeaseEnded),
    ):
        lost = answer(reason).lease_lost()
        assert type(lost) is cls and lost.detail == f"because {reason}"
    for reason in ("request-in-progress", "outcome-unknown", "idempotency-key-reused"):
        assert answer(reason).lease_lost() is None
    upstream = FencedResponse(
        409, {"Content-Type": "application/json"}, b'{"reason": "stale-generation"}', False
    )
    assert upstream.lease_lost() is None


# -- the client's borders -----------------------------------------------------------------


def test_the_old_import_path_gives_the_same_objects() -> None:
    """``lease_core.client`` and ``lease_core.exceptions`` name the client package's very
    objects, so code written against them keeps working (and catches the client's errors)."""
    import fencegate_client
    import lease_core.client
    import lease_core.exceptions

    old_names = (
        "LeaseClient",
        "Lease",
        "FencedSession",
        "FencedResponse",
        "RemoteError",
        "error_from_problem",
        "step_key",
    )
    assert set(old_names) <= set(lease_core.client.__all__)
    for name in lease_core.client.__all__:
        assert getattr(lease_core.client, name) is getattr(fencegate_client, name), name
    for name in lease_core.exceptions.__all__:
        assert getattr(lease_core.exceptions, name) is getattr(exc, name), name
    assert issubclass(fencegate_client.StaleGeneration, lease_core.exceptions.LeaseLost)


def test_the_client_imports_nothing_of_the_service() -> None:
    """A worker needs the client package and aiohttp: importing it loads neither the lease
    service nor the gateway, nor their database and configuration libraries."""
    code = (
        "import json, sys, fencegate_client, fencegate_client.aio, fencegate_client.errors, "
        "fencegate_client.protocol; print(json.dumps(sorted(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = json.loads(done.stdout)
    assert "fencegate_client.aio" in loaded
    for forbidden in ("lease_core", "gateway", "sqlalchemy", "alembic", "pydantic"):
        assert not [m for m in loaded if m == forbidden or m.startswith(forbidden + ".")]


def test_importing_the_package_loads_no_http_library() -> None:
    """The integrations are optional: ``import fencegate_client`` loads none of their
    libraries (nor aiohttp); every name it exports still resolves, each from its module."""
    code = (
        "import json, sys, fencegate_client as fc; before = sorted(sys.modules); "
        "names = {n: getattr(fc, n).__module__ for n in fc.__all__ if n != 'current_lease'}; "
        "print(json.dumps([before, names]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded, names = json.loads(done.stdout)
    for library in ("aiohttp", "httpx", "requests", "boto3", "botocore"):
        assert not [m for m in loaded if m == library or m.startswith(library + ".")], library
    assert names["LeaseClient"] == "fencegate_client.aio"
    assert names["LeaseLost"] == "fencegate_client.errors"
    assert names["step_key"] == "fencegate_client.protocol"


# -- optional libraries and the extras that bring them --------------------------------------

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("module", "library", "extra"),
    [
        ("fencegate_client.sync", "httpx", "httpx"),
        ("fencegate_client.httpx", "httpx", "httpx"),
        ("fencegate_client.requests", "requests", "requests"),
        ("fencegate_client.boto3", "boto3", "boto3"),
        ("fencegate_client.boto3", "botocore", "boto3"),
        ("fencegate_client.celery", "celery", "celery"),
        ("fencegate_client.celery", "httpx", "celery"),
    ],
)
def test_a_missing_library_is_named_with_the_extra_to_install(
    module: str, library: str, extra: str
) -> None:
    """An install without the integration's library (made unimportable here) gets one
    line that says which module needs what, and the extra that brings it."""
    code = f"import sys; sys.modules[{library!r}] = None; import {module}"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"ModuleNotFoundError: {module} needs {library}: pip install 'fencegate-client[{extra}]'"
    ), done.stderr


@pytest.mark.parametrize(
    ("module", "library", "install"),
    [("fencegate_client.aio", "aiohttp", "aiohttp"), ("fencegate_client.signed", "jwt", "pyjwt")],
)
def test_a_missing_base_library_is_named_too(module: str, library: str, install: str) -> None:
    code = f"import sys; sys.modules[{library!r}] = None; import {module}"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    last = done.stderr.strip().splitlines()[-1]
    assert f"{module} needs {library}: pip install" in last and install in last, done.stderr


@pytest.fixture(scope="module")
def fencegate_wheels(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The server's wheel and the client's (``fencegate-client``, which the server depends
    on and which is not on the package index), built from a copy of the sources (a build
    in the tree would leave build/ and egg-info behind)."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for folder in ("lease_core", "gateway", "client", "alembic"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q"),
            *("--wheel-dir", str(work), "./client", "."),
        ],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = work.glob("fencegate-*.whl")
    (client,) = work.glob("fencegate_client-*.whl")
    return wheel, client


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("extra", "example"), [("requests", "requests_worker.py"), ("boto3", "boto3_upload.py")]
)
def test_one_extra_is_enough_for_its_worker(
    fencegate_wheels: tuple[Path, Path], tmp_path: Path, extra: str, example: str
) -> None:
    """``pip install 'fencegate[requests]'`` (or ``[boto3]``) in a fresh venv, nothing
    else: the example worker runs until it asks the lease API (nobody listens, so httpx
    cannot connect), instead of stopping at ``No module named 'httpx'``."""
    venv = tmp_path / "venv"
    made = subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    installed = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")),
            *("install", "-q", f"{fencegate_wheels[0]}[{extra}]", str(fencegate_wheels[1])),
        ],
        capture_output=True,
        text=True,
        timeout=480,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr
    env = clean_env(CONTROL_URL=f"http://127.0.0.1:{free_port()}")
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [str(venv / "bin" / "python"), str(ROOT / "examples" / example), "extras-job"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "ModuleNotFoundError" not in done.stderr, done.stderr
    assert "httpx.ConnectError" in done.stderr, done.stderr
