"""Shared fixtures: real SQLite and real PostgreSQL, a controllable clock, real apps.

PostgreSQL: ``FENCEGATE_TEST_POSTGRES_URL`` (default the local trust-auth server). Each
test session gets its own database, migrated once and emptied before every test. When
the server is unreachable the PostgreSQL tests skip on a developer's machine and FAIL
when ``CI`` is set, so CI can never pass without them.
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.config import Settings
from gateway.records import migrate
from gateway.service.server import create_control_app
from lease_core.db import create_engine
from lease_core.store import LeaseStore
from tests.support import (
    EtcdServer,
    FakeClock,
    Stack,
    Upstream,
    ZooKeeperServer,
    pg_admin,
    pg_url_of,
    postgres_unavailable,
    truncate_all,
)

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def pg_database_url() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for this test session."""
    name = f"fencegate_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        asyncio.run(asyncio.wait_for(pg_admin(f'CREATE DATABASE "{name}"'), 10))
    except Exception as error:  # any failure to reach the server
        postgres_unavailable(f"{type(error).__name__}: {error}")
    url = pg_url_of(name)
    migrate.upgrade(url)
    yield url
    asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def leaked_sockets() -> Iterator[None]:
    """kazoo, redis-py and aiohttp leave the socket of a refused TLS handshake (or AUTH) to
    the garbage collector, which warns of it: collected at the end of the test that made
    it (whose module lets the warning pass), never in whichever test runs next in this
    process (pytest-xdist puts any module there)."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real etcd for this test session (skips on a developer's machine without the
    ``etcd`` binary, fails in CI)."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def zookeeper_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ZooKeeper for this test session (skips on a developer's machine without
    Debian's zookeeper package, fails in CI)."""
    server = ZooKeeperServer(tmp_path_factory.mktemp("zookeeper"))
    yield server.hosts
    server.stop()


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
    asyncio.run(truncate_all(url))
    return url


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


@pytest.fixture
async def upstream(aiohttp_server: Callable[..., Any]) -> Upstream:
    from aiohttp import web

    up = Upstream()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", up.handler)
    server = await aiohttp_server(app)
    up.url = str(server.make_url("")).rstrip("/")
    return up


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
    from gateway.proxy.gateway import Gateway, create_proxy_app

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
