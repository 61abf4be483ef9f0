"""``fencegate serve`` as a user runs it: a real process with a TOML config on SQLite,
a real upstream, workers talking HTTP to both listeners, and the ``fencegate`` command
reading the same database.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support import Upstream

FENCEGATE = str(Path(sys.executable).parent / "fencegate")
WORKER_TOKEN = "worker-token-0123456789"
ADMIN_TOKEN = "admin-token-0123456789ab"
PAY_KEY = "sk_e2e_upstream_secret"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def environment() -> dict[str, str]:
    """A clean environment: no FENCEGATE_* overrides from the developer's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    env["E2E_PAY_KEY"] = PAY_KEY
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Server:
    def __init__(self, config: Path, log: Path, proxy: str, control: str) -> None:
        self.config, self.log = config, log
        self.proxy, self.control = proxy, control
        self.process: subprocess.Popen[bytes] | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def run_cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [FENCEGATE, *args, "--config", str(self.config)],
            capture_output=True,
            text=True,
            timeout=60,
            env=environment(),
            cwd=self.config.parent.parent,
        )


@pytest.fixture
def server(tmp_path: Path, upstream: Upstream) -> Iterator[Server]:
    """Write the config; the test starts the process (and this always kills it)."""
    home = tmp_path / "site"
    home.mkdir()
    proxy, control = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = home / "fencegate.toml"
    config.write_text(
        f"""\
database_url = "sqlite+aiosqlite:///state/fencegate.db"
proxy_listen = "{proxy}"
control_listen = "{control}"

[auth]
worker_tokens = ["{WORKER_TOKEN}"]
admin_tokens = ["{ADMIN_TOKEN}"]

[lease]
default_ttl_seconds = 30

[gateway]
ordering_wait_seconds = 0.5

[[upstreams]]
name = "pay"
url = "{upstream.url}"
timeout_seconds = 2
max_body_bytes = 65536
set_headers = {{ Authorization = "Bearer ${{E2E_PAY_KEY}}" }}
"""
    )
    (home / "state").mkdir()
    srv = Server(config, tmp_path / "serve.log", proxy, control)
    try:
        yield srv
    finally:
        if srv.process is not None and srv.process.poll() is None:
            srv.process.kill()
            srv.process.wait(timeout=10)


async def start(srv: Server) -> None:
    with srv.log.open("wb") as log:
        srv.process = subprocess.Popen(
            [FENCEGATE, "serve", "--config", str(srv.config), "--log-level", "INFO"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment(),
            cwd=srv.config.parent.parent,  # not the config's folder: paths resolve there
        )
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as session:
        while True:
            assert srv.process.poll() is None, f"fencegate exited early:\n{srv.output()}"
            try:
                async with session.get(f"http://{srv.control}/healthz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            assert time.monotonic() < deadline, f"fencegate never got healthy:\n{srv.output()}"
            await asyncio.sleep(0.1)


async def test_a_user_session(server: Server, upstream: Upstream) -> None:
    await start(server)
    assert (server.config.parent / "state" / "fencegate.db").is_file()
    worker = {"Authorization": f"Bearer {WORKER_TOKEN}"}
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    control = f"http://{server.control}"
    proxy = f"http://{server.proxy}"

    async with aiohttp.ClientSession() as http:

        async def acquire(job: str, owner: str, ttl: float) -> dict[str, Any]:
            async with http.put(
                f"{control}/v1/jobs/{job}/lease",
                json={"owner": owner, "ttl_seconds": ttl},
                headers=worker,
            ) as resp:
                assert resp.status == 201, await resp.text()
                lease: dict[str, Any] = await resp.json()
                return lease

        async def write(lease: dict[str, Any], key: str, amount: int) -> tuple[int, Any, bytes]:
            async with http.post(
                f"{proxy}/pay/charges",
                json={"amount": amount},
                headers={"Fencing-Token": lease["lease_token"], "Idempotency-Key": key},
            ) as resp:
                return resp.status, resp.headers, await resp.read()

        async def reason(answer: tuple[int, Any, bytes]) -> str:
            status, headers, body = answer
            assert headers["Content-Type"] == "application/problem+json", body
            doc = json.loads(body)
            assert doc["status"] == status
            return str(doc["reason"])

        async with http.get(f"{control}/readyz") as resp:
            assert resp.status == 200
        async with http.get(f"{control}/v1/jobs/x") as resp:  # no token
            assert resp.status == 401
        async with http.get(f"{control}/admin/rejections", headers=worker) as resp:
            assert resp.status == 403

        # Worker 1 takes the job and charges.
        w1 = await acquire("order-7", "worker-1", ttl=1)
        assert w1["generation"] == 1
        status, _, body = await write(w1, "charge", 5)
        assert status == 201, body
        charged = body
        [sent] = upstream.received
        assert sent["headers"]["Authorization"] == f"Bearer {PAY_KEY}"
        assert sent["headers"]["Fencing-Generation"] == "1"
        assert sent["headers"]["Fencing-Job"] == "order-7"
        assert "Fencing-Token" not in sent["headers"]

        # Worker 1 stalls past its lease.
        await asyncio.sleep(1.2)
        answer = await write(w1, "email", 1)
        assert (answer[0], await reason(answer)) == (409, "lease-expired")

        # Worker 2 reclaims the job; worker 1 wakes up and is fenced off.
        w2 = await acquire("order-7", "worker-2", ttl=30)
        assert w2["generation"] == 2
        answer = await write(w1, "email", 1)
        assert (answer[0], await reason(answer)) == (409, "stale-generation")
        assert json.loads(answer[2])["highest_generation"] == 2

        # Worker 2 repeats the charge step: replayed, not charged twice.
        status, headers, body = await write(w2, "charge", 5)
        assert (status, headers["Idempotent-Replayed"], body) == (201, "true", charged)
        status, _, _ = await write(w2, "email", 1)
        assert status == 201
        assert [r["generation"] for r in upstream.received] == ["1", "2"]

        async with http.post(
            f"{control}/v1/leases/complete",
            json={"lease_token": w2["lease_token"]},
            headers=worker,
        ) as resp:
            assert resp.status == 200, await resp.text()
        answer = await write(w2, "late", 1)
        assert (answer[0], await reason(answer)) == (409, "lease-ended")

        # An upstream that fails ambiguously: the key is held for an operator.
        other = await acquire("order-8", "worker-3", ttl=30)
        upstream.status = 504
        status, _, _ = await write(other, "refund", 3)
        assert status == 504
        upstream.status = 201
        answer = await write(other, "refund", 3)
        assert (answer[0], await reason(answer)) == (409, "outcome-unknown")
        async with http.get(f"{control}/admin/unknown-outcomes", headers=admin) as resp:
            assert [i["key"] for i in (await resp.json())["items"]] == ["refund"]

        async with http.get(f"{control}/admin/rejections", headers=admin) as resp:
            assert resp.status == 200
            api_items = (await resp.json())["items"]
        assert [e["reason"] for e in api_items] == [
            "outcome-unknown",
            "lease-ended",
            "idempotent-replay",
            "stale-generation",
            "lease-expired",
        ]

        # The command line reads the same database while the server runs.
        as_json, table, outcomes = await asyncio.gather(
            asyncio.to_thread(server.run_cli, "audit", "--json"),
            asyncio.to_thread(server.run_cli, "audit", "--job", "order-7"),
            asyncio.to_thread(server.run_cli, "outcomes"),
        )
        assert as_json.returncode == 0, as_json.stderr
        cli_items = json.loads(as_json.stdout)["items"]
        assert cli_items == api_items
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0].split()[:3] == ["AT", "REASON", "STATUS"]
        assert len(lines) == 5  # header + the four entries of order-7
        stale_line = next(line for line in lines if "stale-generation" in line)
        assert "order-7" in stale_line and "409" in stale_line and "1/2" in stale_line
        assert "outcome-unknown" not in table.stdout
        assert outcomes.returncode == 0, outcomes.stderr
        [held] = [line for line in outcomes.stdout.splitlines() if "refund" in line]
        assert "order-8" in held and "504" in held

        # The operator checked with the payment provider: the refund went through.
        async with http.post(
            f"{control}/admin/unknown-outcomes/resolve",
            json={
                "job_id": "order-8",
                "key": "refund",
                "applied": True,
                "status": 201,
                "headers": {"Content-Type": "application/json"},
                "body": '{"refunded": true}',
            },
            headers=admin,
        ) as resp:
            assert resp.status == 200, await resp.text()
        status, headers, body = await write(other, "refund", 3)
        assert (status, headers["Idempotent-Replayed"], body) == (
            201,
            "true",
            b'{"refunded": true}',
        )
        assert headers["Content-Type"].startswith("application/json")
        async with http.get(f"{control}/admin/unknown-outcomes", headers=admin) as resp:
            assert (await resp.json())["items"] == []
        assert len(upstream.received) == 3

    # No token appears whole in anything an operator reads.
    everything = server.output() + json.dumps(cli_items)
    for lease in (w1, w2, other):
        assert lease["lease_token"] not in everything
    assert PAY_KEY not in server.output()

    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(server.process.wait, 20)
    assert code == 0, server.output()
    assert "fencegate listening" in server.output()


async def test_a_bad_config_is_refused_with_the_key_named(tmp_path: Path) -> None:
    config = tmp_path / "fencegate.toml"
    config.write_text('[lease]\nmax_ttl_seconds = "long"\n')
    result = await asyncio.to_thread(
        subprocess.run,
        [FENCEGATE, "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment(),
    )
    assert result.returncode == 2, result
    assert "lease.max_ttl_seconds" in result.stderr
