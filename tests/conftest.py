"""Shared fixtures: real SQLite and real PostgreSQL, a controllable clock, real apps.

PostgreSQL: ``FENCEGATE_TEST_POSTGRES_URL`` (default the local trust-auth server). Each
test session gets its own database, migrated once and emptied before every test. When
the server is unreachable the PostgreSQL tests skip on a developer's machine and FAIL
when ``CI`` is set, so CI can never pass without them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from aiohttp.test_utils import TestClient
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from gateway import migrate
from gateway.config import Settings
from gateway.server import create_control_app
from lease_core.db import create_engine
from lease_core.schema import metadata
from lease_core.store import LeaseStore

PG_URL = os.environ.get(
    "FENCEGATE_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


class FakeClock:
    """A clock the test moves by hand (seconds since the epoch)."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _unavailable(message: str) -> None:
    if IN_CI:
        pytest.fail(f"PostgreSQL is required in CI: {message}", pytrace=False)
    pytest.skip(f"PostgreSQL not reachable: {message}")


async def _admin(sql: str) -> None:
    engine = create_async_engine(PG_URL, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            await conn.execute(sa.text(sql))
    finally:
        await engine.dispose()


@pytest.fixture(scope="session")
def pg_database_url() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for this test session."""
    name = f"fencegate_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        asyncio.run(asyncio.wait_for(_admin(f'CREATE DATABASE "{name}"'), 10))
    except Exception as error:  # any failure to reach the server
        _unavailable(f"{type(error).__name__}: {error}")
    url = sa.make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    migrate.upgrade(url)
    yield url
    asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated once; each test gets a copy."""
    path = tmp_path_factory.mktemp("template") / "template.db"
    migrate.upgrade(f"sqlite+aiosqlite:///{path}")
    return path


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def database_url(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, sqlite_template: Path
) -> str:
    if backend == "sqlite":
        path = tmp_path / "fencegate.db"
        shutil.copy(sqlite_template, path)
        return f"sqlite+aiosqlite:///{path}"
    url: str = request.getfixturevalue("pg_database_url")
    asyncio.run(_truncate(url))
    return url


async def _truncate(url: str) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            names = ", ".join(f'"{t.name}"' for t in metadata.sorted_tables)
            await conn.execute(sa.text(f"TRUNCATE {names}"))
    finally:
        await engine.dispose()


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url)
    yield engine
    await engine.dispose()


@pytest.fixture
def store(engine: AsyncEngine, clock: FakeClock) -> LeaseStore:
    return LeaseStore(engine, clock=clock)


@pytest.fixture
def make_settings(database_url: str) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        return Settings(**{"database_url": database_url, **overrides})

    return make


@pytest.fixture
async def control(
    store: LeaseStore, aiohttp_client: Callable[..., Any], make_settings: Callable[..., Settings]
) -> TestClient[Any, Any]:
    """A test client of the control listener on the backend under test."""
    app = create_control_app(make_settings(), store)
    client: TestClient[Any, Any] = await aiohttp_client(app)
    return client


# -- gateway fixtures -------------------------------------------------------------------


class Upstream:
    """A real HTTP server standing in for a payment / storage API. It records every
    request it receives; ``behaviour`` decides the answer."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.status = 201
        self.delay = 0.0
        self.body: bytes | None = None
        self.headers: dict[str, str] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.url = ""

    async def handler(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.read()
        record = {
            "method": request.method,
            "path": request.path_qs,
            "headers": dict(request.headers),
            "body": body,
            "generation": request.headers.get("Fencing-Generation"),
            "key": request.headers.get("Idempotency-Key"),
        }
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            self.received.append(record)
        finally:
            self.in_flight -= 1
        answer = self.body if self.body is not None else (b'{"applied": %d}' % len(self.received))
        return web.Response(
            status=self.status,
            body=answer,
            content_type="application/json",
            headers=self.headers,
        )


@pytest.fixture
async def upstream(aiohttp_server: Callable[..., Any]) -> Upstream:
    from aiohttp import web

    up = Upstream()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", up.handler)
    server = await aiohttp_server(app)
    up.url = str(server.make_url("")).rstrip("/")
    return up


class Stack:
    """A control client and a proxy client on one store (one gateway replica)."""

    def __init__(self, control: TestClient[Any, Any], proxy: TestClient[Any, Any]) -> None:
        self.control = control
        self.proxy = proxy

    async def lease(self, job_id: str, owner: str = "worker-a", ttl: float = 30) -> dict[str, Any]:
        resp = await self.control.put(
            f"/v1/jobs/{job_id}/lease", json={"owner": owner, "ttl_seconds": ttl}
        )
        assert resp.status == 201, await resp.text()
        lease: dict[str, Any] = await resp.json()
        return lease

    async def write(
        self,
        path: str,
        lease: dict[str, Any] | None,
        key: str | None = "k1",
        body: Any = None,
        method: str = "POST",
        headers: dict[str, str] | None = None,
    ) -> Any:
        h = dict(headers or {})
        if lease is not None:
            h["Fencing-Token"] = lease["lease_token"]
        if key is not None:
            h["Idempotency-Key"] = key
        return await self.proxy.request(method, path, json=body or {"amount": 1}, headers=h)

    async def audit(self, **query: str) -> list[dict[str, Any]]:
        resp = await self.control.get("/admin/rejections", params=query)
        assert resp.status == 200, await resp.text()
        items: list[dict[str, Any]] = (await resp.json())["items"]
        return items


@pytest.fixture
async def make_stack(
    engine: AsyncEngine,
    aiohttp_client: Callable[..., Any],
    make_settings: Callable[..., Settings],
    clock: FakeClock,
) -> AsyncIterator[Callable[..., Any]]:
    """Build a gateway replica: ``await make_stack(upstreams=[...], use_clock=False)``.

    Every replica's apps are closed before ``engine`` (set up first, torn down last) is
    disposed: their background upkeep may still hold a connection."""
    from gateway.proxy import Gateway, create_proxy_app

    stacks: list[Stack] = []

    async def make(*, use_clock: bool = True, **overrides: Any) -> Stack:
        settings = make_settings(**overrides)
        store = LeaseStore(engine, clock=clock if use_clock else None)
        gateway = Gateway(settings, store)
        control = await aiohttp_client(create_control_app(settings, store, gateway))
        proxy = await aiohttp_client(create_proxy_app(gateway))
        stacks.append(Stack(control, proxy))
        return stacks[-1]

    yield make
    for stack in stacks:
        await stack.control.close()
        await stack.proxy.close()


def upstream_config(up: Upstream, name: str = "pay", **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": up.url, **extra}
