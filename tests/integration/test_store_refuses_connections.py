"""A PostgreSQL database that refuses connections is ``store-unavailable`` (issue 52,
item 2).

``ALTER DATABASE ... ALLOW_CONNECTIONS false`` and its sessions terminated, as an operator
does before maintenance: every new connection is refused with FATAL SQLSTATE 55000
(``ObjectNotInPrerequisiteState``, "database ... is not currently accepting
connections"). The server answered, so its code is what says the database cannot serve
now (``lease_core.direct.is_unavailable``): the driver, SQLAlchemy and the gateway's two
listeners all take it as the store being away, never as our SQL's fault (a plain-text
500 before).

The database is this module's own, since its tests make it refuse connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import asyncpg  # type: ignore[import-untyped]
import pytest
import sqlalchemy as sa

from gateway.records import migrate
from lease_core import exceptions as exc
from lease_core.backend import Backend
from lease_core.db import create_engine
from lease_core.direct import is_unavailable
from tests.gateway_helpers import ok, problem
from tests.support import (
    Stack,
    Upstream,
    pg_admin,
    pg_url_of,
    postgres_unavailable,
    truncate_all,
    upstream_config,
)

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def own_database() -> Iterator[str]:
    """A migrated database of this module's own: its tests make it refuse connections."""
    name = f"fencegate_refuses_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        asyncio.run(asyncio.wait_for(pg_admin(f'CREATE DATABASE "{name}"'), 10))
    except Exception as error:  # any failure to reach the server
        postgres_unavailable(f"{type(error).__name__}: {error}")
    migrate.upgrade(pg_url_of(name))
    yield name
    asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def database_url(own_database: str) -> str:
    """The database of ``engine``, ``make_settings`` and ``make_stack`` (tests/conftest.py):
    this module's own, emptied."""
    url = pg_url_of(own_database)
    asyncio.run(truncate_all(url))
    return url


def dsn(database: str) -> str:
    """asyncpg's own spelling of the test server's URL for ``database``."""
    return pg_url_of(database).replace("postgresql+asyncpg://", "postgresql://")


async def sessions_of(database: str) -> int:
    conn = await asyncpg.connect(dsn("postgres"))
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1", database
        )
        return count
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def refuses_connections(database: str) -> AsyncIterator[None]:
    """``database`` taking no new connection and its sessions cut (everyone's but the
    admin's own); afterwards it takes connections again, whatever the test did."""
    await pg_admin(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
    try:
        await pg_admin(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{database}' AND pid <> pg_backend_pid()"
        )
        deadline = time.monotonic() + 10
        while await sessions_of(database):  # gone, and their clients told so
            assert time.monotonic() < deadline, "the sessions were never cut"
            await asyncio.sleep(0.02)
        yield
    finally:
        await pg_admin(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')


async def test_the_driver_refused_a_connection_with_55000_is_unavailability(
    own_database: str,
) -> None:
    async with refuses_connections(own_database):
        with pytest.raises(asyncpg.ObjectNotInPrerequisiteStateError) as refused:
            await asyncpg.connect(dsn(own_database))
    assert refused.value.sqlstate == "55000"
    assert is_unavailable(refused.value), repr(refused.value)


async def test_sqlalchemy_refused_a_connection_is_store_unavailable(own_database: str) -> None:
    """The reads' path (listings, the audit, the dashboard): SQLAlchemy's wrapper of the
    refusal is judged by the same rule, and the same engine reads again afterwards."""
    engine = create_engine(pg_url_of(own_database), pool_size=2)
    backend = Backend(engine)
    try:
        assert await backend.database_now() > 0  # a pooled connection, cut below
        async with refuses_connections(own_database):
            with pytest.raises(exc.StoreUnavailable) as caught:
                await backend.database_now()
            cause = caught.value.__cause__
            # Its reconnection refused: the server's code, carried by SQLAlchemy's wrapper.
            assert isinstance(cause, sa.exc.DBAPIError), repr(cause)
            assert getattr(cause.orig, "sqlstate", None) == "55000", repr(cause.orig)
        assert await backend.database_now() > 0
    finally:
        await engine.dispose()


async def test_a_database_refusing_connections_is_503_on_both_listeners(
    make_stack: Callable[..., Awaitable[Stack]], upstream: Upstream, own_database: str
) -> None:
    """While the database refuses connections, a new fenced write is ``503
    store-unavailable`` (sent never) and does not reach the upstream, and the lease API
    answers 503 problem documents too; once it takes connections again, the same write
    goes through on the same replica."""
    stack = await make_stack(upstreams=[upstream_config(upstream)], use_clock=False)
    lease = await stack.lease("job-1")
    await ok(await stack.write("/pay/charges", lease, key="before"))
    await stack.written()  # nothing of this replica's left to write during the outage

    async with refuses_connections(own_database):
        write = await stack.write("/pay/charges", lease, key="during")
        doc = await problem(write, 503, "store-unavailable")
        assert doc["sent"] == "never", doc
        assert write.headers.get("Retry-After") == "1"
        renew = await stack.control.post(
            "/v1/leases/renew", json={"lease_token": lease["lease_token"]}
        )
        await problem(renew, 503, "store-unavailable")
        acquire = await stack.control.put(
            "/v1/jobs/job-2/lease", json={"owner": "worker-b", "ttl_seconds": 30}
        )
        await problem(acquire, 503, "store-unavailable")
        listed = await stack.control.get("/v1/jobs")
        await problem(listed, 503, "store-unavailable")
        assert [r["key"] for r in upstream.received] == ["before"]

    await ok(await stack.write("/pay/charges", lease, key="during"))
    assert [r["key"] for r in upstream.received] == ["before", "during"]
    renew = await stack.control.post("/v1/leases/renew", json={"lease_token": lease["lease_token"]})
    assert renew.status == 200, await renew.text()
