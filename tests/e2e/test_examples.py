"""The files in ``examples/`` work as their README says: the config is valid, and the
Python worker and the curl script run against a real ``fencegate serve`` using that
config (its database, listeners and upstream URLs pointed at the test's own); the
lease-source examples run against ``fencegate serve`` with ``lease_sources.toml`` (the
same changes, and etcd's endpoint pointed at a real etcd)."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fencegate_client import step_key
from tests.e2e.test_client import (
    FENCEGATE,
    FencegateProcess,
    RecordingUpstream,
    clean_env,
    control_call,
    free_port,
    serving_a_copy,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CONFIG = EXAMPLES / "fencegate.toml"
WORKER = EXAMPLES / "python_worker.py"
CURL_FLOW = EXAMPLES / "curl_flow.sh"
SYNC_WORKER = EXAMPLES / "sync_worker.py"
CLIENT_EXAMPLES = {  # example -> (upstream path of its write, its step)
    "httpx_worker.py": ("/charges", "charge"),
    "requests_worker.py": ("/charges", "charge"),
    "boto3_upload.py": ("/files/reports/{job_id}.csv", "upload-report"),
}
API_KEY = "sk_test_examples_key"
TOKEN = "examples-worker-token-0123456789"


@pytest.fixture(scope="module")
def payments_api() -> Iterator[RecordingUpstream]:
    api = RecordingUpstream().start()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, payments_api: RecordingUpstream
) -> Iterator[FencegateProcess]:
    """``fencegate serve`` with the example config; only the upstream URLs are changed in
    a copy (upstreams are a list, which the environment can only replace whole), the
    rest is overridden the way an operator would: FENCEGATE_* variables."""
    folder = tmp_path_factory.mktemp("fencegate-examples")
    text = CONFIG.read_text(encoding="utf-8")
    for original, replacement in (
        ('url = "http://127.0.0.1:9000"', f'url = "{payments_api.url}"'),
        ('url = "http://127.0.0.1:9001"', f'url = "{payments_api.url}/mail"'),
        ('url = "http://127.0.0.1:9002"', f'url = "{payments_api.url}/files"'),
    ):
        assert text.count(original) == 1, original
        text = text.replace(original, replacement)
    config = folder / "fencegate.toml"
    config.write_text(text, encoding="utf-8")
    control_port, proxy_port = free_port(), free_port()
    env = clean_env(
        PAYMENTS_API_KEY=API_KEY,
        FENCEGATE_DATABASE_URL=f"sqlite+aiosqlite:///{folder / 'override.db'}",
        FENCEGATE_PROXY_LISTEN=f"127.0.0.1:{proxy_port}",
        FENCEGATE_CONTROL_LISTEN=f"127.0.0.1:{control_port}",
        FENCEGATE_AUTH__WORKER_TOKENS=json.dumps([TOKEN]),
    )
    process = FencegateProcess(config, control_port=control_port, proxy_port=proxy_port, env=env)
    try:
        process.start()
        yield process
    finally:
        process.stop()
    # The environment won over the file: the database is where FENCEGATE_DATABASE_URL said.
    assert (folder / "override.db").exists()
    assert not (folder / "fencegate.db").exists()


def run(
    args: list[str], *, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False
    )


def test_example_config_passes_check_config() -> None:
    done = run(
        [FENCEGATE, "check-config", "--config", str(CONFIG)],
        env=clean_env(PAYMENTS_API_KEY="sk_test_anything"),
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "configuration is valid" in out
    assert "payments -> http://127.0.0.1:9000" in out
    assert "mail -> http://127.0.0.1:9001" in out
    assert "unknown outcome: retry" in out and "unknown outcome: hold" in out
    assert str(EXAMPLES / "fencegate.db") in out  # relative SQLite path: next to the config

    upstreams = run(
        [FENCEGATE, "upstreams", "--json", "--config", str(CONFIG)],
        env=clean_env(PAYMENTS_API_KEY="sk_test_anything"),
    )
    assert upstreams.returncode == 0, upstreams.stderr
    items = {u["name"]: u for u in json.loads(upstreams.stdout)["items"]}
    assert items["payments"]["set_headers"] == ["Authorization"]
    assert items["payments"]["require_idempotency_key"] is True
    assert items["mail"]["unknown_outcome"] == "retry"
    assert "sk_test_anything" not in upstreams.stdout

    # The API key really comes from the environment: without it the config is refused.
    missing = run([FENCEGATE, "check-config", "--config", str(CONFIG)], env=clean_env())
    assert missing.returncode == 2
    assert "PAYMENTS_API_KEY" in missing.stderr


def test_python_worker_help() -> None:
    done = run([sys.executable, str(WORKER), "--help"], env=clean_env())
    assert done.returncode == 0, done.stderr
    for option in ("--control-url", "--gateway-url", "--token", "--owner"):
        assert option in done.stdout


def test_python_worker_charges_once_and_completes(
    server: FencegateProcess, payments_api: RecordingUpstream
) -> None:
    payment = {"amount": 1999, "currency": "EUR", "customer": "cus_42"}
    status, job = control_call(
        server, "POST", "/v1/jobs", {"queue": "payments", "payload": payment}, token=TOKEN
    )
    assert status == 201, job
    job_id = job["job_id"]
    worker = [
        sys.executable,
        str(WORKER),
        "--control-url",
        server.control_url,
        "--gateway-url",
        server.proxy_url,
        "--owner",
        "e2e-worker",
    ]
    done = run(worker, env=clean_env(WORKER_TOKEN=TOKEN))  # the token from the environment
    assert done.returncode == 0, done.stderr
    assert f"job {job_id} completed" in done.stderr

    (call,) = payments_api.for_job(job_id)
    assert call["method"] == "POST" and call["path"] == "/charges"
    assert call["key"] == step_key(job_id, "charge")
    assert call["headers"]["Authorization"] == f"Bearer {API_KEY}"
    assert "Fencing-Token" not in call["headers"]
    sent = json.loads(call["body"])
    assert sent["amount"] == 1999 and sent["customer"] == "cus_42"
    assert sent["reference"] == job_id

    status, after = control_call(server, "GET", f"/v1/jobs/{job_id}", token=TOKEN)
    assert status == 200
    assert after["state"] == "completed" and after["owner"] == "e2e-worker"
    number = _number(payments_api, call)
    assert after["result"] == {
        "status": 201,
        "charge": {"id": f"ch_{number}", "number": number, "path": "/charges"},
        "replayed": False,
    }

    # Nothing left: a second run exits 0 and charges nothing.
    again = run([*worker, "--token", TOKEN], env=clean_env())
    assert again.returncode == 0, again.stderr
    assert "0 job(s) done" in again.stderr
    assert len(payments_api.for_job(job_id)) == 1

    # A wrong token is a clear error, not a traceback.
    refused = run([*worker, "--token", "not-the-right-token-at-all"], env=clean_env())
    assert refused.returncode == 1
    assert "unauthorized" in refused.stderr and "Traceback" not in refused.stderr


def _number(api: RecordingUpstream, call: dict[str, object]) -> int:
    """The upstream's running number of ``call`` (its answer's id is ch_<number>)."""
    return api.received.index(call) + 1


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_flow(server: FencegateProcess, payments_api: RecordingUpstream) -> None:
    job_id = f"curl-{uuid.uuid4().hex[:12]}"
    env = clean_env(
        CONTROL_URL=server.control_url,
        GATEWAY_URL=server.proxy_url,
        WORKER_TOKEN=TOKEN,
        JOB_ID=job_id,
        QUEUE=f"curl-{uuid.uuid4().hex[:6]}",
    )
    done = run(["bash", str(CURL_FLOW)], env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("HTTP/1.1 201") == 2
    assert done.stdout.count("Idempotent-Replayed: true") == 1
    assert done.stdout.rstrip().endswith("done")

    (call,) = payments_api.for_job(job_id)  # the repeated charge never reached it
    assert call["path"] == "/charges"
    assert call["key"] == f"charge-{job_id}"
    assert call["headers"]["Authorization"] == f"Bearer {API_KEY}"

    status, job = control_call(server, "GET", f"/v1/jobs/{job_id}", token=TOKEN)
    assert status == 200
    assert job["state"] == "completed"
    number = _number(payments_api, call)
    assert job["result"] == {"charge": {"id": f"ch_{number}", "number": number, "path": "/charges"}}


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_flow_stops_at_the_first_refusal(
    server: FencegateProcess, payments_api: RecordingUpstream
) -> None:
    job_id = f"curl-{uuid.uuid4().hex[:12]}"
    env = clean_env(
        CONTROL_URL=server.control_url,
        GATEWAY_URL=server.proxy_url,
        WORKER_TOKEN="not-the-right-token-at-all",
        JOB_ID=job_id,
    )
    done = run(["bash", str(CURL_FLOW)], env=env)
    assert done.returncode != 0
    assert "HTTP 401" in done.stderr
    assert payments_api.for_job(job_id) == []
    status, _ = control_call(server, "GET", f"/v1/jobs/{job_id}", token=TOKEN)
    assert status == 404


def test_sync_worker_charges_each_job_once(
    server: FencegateProcess, payments_api: RecordingUpstream
) -> None:
    queue = f"sync-{uuid.uuid4().hex[:8]}"
    jobs = []
    for amount in (100, 200):
        status, job = control_call(
            server, "POST", "/v1/jobs", {"queue": queue, "payload": {"amount": amount}}, token=TOKEN
        )
        assert status == 201, job
        jobs.append(job["job_id"])
    env = clean_env(
        CONTROL_URL=server.control_url, GATEWAY_URL=server.proxy_url, WORKER_TOKEN=TOKEN
    )
    done = run([sys.executable, str(SYNC_WORKER), queue], env=env)
    assert done.returncode == 0, done.stderr
    for job_id in jobs:
        assert f"job {job_id} completed" in done.stderr
        (call,) = payments_api.for_job(job_id)
        assert call["key"] == step_key(job_id, "charge")
        status, after = control_call(server, "GET", f"/v1/jobs/{job_id}", token=TOKEN)
        assert after["state"] == "completed" and after["result"]["replayed"] is False


@pytest.mark.parametrize("example", sorted(CLIENT_EXAMPLES))
def test_client_integration_example_writes_once(
    example: str, server: FencegateProcess, payments_api: RecordingUpstream
) -> None:
    """Each integration's example completes its job with one fenced write; run again on
    the completed job it is refused by the lease API and writes nothing."""
    job_id = f"{example.split('_')[0]}-{uuid.uuid4().hex[:8]}"
    env = clean_env(
        CONTROL_URL=server.control_url, GATEWAY_URL=server.proxy_url, WORKER_TOKEN=TOKEN
    )
    done = run([sys.executable, str(EXAMPLES / example), job_id], env=env)
    assert done.returncode == 0, done.stderr
    path, step = CLIENT_EXAMPLES[example]
    (call,) = payments_api.for_job(job_id)
    assert call["path"] == path.format(job_id=job_id)
    assert call["key"] == step_key(job_id, step)
    assert "Fencing-Token" not in call["headers"]
    status, after = control_call(server, "GET", f"/v1/jobs/{job_id}", token=TOKEN)
    assert status == 200 and after["state"] == "completed"

    again = run([sys.executable, str(EXAMPLES / example), job_id], env=env)
    assert again.returncode != 0 and "JobFinished" in again.stderr
    assert len(payments_api.for_job(job_id)) == 1


# -- lease sources: examples/lease_sources.toml, signed_token_worker.py, etcd_worker.py ------

SOURCES_CONFIG = EXAMPLES / "lease_sources.toml"
AWS_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
SIGNED_WORKER = EXAMPLES / "signed_token_worker.py"
ETCD_WORKER = EXAMPLES / "etcd_worker.py"


@pytest.fixture(scope="module")
def sources_server(
    tmp_path_factory: pytest.TempPathFactory, payments_api: RecordingUpstream, etcd_url: str
) -> Iterator[FencegateProcess]:
    """``fencegate serve`` with examples/lease_sources.toml: in a copy, the upstream's URL
    and etcd's endpoint point at the test's own; database and listeners come from the
    environment. The signing key is the file's own (the demo key's public half)."""
    replacements = {
        'url = "http://127.0.0.1:9000"': f'url = "{payments_api.url}"',
        'endpoints = ["http://127.0.0.1:2379"]': f'endpoints = ["{etcd_url}"]',
    }
    folder = tmp_path_factory.mktemp("fencegate-sources")
    # The ddb source's AWS credentials (any: the file's endpoint is moto's); serve
    # refuses to start without them.
    with serving_a_copy(SOURCES_CONFIG, folder, replacements, **AWS_CREDENTIALS) as process:
        yield process


def test_source_examples_default_to_the_example_config() -> None:
    """Run without arguments, the examples talk to what lease_sources.toml configures."""
    config = tomllib.loads(SOURCES_CONFIG.read_text(encoding="utf-8"))
    gateway = f'default="http://{config["proxy_listen"]}"'
    (etcd,) = (s for s in config["lease_sources"] if s["kind"] == "etcd")
    assert gateway in SIGNED_WORKER.read_text(encoding="utf-8")
    assert gateway in ETCD_WORKER.read_text(encoding="utf-8")
    assert f'default="{etcd["endpoints"][0]}"' in ETCD_WORKER.read_text(encoding="utf-8")


def test_signed_token_worker_is_fenced_by_generation(
    sources_server: FencegateProcess, payments_api: RecordingUpstream
) -> None:
    done = run([sys.executable, str(SIGNED_WORKER), sources_server.proxy_url], env=clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.search(r"^job (order-[0-9a-f]{8}) ", done.stdout, re.MULTILINE)
    assert match, done.stdout
    job = f"queue/{match.group(1)}"
    lines = done.stdout.splitlines()[1:]
    assert lines == [
        "A (generation 1): POST /payments/charges -> 201",
        "B (generation 2): POST /payments/charges -> 201 (replayed)",
        "B (generation 2): POST /payments/receipts -> 201",
        "A (generation 1): POST /payments/receipts -> 409 stale-generation",
    ]
    # The upstream saw each step once, in generation order, under the namespaced job.
    calls = payments_api.for_job(job)
    assert [(c["path"], c["generation"], c["key"]) for c in calls] == [
        ("/charges", "1", "charge"),
        ("/receipts", "2", "receipt"),
    ]
    assert all("Fencing-Token" not in c["headers"] for c in calls)


def test_etcd_worker_token_ends_with_the_lock(
    sources_server: FencegateProcess, payments_api: RecordingUpstream, etcd_url: str
) -> None:
    done = run(
        [sys.executable, str(ETCD_WORKER), etcd_url, sources_server.proxy_url], env=clean_env()
    )
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.search(
        r"^locked (/locks/order-[0-9a-f]{8}): Fencing-Token etcd:(\S+)$", done.stdout, re.MULTILINE
    )
    assert match, done.stdout
    name, key = match.groups()
    assert key.startswith(f"{name}/")  # etcd's lock key: <name>/<lease id in hex>
    assert "POST /payments/charges (key charge) -> 201" in done.stdout
    assert "POST /payments/charges (key receipt) -> 409 lease-ended" in done.stdout

    (call,) = payments_api.for_job(f"etcd/{name}")  # the late write never reached it
    assert call["path"] == "/charges" and call["key"] == "charge"
    assert int(call["generation"]) > 0  # the lock key's create revision
    # The example revoked its session: no key is left under <name>/ ("0" follows "/").
    request = urllib.request.Request(
        f"{etcd_url}/v3/kv/range",
        data=json.dumps({"key": _b64(name + "/"), "range_end": _b64(name + "0")}).encode(),
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert "kvs" not in json.loads(answer.read())


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()
