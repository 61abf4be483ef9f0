"""Engines, clocks and the dialect differences the statements need."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from .direct import IN_MEMORY, Direct, is_in_memory, is_unavailable
from .direct_postgres import PostgresDirect
from .direct_sqlite import SqliteDirect, configure_sqlite

Clock = Callable[[], float]
"""Seconds since the epoch. Injected in tests; None means the authoritative clock."""


def is_sqlite(url: str | sa.URL) -> bool:
    return sa.make_url(url).get_backend_name() == "sqlite"


def create_direct(engine: sa.Engine, *, pool_size: int) -> Direct:
    """The executor for ``engine``'s database, connecting as that engine does."""
    if engine.dialect.name == "sqlite":
        if is_in_memory(engine.url):
            raise ValueError(IN_MEMORY)
        return SqliteDirect(engine.url.database or "")
    _args, params = engine.dialect.create_connect_args(engine.url)
    return PostgresDirect(dict(params), pool_size=pool_size)


class Engine(AsyncEngine):
    """An async engine that also carries the driver-level executor of the hot path
    (``lease_core.direct``); ``dispose()`` closes both."""

    def __init__(self, sync_engine: sa.Engine, *, direct_pool_size: int = 10) -> None:
        super().__init__(sync_engine)
        self.direct: Direct = create_direct(sync_engine, pool_size=direct_pool_size)

    async def dispose(self, close: bool = True) -> None:
        await self.direct.close()
        await super().dispose(close)


def direct_of(engine: AsyncEngine) -> Direct:
    if not isinstance(engine, Engine):
        raise TypeError("make the engine with lease_core.db.create_engine")
    return engine.direct


def create_engine(url: str | sa.URL, *, pool_size: int = 10) -> Engine:
    """An engine tuned for the backend.

    SQLite: one SQLAlchemy connection, WAL, transactions begun DEFERRED: this engine
    only reads (every write is an operation of ``lease_core.backend``, on the driver's
    own connections, ``lease_core.direct_sqlite``), and a reader in WAL never holds the write
    lock, so it never makes an operation wait.
    PostgreSQL: a pool with pre-ping so a restarted server is recovered from, beside
    the hot path's own asyncpg pool (``lease_core.direct_postgres``).
    Both hide statement parameters from SQLAlchemy's logs and error messages: they
    carry request bodies, stored answers and tokens' hashes.
    """
    url = sa.make_url(url)
    if is_sqlite(url):
        if is_in_memory(url):
            raise ValueError(IN_MEMORY)
        engine = create_async_engine(
            url, pool_size=1, max_overflow=0, pool_timeout=60, hide_parameters=True
        )
        _sqlite_setup(engine)
        return Engine(engine.sync_engine)
    # The hot path's own pool gets ``pool_size`` connections; the rarer statements on
    # SQLAlchemy's pool half as many plus as many again under bursts: at most
    # 2 x pool_size in all.
    half = max(1, pool_size // 2)
    engine = create_async_engine(
        url,
        pool_size=half,
        max_overflow=half,
        pool_pre_ping=True,
        pool_timeout=30,
        hide_parameters=True,
    )
    _discard_broken_connections(engine)
    return Engine(engine.sync_engine, direct_pool_size=pool_size)


def _discard_broken_connections(engine: AsyncEngine) -> None:
    """A PostgreSQL connection whose error says the database cannot serve now
    (``is_unavailable``: the server gone, or asyncpg's "another operation is in
    progress") is taken for disconnected: SQLAlchemy invalidates it, so it is closed and
    never handed out again, and the pool's pre-ping replaces one that fails so. asyncpg's
    dialect alone counts only a connection already closed. One taken so by this rule
    alone costs only itself: the rest of the pool is pinged at checkout anyway."""

    @event.listens_for(engine.sync_engine, "handle_error")
    def _handle_error(context: sa.engine.ExceptionContext) -> None:
        if not context.is_disconnect and is_unavailable(context.original_exception):
            context.is_disconnect = True
            context.invalidate_pool_on_disconnect = False


def _sqlite_setup(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        configure_sqlite(cursor)
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN")  # one snapshot for the reads of one transaction


class Dialect:
    """What differs between SQLite and PostgreSQL in our statements."""

    def __init__(self, engine: AsyncEngine, clock: Clock | None = None) -> None:
        self.name = engine.dialect.name
        self.sqlite = self.name == "sqlite"
        if clock is None and self.sqlite:
            clock = time.time
        self._clock = clock

    def now(self) -> sa.ColumnElement[float]:
        """The authoritative 'now' as an SQL expression: the injected clock's reading as
        a parameter, or the database server's clock on PostgreSQL."""
        if self._clock is not None:
            return sa.literal(self._clock(), sa.Float)
        return sa.cast(sa.extract("epoch", sa.func.now()), sa.Float)

    def injected_now(self) -> float | None:
        """The injected clock's reading, or None when the database's clock decides."""
        return self._clock() if self._clock is not None else None

    def floor(self, value: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
        """``floor(value)`` of a positive ``value`` (an epoch time, a bucket number), on
        every build of the database."""
        if self.sqlite:
            # Not every SQLite build has floor(); for a positive value truncation toward
            # zero is the floor.
            return sa.cast(value, sa.Integer)
        return sa.func.floor(value)
