"""The benchmark's databases: PostgreSQL's administration (a database of the
benchmark's own, created and dropped; settings, ``VACUUM`` and ``ANALYZE``, the
statistics a long run may change) and, through the same ``Database`` handle, the counts
and bulk inserts of the seeding on SQLite and PostgreSQL alike."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


def _sa_url(url: str) -> Any:
    import sqlalchemy as sa

    parsed = sa.make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+asyncpg")
    return parsed


def pg_dsn(url: str) -> str:
    return str(_sa_url(url).set(drivername="postgresql").render_as_string(hide_password=False))


async def pg_execute(dsn: str, *statements: str) -> None:
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncio.wait_for(asyncpg.connect(dsn), 10)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


# What a long run may change under the hot statements, read from PostgreSQL's own
# statistics: the records table's live and dead rows, autovacuum passes over it, its size
# (indexes included), writes_in_flight's size and dead rows (a row inserted and deleted
# per write), whether a vacuum of it is running now; buffers the checkpointer and
# the backends wrote (the latter when the background writer fell behind), checkpoints
# and WAL. ``Database.server_state`` reads it before and after a run, ``Maintenance``
# once a second during a soak.
PG_STATE = """
    SELECT extract(epoch FROM clock_timestamp())::float8 AS at,
           t.n_live_tup AS live_rows, t.n_dead_tup AS dead_rows,
           t.autovacuum_count AS autovacuums,
           t.n_tup_upd AS updates, t.n_tup_hot_upd AS hot_updates,
           pg_total_relation_size('idempotency_records')::float8 AS records_bytes,
           pg_total_relation_size('writes_in_flight')::float8 AS in_flight_bytes,
           (SELECT w.n_dead_tup FROM pg_stat_user_tables AS w
            WHERE w.relname = 'writes_in_flight') AS in_flight_dead_rows,
           EXISTS (SELECT 1 FROM pg_stat_progress_vacuum AS p
                   WHERE p.relid = 'idempotency_records'::regclass) AS vacuuming,
           b.buffers_checkpoint, b.buffers_backend,
           b.checkpoints_timed + b.checkpoints_req AS checkpoints,
           pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8 AS wal_bytes
    FROM pg_stat_user_tables AS t, pg_stat_bgwriter AS b
    WHERE t.relname = 'idempotency_records'
"""
# The readings that are counters or levels (what ``server_state`` compares).
PG_STATE_COUNTS = (
    "live_rows",
    "dead_rows",
    "autovacuums",
    "updates",
    "hot_updates",
    "records_bytes",
    "in_flight_bytes",
    "in_flight_dead_rows",
    "buffers_checkpoint",
    "buffers_backend",
    "checkpoints",
    "wal_bytes",
)

# The tables a fenced write updates (and jobs, the lease API's, for comparison): their
# updates and the share of them that were heap-only (HOT: no index entry written, the
# old version pruned from its page without a vacuum), their dead rows and size with
# their indexes. ``Database.server_state`` adds them as "<reading>:<table>".
HOT_TABLES = ("idempotency_records", "writes_in_flight", "fences", "audit_log", "jobs")
PG_TABLES = """
    SELECT relname, n_tup_upd AS updates, n_tup_hot_upd AS hot_updates,
           n_dead_tup AS dead_rows, pg_total_relation_size(relid)::float8 AS bytes
    FROM pg_stat_user_tables WHERE relname = ANY($1::text[])
"""
PG_TABLE_COUNTS = ("updates", "hot_updates", "dead_rows", "bytes")


async def pg_tables(dsn: str) -> dict[str, float]:
    """``PG_TABLES`` of ``HOT_TABLES``, flat: ``{"updates:fences": ..., ...}``."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(PG_TABLES, list(HOT_TABLES))
    finally:
        await conn.close()
    return {f"{k}:{r['relname']}": float(r[k]) for r in rows for k in PG_TABLE_COUNTS}


async def pg_fetchval(dsn: str, query: str) -> Any:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


async def pg_fetchrow(dsn: str, query: str) -> dict[str, Any]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return dict(await conn.fetchrow(query))
    finally:
        await conn.close()


@dataclass
class Database:
    backend: str
    url: str  # the gateway's database_url
    admin_dsn: str | None = None  # PostgreSQL: where CREATE / DROP DATABASE run
    name: str | None = None

    @property
    def dsn(self) -> str:
        return pg_dsn(self.url)

    @property
    def sqlite_path(self) -> str:
        return self.url.split(":///", 1)[1]

    def create(self) -> None:
        if self.backend == "postgres":
            assert self.admin_dsn and self.name
            asyncio.run(pg_execute(self.admin_dsn, f'CREATE DATABASE "{self.name}"'))

    def drop(self) -> None:
        if self.backend == "postgres":
            assert self.admin_dsn and self.name
            asyncio.run(
                pg_execute(self.admin_dsn, f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
            )

    stats = "fresh"  # see --stats

    def vacuum(self, *tables: str) -> None:
        """PostgreSQL: VACUUM, so runs start from the same state (autovacuum would get
        there too, at a time of its choosing), with ANALYZE when statistics are fresh."""
        if self.backend == "postgres":
            verb = "VACUUM ANALYZE" if self.stats == "fresh" else "VACUUM"
            asyncio.run(pg_execute(self.dsn, *(f"{verb} {t}" for t in tables)))

    def gather_stats(self, *tables: str) -> dict[str, Any]:
        """``vacuum`` of ``tables`` (with ANALYZE when statistics are fresh); what the
        planner then believes of each: its row estimate (``pg_class.reltuples``, -1:
        never analyzed)."""
        if self.backend != "postgres":
            return {}
        self.vacuum(*tables)
        query = "SELECT reltuples FROM pg_class WHERE relname = '{}'"
        believed = {
            table: float(asyncio.run(pg_fetchval(self.dsn, query.format(table))))
            for table in tables
        }
        return {"planner_rows": believed}

    def server_state(self) -> dict[str, float]:
        """PostgreSQL: what a long run may change under the hot statements (``PG_STATE``),
        and each hot table's updates, HOT updates, dead rows and size (``PG_TABLES``)."""
        if self.backend != "postgres":
            return {}
        row = asyncio.run(pg_fetchrow(self.dsn, PG_STATE))
        return {k: float(row[k]) for k in PG_STATE_COUNTS} | asyncio.run(pg_tables(self.dsn))

    def analyze(self) -> None:
        if self.backend == "postgres":
            asyncio.run(pg_execute(self.dsn, "ANALYZE"))

    def setting(self, name: str) -> str | None:
        if self.backend != "postgres":
            return None
        return str(asyncio.run(pg_fetchval(self.dsn, f"SHOW {name}")))

    def count(self, table: str) -> int:
        if self.backend == "postgres":
            return int(asyncio.run(pg_fetchval(self.dsn, f"SELECT count(*) FROM {table}")))
        with contextlib.closing(sqlite3.connect(self.sqlite_path, timeout=30)) as conn:
            return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])

    def insert(self, table: str, columns: Sequence[str], rows: Iterable[tuple[Any, ...]]) -> int:
        """Bulk insert: COPY on PostgreSQL, executemany in one transaction on SQLite."""
        if self.backend == "postgres":
            return asyncio.run(_pg_copy(self.dsn, table, columns, rows))
        marks = ", ".join("?" for _ in columns)
        sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})"
        count = 0
        with contextlib.closing(sqlite3.connect(self.sqlite_path, timeout=60)) as conn:
            conn.execute("PRAGMA busy_timeout = 60000")
            for chunk in _chunks(rows, 50_000):
                with conn:
                    conn.executemany(sql, chunk)
                count += len(chunk)
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return count


async def _pg_copy(
    dsn: str, table: str, columns: Sequence[str], rows: Iterable[tuple[Any, ...]]
) -> int:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    count = 0
    try:
        for chunk in _chunks(rows, 50_000):
            await conn.copy_records_to_table(table, records=chunk, columns=list(columns))
            count += len(chunk)
    finally:
        await conn.close()
    return count


def _chunks(rows: Iterable[tuple[Any, ...]], size: int) -> Iterator[list[tuple[Any, ...]]]:
    chunk: list[tuple[Any, ...]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def set_autovacuum(db: Database, value: str) -> Callable[[], None]:
    """Turn the server's autovacuum on or off for the run (ALTER SYSTEM, reload); the
    function returned puts back what postgresql.auto.conf said before."""
    assert db.admin_dsn is not None
    admin = db.admin_dsn
    before = asyncio.run(
        pg_fetchval(
            admin,
            "SELECT setting FROM pg_file_settings WHERE name = 'autovacuum' "
            "AND sourcefile LIKE '%postgresql.auto.conf' ORDER BY seqno DESC LIMIT 1",
        )
    )
    asyncio.run(
        pg_execute(admin, f"ALTER SYSTEM SET autovacuum = {value}", "SELECT pg_reload_conf()")
    )
    print(f"postgres: autovacuum = {value} for this run", flush=True)

    def restore() -> None:
        undo = (
            "ALTER SYSTEM RESET autovacuum"
            if before is None
            else (f"ALTER SYSTEM SET autovacuum = {before}")
        )
        asyncio.run(pg_execute(admin, undo, "SELECT pg_reload_conf()"))
        print("postgres: autovacuum restored", flush=True)

    return restore
