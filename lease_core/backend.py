"""The one writer: runs the catalogue's operations (``lease_core.catalogue``) on one
database, PostgreSQL or SQLite, through the driver-level executor (``lease_core.direct``),
with the authoritative clock, measured, its errors translated once."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from . import catalogue
from . import exceptions as exc
from .db import Clock, Dialect, direct_of
from .metrics import Metrics

Row = Mapping[str, Any]


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

    @property
    def sqlite(self) -> bool:
        return self.direct.sqlite

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
