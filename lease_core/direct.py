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
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import sqlite3
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import sqlalchemy as sa

from . import exceptions as exc

if TYPE_CHECKING:
    from .catalogue import Operation

T = TypeVar("T")
Row = Mapping[str, Any]

_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")
_SERVER_NOW = "CAST(extract(epoch FROM now()) AS double precision)"


def parameter_names(text: str) -> list[str]:
    """The ``:name`` parameters of a statement's text, in order (``::`` casts are not)."""
    return _PARAM.findall(text)


class Statement:
    """One SQL statement written once, with ``:name`` parameters and ``{now}`` where
    the authoritative time goes: a ``:now`` parameter (SQLite, or an injected clock)
    or PostgreSQL's own clock."""

    def __init__(self, text: str) -> None:
        self.text = text

    @cached_property
    def reads_only(self) -> bool:
        """A plain ``SELECT``: it changes nothing (SQLite runs it without joining a
        group transaction's commit)."""
        return _first_word(self.text) == "SELECT"

    @cached_property
    def sqlite(self) -> str:
        return self.text.replace("{now}", ":now")

    def postgres(self, injected_now: bool) -> tuple[str, tuple[str, ...]]:
        return self._postgres[injected_now]

    @cached_property
    def _postgres(self) -> dict[bool, tuple[str, tuple[str, ...]]]:
        variants = {}
        for injected in (False, True):
            text = self.text.replace(
                "{now}", "CAST(:now AS double precision)" if injected else _SERVER_NOW
            )
            names: list[str] = []

            def number(match: re.Match[str], names: list[str] = names) -> str:
                name = match.group(1)
                if name not in names:
                    names.append(name)
                return f"${names.index(name) + 1}"

            variants[injected] = (_PARAM.sub(number, text), tuple(names))
        return variants


def _first_word(sql: str) -> str:
    for line in sql.splitlines():
        words = line.split("--", 1)[0].split()
        if words:
            return words[0].upper()
    return ""


# Batched statements: at most this many of one kind in flight at once; callers arriving
# meanwhile wait and go together in the next one (up to MAX_BATCH).
BATCH_LANES = 2
MAX_BATCH = 64


class Batched:
    """A statement that concurrent callers share on PostgreSQL: ``many`` runs over
    arrays (``:name`` is then the list of every caller's ``name``, in order) and
    returns a column ``n``, the 1-based position of the caller a row answers.
    ``single`` is the same for one caller's plain parameters (SQLite runs only that);
    without it a lone caller is sent ``many`` over arrays of one. ``lanes``: how many
    of its batches may be in flight at once (1 for a statement whose batches would
    contend for the same rows)."""

    def __init__(
        self, many: Statement, single: Statement | None = None, *, lanes: int = BATCH_LANES
    ) -> None:
        self.many = many
        self.single = single
        self.lanes = lanes


class Direct:
    """The driver-level executor of one engine. Created with the engine, closed by its
    ``dispose()``; connects on first use."""

    sqlite: bool
    # Told "host:port" of the server each new connection reached (PostgreSQL): the
    # backend counts reconnects and notices a new primary after a failover.
    on_connect: Callable[[str], None] | None = None

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

    async def run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """SQLite only: ``work`` in a write transaction; its result once committed; its
        writes rolled back when it raises."""
        raise NotImplementedError

    def execute(self, operation: Operation, params: Mapping[str, Any]) -> Awaitable[Row | None]:
        """Run a catalogue operation (``lease_core.catalogue``) as one transaction: its
        answer, or None when none of its statements returned a row. Returns what to
        await (no coroutine of its own: this sits on every hot call's path)."""
        batched = operation.batched
        if batched is not None and not self.sqlite:
            return self.fetchrow_batched(batched, params)
        statements = operation.statements
        if not statements:
            raise TypeError(f"{operation.name}: no form for one caller")
        if len(statements) == 1:
            return self.fetchrow(statements[0], params)
        return self._chain(statements, params)

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


def create_direct(engine: sa.Engine, *, pool_size: int) -> Direct:
    """The executor for ``engine``'s database, connecting as that engine does."""
    if engine.dialect.name == "sqlite":
        if is_in_memory(engine.url):
            raise ValueError(IN_MEMORY)
        return SqliteDirect(engine.url.database or "")
    _args, params = engine.dialect.create_connect_args(engine.url)
    return PostgresDirect(dict(params), pool_size=pool_size)


# -- PostgreSQL ---------------------------------------------------------------------------


class PostgresDirect(Direct):
    sqlite = False

    def __init__(self, connect_args: dict[str, Any], *, pool_size: int) -> None:
        # SQLAlchemy's own spelling of the statement cache; asyncpg's is different.
        cache = connect_args.pop("prepared_statement_cache_size", None)
        connect_args.pop("prepared_statement_name_func", None)
        if cache is not None:
            connect_args["statement_cache_size"] = int(cache)
        self._connect_args = connect_args
        self._pool_size = pool_size
        self._pool: Any = None
        self._opening: asyncio.Lock | None = None
        self._coalescers: dict[Batched, Coalescer[Mapping[str, Any], Row | None]] = {}
        self._columns: dict[str, tuple[str, ...]] = {}  # of the statements of a Chain

    async def _get_pool(self) -> Any:
        if self._pool is not None:
            return self._pool
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._pool is None:
                import asyncpg  # type: ignore[import-untyped]

                # No reset query on release (asyncpg's default costs a round trip per
                # use): these statements never change a session's state.
                self._pool = await asyncpg.create_pool(
                    min_size=0,
                    max_size=self._pool_size,
                    reset=_no_reset,
                    init=self._connected,
                    **self._connect_args,
                )
        return self._pool

    async def _connected(self, conn: Any) -> None:
        """A new connection of the pool (the first ones, or one replacing a connection
        that broke: a restart or a failover): which server it reached. With several
        hosts and ``target_session_attrs=read-write``, asyncpg tried them in order and
        kept the one that takes writes."""
        if self.on_connect is not None:
            row = await conn.fetchrow(_SERVER_OF_CONNECTION)
            self.on_connect(f"{row[0]}:{row[1]}")

    async def fetchrow(self, statement: Statement, params: Mapping[str, Any]) -> Row | None:
        row: Row | None = await self._send("fetchrow", statement, params)
        return row

    def fetchrow_batched(
        self, statement: Batched, params: Mapping[str, Any]
    ) -> Awaitable[Row | None]:
        coalescer = self._coalescers.get(statement)
        if coalescer is None:
            coalescer = self._coalescers[statement] = Coalescer(
                partial(self._fetch_many, statement), lanes=statement.lanes, max_batch=MAX_BATCH
            )
        return coalescer.submit(params)

    async def _fetch_many(
        self, statement: Batched, calls: list[Mapping[str, Any]]
    ) -> list[Row | BaseException | None]:
        """One statement for all ``calls``; when it fails for another reason than an
        unreachable database, each call again on its own (one bad call must not fail
        the others, and a deadlock between two batches is retried this way)."""
        if len(calls) == 1:
            return [await self._answer(self._one(statement, calls[0]))]
        answers: list[Row | BaseException | None] = [None] * len(calls)
        # One statement per clock reading: an injected clock (tests) is each caller's
        # own; the server's clock (None) is shared by all.
        by_clock: dict[Any, list[int]] = {}
        for i, call in enumerate(calls):
            by_clock.setdefault(call.get("now"), []).append(i)
        for positions in by_clock.values():
            group = [calls[i] for i in positions]
            try:
                rows = await self._fetch_all(statement.many, _arrays(group))
            except exc.StoreUnavailable:
                raise
            except Exception:
                for i in positions:
                    answers[i] = await self._answer(self._one(statement, calls[i]))
                continue
            for row in rows:
                answers[positions[row["n"] - 1]] = row
        return answers

    async def _one(self, statement: Batched, params: Mapping[str, Any]) -> Row | None:
        if statement.single is not None:
            return await self.fetchrow(statement.single, params)
        rows = await self._fetch_all(statement.many, _arrays([params]))
        return rows[0] if rows else None

    @staticmethod
    async def _answer(call: Awaitable[Row | None]) -> Row | BaseException | None:
        try:
            return await call
        except Exception as error:
            return error

    async def _fetch_all(self, statement: Statement, params: Mapping[str, Any]) -> list[Row]:
        rows: list[Row] = await self._send("fetch", statement, params)
        return rows

    async def _send(self, method: str, statement: Statement, params: Mapping[str, Any]) -> Any:
        """``statement`` through the connection's ``method`` (``fetch``, ``fetchrow``)."""
        text, names = statement.postgres(params.get("now") is not None)
        args = [params[name] for name in names]
        try:
            pool = await self._get_pool()
            async with pool.acquire() as conn:
                return await getattr(conn, method)(text, *args)
        except Exception as error:
            if is_unavailable(error):
                raise exc.StoreUnavailable() from error
            raise

    async def _chain(
        self, statements: Sequence[Statement], params: Mapping[str, Any]
    ) -> Row | None:
        injected = params.get("now") is not None
        try:
            pool = await self._get_pool()
            async with pool.acquire() as conn, conn.transaction():
                chain = Chain(params)
                for statement in statements:
                    text, names = statement.postgres(injected)
                    # ``fetch`` uses the connection's cache of prepared statements; the
                    # columns of one that returned no row are read once, when first needed.
                    rows = await conn.fetch(text, *(chain.params[name] for name in names))
                    columns = self._columns.get(text)
                    if columns is None:
                        if rows:
                            columns = tuple(rows[0].keys())
                        else:
                            prepared = await conn.prepare(text)
                            columns = tuple(a.name for a in prepared.get_attributes())
                        self._columns[text] = columns
                    chain.add(columns, rows[0] if rows else None)
                return chain.answer()
        except Exception as error:
            if is_unavailable(error):
                raise exc.StoreUnavailable() from error
            raise

    async def run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        raise TypeError("run() is for SQLite; on PostgreSQL an operation is one statement")

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()


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


def _arrays(calls: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The parameters of a ``Batched.many``: one list per name; the clock reading the
    calls share."""
    arrays: dict[str, Any] = {name: [call[name] for call in calls] for name in calls[0]}
    arrays["now"] = calls[0].get("now")
    return arrays


Item = TypeVar("Item")
Answer = TypeVar("Answer")


class Coalescer(Generic[Item, Answer]):
    """Concurrent calls coalesced into batches: while ``lanes`` batches are running,
    new calls queue and go in the next batch. A lone caller is sent at once, so
    batching adds no wait when there is no load. ``run_batch`` returns one answer
    per call (an exception instance answers that call with that exception).

    A lane that has answered a batch lets the event loop run once before it takes the
    next: the callers it just answered go on first (an HTTP handler writes its answer
    and its client can send again) instead of waiting behind the next batch's send. On
    PostgreSQL that made renewals and claims through the API faster
    (docs/performance-history.md, "Renewals on PostgreSQL, met")."""

    def __init__(
        self,
        run_batch: Callable[[list[Item]], Awaitable[list[Answer | BaseException]]],
        *,
        lanes: int,
        max_batch: int,
    ) -> None:
        self._run_batch = run_batch
        self._lanes = lanes
        self._max_batch = max_batch
        self._queued: list[tuple[Item, asyncio.Future[Answer]]] = []
        self._running = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, item: Item) -> asyncio.Future[Answer]:
        """Queue ``item``; the future its answer arrives on (cancelling it drops the
        answer, not the batch)."""
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._queued.append((item, future))
        if self._running < self._lanes:
            self._running += 1
            task = asyncio.ensure_future(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return future

    async def _drain(self) -> None:
        try:
            while self._queued:
                batch = self._queued[: self._max_batch]
                del self._queued[: self._max_batch]
                try:
                    answers = await self._run_batch([item for item, _ in batch])
                except BaseException as error:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    if not isinstance(error, Exception):
                        raise
                else:
                    for (_, future), answer in zip(batch, answers, strict=True):
                        if future.done():
                            continue
                        if isinstance(answer, BaseException):
                            future.set_exception(answer)
                        else:
                            future.set_result(answer)
                await asyncio.sleep(0)  # the answered callers run before the next send
        finally:
            self._running -= 1


_SERVER_OF_CONNECTION = (
    "SELECT coalesce(host(inet_server_addr()), 'local socket'), inet_server_port()"
)


async def _no_reset(_conn: Any) -> None:
    return None


# SQLSTATE classes and codes that mean "the server is not there right now": 08 connection
# exceptions, 57P01-57P03 admin/crash shutdown and "cannot connect now", 53 resources.
_UNAVAILABLE_SQLSTATES = ("08", "57P01", "57P02", "57P03", "53")
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
    for candidate in (error, error.__cause__):
        if isinstance(candidate, OSError | ConnectionError | TimeoutError):
            return True
        name = type(candidate).__name__
        if "Connection" in name or "CannotConnectNow" in name or "AdminShutdown" in name:
            return True
    # A client-side error of the driver ("connection is closed", "another operation is
    # in progress"): these carry no values of ours, so their words are safe to read.
    text = str(error).lower()
    return any(word in text for word in _UNAVAILABLE_WORDS)


# -- SQLite -------------------------------------------------------------------------------


# Inline operations between two checkpoints. SQLite's own default is every 1,000 pages of
# log; an admission writes a handful of pages.
CHECKPOINT_EVERY = 200
# The log's bound. A passive checkpoint copies the log without holding up a writer, but
# the log starts again from its beginning only once every frame is copied before the
# next write begins: never while the event loop writes without a pause (the benchmark's
# soak grew it past a gigabyte). Past this size the database thread restarts it, and
# every connection cuts the file back to it (``journal_size_limit``). The event loop
# reads the file's size itself at every checkpoint it asks for, so the bound is this
# plus ``CHECKPOINT_EVERY`` operations, however far behind the thread is (a slow disk).
WAL_LIMIT_BYTES = 64 * 1024 * 1024
# How long that restart waits for a reader or writer to finish with the log before it
# gives up until the next checkpoint; writers wait for it meanwhile.
WAL_RESTART_WAIT_MS = 200
_CHECKPOINT = "checkpoint"
# The database thread's wait for the write lock (another process holds it).
BUSY_TIMEOUT_MS = 10_000
_Job = tuple[Callable[[sqlite3.Connection], Any], asyncio.Future[Any], asyncio.AbstractEventLoop]


class SqliteDirect(Direct):
    sqlite = True

    def __init__(self, path: str) -> None:
        self._path = path
        self._log_path = os.path.abspath(path) + "-wal"
        self._inline: sqlite3.Connection | None = None
        self._jobs: queue.SimpleQueue[_Job | str | None] = queue.SimpleQueue()
        self._written = 0  # inline operations since the last checkpoint was asked for
        self._checkpoint_queued = False  # a passive checkpoint waits for the thread
        self._restart_missed = 0  # the log file's size when a restart last gave up
        self._group: _Group | None = None  # the open group transaction
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._stopped_loop: asyncio.AbstractEventLoop | None = None
        self.handed_off = 0  # operations sent to the thread: the lock was taken
        self._on_thread_now = 0  # of those, not answered by the thread yet
        self._behind: list[asyncio.Future[None]] = []  # operations waiting for them

    async def fetchrow(self, statement: Statement, params: Mapping[str, Any]) -> Row | None:
        text = statement.sqlite

        def one(conn: sqlite3.Connection) -> Row | None:
            row: Row | None = conn.execute(text, params).fetchone()
            return row

        if statement.reads_only:
            # A read runs and answers at once: it waits for no COMMIT, since it wrote
            # nothing. Inside this turn's open group transaction it also sees that
            # group's writes, which can only make a gate stricter (a newer fence, a
            # write in flight); should the group then fail to commit, that was a refusal
            # too many, never a write let through.
            try:
                return one(self._connection())
            except sqlite3.Error as error:
                if not (isinstance(error, sqlite3.OperationalError) and _is_busy(error)):
                    if is_unavailable(error):
                        raise exc.StoreUnavailable() from error
                    raise
            self.handed_off += 1  # busy (rare for a reader of a WAL file): wait there
            return await self._on_thread(one)
        # One statement needs no savepoint: SQLite undoes a failed statement itself.
        return await self._run(one, savepoint=False)

    async def _chain(
        self, statements: Sequence[Statement], params: Mapping[str, Any]
    ) -> Row | None:
        return await self.run(partial(_chain_sqlite, statements, params))

    async def run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """``work`` runs at once, on this thread, under its own savepoint of the group
        transaction: every operation of this turn of the event loop shares one
        ``BEGIN IMMEDIATE ... COMMIT``. The caller gets its answer once that COMMIT is
        done; a ``work`` that raises is rolled back alone, and raises at once."""
        return await self._run(work, savepoint=True)

    def _connection(self) -> sqlite3.Connection:
        """The event loop's own connection, opened on first use."""
        conn = self._inline
        if conn is None:
            conn = self._inline = self._open(busy_timeout_ms=0, check_same_thread=False)
            # Checkpoints copy the log into the database file (and sync it): never on
            # the event loop; the database thread runs them (``_checkpoint_soon``).
            conn.execute("PRAGMA wal_autocheckpoint = 0")
        return conn

    async def _run(self, work: Callable[[sqlite3.Connection], T], *, savepoint: bool) -> T:
        while self._on_thread_now:
            # Behind an operation that waits on the thread for the lock: wait until the
            # thread has answered it, or the loop's group transactions would keep taking
            # the lock before it; then inline. (Sent to the thread behind it, writers
            # that never pause kept finding one another there, and stayed.)
            behind: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._behind.append(behind)
            await behind
        conn = self._connection()
        group = self._group
        if group is None:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as error:
                if not _is_busy(error):
                    raise exc.StoreUnavailable() from error
                self.handed_off += 1
                return await self._on_thread(work)
            group = self._group = _Group()
            asyncio.get_running_loop().call_soon(self._commit, group)
        # An operation that has the group to itself so far needs no savepoint: when it
        # fails, the whole transaction is rolled back, and nothing else was in it.
        alone = not group.waiting
        undo_alone = savepoint and alone
        savepoint = savepoint and not alone
        if savepoint:
            conn.execute("SAVEPOINT op")
        try:
            result = work(conn)
        except BaseException as error:
            unavailable = isinstance(error, sqlite3.Error) and is_unavailable(error)
            if not conn.in_transaction:
                # The error took the whole transaction with it (an I/O error, a full
                # disk): the group's earlier operations are undone too.
                self._end(group, exc.StoreUnavailable() if unavailable else error)
            elif savepoint:
                conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
            elif undo_alone:
                conn.execute("ROLLBACK")
                self._end(group, None)  # nobody else waits for it
            if unavailable:
                raise exc.StoreUnavailable() from error
            raise
        if savepoint:
            conn.execute("RELEASE op")
        committed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        group.waiting.append(committed)
        await committed
        return result

    def _commit(self, group: _Group) -> None:
        """End the group transaction (scheduled by the first operation in it)."""
        if group is not self._group:
            return  # ended already (failed, or closed)
        conn = self._inline
        failure: BaseException | None = None
        if conn is None:
            failure = exc.StoreUnavailable()
        else:
            try:
                conn.execute("COMMIT")
            except sqlite3.Error as error:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                failure = exc.StoreUnavailable() if is_unavailable(error) else error
        self._end(group, failure)

    def _end(self, group: _Group, failure: BaseException | None) -> None:
        """Answer the group's callers: committed, or ``failure``."""
        self._group = None
        for future in group.waiting:
            if future.done():
                continue
            if failure is None:
                future.set_result(None)
            else:
                future.set_exception(failure)
        if failure is None:
            self._written += len(group.waiting)
            if self._written >= CHECKPOINT_EVERY:
                self._checkpoint_soon()

    def _checkpoint_soon(self) -> None:
        self._written = 0
        self._start_thread()
        # The file grows past the limit only while the log does: the first commit after
        # a restart cuts it back (``journal_size_limit``).
        size = _file_size(self._log_path)
        if size <= WAL_LIMIT_BYTES:
            self._restart_missed = 0  # restarted: by us, in a pause, or by another process
        # A restart that gave up (a long read holds the log) is tried again only once the
        # log has grown by the limit once more: each try holds up the writers.
        elif size >= self._restart_missed + WAL_LIMIT_BYTES:
            # The restart takes the write lock: the loop's operations wait behind it, as
            # behind any operation on the thread, instead of racing it for the lock. It
            # goes even while a passive checkpoint is still on its way (the thread runs
            # both in turn): waiting for that one to answer first let the log grow by what
            # was written meanwhile, several times the limit on a busy machine.
            loop = asyncio.get_running_loop()
            restarted: asyncio.Future[bool] = loop.create_future()
            restarted.add_done_callback(partial(self._restart_done, size))
            self._on_thread_now += 1
            self._jobs.put((_restart_log, restarted, loop))
            return
        if not self._checkpoint_queued:
            self._checkpoint_queued = True
            self._jobs.put(_CHECKPOINT)

    def _restart_done(self, size: int, restarted: asyncio.Future[bool]) -> None:
        if not restarted.cancelled() and not restarted.result():
            self._restart_missed = size

    def _checkpoint(self, conn: sqlite3.Connection | None, *, restart: bool) -> bool:
        """On the thread, outside any transaction: whether the log was restarted."""
        if not restart:
            self._checkpoint_queued = False
        if conn is None:
            return False
        with contextlib.suppress(sqlite3.Error):
            return _checkpoint(conn, restart=restart)
        return False

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name="fencegate-sqlite", daemon=True
            )
            self._thread.start()

    async def _on_thread(self, work: Callable[[sqlite3.Connection], T]) -> T:
        loop = asyncio.get_running_loop()
        self._start_thread()
        future: asyncio.Future[T] = loop.create_future()
        self._on_thread_now += 1  # counted down when the thread answers (``_deliver``)
        self._jobs.put((work, future, loop))
        return await future

    def _deliver(self, results: Sequence[tuple[asyncio.Future[Any], bool, Any]]) -> None:
        """The thread's answers, on the event loop."""
        self._on_thread_now -= len(results)
        if not self._on_thread_now:
            behind, self._behind = self._behind, []
            for waiter in behind:
                if not waiter.done():
                    waiter.set_result(None)
        for future, ok, value in results:
            if future.cancelled():
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    async def close(self) -> None:
        if self._group is not None:
            self._commit(self._group)
        inline, self._inline = self._inline, None
        if inline is not None:
            inline.close()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._stopped, self._stopped_loop = done, loop
        self._jobs.put(None)
        await done
        thread.join()

    def _open(
        self, *, busy_timeout_ms: int = BUSY_TIMEOUT_MS, check_same_thread: bool = True
    ) -> sqlite3.Connection:
        path = self._path
        if is_in_memory(sa.URL.create("sqlite", database=path)):
            raise ValueError(IN_MEMORY)
        try:
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=check_same_thread)
            conn.row_factory = sqlite3.Row
            configure_sqlite(conn, busy_timeout_ms=busy_timeout_ms)
            conn.execute("PRAGMA cache_size = -65536")  # up to 64 MiB of pages, on demand
        except sqlite3.Error as error:
            raise exc.StoreUnavailable() from error
        return conn

    def _serve(self) -> None:
        """The database thread: take what is queued, run each in its own transaction,
        answer the batch with one wake-up per event loop."""
        conn: sqlite3.Connection | None = None
        opening_error: BaseException | None = None
        try:
            conn = self._open()
        except exc.StoreUnavailable as error:
            opening_error = error
        stop = False
        while not stop:
            batch = [self._jobs.get()]
            while True:
                try:
                    batch.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            answers: dict[asyncio.AbstractEventLoop, list[tuple[Any, bool, Any]]] = {}
            for job in batch:
                if job is None:
                    stop = True
                    continue
                if job == _CHECKPOINT:
                    self._checkpoint(conn, restart=False)
                    continue
                assert not isinstance(job, str)
                work, future, loop = job
                if work is _restart_log:  # answered, so that the loop's writers go on
                    restarted = self._checkpoint(conn, restart=True)
                    answers.setdefault(loop, []).append((future, True, restarted))
                    continue
                try:
                    if conn is None:
                        assert opening_error is not None
                        raise opening_error
                    answer = (future, True, _transaction(conn, work))
                except BaseException as error:
                    answer = (future, False, error)
                answers.setdefault(loop, []).append(answer)
            for loop, results in answers.items():
                try:
                    loop.call_soon_threadsafe(self._deliver, results)
                except RuntimeError:  # that loop is closed: nobody waits for these
                    pass
        if conn is not None:
            conn.close()
        if self._stopped is not None and self._stopped_loop is not None:
            try:
                self._stopped_loop.call_soon_threadsafe(_set_done, self._stopped)
            except RuntimeError:
                pass


class _Executes(Protocol):
    def execute(self, sql: str, /) -> object: ...


def configure_sqlite(conn: _Executes, *, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:
    """Every connection's settings, ours and SQLAlchemy's. Whichever connection writes
    first after the log was restarted cuts the file back to ``WAL_LIMIT_BYTES``: each
    needs that limit, or the file keeps its size (and looks past the limit) until the
    next restart."""
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    with contextlib.suppress(sqlite3.OperationalError):  # set already, or busy now
        conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute(f"PRAGMA journal_size_limit = {int(WAL_LIMIT_BYTES)}")


def _checkpoint(conn: sqlite3.Connection, *, restart: bool) -> bool:
    """Copy the log into the database file; return whether the log was restarted.
    PASSIVE holds up no writer. RESTART holds the write lock while it copies what is
    left and waits for the log's readers, so that the next write starts the log from
    its beginning; it waits ``WAL_RESTART_WAIT_MS`` at most, then gives up until the
    log has grown by the limit again."""
    if not restart:
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return False
    conn.execute(f"PRAGMA busy_timeout = {int(WAL_RESTART_WAIT_MS)}")
    try:
        busy, _, _ = conn.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()
    finally:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    return not busy


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:  # no log yet
        return 0


def _restart_log(conn: sqlite3.Connection) -> None:
    """The job that restarts the log: a marker, ``SqliteDirect._serve`` runs it."""


def _chain_sqlite(
    statements: Sequence[Statement], params: Mapping[str, Any], conn: sqlite3.Connection
) -> Row | None:
    chain = Chain(params)
    for statement in statements:
        cursor = conn.execute(statement.sqlite, chain.params)
        rows = cursor.fetchall()  # to the end: a statement's changes are done only then
        columns = [d[0] for d in cursor.description] if cursor.description else []
        chain.add(columns, tuple(rows[0]) if rows else None)
    return chain.answer()


class _Group:
    """One group transaction: the callers waiting for its COMMIT."""

    __slots__ = ("waiting",)

    def __init__(self) -> None:
        self.waiting: list[asyncio.Future[None]] = []


def _is_busy(error: sqlite3.OperationalError) -> bool:
    text = str(error).lower()
    return "locked" in text or "busy" in text


def _transaction(conn: sqlite3.Connection, work: Callable[[sqlite3.Connection], T]) -> T:
    """``work`` in one IMMEDIATE transaction (the database thread's). A lock not had
    within the busy timeout and other connection-level failures: ``StoreUnavailable``."""
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = work(conn)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return result
    except sqlite3.Error as error:
        if is_unavailable(error):
            raise exc.StoreUnavailable() from error
        raise


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
