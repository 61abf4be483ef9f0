"""asyncpg's own errors about a broken connection are ``store-unavailable``, on the real
PostgreSQL (issue 43, "Also found").

At a PostgreSQL restart asyncpg raises, besides the server's errors (which carry a
SQLSTATE), errors of its own: its ``InterfaceError`` family ("connection is closed",
"another operation is in progress", "pool is closing") and its ``InternalClientError``
family (a protocol state it did not expect; ``TargetServerAttributeNotMatched`` when no
host takes writes, as a server that came back as a standby). None of them says that our
SQL or a value is wrong: each means the connection cannot serve now, so every operation
(a fenced write, a lease call, a listing) answers ``503 store-unavailable``, never a 500,
and a connection they broke is not handed out again.

Every error here is caused for real: two operations at once on one connection, a backend
terminated mid-statement, a pool closed under a caller, and a database that takes no
writes (``default_transaction_read_only``, which asyncpg's ``target_session_attrs =
read-write`` treats as it treats a standby) after its sessions were cut, as a restart
cuts them. The database is this module's own, since its tests turn it read-only.
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
from lease_core.statement import Statement
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

READ_WRITE = "target_session_attrs=read-write"


@pytest.fixture(scope="module")
def own_database() -> Iterator[str]:
    """A migrated database of this module's own: its tests turn it read-only."""
    name = f"fencegate_store_errors_{os.getpid()}_{uuid.uuid4().hex[:6]}"
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
    this module's own, reached the way a deployment with standbys is told to
    (docs/operations.md): only a server that takes writes will do."""
    url = pg_url_of(own_database)
    asyncio.run(truncate_all(url))
    return f"{url}?{READ_WRITE}"


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
async def takes_no_writes(database: str) -> AsyncIterator[None]:
    """``database`` as a server that came back from a restart as a standby looks to a
    client: its sessions cut (FATAL 57P01, as a restart cuts them), and every new one
    read-only, which ``target_session_attrs=read-write`` refuses. Afterwards it takes
    writes again."""
    await pg_admin(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
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
        await pg_admin(f'ALTER DATABASE "{database}" RESET default_transaction_read_only')


# -- the errors themselves, raised by the real driver -----------------------------------------

Cause = Callable[[str], Awaitable[BaseException]]


async def another_operation_in_progress(database: str) -> BaseException:
    conn = await asyncpg.connect(dsn(database))
    try:
        busy = asyncio.ensure_future(conn.fetchval("SELECT pg_sleep(0.3)"))
        await asyncio.sleep(0.05)
        try:
            await conn.fetchval("SELECT 1")
        except Exception as error:
            return error
        finally:
            await busy
        raise AssertionError("two operations ran at once on one connection")
    finally:
        await conn.close()


async def terminated_mid_statement(database: str) -> BaseException:
    conn = await asyncpg.connect(dsn(database))
    try:
        slow = asyncio.ensure_future(conn.fetchval("SELECT pg_sleep(5)"))
        await asyncio.sleep(0.1)
        await pg_admin(f"SELECT pg_terminate_backend({conn.get_server_pid()})")
        try:
            await slow
        except Exception as error:
            return error
        raise AssertionError("the statement outlived its backend")
    finally:
        conn.terminate()


async def used_after_termination(database: str) -> BaseException:
    conn = await asyncpg.connect(dsn(database))
    try:
        await pg_admin(f"SELECT pg_terminate_backend({conn.get_server_pid()})")
        deadline = time.monotonic() + 5
        while not conn.is_closed():
            assert time.monotonic() < deadline, "the client never saw the session end"
            await asyncio.sleep(0.02)
        try:
            await conn.fetchval("SELECT 1")
        except Exception as error:
            return error
        raise AssertionError("a closed connection answered")
    finally:
        conn.terminate()


async def pool_closing(database: str) -> BaseException:
    pool = await asyncpg.create_pool(dsn(database), min_size=0, max_size=1)
    refused: BaseException | None = None
    async with pool.acquire():
        closing = asyncio.ensure_future(pool.close())  # waits for the connection held
        await asyncio.sleep(0.05)
        try:
            async with pool.acquire():
                pass
        except Exception as error:
            refused = error
    await closing
    assert refused is not None, "a closing pool handed out a connection"
    return refused


async def no_host_takes_writes(database: str) -> BaseException:
    async with takes_no_writes(database):
        try:
            conn = await asyncpg.connect(dsn(database), target_session_attrs="read-write")
        except Exception as error:
            return error
        await conn.close()
        raise AssertionError("a read-only server was taken for one that takes writes")


CAUSES: dict[str, Cause] = {
    "another operation is in progress": another_operation_in_progress,
    "terminated mid-statement": terminated_mid_statement,
    "used after its session ended": used_after_termination,
    "pool is closing": pool_closing,
    "no host takes writes (InternalClientError)": no_host_takes_writes,
}


@pytest.mark.parametrize("cause", list(CAUSES))
async def test_asyncpg_errors_of_a_connection_that_cannot_serve_are_unavailability(
    own_database: str, cause: str
) -> None:
    error = await CAUSES[cause](own_database)
    driver_errors = asyncpg.InterfaceError | asyncpg.PostgresError | asyncpg.InternalClientError
    assert isinstance(error, driver_errors), repr(error)
    assert is_unavailable(error), repr(error)


async def test_asyncpg_errors_of_our_values_or_sql_are_not_unavailability(
    own_database: str,
) -> None:
    """The other side of the line: what a retry could never fix stays an error (a 500
    or the caller's own refusal), however the driver raised it."""
    conn = await asyncpg.connect(dsn(own_database))
    try:
        errors: list[BaseException] = []
        for sql, args in (
            ("SELECT $1::int", ("not a number",)),  # asyncpg's DataError, client side
            ("SELECT 'x'::int", ()),  # 22P02, the server's
            ("SELEC 1", ()),  # 42601
            ("SELECT 1 FROM no_such_table", ()),  # 42P01
        ):
            with pytest.raises(Exception) as caught:
                await conn.fetchval(sql, *args)
            errors.append(caught.value)
        assert not [e for e in errors if is_unavailable(e)], errors
        assert await conn.fetchval("SELECT 1") == 1  # none of them broke the connection
    finally:
        await conn.close()


# -- the hot path's own pool: the operations of the lease API and the gateway -------------------

BACKEND_PID = Statement("SELECT pg_backend_pid() AS pid")
# What the server says, as an ERROR on a session that stays open, when the disk is full
# (class 53, insufficient resources): the database cannot serve now.
DISK_FULL = Statement(
    "DO $$ BEGIN RAISE EXCEPTION 'could not extend file' USING ERRCODE = '53100'; END $$"
)


async def test_the_hot_path_closes_a_connection_whose_operation_found_the_store_unavailable(
    own_database: str,
) -> None:
    """asyncpg's pool takes back a connection still open whatever its operation raised;
    one that failed because the database cannot serve is closed instead, and the next
    operation gets a new session. A connection that only refused our SQL is kept."""
    engine = create_engine(pg_url_of(own_database), pool_size=1)  # one connection
    direct = engine.direct
    try:
        first = await direct.fetchrow(BACKEND_PID, {})
        assert first is not None
        with pytest.raises(exc.StoreUnavailable) as caught:
            await direct.fetchrow(DISK_FULL, {})
        assert isinstance(caught.value.__cause__, asyncpg.PostgresError)
        second = await direct.fetchrow(BACKEND_PID, {})
        assert second is not None and second["pid"] != first["pid"]

        with pytest.raises(asyncpg.PostgresSyntaxError):
            await direct.fetchrow(Statement("SELEC 1"), {})
        third = await direct.fetchrow(BACKEND_PID, {})
        assert third is not None and third["pid"] == second["pid"]
    finally:
        await engine.dispose()


# -- through SQLAlchemy: the listings, the audit, the dashboard ----------------------------------


async def test_sqlalchemy_discards_a_connection_asyncpg_said_is_busy(own_database: str) -> None:
    """Two operations at once on one pooled connection: the read is ``StoreUnavailable``,
    the connection is invalidated (closed, never handed out again), and the next read
    gets a connection of its own."""
    engine = create_engine(pg_url_of(own_database), pool_size=2)
    backend = Backend(engine)
    try:
        with pytest.raises(exc.StoreUnavailable) as caught:
            async with backend.transaction() as conn:
                raw = (await conn.get_raw_connection()).driver_connection
                assert raw is not None
                pid = raw.get_server_pid()
                busy = asyncio.ensure_future(raw.fetchval("SELECT pg_sleep(0.3)"))
                await asyncio.sleep(0.05)
                await conn.execute(sa.text("SELECT 1"))
        with contextlib.suppress(asyncpg.InterfaceError, asyncpg.PostgresError):
            await busy
        cause = caught.value.__cause__
        assert isinstance(cause, sa.exc.DBAPIError), repr(cause)
        assert cause.connection_invalidated, repr(cause)
        assert raw is not None and raw.is_closed()
        async with backend.transaction() as conn:
            again = (await conn.get_raw_connection()).driver_connection
            assert again is not raw
            assert (await conn.execute(sa.text("SELECT pg_backend_pid()"))).scalar_one() != pid
    finally:
        await engine.dispose()


async def test_sqlalchemy_no_host_that_takes_writes_is_store_unavailable(
    own_database: str,
) -> None:
    engine = create_engine(f"{pg_url_of(own_database)}?{READ_WRITE}", pool_size=2)
    backend = Backend(engine)
    try:
        async with takes_no_writes(own_database):
            with pytest.raises(exc.StoreUnavailable):
                await backend.database_now()
        assert await backend.database_now() > 0  # back: the same engine reads again
    finally:
        await engine.dispose()


# -- through the gateway: a fenced write and a renewal ------------------------------------------


async def test_a_restart_that_leaves_no_server_taking_writes_is_503_for_every_operation(
    make_stack: Callable[..., Awaitable[Stack]], upstream: Upstream, own_database: str
) -> None:
    """The gateway's own connections (the hot path's asyncpg pool and SQLAlchemy's) are
    cut and can only reconnect to a server that takes no writes: asyncpg raises
    ``TargetServerAttributeNotMatched``, an ``InternalClientError``. The fenced write and
    the renewal are ``503 store-unavailable`` with ``Retry-After``, nothing reaches the
    upstream, and once the server takes writes again the same replica serves them."""
    stack = await make_stack(upstreams=[upstream_config(upstream)], use_clock=False)
    lease = await stack.lease("job-1")
    await ok(await stack.write("/pay/charges", lease, key="before"))

    async with takes_no_writes(own_database):
        write = await stack.write("/pay/charges", lease, key="during")
        await problem(write, 503, "store-unavailable")
        assert write.headers.get("Retry-After") == "1"
        renew = await stack.control.post(
            "/v1/leases/renew", json={"lease_token": lease["lease_token"]}
        )
        await problem(renew, 503, "store-unavailable")
        listed = await stack.control.get("/v1/jobs")
        await problem(listed, 503, "store-unavailable")
    assert len(upstream.received) == 1

    await ok(await stack.write("/pay/charges", lease, key="after"))
    renew = await stack.control.post("/v1/leases/renew", json={"lease_token": lease["lease_token"]})
    assert renew.status == 200, await renew.text()
    assert len(upstream.received) == 2


# -- a server that turned read-only, reached without target_session_attrs -----------------


async def test_a_server_turned_read_only_is_store_unavailable(own_database: str) -> None:
    """A primary demoted by a failover, reached by a URL without
    ``target_session_attrs=read-write``: the connection opens, and every write fails with
    SQLSTATE 25006 (read-only transaction). No write was made, and another server (or
    this one, promoted again) will take it: unavailable, not our SQL's fault."""
    engine = create_engine(pg_url_of(own_database), pool_size=2)
    try:
        async with takes_no_writes(own_database):
            conn = await asyncpg.connect(dsn(own_database))
            try:
                with pytest.raises(asyncpg.exceptions.ReadOnlySQLTransactionError) as raw:
                    await conn.execute("UPDATE jobs SET state = state WHERE false")
            finally:
                await conn.close()
            assert is_unavailable(raw.value)
            with pytest.raises(sa.exc.DBAPIError) as wrapped:
                async with engine.begin() as session:
                    await session.execute(sa.text("UPDATE jobs SET state = state WHERE false"))
            # As the backend reads SQLAlchemy's errors (its ``orig``); and the connection
            # is dropped, so the pool looks for one that takes writes.
            assert is_unavailable(wrapped.value.orig)
            assert wrapped.value.connection_invalidated
    finally:
        await engine.dispose()
