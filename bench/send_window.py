"""How long a claimed write can still be sent late: the window between the gateway's
last judgement of a claim (the machine's READ_CLAIM step: the fence and the claim's deadline,
read from the database right before the forward) and the first byte of the request
leaving for the upstream.

A replica that stops inside that window (a paused process, a VM frozen by its host) and
wakes after a newer generation has written sends the older write late; no check in the
gateway can close it, only an upstream that checks ``Fencing-Generation`` (see
docs/limits.md). This measures its size, in process, on SQLite and PostgreSQL:

- ``read``: the last judgement's database round trip (the database's reading is taken
  somewhere inside it);
- ``to_first_byte``: from that answer to the upstream client having written the request
  to the socket (``gateway.upstream.connection.Connection.send``): the rest of the window.

    .venv/bin/python -m bench.send_window [--writes 2000] [--backends sqlite,postgres]

It instruments the gateway from outside (wrappers) and changes nothing in it. Not a
test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import sqlalchemy as sa
from aiohttp import web
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.config import Settings
from gateway.fencing.decision import Act
from gateway.proxy.gateway import Gateway, create_proxy_app
from gateway.records import migrate
from gateway.upstream import connection
from lease_core.db import create_engine
from lease_core.store import LeaseStore

from .common import percentile

PG_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"


@contextlib.asynccontextmanager
async def database(backend: str, pg_url: str) -> AsyncIterator[str]:
    """A fresh migrated database; its URL."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as folder:
            url = f"sqlite+aiosqlite:///{Path(folder) / 'window.db'}"
            await asyncio.to_thread(migrate.upgrade, url)
            yield url
        return
    name = f"fencegate_window_{uuid.uuid4().hex[:8]}"
    admin = create_async_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as conn:
            await conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        url = sa.make_url(pg_url).set(database=name).render_as_string(hide_password=False)
        await asyncio.to_thread(migrate.upgrade, url)
        yield url
    finally:
        async with admin.connect() as conn:
            await conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        await admin.dispose()


async def start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def measure(
    backend: str, pg_url: str, writes: int, concurrency: int, keep_alive: bool
) -> dict[str, Any]:
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"ok": True})

    upstream_app = web.Application()
    upstream_app.router.add_route("*", "/{tail:.*}", answer)
    upstream_runner, upstream_url = await start(upstream_app)

    async with database(backend, pg_url) as url:
        engine = create_engine(url)
        store = LeaseStore(engine)
        settings = Settings(
            database_url=url,
            upstreams=[{"name": "pay", "url": upstream_url}],
        )
        gateway = Gateway(settings, store)
        proxy_runner, proxy_url = await start(create_proxy_app(gateway))
        assert gateway.forwarder.client is not None
        if not keep_alive:  # every forward opens a new connection to the upstream
            gateway.forwarder.client.keepalive_seconds = 0

        judged: dict[asyncio.Task[Any], float] = {}
        reads: list[float] = []
        windows: list[float] = []
        judge_again = gateway.driver.acts[Act.READ_CLAIM]
        claim = gateway.store.claim

        async def timed_claim(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return await claim(*args)
            finally:
                reads.append(time.perf_counter() - started)

        async def timed_judge_at_send(*args: Any) -> Any:
            found = await judge_again(*args)
            task = asyncio.current_task()
            assert task is not None
            judged[task] = time.perf_counter()
            return found

        async def headers_sent(*_: Any) -> None:
            task = asyncio.current_task()
            at = judged.pop(task, None) if task is not None else None
            if at is not None:
                windows.append(time.perf_counter() - at)

        send = connection.Connection.send

        async def timed_send(conn: Any, *args: Any) -> None:
            await send(conn, *args)
            await headers_sent()

        # Timers wrapped around the real methods (a measurement, not a test double).
        setattr(connection.Connection, "send", timed_send)  # noqa: B010
        setattr(gateway.store, "claim", timed_claim)  # noqa: B010
        gateway.driver.acts[Act.READ_CLAIM] = timed_judge_at_send

        leases = [
            await store.acquire(job_id=f"job-{i}", owner="w", ttl=600, queue="window")
            for i in range(concurrency)
        ]
        per_worker = writes // concurrency
        failures = 0

        async def worker(lease: Any, client: aiohttp.ClientSession) -> None:
            nonlocal failures
            for n in range(per_worker):
                async with client.post(
                    f"{proxy_url}/pay/charges",
                    json={"n": n},
                    headers={"Fencing-Token": lease.lease_token, "Idempotency-Key": f"k{n}"},
                ) as response:
                    await response.read()
                    failures += response.status != 200

        try:
            async with aiohttp.ClientSession() as client:
                started = time.perf_counter()
                await asyncio.gather(*(worker(lease, client) for lease in leases))
                took = time.perf_counter() - started
        finally:
            connection.Connection.send = send  # type: ignore[method-assign]
            await proxy_runner.cleanup()
            await engine.dispose()
            await upstream_runner.cleanup()

    def ms(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {
            "p50": round(percentile(ordered, 0.5) * 1000, 3),
            "p99": round(percentile(ordered, 0.99) * 1000, 3),
            "max": round((ordered[-1] if ordered else 0.0) * 1000, 3),
        }

    return {
        "backend": backend,
        "concurrency": concurrency,
        "keep_alive": keep_alive,
        "writes": len(windows),
        "failures": failures,
        "writes_per_second": round(len(windows) / took, 1),
        "read_ms": ms(reads),
        "to_first_byte_ms": ms(windows),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.send_window", description=__doc__)
    parser.add_argument("--writes", type=int, default=2000)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--postgres-url", default=PG_URL, help="a server to create a database on")
    return parser


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for backend in args.backends.split(","):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for keep_alive in (True, False):
                result = await measure(
                    backend, args.postgres_url, args.writes, concurrency, keep_alive
                )
                print(json.dumps(result), flush=True)
                results.append(result)
    return results


def main(argv: Sequence[str] | None = None) -> None:
    asyncio.run(main_async(build_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
