"""The one writer: runs the catalogue's operations (``lease_core.catalogue``) on one
database, PostgreSQL or SQLite, through the driver-level executor (``lease_core.direct``),
with the authoritative clock, measured, its errors translated once."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from . import catalogue
from . import exceptions as exc
from .db import Clock, Dialect, direct_of
from .metrics import Metrics

log = logging.getLogger("fencegate.database")

Row = Mapping[str, Any]

# Rows a purge removes per transaction (``Backend.run_in_batches``).
PURGE_BATCH = 1000


class Backend:
    """The operations of one database. A new backend is one dialect's SQL file in
    ``lease_core/sql`` and one ``Direct`` class."""

    def __init__(
        self, engine: AsyncEngine, *, clock: Clock | None = None, metrics: Metrics | None = None
    ) -> None:
        self.direct = direct_of(engine)
        self.dialect = Dialect(engine, clock)
        self.catalogue = catalogue.load(self.dialect.name)
        self.metrics = metrics or Metrics()
        self.server: str | None = None  # host:port of the last server connected to
        self.direct.on_connect = self._connected

    def _connected(self, server: str) -> None:
        self.metrics.db_connections.inc()
        if self.server is not None and server != self.server:
            self.metrics.db_primary_changes.inc()
            log.warning("the database's primary is now %s (was %s)", server, self.server)
        self.server = server

    @property
    def sqlite(self) -> bool:
        return self.direct.sqlite

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
            row = await self.run(name, limit=batch if self.sqlite else None, **params)
            assert row is not None
            changed = int(row["changed"])
            total += changed
            if not self.sqlite or changed < batch:
                return total, row

    async def count(self, name: str, **params: Any) -> int:
        """Operation ``name``, one that says how many rows it changed (``changed``)."""
        row = await self.run(name, **params)
        assert row is not None
        return int(row["changed"])

    async def run(self, name: str, **params: Any) -> Row | None:
        """Operation ``name`` with ``params`` (and ``now``, the injected clock's reading,
        or None where the database's clock decides): its answer row, or None."""
        params["now"] = self.dialect.injected_now()
        started = time.perf_counter()
        try:
            return await self.direct.execute(self.catalogue[name], params)
        except exc.StoreUnavailable:
            self.metrics.store_errors.inc()
            raise
        finally:
            self.metrics.store_seconds.observe(time.perf_counter() - started)
