"""The PostgreSQL executor of the hot path (``lease_core.direct``): one asyncpg pool,
each operation one prepared statement (or one transaction, ``Chain``), concurrent
callers of a ``Batched`` statement sharing one round trip (``Coalescer``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping, Sequence
from functools import partial
from typing import Any

from . import exceptions as exc
from .coalesce import Coalescer
from .direct import Chain, Direct, is_unavailable
from .statement import MAX_BATCH, Batched, Row, Statement


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

    async def fetchall(self, statement: Statement, params: Mapping[str, Any]) -> list[Row]:
        rows: list[Row] = await self._send("fetch", statement, params)
        return rows

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
            began = time.perf_counter()
            async with pool.acquire() as conn:
                sent = time.perf_counter()
                try:
                    answer = await getattr(conn, method)(text, *args)
                except Exception as error:
                    _discard_if_unavailable(conn, error)
                    raise
                timers = self.timers
                if timers is not None:
                    waited, ran, _ = timers[statement]
                    waited.observe(sent - began)
                    ran.observe(time.perf_counter() - sent)
                return answer
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
            began = time.perf_counter()
            async with pool.acquire() as conn:
                sent = time.perf_counter()
                try:
                    transaction = conn.transaction()
                    await transaction.start()
                    try:
                        answer = await self._run_chain(conn, statements, params, injected)
                    except BaseException:
                        await transaction.rollback()
                        raise
                    committing = time.perf_counter()
                    await transaction.commit()
                except Exception as error:
                    _discard_if_unavailable(conn, error)
                    raise
                if self.timers is not None:
                    waited, ran, committed = self.timers[statements[0]]
                    waited.observe(sent - began)
                    ran.observe(committing - sent)
                    committed.observe(time.perf_counter() - committing)
                return answer
        except Exception as error:
            if is_unavailable(error):
                raise exc.StoreUnavailable() from error
            raise

    async def _run_chain(
        self, conn: Any, statements: Sequence[Statement], params: Mapping[str, Any], injected: bool
    ) -> Row | None:
        chain = Chain(params)
        for statement in statements:
            text, names = statement.postgres(injected)
            # ``fetch`` uses the connection's cache of prepared statements; the columns
            # of one that returned no row are read once, when first needed.
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

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()


def _arrays(calls: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The parameters of a ``Batched.many``: one list per name; the clock reading the
    calls share."""
    arrays: dict[str, Any] = {name: [call[name] for call in calls] for name in calls[0]}
    arrays["now"] = calls[0].get("now")
    return arrays


_SERVER_OF_CONNECTION = (
    "SELECT coalesce(host(inet_server_addr()), 'local socket'), inet_server_port()"
)


def _discard_if_unavailable(conn: Any, error: BaseException) -> None:
    """A connection whose operation failed because the database cannot serve now
    (``is_unavailable``) is closed instead of going back to the pool: asyncpg's pool
    itself gives back one still open (one that said "another operation is in progress",
    one whose session hit a full disk), and the next operation would meet it again. The
    pool connects anew in its place."""
    if is_unavailable(error):
        conn.terminate()


async def _no_reset(_conn: Any) -> None:
    return None
