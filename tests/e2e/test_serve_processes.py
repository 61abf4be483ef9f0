"""The ``fencegate`` command as a user runs it: real processes, real ports, real HTTP.

Servers listen on port 0 and the test reads the ports from the line they print when
ready. Every process is killed in a ``finally``.
"""

from __future__ import annotations

import asyncio
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
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from lease_core.db import create_engine
from lease_core.store import LeaseStore
from tests.support import pg_admin, pg_url_of

FENCEGATE = str(Path(sys.executable).with_name("fencegate"))
LISTENING = re.compile(r"fencegate listening: .*?control=([^\s\"]+).*?proxy=([^\s\"]+)")


def child_env() -> dict[str, str]:
    """The test's environment without FENCEGATE_* settings (the config file decides)."""
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("FENCEGATE_")}


def run(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FENCEGATE, *args],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def write_serve_config(folder: Path, database_url: str, extra: str = "") -> Path:
    """``folder/fencegate.toml``: the database, both listeners on port 0, then ``extra``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fencegate.toml"
    path.write_text(
        f'database_url = "{database_url}"\n'
        'proxy_listen = "127.0.0.1:0"\n'
        'control_listen = "127.0.0.1:0"\n'
        f"{extra}\n",
        encoding="utf-8",
    )
    return path


def write_config(folder: Path, database_url: str, extra: str = "") -> Path:
    """``write_serve_config`` with a ``[lease]`` table after ``extra``."""
    lease = "[lease]\ndefault_ttl_seconds = 30\nmax_ttl_seconds = 3600"
    return write_serve_config(folder, database_url, f"{extra}\n{lease}")


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    control: str  # base URL of the control listener
    proxy: str
    log: Path

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def _popen(args: Sequence[str], cwd: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        process = subprocess.Popen(
            list(args), cwd=cwd, env=child_env(), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


@asynccontextmanager
async def serve(config: Path, cwd: Path, name: str = "server") -> AsyncIterator[Server]:
    """``fencegate serve --config CONFIG`` until /healthz answers; killed at the end."""
    cwd.mkdir(parents=True, exist_ok=True)
    log = config.parent / f"{name}.log"
    with _popen([FENCEGATE, "serve", "--config", str(config)], cwd, log) as process:
        deadline = time.monotonic() + 30
        match = None
        while match is None:
            if process.poll() is not None:
                pytest.fail(f"fencegate serve exited with {process.returncode}:\n{_read(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"fencegate serve did not start:\n{_read(log)}")
            await asyncio.sleep(0.05)
            match = LISTENING.search(_read(log))
        server = Server(process, f"http://{match[1]}", f"http://{match[2]}", log)
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(server.control + "/healthz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"/healthz never answered:\n{server.logs()}")
                await asyncio.sleep(0.05)
        yield server


def _read(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


async def stop(server: Server) -> int:
    """SIGTERM, then the exit code (a clean stop is 0)."""
    server.process.send_signal(signal.SIGTERM)
    return await asyncio.to_thread(server.process.wait, 20)


async def call(
    session: aiohttp.ClientSession, method: str, url: str, status: int, body: Any = None
) -> Any:
    async with session.request(method, url, json=body) as resp:
        text = await resp.text()
        assert resp.status == status, f"{method} {url}: {resp.status} {text}"
        return json.loads(text) if text else None


# -- (a) one server on SQLite -----------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_serve_on_sqlite_drives_a_lease_and_stops_cleanly(tmp_path: Path) -> None:
    # A relative SQLite path: resolved against the config file's folder, not the cwd.
    config = write_config(tmp_path / "conf", "sqlite+aiosqlite:///data.db")
    async with serve(config, cwd=tmp_path / "elsewhere") as server:
        assert (tmp_path / "conf" / "data.db").is_file()
        assert not (tmp_path / "elsewhere" / "data.db").exists()
        v1 = server.control + "/v1"
        async with aiohttp.ClientSession() as session:
            assert await call(session, "GET", server.control + "/readyz", 200)
            job = await call(
                session,
                "POST",
                v1 + "/jobs",
                201,
                {"queue": "mail", "job_id": "e2e-1", "payload": {"to": "a@example.com"}},
            )
            assert job["state"] == "pending"
            lease = await call(
                session, "POST", v1 + "/queues/mail/claim", 200, {"owner": "w1", "ttl_seconds": 60}
            )
            assert lease["job_id"] == "e2e-1"
            assert lease["generation"] == 1
            assert lease["payload"] == {"to": "a@example.com"}
            token = lease["lease_token"]
            renewed = await call(session, "POST", v1 + "/leases/renew", 200, {"lease_token": token})
            assert "lease_token" not in renewed
            assert renewed["generation"] == 1
            done = await call(
                session,
                "POST",
                v1 + "/leases/complete",
                200,
                {"lease_token": token, "result": {"sent": True}},
            )
            assert done["state"] == "completed"
            again = await call(session, "GET", v1 + "/jobs/e2e-1", 200)
            assert again["result"] == {"sent": True}
            async with session.post(v1 + "/leases/renew", json={"lease_token": token}) as resp:
                assert resp.status == 409
                assert (await resp.json(content_type=None))["reason"] == "lease-ended"
            await call(session, "POST", v1 + "/queues/mail/claim", 204, {"owner": "w2"})
        assert await stop(server) == 0, server.logs()
    # The data outlives the process.
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'conf' / 'data.db'}")
    try:
        job = await LeaseStore(engine).get_job("e2e-1")
    finally:
        await engine.dispose()
    assert job.state == "completed" and job.result == {"sent": True}


# -- (b) two servers on one PostgreSQL database -------------------------------------------------


async def _enqueue(database_url: str, queue: str, count: int) -> list[str]:
    engine = create_engine(database_url)
    try:
        store = LeaseStore(engine)
        ids = [f"{queue}-{i:02d}" for i in range(count)]
        for job_id in ids:
            await store.enqueue(queue=queue, job_id=job_id)
        return ids
    finally:
        await engine.dispose()


@pytest.mark.postgres
@pytest.mark.timeout(90)
async def test_two_servers_on_one_postgres_never_hand_out_a_job_twice(
    tmp_path: Path, pg_database_url: str
) -> None:
    queue = f"e2e-{uuid.uuid4().hex[:8]}"  # the session database is shared: own queue
    ids = await _enqueue(pg_database_url, queue, 15)
    config = write_config(tmp_path, pg_database_url)
    async with (
        serve(config, cwd=tmp_path, name="a") as a,
        serve(config, cwd=tmp_path, name="b") as b,
        aiohttp.ClientSession() as session,
    ):
        servers = [a, b]
        assert a.control != b.control

        async def claim(i: int) -> tuple[int, int, Any]:
            url = f"{servers[i % 2].control}/v1/queues/{queue}/claim"
            body = {"owner": f"w{i}", "ttl_seconds": 600}
            async with session.post(url, json=body) as resp:
                text = await resp.text()
                return i, resp.status, json.loads(text) if text else None

        # One claim through each replica first (both grant), then 40 at once, 20 through
        # each, for the 13 jobs left.
        warm_up = [await claim(0), await claim(1)]
        assert [status for _, status, _ in warm_up] == [200, 200]
        results = await asyncio.gather(*(claim(i) for i in range(2, 42)))
        statuses = Counter(status for _, status, _ in results)
        assert statuses == {200: 13, 204: 27}, results
        granted = [(i, body) for i, status, body in [*warm_up, *results] if status == 200]
        won = {body["job_id"]: (i, body) for i, body in granted}
        assert len(won) == len(granted) == 15  # no job held twice
        assert sorted(won) == ids

        # Each replica agrees on who holds what (it is all in the database).
        for job_id, (i, lease) in won.items():
            other = servers[(i + 1) % 2]
            job = await call(session, "GET", f"{other.control}/v1/jobs/{job_id}", 200)
            assert job["owner"] == f"w{i}"
            assert job["generation"] == lease["generation"] == 1
            # ... and the other replica renews the lease the first one granted.
            renew = {"lease_token": lease["lease_token"]}
            await call(session, "POST", f"{other.control}/v1/leases/renew", 200, renew)

        for server in servers:
            assert await stop(server) == 0, server.logs()


@pytest.fixture
def empty_pg_database(pg_database_url: str) -> Iterator[str]:
    """A throwaway PostgreSQL database with no schema."""
    name = f"fencegate_e2e_{uuid.uuid4().hex[:10]}"

    asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield pg_url_of(name)
    finally:
        asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.mark.postgres
@pytest.mark.timeout(90)
def test_serve_on_postgres_needs_migrate_first(tmp_path: Path, empty_pg_database: str) -> None:
    config = write_config(tmp_path, empty_pg_database)
    refused = run("serve", "--config", str(config), cwd=tmp_path)
    assert refused.returncode != 0
    assert "fencegate migrate" in refused.stderr + refused.stdout

    migrated = run("migrate", "--config", str(config), cwd=tmp_path)
    assert migrated.returncode == 0, migrated.stderr
    assert "database at revision" in migrated.stdout

    async def serve_once() -> int:
        async with serve(config, cwd=tmp_path) as server:
            async with aiohttp.ClientSession() as session:
                await call(session, "GET", server.control + "/readyz", 200)
            return await stop(server)

    assert asyncio.run(serve_once()) == 0


# -- (c) the command line -------------------------------------------------------------------------


def test_help_of_every_command(tmp_path: Path) -> None:
    commands = [[], ["serve"], ["migrate"], ["jobs"], ["check-config"]]
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        results = list(pool.map(lambda c: run(*c, "--help", cwd=tmp_path), commands))
    top = results[0]
    assert top.returncode == 0, top.stderr
    for name in ("serve", "migrate", "jobs", "check-config"):
        assert name in top.stdout
    for command, result in zip(commands[1:], results[1:], strict=True):
        assert result.returncode == 0, (command, result.stderr)
        assert result.stdout.startswith(f"usage: fencegate {command[0]}"), result.stdout
        assert "--config" in result.stdout


def test_check_config_exits_2_naming_the_bad_key_or_0_when_valid(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[lease]\nmax_ttl = 5\n", encoding="utf-8")
    exposed = tmp_path / "exposed.toml"
    exposed.write_text('control_listen = "0.0.0.0:0"\n', encoding="utf-8")
    good = write_config(
        tmp_path / "good",
        "postgresql+asyncpg://fg:hunter2hunter2@db:5432/fg",
        '[[upstreams]]\nname = "pay"\nurl = "http://127.0.0.1:9"\n'
        'set_headers = { Authorization = "Bearer s3cr3t-value" }\n',
    )
    calls = [
        ("check-config", "--config", str(bad)),
        ("check-config", "--config", str(good)),
        # The server refuses to listen beyond loopback without tokens: it never starts.
        ("serve", "--config", str(exposed)),
        ("check-config", "--config", str(exposed)),
        # A deployment's migration step runs with the database URL alone: no tokens,
        # no upstream secrets (the Kubernetes Job and compose's migrate get nothing else).
        ("migrate", "--config", str(exposed)),
    ]
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        invalid, valid, refused, checked, migrated = pool.map(
            lambda args: run(*args, cwd=tmp_path), calls
        )

    assert invalid.returncode == 2, invalid
    assert "lease.max_ttl: unknown setting" in invalid.stderr
    assert invalid.stdout == ""

    assert valid.returncode == 0, valid.stderr
    assert "configuration is valid" in valid.stdout
    assert "pay" in valid.stdout
    # Secrets stay out of the summary.
    assert "hunter2hunter2" not in valid.stdout
    assert "s3cr3t-value" not in valid.stdout

    for answer in (refused, checked):
        assert answer.returncode == 2, answer
        assert "control_listen" in answer.stderr
        assert "loopback" in answer.stderr
    assert migrated.returncode == 0, migrated.stderr
    assert "database at revision" in migrated.stdout


def test_jobs_lists_shows_and_purges(tmp_path: Path, sqlite_template: Path) -> None:
    """``fencegate jobs`` on a database with three jobs, one of them leased."""
    folder = tmp_path / "conf"
    folder.mkdir()
    shutil.copy(sqlite_template, folder / "jobs.db")
    config = write_config(folder, "sqlite+aiosqlite:///jobs.db")
    database_url = f"sqlite+aiosqlite:///{folder / 'jobs.db'}"

    async def fill() -> None:
        engine = create_engine(database_url)
        try:
            store = LeaseStore(engine)
            for job_id, queue in (("alpha", "mail"), ("beta", "mail"), ("gamma", "pay")):
                await store.enqueue(queue=queue, job_id=job_id, payload={"n": job_id})
            await store.acquire(job_id="beta", owner="worker-7", ttl=600, queue="mail")
        finally:
            await engine.dispose()

    asyncio.run(fill())

    def jobs(*args: str) -> subprocess.CompletedProcess[str]:
        return run("jobs", *args, "--config", str(config), cwd=tmp_path)

    with ThreadPoolExecutor(max_workers=4) as pool:
        table, by_queue, first, shown = pool.map(
            lambda args: jobs(*args),
            [(), ("--json", "--queue", "mail"), ("--json", "--limit", "2"), ("show", "gamma")],
        )

    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    header = ["JOB", "QUEUE", "STATE", "GEN", "OWNER", "LEASE", "EXPIRES", "ATTEMPTS"]
    assert lines[0].split() == header
    rows = {line.split()[0]: line.split() for line in lines[1:] if line.strip()}
    assert set(rows) == {"alpha", "beta", "gamma"}
    assert rows["beta"][1:5] == ["mail", "leased", "1", "worker-7"]
    assert rows["beta"][-1] == "1/3"
    assert rows["gamma"][1:5] == ["pay", "pending", "0", "-"]

    assert by_queue.returncode == 0, by_queue.stderr
    doc = json.loads(by_queue.stdout)
    assert [j["job_id"] for j in doc["items"]] == ["alpha", "beta"]
    assert doc["next_cursor"] is None
    beta = doc["items"][1]
    assert beta["state"] == "leased" and beta["owner"] == "worker-7"
    assert beta["payload"] == {"n": "beta"}

    page = json.loads(first.stdout)
    assert len(page["items"]) == 2 and page["next_cursor"]

    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["queue"] == "pay"

    with ThreadPoolExecutor(max_workers=3) as pool:
        rest, purged, held = pool.map(
            lambda args: jobs(*args),
            [("--json", "--cursor", page["next_cursor"]), ("purge", "alpha"), ("purge", "beta")],
        )
    assert [j["job_id"] for j in json.loads(rest.stdout)["items"]] == ["gamma"]
    assert purged.returncode == 0, purged.stderr
    assert held.returncode == 1  # a current lease holds it: not purged
    assert "lease" in held.stderr

    async def remaining() -> list[str]:
        engine = create_engine(database_url)
        try:
            page = await LeaseStore(engine).list_jobs()
            return [job.job_id for job in page.items]
        finally:
            await engine.dispose()

    assert asyncio.run(remaining()) == ["beta", "gamma"]
