"""``fencegate serve --workers 2`` as a user runs it: a real parent process and its real
workers on real ports (port 0, read from the line the parent prints), real HTTP.

Each server is started in a session of its own and, in a ``finally``, stopped with
SIGTERM if it still runs, then killed whole (its process group: the parent and every
worker), whatever the test did to it before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.test_serve_processes import write_serve_config
from tests.support import Upstream

FENCEGATE = str(Path(sys.executable).with_name("fencegate"))
LISTENING = re.compile(r"fencegate listening: .*?control=([^\s\"]+).*?proxy=([^\s\"]+)")
START_SECONDS = 60  # a loaded 2-core machine starts three interpreters slowly


def environment(**extra: str) -> dict[str, str]:
    """The test's environment without FENCEGATE_* settings (the config file decides)."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("FENCEGATE_")}
    return env | extra


def upstream_table(upstream: Upstream) -> str:
    return f'[[upstreams]]\nname = "pay"\nurl = "{upstream.url}"\n'


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    control: str  # base URLs
    proxy: str
    log: Path

    def records(self) -> list[dict[str, Any]]:
        """The JSON log lines of the parent and its workers so far."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    out.append(record)
        return out

    def ready(self) -> list[tuple[int, int]]:
        """(number, pid) of each worker the parent said ready, in the order it did."""
        return [
            (r["worker"], r["worker_pid"])
            for r in self.records()
            if r.get("logger") == "fencegate.workers"
            and re.fullmatch(r"worker \d+ ready \(pid \d+\)", r["msg"])
        ]

    def worker_pids(self) -> list[int]:
        return [pid for _, pid in self.ready()]

    def live_workers(self) -> list[int]:
        """The parent's children now (``/proc``)."""
        return children_of(self.process.pid)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                # The fields after the command's name (which may hold spaces).
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                if int(fields[1]) == pid and fields[0] != "Z":
                    found.append(int(entry.name))
    return sorted(found)


def metrics_folder(pid: int) -> Path:
    """A worker's ``--metrics-dir``, from its command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return Path(argv[argv.index("--metrics-dir") + 1])


def gone(pid: int) -> bool:
    """No such process (a zombie counts as there: its parent has not reaped it)."""
    return not Path(f"/proc/{pid}").exists()


def wait_until(check: Any, seconds: float, what: str, served: Served | None = None) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {seconds} s" + (f":\n{served.output()}" if served else ""))
        time.sleep(0.05)


@contextmanager
def started(config: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    """``fencegate serve --config CONFIG ARGS`` (JSON logs) until it prints its listening
    line. At the end its whole process group is killed, whatever happened."""
    log = config.parent / f"serve-{uuid.uuid4().hex[:6]}.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [FENCEGATE, "serve", "--config", str(config), "--log-format", "json", *args],
            cwd=config.parent,
            env=env or environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the parent and its workers: one group to kill
        )
    try:
        deadline = time.monotonic() + START_SECONDS
        while (match := LISTENING.search(log.read_text(errors="replace"))) is None:
            if process.poll() is not None:
                pytest.fail(f"serve exited with {process.returncode}:\n{log.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"serve did not start:\n{log.read_text()}")
            time.sleep(0.05)
        yield Served(process, f"http://{match[1]}", f"http://{match[2]}", log)
    finally:
        if process.poll() is None:  # the test failed early: a clean stop first
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever is left of the group
        process.wait(timeout=30)


@contextmanager
def two_workers(folder: Path, upstream: Upstream) -> Iterator[Served]:
    """``started``: ``--workers 2`` on SQLite (``folder/serve.db``), the upstream ``pay``."""
    config = write_serve_config(folder, "sqlite+aiosqlite:///serve.db", upstream_table(upstream))
    with started(config, "--workers", "2") as served:
        yield served


def stop(served: Served, seconds: float = 60) -> int:
    """SIGTERM to the parent alone; its exit code."""
    served.process.send_signal(signal.SIGTERM)
    return served.process.wait(timeout=seconds)


@asynccontextmanager
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """A client that opens a connection per request, so the kernel hands requests to
    either worker (a kept-alive connection stays with the worker that accepted it)."""
    connector = aiohttp.TCPConnector(force_close=True, limit=40)
    async with aiohttp.ClientSession(connector=connector) as client:
        yield client


# -- start, serve, stop ---------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_two_workers_serve_one_port_and_stop_on_sigterm_leaving_no_process(
    tmp_path: Path, upstream: Upstream
) -> None:
    with two_workers(tmp_path, upstream) as served:
        pids = served.worker_pids()
        assert len(pids) == 2, served.output()
        assert served.live_workers() == sorted(pids)
        (folder,) = {metrics_folder(pid) for pid in pids}  # one for both workers
        assert folder.is_dir()
        async with session() as client:
            for _ in range(5):
                async with client.get(served.control + "/healthz") as resp:
                    assert resp.status == 200
                async with client.get(served.proxy + "/pay/ping") as resp:
                    assert resp.status == 201  # unfenced: passed through
            async with client.get(served.control + "/readyz") as resp:
                assert resp.status == 200, await resp.text()
        started_at = time.monotonic()
        assert stop(served) == 0, served.output()
        assert time.monotonic() - started_at < 30
        assert all(gone(pid) for pid in pids), served.output()
        assert not folder.exists()
        said = [r["msg"] for r in served.records()]
        assert "fencegate stopped" in said
        stopping = [r for r in served.records() if r["msg"] == "fencegate stopping"]
        assert sorted(r["pid"] for r in stopping) == sorted(pids)  # each drained itself


@pytest.mark.timeout(120)
async def test_sigterm_lets_a_request_in_progress_finish_and_refuses_new_connections(
    tmp_path: Path, upstream: Upstream
) -> None:
    """Each worker drains as a single process does: the listeners close at once (a new
    connection is refused, not left waiting in the backlog), the request in progress
    gets its answer, then the parent exits 0."""
    upstream.delay = 4.0
    with two_workers(tmp_path, upstream) as served:
        pids = served.worker_pids()
        async with session() as client:

            async def slow() -> int:
                async with client.get(served.proxy + "/pay/slow") as resp:
                    await resp.read()
                    return resp.status

            in_progress = asyncio.ensure_future(slow())
            deadline = time.monotonic() + 10
            while upstream.in_flight == 0:
                assert time.monotonic() < deadline, served.output()
                await asyncio.sleep(0.02)
            served.process.send_signal(signal.SIGTERM)
            host, port = served.proxy.removeprefix("http://").rsplit(":", 1)
            refused_at = None
            while refused_at is None and time.monotonic() < deadline:
                try:
                    _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 1)
                    writer.close()
                    await asyncio.sleep(0.05)
                except ConnectionRefusedError:
                    refused_at = time.monotonic()
            assert refused_at is not None, served.output()
            assert not in_progress.done()  # refused while the slow request still ran
            assert await in_progress == 201
        code = await asyncio.to_thread(served.process.wait, 60)
        assert code == 0, served.output()
        assert all(gone(pid) for pid in pids)


@pytest.mark.timeout(120)
async def test_a_killed_worker_is_replaced_and_the_ports_keep_answering(
    tmp_path: Path, upstream: Upstream
) -> None:
    with two_workers(tmp_path, upstream) as served:
        (number, first), (_, second) = served.ready()
        async with session() as client:
            for _ in range(10):
                async with client.get(served.proxy + "/pay/before") as resp:
                    assert resp.status == 201
            os.kill(first, signal.SIGKILL)
            await asyncio.to_thread(wait_until, lambda: gone(first), 10, "the killed worker gone")
            # While its replacement starts, the other worker answers on the same ports.
            for _ in range(20):
                async with client.get(served.control + "/healthz") as resp:
                    assert resp.status == 200
                async with client.get(served.proxy + "/pay/during") as resp:
                    assert resp.status == 201

            def replaced() -> bool:
                return len(served.live_workers()) == 2 and len(served.worker_pids()) == 3

            await asyncio.to_thread(wait_until, replaced, START_SECONDS, "a new worker", served)
            (again, third) = served.ready()[-1]
            assert again == number  # the dead worker's place
            assert third not in (first, second)
            assert served.live_workers() == sorted([second, third])
            errors = [r for r in served.records() if r["level"] == "error"]
            assert [r["msg"] for r in errors] == [
                f"worker {number} (pid {first}) exited unexpectedly (killed by SIGKILL); "
                "starting another in its place"
            ]
            # The dead worker's counts stay in the sums: a total never goes back.
            async with client.get(served.control + "/metrics") as resp:
                text = await resp.text()
            assert forwarded(text, "pay") == 30, text
        assert stop(served) == 0, served.output()
        assert gone(second) and gone(third)


def forwarded(metrics: str, upstream: str) -> float:
    return decisions(metrics).get((upstream, "forwarded"), 0.0)


def decisions(metrics: str) -> dict[tuple[str, str], float]:
    """``fencegate_gateway_decisions_total`` by (upstream, reason), those above 0."""
    found = {}
    for line in metrics.splitlines():
        match = re.fullmatch(r"fencegate_gateway_decisions_total\{([^}]*)\} (\S+)", line)
        if match and float(match[2]):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match[1]))
            found[(labels["upstream"], labels["reason"])] = float(match[2])
    return found


# -- failing to start ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_workers_that_cannot_start_stop_serve_with_an_error_at_once(tmp_path: Path) -> None:
    """A configuration error is said before any worker starts (exit 2); a failure only a
    worker meets (a DynamoDB lease source, no AWS credentials) stops serve with exit 1,
    once per worker, without starting them again."""
    bad = tmp_path / "bad" / "fencegate.toml"
    bad.parent.mkdir()
    bad.write_text("[gateway]\nworkers = 2\n", encoding="utf-8")
    refused = subprocess.run(
        [FENCEGATE, "serve", "--config", str(bad), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=30,
        env=environment(),
        check=False,
    )
    assert refused.returncode == 2, refused
    assert "gateway.workers: unknown setting" in refused.stderr

    (tmp_path / "aws-empty").write_text("")
    config = write_serve_config(
        tmp_path / "ddb",
        "sqlite+aiosqlite:///serve.db",
        '[[lease_sources]]\nname = "ddb"\nkind = "dynamodb"\ntable = "locks"\n'
        'region = "us-east-1"\nendpoint_url = "http://127.0.0.1:9"\n',
    )
    no_aws = {k: v for k, v in environment().items() if not k.startswith("AWS_")} | {
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-empty"),
        "AWS_CONFIG_FILE": str(tmp_path / "aws-empty"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "HOME": str(tmp_path),
    }
    began = time.monotonic()
    process = subprocess.Popen(
        [FENCEGATE, "serve", "--config", str(config), "--workers", "2", "--log-format", "json"],
        env=no_aws,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=START_SECONDS)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    assert process.returncode == 1, out + err
    assert time.monotonic() - began < START_SECONDS
    said = err.count("fencegate: lease source ddb: botocore found no AWS credentials")
    assert 1 <= said <= 2, err  # each worker once (the second may be stopped first)
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    failed = [r for r in records if "exited before it was ready" in r["msg"]]
    assert 1 <= len(failed) <= 2, err
    assert not [r for r in records if "starting another" in r["msg"]], err
    assert all(gone(r["worker_pid"]) for r in failed)
    assert "fencegate listening" not in out + err


# -- the parent gone -----------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_workers_stop_when_their_parent_is_killed(tmp_path: Path) -> None:
    config = write_serve_config(tmp_path, "sqlite+aiosqlite:///serve.db")
    with started(config, "--workers", "2") as served:
        pids = served.worker_pids()
        folder = metrics_folder(pids[0])
        try:
            served.process.kill()
            served.process.wait(timeout=10)
            # Orphans now (re-parented): each sees its channel to the parent close.
            wait_until(lambda: all(gone(pid) for pid in pids), 40, "the workers gone", served)
        finally:
            # A parent killed so cannot remove its metrics folder: the test does.
            shutil.rmtree(folder, ignore_errors=True)
        stopping = [
            r for r in served.records() if r["msg"] == "the parent process is gone: stopping"
        ]
        assert sorted(r["pid"] for r in stopping) == sorted(pids)


# -- the fence, as with one worker ---------------------------------------------------------------

STALE_PER_GENERATION = 20
KEYS = 40


@pytest.fixture
def postgres_url(backend: str, request: pytest.FixtureRequest) -> str | None:
    """The session's PostgreSQL database on the postgres backend (jobs of their own)."""
    return str(request.getfixturevalue("pg_database_url")) if backend == "postgres" else None


@pytest.mark.timeout(240)
async def test_two_workers_hold_the_fence_exactly_as_one(
    postgres_url: str | None, tmp_path: Path, upstream: Upstream
) -> None:
    """Three generations of one job write at once through the proxy port, each request on
    a connection of its own: the first two's writes are refused ``stale-generation``,
    the current one's each reach the upstream once, and each one's duplicate, sent at
    the same time with ``Prefer: wait``, is replayed. The answers are the same with one
    worker and with two; with two, requests reached both workers (the pid of each access
    line), and ``/metrics`` on the control port counts every request once, however the
    workers shared them."""
    outcomes = {}
    for workers in (1, 2):
        url = postgres_url or f"sqlite+aiosqlite:///fence-{workers}.db"
        config = write_serve_config(tmp_path / f"w{workers}", url, upstream_table(upstream))
        upstream.received.clear()
        with started(config, "--workers", str(workers), "--access-log") as served:
            outcomes[workers] = await fenced_burst(served, upstream)
            if workers == 2:
                pids = served.worker_pids()
                proxied = [
                    r["pid"]
                    for r in served.records()
                    if r.get("logger") == "fencegate.access" and r["path"].startswith("/pay/")
                ]
                assert len(proxied) == 2 * STALE_PER_GENERATION + 2 * KEYS
                per_worker = Counter(proxied)
                assert set(per_worker) == set(pids), per_worker  # both workers answered
            assert stop(served) == 0, served.output()
    assert outcomes[1] == outcomes[2]


async def fenced_burst(served: Served, upstream: Upstream) -> list[tuple[str, int, str]]:
    """The writes at once; checked here; their answers, normalised and sorted."""
    job = f"pay-{uuid.uuid4().hex[:8]}"
    async with session() as client:
        tokens = []
        for _ in range(3):  # one owner acquiring again: each grant a newer generation
            async with client.put(
                f"{served.control}/v1/jobs/{job}/lease", json={"owner": "w", "ttl_seconds": 600}
            ) as resp:
                assert resp.status == 201, await resp.text()
                tokens.append((await resp.json())["lease_token"])

        async def write(token: str, key: str, kind: str) -> tuple[str, int, str, str]:
            headers = {"Fencing-Token": token, "Idempotency-Key": key, "Prefer": "wait=30"}
            async with client.post(
                f"{served.proxy}/pay/charges", json={"key": key}, headers=headers
            ) as resp:
                text = await resp.text()
                replayed = resp.headers.get("Idempotent-Replayed") == "true"
                reason = json.loads(text).get("reason", "") if resp.status >= 400 else ""
                return kind, resp.status, "replayed" if replayed else reason, key

        sends = [
            write(tokens[generation], f"old-{generation}-{i}", f"gen{generation + 1}")
            for generation in (0, 1)
            for i in range(STALE_PER_GENERATION)
        ]
        sends += [write(tokens[2], f"k{i}", "current") for i in range(KEYS) for _ in range(2)]
        answers = await asyncio.gather(*sends)
        async with client.get(served.control + "/metrics") as resp:
            metrics = await resp.text()

    stale = [a for a in answers if a[0] != "current"]
    assert {(status, reason) for _, status, reason, _ in stale} == {(409, "stale-generation")}
    current = [a for a in answers if a[0] == "current"]
    by_key: dict[str, list[str]] = {}
    for _, status, reason, key in current:
        assert status == 201, current
        by_key.setdefault(key, []).append(reason)
    assert all(sorted(kinds) == ["", "replayed"] for kinds in by_key.values()), by_key
    # Each current write reached the upstream once; no stale one did.
    assert sorted(r["key"] for r in upstream.received) == sorted(f"k{i}" for i in range(KEYS))
    assert {r["generation"] for r in upstream.received} == {"3"}
    # The whole server's counts, whichever worker answered the scrape.
    counted = decisions(metrics)
    assert counted == {
        ("pay", "forwarded"): KEYS,
        ("pay", "idempotent-replay"): KEYS,
        ("pay", "stale-generation"): 2 * STALE_PER_GENERATION,
    }, metrics
    assert sum(counted.values()) == len(answers)
    return sorted((kind, status, reason) for kind, status, reason, _ in answers)
