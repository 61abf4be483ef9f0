"""What the ``fencegate`` subcommands share: the usage exit code, the database at the
newest schema, the event loop, and the plain-text table."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from gateway.config import Settings
from lease_core.db import create_engine
from lease_core.store import LeaseStore

EXIT_USAGE = 2


@asynccontextmanager
async def open_store(settings: Settings) -> AsyncIterator[LeaseStore]:
    """The database, at the newest schema (SQLite migrates itself; PostgreSQL must have
    been migrated with `fencegate migrate`)."""
    from gateway.service.server import prepare_database

    engine = create_engine(settings.database_url)
    try:
        store = LeaseStore(engine)
        await prepare_database(settings, store)
        yield store
    finally:
        await engine.dispose()


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where it is installed (a faster event loop), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def print_table(header: list[str], rows: list[list[str]]) -> None:
    if not rows:
        print("(none)")
        return
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print(
            "  ".join(
                str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)
            ).rstrip()
        )
