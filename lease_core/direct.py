"""The catalogue's operations (``lease_core.catalogue``), sent straight to the database
driver.

A fenced write (admit, settle), a claim and a renewal each run a fixed statement. Through
SQLAlchemy's per-call machinery (statement building, compiled-cache lookup, execution
context, pool pre-ping, BEGIN/COMMIT around one statement) they took most of the
gateway's CPU; sent straight to the driver, a small part of it
(docs/performance-history.md, "How the hot path got here").
So every write goes direct, and only reads (listings, the dashboard) and the migrations
stay on SQLAlchemy:

- PostgreSQL: one asyncpg pool. The hot operations are ONE statement each
  (data-modifying CTEs where they have several steps), prepared once per connection and
  sent without BEGIN/COMMIT (a single statement is its own transaction), and no reset
  query when the connection goes back to the pool: one round trip. The few rare ones of
  several statements (acquire, purge) run in one transaction (``Chain``). Concurrent
  admissions and settles share one statement over arrays (``Batched``, ``Coalescer``):
  one round trip and one commit for all of them, each judged as if alone.
- SQLite: each operation runs right on the event loop's thread: with WAL and
  ``synchronous = NORMAL`` a whole admission takes tens of microseconds, less than one
  hop to a worker thread and back. The operations of one turn of the event loop share
  one ``BEGIN IMMEDIATE ... COMMIT``, a savepoint each but the first. That connection
  never waits for the lock (``busy_timeout = 0``): when another process holds it, the
  operation goes to a database thread whose connection waits for it, while the event
  loop serves other requests; operations queue behind it there until it is done. (The
  SQLAlchemy engine only reads, in DEFERRED transactions, so it never holds the lock.)
  That thread also runs the WAL checkpoints, which copy the log into the database file
  and sync it.

Both turn "the database is not there right now" into ``StoreUnavailable``.

This module holds what both share: ``Direct``, the executor's interface, ``Chain``,
``is_unavailable`` and the in-memory check. The executors themselves are in
``lease_core.direct_postgres`` and ``lease_core.direct_sqlite``; ``lease_core.db``
creates the one an engine needs. The statements are ``lease_core.statement``'s,
batches ``lease_core.coalesce``'s.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from . import exceptions as exc
from .statement import Batched, Row, Statement

if TYPE_CHECKING:
    from .catalogue import Operation
    from .metrics import PhaseTimers


class Direct:
    """The driver-level executor of one engine. Created with the engine, closed by its
    ``dispose()``; connects on first use."""

    sqlite: bool
    # Told "host:port" of the server each new connection reached (PostgreSQL): the
    # backend counts reconnects and notices a new primary after a failover.
    on_connect: Callable[[str], None] | None = None
    # Where each statement's phases are timed (pool, statement, commit: the backend's
    # ``fencegate_db_seconds``); None: not timed.
    timers: PhaseTimers | None = None

    async def fetchrow(self, statement: Statement, params: Mapping[str, Any]) -> Row | None:
        """Run one statement as its own transaction; its first row, if any."""
        raise NotImplementedError

    def fetchrow_batched(
        self, statement: Batched, params: Mapping[str, Any]
    ) -> Awaitable[Row | None]:
        """``fetchrow`` of ``statement.single``, where concurrent callers may share one
        round trip and one commit (PostgreSQL)."""
        if statement.single is None:
            raise TypeError("this statement has no form for one caller")
        return self.fetchrow(statement.single, params)

    async def fetchall(self, statement: Statement, params: Mapping[str, Any]) -> list[Row]:
        """Run one read: every row it found."""
        raise NotImplementedError

    def execute(self, operation: Operation, params: Mapping[str, Any]) -> Awaitable[Row | None]:
        """Run a catalogue operation (``lease_core.catalogue``) as one transaction: its
        answer, or None when none of its statements returned a row (a listing's answer:
        ``{"rows": [...]}``). Returns what to await (no coroutine of its own: this sits
        on every hot call's path)."""
        if operation.rows:
            return self._listing(operation.statements[0], params)
        batched = operation.batched
        if batched is not None and not self.sqlite:
            return self.fetchrow_batched(batched, params)
        statements = operation.statements
        if not statements:
            raise TypeError(f"{operation.name}: no form for one caller")
        if len(statements) == 1:
            return self.fetchrow(statements[0], params)
        return self._chain(statements, params)

    async def _listing(self, statement: Statement, params: Mapping[str, Any]) -> Row:
        return {"rows": await self.fetchall(statement, params)}

    async def _chain(
        self, statements: Sequence[Statement], params: Mapping[str, Any]
    ) -> Row | None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


IN_MEMORY = "SQLite in memory is not supported: give the database a file"


def is_in_memory(url: str | sa.URL) -> bool:
    """An SQLite URL whose database lives in one connection's memory (each of our
    connections would see a different, empty database)."""
    url = sa.make_url(url)
    database = url.database or ""
    return (
        not database
        or database == ":memory:"
        or database.startswith("file::memory")
        or url.query.get("mode") == "memory"
    )


class Chain:
    """The statements of one operation, run in order: each one's columns (NULL when it
    returned no row) become parameters of the statements after it, though never in place
    of one the caller gave; the answer is all of them, or None when no statement returned
    a row."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.given = params
        self.params: dict[str, Any] = dict(params)
        self._columns: dict[str, Any] = {}
        self._answered = False

    def add(self, columns: Sequence[str], row: Any) -> None:
        if not columns:
            return
        values = dict.fromkeys(columns) if row is None else dict(zip(columns, row, strict=True))
        self._columns.update(values)
        self._answered = self._answered or row is not None
        self.params = {**self._columns, **self.given}

    def answer(self) -> Row | None:
        return self._columns if self._answered else None


# The SQLSTATE classes and codes of a server that answered "I cannot serve now"; none of
# them says that our SQL or a value is wrong:
# - 08: connection exceptions;
# - 53: insufficient resources (a full disk, out of memory, too many clients);
# - 55: object not in prerequisite state: 55000 "database ... is not currently accepting
#   connections" (ALLOW_CONNECTIONS false, as before maintenance), 55006 object in use,
#   55P03 lock not available;
# - 57P0x: operator intervention that ends sessions (57P01 admin shutdown, 57P02 crash
#   shutdown, 57P03 cannot connect now, 57P04 database dropped, 57P05 idle session
#   timeout); not 57014, a statement cancelled;
# - 25006, read-only transaction: a server that a failover demoted, reached by a URL
#   without target_session_attrs=read-write, takes no write until it is a primary again
#   or the pool finds the one that is.
_UNAVAILABLE_SQLSTATES = ("08", "53", "55", "57P0", "25006")
_UNAVAILABLE_WORDS = (
    "connect",
    "closed",
    "terminat",
    "shutdown",
    "shutting down",
    "starting up",
    "another operation is in progress",
    "database is locked",
    "recovery mode",
)


def is_unavailable(error: BaseException) -> bool:
    """A driver's error that means the database is unreachable, not that our SQL or a
    value is wrong (asyncpg, sqlite3, or the OS underneath them)."""
    if isinstance(error, OSError | ConnectionError | TimeoutError | exc.StoreUnavailable):
        return True
    if isinstance(error, sqlite3.Error):
        text = str(error).lower()
        return isinstance(error, sqlite3.OperationalError) and (
            "locked" in text or "unable to open" in text or "disk i/o" in text
        )
    if isinstance(error, ValueError):  # a value the driver could not encode (DataError)
        return False
    sqlstate = str(getattr(error, "sqlstate", None) or getattr(error, "pgcode", None) or "")
    if sqlstate:  # the server answered: its code says what happened, never its text
        return sqlstate.startswith(_UNAVAILABLE_SQLSTATES)
    # The error itself, or the driver's under SQLAlchemy's wrapper (its ``orig``).
    for candidate in (error, error.__cause__):
        if isinstance(candidate, OSError | ConnectionError | TimeoutError):
            return True
        if _is_asyncpg_connection_error(candidate):
            return True
        name = type(candidate).__name__
        if "Connection" in name or "CannotConnectNow" in name or "AdminShutdown" in name:
            return True
    # Another client-side error of a driver ("connection is closed", "database is
    # locked"): these carry no values of ours, so their words are safe to read.
    text = str(error).lower()
    return any(word in text for word in _UNAVAILABLE_WORDS)


def _is_asyncpg_connection_error(error: BaseException | None) -> bool:
    """One of asyncpg's own errors (the client's, with no SQLSTATE) that says this
    connection cannot serve now, whatever its words: its ``InterfaceError`` family
    ("connection is closed", "another operation is in progress", "pool is closing") and
    its ``InternalClientError`` family (a protocol state it did not expect;
    ``TargetServerAttributeNotMatched``, no host that takes writes, as while a restart or
    a failover has left only standbys). Not those that say a value or the SQL is wrong:
    ``DataError`` and ``ClientConfigurationError`` (ValueErrors), a feature unsupported."""
    asyncpg = sys.modules.get("asyncpg")
    if asyncpg is None or error is None:  # asyncpg not loaded: not its error
        return False
    errors = asyncpg.exceptions
    if isinstance(
        error,
        ValueError | errors.UnsupportedClientFeatureError | errors.UnsupportedServerFeatureError,
    ):
        return False
    return isinstance(error, errors.InterfaceError | errors.InternalClientError)
