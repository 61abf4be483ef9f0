"""The SQLite executor of the hot path (``lease_core.direct``): operations inline on the
event loop's thread in group transactions, a database thread for when another process
holds the lock, and the WAL checkpoints; ``configure_sqlite``, every connection's
settings."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

import sqlalchemy as sa

from . import exceptions as exc
from .direct import IN_MEMORY, Chain, Direct, is_in_memory, is_unavailable
from .statement import Row, Statement

T = TypeVar("T")


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
        timers = self.timers

        def one(conn: sqlite3.Connection) -> Row | None:
            began = time.perf_counter()
            row: Row | None = conn.execute(text, params).fetchone()
            if timers is not None:
                timers[statement][1].observe(time.perf_counter() - began)
            return row

        if statement.reads_only:
            return await self._read(one)
        # One statement needs no savepoint: SQLite undoes a failed statement itself.
        return await self._run(one, savepoint=False)

    async def fetchall(self, statement: Statement, params: Mapping[str, Any]) -> list[Row]:
        text = statement.sqlite

        def every(conn: sqlite3.Connection) -> list[Row]:
            return list(conn.execute(text, params).fetchall())

        if not statement.reads_only:
            raise TypeError("fetchall() is for a read")
        return await self._read(every)

    async def _read(self, read: Callable[[sqlite3.Connection], T]) -> T:
        """A read runs and answers at once: it waits for no COMMIT, since it wrote
        nothing. Inside this turn's open group transaction it also sees that group's
        writes, which can only make a gate stricter (a newer fence, a write in flight);
        should the group then fail to commit, that was a refusal too many, never a write
        let through."""
        try:
            return read(self._connection())
        except sqlite3.Error as error:
            if not (isinstance(error, sqlite3.OperationalError) and _is_busy(error)):
                if is_unavailable(error):
                    raise exc.StoreUnavailable() from error
                raise
        self.handed_off += 1  # busy (rare for a reader of a WAL file): wait there
        return await self._on_thread(read)

    async def _chain(
        self, statements: Sequence[Statement], params: Mapping[str, Any]
    ) -> Row | None:
        work = partial(_chain_sqlite, statements, params)
        timers = self.timers
        if timers is None:
            return await self.in_write_transaction(work)
        ran = timers[statements[0]][1]

        def timed(conn: sqlite3.Connection) -> Row | None:
            began = time.perf_counter()
            try:
                return work(conn)
            finally:
                ran.observe(time.perf_counter() - began)

        return await self.in_write_transaction(timed)

    async def in_write_transaction(self, work: Callable[[sqlite3.Connection], T]) -> T:
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
                began = time.perf_counter()
                conn.execute("COMMIT")
                if self.timers is not None:
                    self.timers["group"][2].observe(time.perf_counter() - began)
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
