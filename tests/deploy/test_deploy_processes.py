"""What the containers would run, run as real processes (there is no Docker engine here).

The image is stood in for by a fresh virtual environment: the server's and the client's
wheels built with ``pip wheel --no-deps`` from exactly the files the Dockerfile's build
stage copies, then installed non-editable with the ``postgres`` extra, as the Dockerfile
does. Against a fresh PostgreSQL database and the example configuration
deploy/fencegate.toml it runs ``check-config``, the migration Job (``fencegate
migrate``), two Deployment replicas (``fencegate serve``) on the same database, the
image's HEALTHCHECK command, and a SIGTERM stop.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support import postgres_unavailable

from ._support import (
    CONFIG,
    ROOT,
    copy_sources,
    database_url,
    dockerfile,
    healthcheck_command,
    pg_admin_sync,
)

WORKER_TOKEN = "worker-" + secrets.token_urlsafe(18)
ADMIN_TOKEN = "admin-" + secrets.token_urlsafe(18)
PAYMENTS_API_KEY = "pk_test_" + secrets.token_hex(12)
EXAMPLE_UPSTREAM_URL = 'url = "https://payments.example.com"'


@dataclass(frozen=True)
class Image:
    """The stand-in for the container image: a venv with the wheel installed."""

    venv: Path
    home: Path

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    @property
    def fencegate(self) -> str:
        return str(self.bin / "fencegate")

    def env(self, **extra: str) -> dict[str, str]:
        """A clean environment, as in the container: the image's PATH first and only the
        variables a deployment sets (nothing FENCEGATE_* leaks in from the test run)."""
        return {
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            **extra,
        }


def _run(cmd: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def _check(result: subprocess.CompletedProcess[str], what: str) -> None:
    if result.returncode != 0:
        pytest.fail(
            f"{what} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
            f"{result.stderr[-3000:]}",
            pytrace=False,
        )


# The first test that asks for the image builds it: two wheels and a venv with every
# dependency, minutes on a busy two-core machine, so those tests get the fresh-venv tests'
# timeout (tests/e2e/test_client.py) instead of the default two minutes.
BUILDS_THE_IMAGE = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    work = tmp_path_factory.mktemp("image")
    # The build stage's context: exactly what the Dockerfile's first stage COPYs, so a
    # file the build needs but the Dockerfile forgets fails here too.
    src = work / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for source in copy_sources(dockerfile(), stage=0):
        origin, target = ROOT / source, src / source
        if origin.is_dir():
            shutil.copytree(origin, target, ignore=ignore)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, target)
    wheels = work / "wheels"
    result = _run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q"),
            *("--wheel-dir", str(wheels), "./client", "."),
        ],
        timeout=240,
        cwd=src,
    )
    _check(result, "pip wheel --no-deps")
    (wheel,) = wheels.glob("fencegate-*.whl")
    (client,) = wheels.glob("fencegate_client-*.whl")  # not on the index: named as a file
    # A venv without its own pip (creating one with pip costs seconds); this pip installs
    # into it, wheel and dependencies, as the image's `pip install ...[postgres,otel]` does.
    venv = work / "venv"
    result = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    _check(result, "python -m venv")
    result = _run(
        [
            *(sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")),
            *("install", "-q", f"{wheel}[postgres,otel]", str(client)),
        ],
        timeout=300,
    )
    _check(result, "pip install fencegate[postgres,otel]")
    home = work / "home"
    home.mkdir()
    return Image(venv, home)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _config(tmp_path: Path, upstream_url: str | None = None) -> Path:
    """A copy of deploy/fencegate.toml, as the ConfigMap / compose mount provide it;
    optionally with the example upstream pointed at a local stand-in."""
    text = CONFIG.read_text(encoding="utf-8")
    if upstream_url is not None:
        assert text.count(EXAMPLE_UPSTREAM_URL) == 1
        text = text.replace(EXAMPLE_UPSTREAM_URL, f'url = "{upstream_url}"')
    folder = tmp_path / "etc"
    folder.mkdir(exist_ok=True)
    path = folder / "fencegate.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _secrets(db_url: str) -> dict[str, str]:
    """What the Kubernetes Secret / compose .env put in the environment."""
    return {
        "FENCEGATE_DATABASE_URL": db_url,
        "FENCEGATE_AUTH__WORKER_TOKENS": json.dumps([WORKER_TOKEN]),
        "FENCEGATE_AUTH__ADMIN_TOKENS": json.dumps([ADMIN_TOKEN]),
        "PAYMENTS_API_KEY": PAYMENTS_API_KEY,
    }


# -- HTTP ------------------------------------------------------------------------------

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: Any


def http(
    method: str,
    url: str,
    *,
    token: str | None = None,
    json_body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10,
) -> Answer:
    all_headers = dict(headers or {})
    data = None
    if json_body is not None:
        data = json.dumps(json_body).encode()
        all_headers["Content-Type"] = "application/json"
    if token is not None:
        all_headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, method=method, headers=all_headers)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            status, answer_headers, raw = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        with error:
            status, answer_headers, raw = error.code, dict(error.headers), error.read()
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = raw.decode("utf-8", "replace")
    return Answer(status, answer_headers, body)


class StubUpstream:
    """A local stand-in for the payments API: records what reaches it."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                owner.received.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "headers": dict(self.headers),
                        "body": self.rfile.read(length),
                    }
                )
                body = json.dumps({"charged": len(owner.received)}).encode()
                self.send_response(201)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


# -- processes -------------------------------------------------------------------------


@dataclass
class Replica:
    name: str
    process: subprocess.Popen[bytes]
    proxy: str
    control: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-4000:]


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Every process a test starts; whatever still runs at the end is killed."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
            process.wait(10)


def start_replica(
    image: Image,
    name: str,
    config: Path,
    env: dict[str, str],
    workdir: Path,
    processes: list[subprocess.Popen[bytes]],
) -> Replica:
    proxy, control = _free_port(), _free_port()
    log = workdir / f"{name}.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [image.fencegate, "serve", "--config", str(config)],
            env=image.env(
                **env,
                FENCEGATE_PROXY_LISTEN=f"127.0.0.1:{proxy}",
                FENCEGATE_CONTROL_LISTEN=f"127.0.0.1:{control}",
            ),
            cwd=workdir,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    processes.append(process)
    return Replica(name, process, f"http://127.0.0.1:{proxy}", f"http://127.0.0.1:{control}", log)


def wait_ready(replica: Replica, deadline: float) -> None:
    """Until /healthz and /readyz both answer 200 (what the probes wait for)."""
    while True:
        if replica.process.poll() is not None:
            pytest.fail(
                f"{replica.name} exited with {replica.process.returncode}:\n{replica.output()}",
                pytrace=False,
            )
        try:
            health = http("GET", f"{replica.control}/healthz", timeout=2)
            ready = http("GET", f"{replica.control}/readyz", timeout=2)
            if health.status == ready.status == 200:
                assert health.body == {"status": "ok"}
                assert ready.body["status"] == "ready"
                return
        except OSError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            pytest.fail(f"{replica.name} did not become ready:\n{replica.output()}", pytrace=False)
        time.sleep(0.2)


# -- tests -----------------------------------------------------------------------------


@BUILDS_THE_IMAGE
def test_wheel_installs_with_its_migrations(image: Image, tmp_path: Path) -> None:
    """A non-editable install (the image's) finds the alembic scripts it ships under
    <prefix>/share/fencegate/alembic, and imports the installed code, not the checkout."""
    code = (
        "import gateway, gateway.records.migrate as m; "
        "print(gateway.__file__); print(m.script_location()); print(m.head_revision())"
    )
    result = _run(
        [str(image.bin / "python"), "-c", code], timeout=60, cwd=tmp_path, env=image.env()
    )
    _check(result, "import gateway")
    module, location, head = result.stdout.split()
    assert Path(module).is_relative_to(image.venv)
    assert Path(location) == image.venv / "share" / "fencegate" / "alembic"
    assert (Path(location) / "env.py").is_file()
    assert head and head != "None"
    result = _run([image.fencegate, "--help"], timeout=60, env=image.env())
    _check(result, "fencegate --help")
    for command in ("serve", "migrate", "check-config"):
        assert command in result.stdout


@BUILDS_THE_IMAGE
def test_check_config_accepts_the_example_config(image: Image, tmp_path: Path) -> None:
    config = _config(tmp_path)
    secrets_env = _secrets("postgresql+asyncpg://fencegate:s3cret-pw@postgres:5432/fencegate")
    result = _run(
        [image.fencegate, "check-config", "--config", str(config)],
        timeout=60,
        env=image.env(**secrets_env),
        cwd=tmp_path,
    )
    _check(result, "fencegate check-config")
    out = result.stdout
    assert "configuration is valid" in out
    assert "postgresql+asyncpg://fencegate:***@postgres:5432/fencegate" in out
    assert "s3cret-pw" not in out and PAYMENTS_API_KEY not in out and WORKER_TOKEN not in out
    assert "0.0.0.0:8080" in out and "0.0.0.0:8081" in out
    assert "1 worker token(s), 1 admin token(s)" in out
    assert "payments -> https://payments.example.com" in out

    # Each secret is required: without the upstream key, or without tokens on the
    # all-interfaces listeners, the configuration is refused (exit 2, naming the key).
    for missing, expected in (
        ("PAYMENTS_API_KEY", "environment variable PAYMENTS_API_KEY is not set"),
        ("FENCEGATE_AUTH__WORKER_TOKENS", None),
    ):
        env = {k: v for k, v in secrets_env.items() if k != missing}
        if missing.startswith("FENCEGATE_AUTH"):
            env.pop("FENCEGATE_AUTH__ADMIN_TOKENS")
            expected = "not a loopback address and no auth tokens are configured"
        result = _run(
            [image.fencegate, "check-config", "--config", str(config)],
            timeout=60,
            env=image.env(**env),
            cwd=tmp_path,
        )
        assert result.returncode == 2, result.stdout + result.stderr
        assert expected in result.stderr


@BUILDS_THE_IMAGE
@pytest.mark.postgres
def test_migration_job_then_two_replicas(
    image: Image, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    name = f"fencegate_deploy_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        pg_admin_sync(f'CREATE DATABASE "{name}"')
    except Exception as error:  # any failure to reach the server
        postgres_unavailable(f"{type(error).__name__}: {error}")
    upstream = StubUpstream()
    try:
        _deploy_and_exercise(image, tmp_path, database_url(name), upstream, processes)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        upstream.close()
        pg_admin_sync(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _deploy_and_exercise(
    image: Image,
    tmp_path: Path,
    db_url: str,
    upstream: StubUpstream,
    processes: list[subprocess.Popen[bytes]],
) -> None:
    config = _config(tmp_path, upstream_url=upstream.url)
    env = _secrets(db_url)
    workdir = tmp_path / "data"  # the image's WORKDIR
    workdir.mkdir()

    # The image's 0.0.0.0:8080/8081 moved to free ports, as the replicas below are: a
    # developer's own `fencegate serve` may hold 8080/8081.
    ports = {
        "FENCEGATE_PROXY_LISTEN": f"127.0.0.1:{_free_port()}",
        "FENCEGATE_CONTROL_LISTEN": f"127.0.0.1:{_free_port()}",
    }

    def fencegate(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return _run(
            [image.fencegate, *args, "--config", str(config)],
            timeout=timeout,
            env=image.env(**env, **ports),
            cwd=workdir,
        )

    _check(fencegate("check-config"), "fencegate check-config")

    # Before the migration step, a replica refuses to start (this is why compose waits
    # for `migrate` to complete and Kubernetes runs the Job first).
    early = fencegate("serve")
    assert early.returncode != 0
    assert "fencegate migrate" in early.stderr

    # The Job: `fencegate migrate`, and again (a retried Job is harmless).
    for attempt in (1, 2):
        result = fencegate("migrate", timeout=120)
        _check(result, f"fencegate migrate (attempt {attempt})")
        assert "database at revision" in result.stdout

    # The Deployment: two replicas on one database.
    replicas = [
        start_replica(image, f"gateway-{n}", config, env, workdir, processes) for n in (1, 2)
    ]
    deadline = time.monotonic() + 45
    for replica in replicas:
        wait_ready(replica, deadline)
    one, two = replicas

    # The control listener needs tokens; /healthz and /readyz do not.
    assert http("GET", f"{one.control}/admin/rejections").status == 401
    assert http("GET", f"{one.control}/admin/rejections", token="x" * 20).status == 401
    assert http("GET", f"{one.control}/admin/rejections", token=WORKER_TOKEN).status == 403
    assert http("GET", f"{one.control}/v1/jobs/nope").status == 401
    assert http("GET", f"{one.control}/v1/jobs/nope", token=WORKER_TOKEN).status == 404
    metrics = http("GET", f"{two.control}/metrics", token=ADMIN_TOKEN)
    assert metrics.status == 200 and "fencegate_" in metrics.body

    # One worker's write through replica 1 reaches the upstream with the key from the
    # environment and without the fencing token.
    job = f"deploy-{uuid.uuid4().hex[:8]}"
    first = http(
        "PUT",
        f"{one.control}/v1/jobs/{job}/lease",
        token=WORKER_TOKEN,
        json_body={"owner": "worker-a", "ttl_seconds": 60},
    )
    assert first.status == 201, first.body
    charge = {"amount": 100, "currency": "EUR"}
    written = http(
        "POST",
        f"{one.proxy}/payments/v1/charges",
        json_body=charge,
        headers={"Fencing-Token": first.body["lease_token"], "Idempotency-Key": "charge-1"},
    )
    assert written.status == 201, written.body
    assert len(upstream.received) == 1
    forwarded = upstream.received[0]
    assert forwarded["path"] == "/v1/charges"
    assert forwarded["headers"]["Authorization"] == f"Bearer {PAYMENTS_API_KEY}"
    assert "Fencing-Token" not in forwarded["headers"]
    assert forwarded["headers"]["Fencing-Generation"] == str(first.body["generation"])

    # A newer grant taken through replica 2 fences the first token off on replica 1 too,
    # and replica 2 answers a repeated step from the record replica 1 wrote.
    second = http(
        "PUT",
        f"{two.control}/v1/jobs/{job}/lease",
        token=WORKER_TOKEN,
        json_body={"owner": "worker-a", "ttl_seconds": 60},
    )
    assert second.status == 201, second.body
    assert second.body["generation"] > first.body["generation"]
    stale = http(
        "POST",
        f"{one.proxy}/payments/v1/charges",
        json_body=charge,
        headers={"Fencing-Token": first.body["lease_token"], "Idempotency-Key": "charge-2"},
    )
    assert stale.status == 409 and stale.body["reason"] == "stale-generation", stale.body
    replay = http(
        "POST",
        f"{two.proxy}/payments/v1/charges",
        json_body=charge,
        headers={"Fencing-Token": second.body["lease_token"], "Idempotency-Key": "charge-1"},
    )
    assert replay.status == 201, replay.body
    assert replay.headers.get("Idempotent-Replayed") == "true"
    assert len(upstream.received) == 1  # neither reached the upstream
    # Each replica writes its audit entries behind its answers (within milliseconds):
    # replica one's read waits for its own, and sees replica two's once written.
    deadline = time.monotonic() + 5
    while True:
        audit = http("GET", f"{one.control}/admin/rejections?job_id={job}", token=ADMIN_TOKEN)
        assert audit.status == 200
        reasons = {e["reason"] for e in audit.body["items"]}
        if len(reasons) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert reasons == {"stale-generation", "idempotent-replay"}

    # The image's HEALTHCHECK, word for word from the Dockerfile, against replica 1 (its
    # address override pointing at this replica's control port), then at a closed port.
    command = healthcheck_command(dockerfile())
    check = _run(
        command,
        timeout=30,
        env=image.env(FENCEGATE_HEALTHCHECK_URL=f"{one.control}/healthz"),
        cwd=workdir,
    )
    assert check.returncode == 0, check.stderr
    closed = _run(
        command,
        timeout=30,
        env=image.env(FENCEGATE_HEALTHCHECK_URL=f"http://127.0.0.1:{_free_port()}/healthz"),
        cwd=workdir,
    )
    assert closed.returncode != 0

    # SIGTERM (the image's STOPSIGNAL, Kubernetes' and compose's stop) ends both cleanly.
    for replica in replicas:
        replica.process.send_signal(signal.SIGTERM)
    for replica in replicas:
        try:
            code = replica.process.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{replica.name} ignored SIGTERM:\n{replica.output()}", pytrace=False)
        assert code == 0, replica.output()
        assert "fencegate stopping" in replica.output()
