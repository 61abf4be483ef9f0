"""The database handle: runs the catalogue's operations (``lease_core.catalogue``) on one
database, PostgreSQL or SQLite, through the driver-level executor (``lease_core.direct``),
with the authoritative clock, measured, its errors translated once; and the SQLAlchemy
read transactions of the listings, with the dialect's expressions they need.

The one writer, and the one place outside the dialect files (``lease_core.db``,
``lease_core.direct*``) that knows which database it is on: its callers (the lease
store, the gateway's records, audit and dashboard) use its methods and branch on no
dialect."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from . import catalogue
from . import exceptions as exc
from .db import Clock, Dialect, direct_of
from .direct import is_unavailable
from .metrics import Metrics, PhaseTimers

log = logging.getLogger("fencegate.database")

Row = Mapping[str, Any]

# Rows a purge removes per transaction (``Backend.run_in_batches``).
PURGE_BATCH = 1000


class Backend:
    """One database: its operations (``run``, ``run_in_batches``, ``count``,
    ``slice_end``), its read transactions (``transaction``) and its clock (``now``,
    ``injected_now``, ``database_now``). A new backend is one dialect's SQL file in
    ``lease_core/sql`` and one ``Direct`` class."""

    def __init__(
        self, engine: AsyncEngine, *, clock: Clock | None = None, metrics: Metrics | None = None
    ) -> None:
        # The SQLAlchemy engine, for what needs a connection of its own: the schema's
        # migrations and the replication check (the listings use ``transaction``).
        self.engine = engine
        self._direct = direct_of(engine)
        self._dialect = Dialect(engine, clock)
        self._sqlite = self._dialect.sqlite
        self._catalogue = catalogue.load(self._dialect.name)
        self.metrics = metrics or Metrics()
        self.server: str | None = None  # host:port of the last server connected to
        self._direct.on_connect = self._connected
        # Each operation's statements, timed by phase (``fencegate_db_seconds``).
        names: dict[object, str] = {}
        for operation in self._catalogue.values():
            for statement in (*operation.statements, operation.many):
                if statement is not None:
                    names[statement] = operation.name
        self._direct.timers = PhaseTimers(self.metrics.db_seconds, names)
        self._refused: str | None = None  # why every operation is refused (``refuse``)

    @property
    def refused(self) -> str | None:
        return self._refused

    def refuse(self, reason: str | None) -> None:
        """From now on every operation fails ``StoreUnavailable(reason)``; None serves
        again. For a process that must not write this database any more, such as one
        whose code a migration has left behind (the server's schema check)."""
        self._refused = reason

    def _connected(self, server: str) -> None:
        self.metrics.db_connections.inc()
        if self.server is not None and server != self.server:
            self.metrics.db_primary_changes.inc()
            log.warning("the database's primary is now %s (was %s)", server, self.server)
        self.server = server

    # -- operations ---------------------------------------------------------------

    async def run(self, name: str, **params: Any) -> Row | None:
        """Operation ``name`` with ``params`` (and ``now``, the injected clock's reading,
        or None where the database's clock decides; a caller that writes down later what
        happened earlier passes the reading it took then): its answer row, or None."""
        if self._refused is not None:
            self.metrics.store_errors.inc()
            raise exc.StoreUnavailable(self._refused)
        if "now" not in params:
            params["now"] = self._dialect.injected_now()
        started = time.perf_counter()
        try:
            return await self._direct.execute(self._catalogue[name], params)
        except exc.StoreUnavailable:
            self.metrics.store_errors.inc()
            raise
        finally:
            self.metrics.store_seconds.observe(time.perf_counter() - started)

    async def run_in_batches(
        self, name: str, *, batch: int = PURGE_BATCH, **params: Any
    ) -> tuple[int, Row]:
        """Operation ``name``, a purge that removes ``:limit`` rows at most of each kind
        it looks for (NULL: all) and says how many (``changed``); how many in all, and
        the last run's row.

        On SQLite it runs with ``batch`` as the limit, again until a run removes fewer:
        each run is its own short transaction, and writes go on between them instead of
        waiting behind one long delete under the file's one write lock. On PostgreSQL it
        runs once, without a limit: a delete there holds up no other writer, and every
        batch would read again the rows the batches before it deleted (dead until
        vacuumed), so a backlog would cost its square."""
        total = 0
        while True:
            row = await self.run(name, limit=batch if self._sqlite else None, **params)
            assert row is not None
            changed = int(row["changed"])
            total += changed
            if not self._sqlite or changed < batch:
                return total, row

    async def slice_end(self, name: str, *, batch: int, **params: Any) -> float:
        """Where the next slice of a sweep ends: on SQLite the ``slice_end`` that
        operation ``name`` answers for ``batch`` rows (each slice then its own short
        transaction, as in ``run_in_batches``), infinity when no slice is left to cut;
        on PostgreSQL, where a delete holds up no other writer, always infinity: one
        statement sweeps all."""
        if not self._sqlite:
            return math.inf
        found = await self.run(name, batch=batch, **params)
        assert found is not None
        return math.inf if found["slice_end"] is None else float(found["slice_end"])

    async def count(self, name: str, **params: Any) -> int:
        """Operation ``name``, one that says how many rows it changed (``changed``)."""
        row = await self.run(name, **params)
        assert row is not None
        return int(row["changed"])

    async def vacuum(self, table: str) -> None:
        """PostgreSQL: ``VACUUM (SKIP_LOCKED)`` of ``table``, a small table that a row
        inserted and deleted per write would otherwise grow until autovacuum comes (and
        forever where it is off): its dead rows and their index entries go, and the
        freed pages are reused. SQLite reuses a deleted row's space by itself: nothing.
        A user that does not own the table gets PostgreSQL's warning and no vacuum."""
        if self._sqlite:
            return
        began = time.perf_counter()
        async with self._measured(), self.engine.connect() as conn:
            auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
            await auto.execute(sa.text(f'VACUUM (SKIP_LOCKED) "{table}"'))
        # An upkeep beside the writes: timed with them (``fencegate_db_seconds``).
        self.metrics.db_seconds.labels("vacuum", "statement").observe(time.perf_counter() - began)

    # -- reads ----------------------------------------------------------------------

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """One SQLAlchemy transaction, for reading (the listings, the audit, the
        dashboard); connection failures become ``StoreUnavailable``."""
        async with self._measured(), self.engine.begin() as conn:
            yield conn

    @asynccontextmanager
    async def _measured(self) -> AsyncIterator[None]:
        """Work on an engine connection, timed; its connection failures become
        ``StoreUnavailable`` (and are counted), other database errors pass."""
        started = time.perf_counter()
        try:
            yield
        except _UNAVAILABLE as error:
            if isinstance(error, sa.exc.DBAPIError) and not _is_connection_error(error):
                raise
            self.metrics.store_errors.inc()
            raise exc.StoreUnavailable() from error
        finally:
            self.metrics.store_seconds.observe(time.perf_counter() - started)

    def floor(self, value: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
        """``floor(value)`` of a positive value as an SQL expression, on every build of
        the database (a time bucket's number)."""
        return self._dialect.floor(value)

    # -- the clock ------------------------------------------------------------------

    def now(self) -> sa.ColumnElement[float]:
        """The authoritative 'now' as an SQL expression: the injected clock's reading as
        a parameter, or the database server's clock on PostgreSQL."""
        return self._dialect.now()

    def injected_now(self) -> float | None:
        """The injected clock's reading, or None when the database's clock decides."""
        return self._dialect.injected_now()

    async def database_now(self) -> float:
        """The authoritative clock's reading: the injected one (SQLite, tests), else the
        database server's."""
        injected = self._dialect.injected_now()
        if injected is not None:
            return injected
        async with self.transaction() as conn:
            return float((await conn.execute(sa.select(self._dialect.now()))).scalar_one())


# Errors that mean "the database is not there right now", translated in one place.
_UNAVAILABLE = (sa.exc.DBAPIError, OSError, TimeoutError)


def _is_connection_error(error: sa.exc.DBAPIError) -> bool:
    """A DBAPI error that means the database is unreachable, not that our SQL is wrong."""
    if error.connection_invalidated or isinstance(
        error, sa.exc.OperationalError | sa.exc.InterfaceError
    ):
        return True
    return error.orig is not None and is_unavailable(error.orig)
