"""The raw SQL floors of the lease core (driver modes ``floor-claims`` and
``floor-renewals``): the store's claim and renew statements sent straight to the
database from the same number of concurrent tasks, asyncpg on PostgreSQL, aiosqlite on
SQLite."""

from __future__ import annotations

import argparse
import itertools
import secrets
import time
from typing import Any

from bench.loops import EMPTY, OK, Op, _error, run_loops, split

# The store's statements (lease_core/store.py), written out as raw SQL.
PG_NOW = "CAST(EXTRACT(epoch FROM now()) AS double precision)"
PG_CLAIM = f"""
UPDATE jobs SET state = 'leased', generation = jobs.generation + 1, owner = $2,
    lease_token_hash = $3, lease_ttl_seconds = $4, lease_expires_at = {PG_NOW} + $4,
    claimable_at = {PG_NOW} + $4, attempts = jobs.attempts + 1, updated_at = {PG_NOW}
WHERE jobs.job_id = (
    SELECT jobs.job_id FROM jobs
    WHERE jobs.queue = $1 AND jobs.claimable_at IS NOT NULL
      AND jobs.claimable_at <= {PG_NOW} AND jobs.attempts < jobs.max_attempts
    ORDER BY jobs.claimable_at LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING jobs.job_id, jobs.generation, jobs.owner, jobs.lease_expires_at,
    jobs.lease_ttl_seconds, jobs.payload
"""
PG_RENEW = f"""
UPDATE jobs SET lease_ttl_seconds = $2, lease_expires_at = {PG_NOW} + $2,
    claimable_at = {PG_NOW} + $2, updated_at = {PG_NOW}
WHERE jobs.lease_token_hash = $1 AND jobs.state = 'leased' AND jobs.lease_expires_at > {PG_NOW}
RETURNING jobs.job_id, jobs.generation, jobs.owner, jobs.lease_expires_at,
    jobs.lease_ttl_seconds, jobs.payload
"""
# SQLite has no row locks (one writer at a time): the same statement without SKIP LOCKED,
# "now" from the process clock, as the store does in SQLite mode.
SQLITE_CLAIM = """
UPDATE jobs SET state = 'leased', generation = jobs.generation + 1, owner = :owner,
    lease_token_hash = :hash, lease_ttl_seconds = :ttl, lease_expires_at = :now + :ttl,
    claimable_at = :now + :ttl, attempts = jobs.attempts + 1, updated_at = :now
WHERE jobs.job_id = (
    SELECT jobs.job_id FROM jobs
    WHERE jobs.queue = :queue AND jobs.claimable_at IS NOT NULL
      AND jobs.claimable_at <= :now AND jobs.attempts < jobs.max_attempts
    ORDER BY jobs.claimable_at LIMIT 1)
RETURNING jobs.job_id, jobs.generation, jobs.owner, jobs.lease_expires_at,
    jobs.lease_ttl_seconds, jobs.payload
"""
SQLITE_RENEW = """
UPDATE jobs SET lease_ttl_seconds = :ttl, lease_expires_at = :now + :ttl,
    claimable_at = :now + :ttl, updated_at = :now
WHERE jobs.lease_token_hash = :hash AND jobs.state = 'leased' AND jobs.lease_expires_at > :now
RETURNING jobs.job_id, jobs.generation, jobs.owner, jobs.lease_expires_at,
    jobs.lease_ttl_seconds, jobs.payload
"""


async def _no_reset(_conn: Any) -> None:
    return None


def _pg_dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


def _sqlite_path(url: str) -> str:
    return url.split(":///", 1)[1]


async def mode_floor(args: argparse.Namespace, what: str) -> dict[str, Any]:
    url: str = args.database_url
    concurrency = args.concurrency
    if url.startswith("postgresql"):
        import asyncpg  # type: ignore[import-untyped]

        # No reset query when a connection goes back to the pool (asyncpg's default
        # costs a round trip per statement; the gateway's own pool skips it too).
        pool = await asyncpg.create_pool(
            _pg_dsn(url), min_size=args.pool_size, max_size=args.pool_size, reset=_no_reset
        )
        try:
            if what == "claims":

                def make(i: int) -> Op:
                    owner = f"floor-{i}"

                    async def op() -> str:
                        row = await pool.fetchrow(
                            PG_CLAIM, args.queue, owner, secrets.token_hex(32), args.ttl
                        )
                        return OK if row is not None else EMPTY

                    return op

                ops = [make(i) for i in range(concurrency)]
            else:
                hashes = [
                    r[0]
                    for r in await pool.fetch(
                        "SELECT lease_token_hash FROM jobs WHERE job_id LIKE $1 "
                        "AND state = 'leased' ORDER BY job_id",
                        args.job_prefix + "%",
                    )
                ]
                ops = [_pg_renew_op(pool, hs, args.ttl) for hs in split(hashes, concurrency)]
            return await run_loops(ops, args.warmup, args.duration)
        finally:
            await pool.close()

    import aiosqlite

    conn = await aiosqlite.connect(_sqlite_path(url), isolation_level=None)
    try:
        for pragma in (
            "PRAGMA busy_timeout = 10000",
            "PRAGMA journal_mode = WAL",
            "PRAGMA synchronous = NORMAL",
        ):
            await conn.execute(pragma)
        if what == "claims":

            def make_sqlite(i: int) -> Op:
                owner = f"floor-{i}"

                async def op() -> str:
                    params = {
                        "owner": owner,
                        "hash": secrets.token_hex(32),
                        "ttl": args.ttl,
                        "now": time.time(),
                        "queue": args.queue,
                    }
                    async with conn.execute(SQLITE_CLAIM, params) as cursor:
                        row = await cursor.fetchone()
                    return OK if row is not None else EMPTY

                return op

            ops = [make_sqlite(i) for i in range(concurrency)]
        else:
            async with conn.execute(
                "SELECT lease_token_hash FROM jobs WHERE job_id LIKE ? AND state = 'leased' "
                "ORDER BY job_id",
                (args.job_prefix + "%",),
            ) as cursor:
                hashes = [r[0] for r in await cursor.fetchall()]
            ops = [_sqlite_renew_op(conn, hs, args.ttl) for hs in split(hashes, concurrency)]
        return await run_loops(ops, args.warmup, args.duration)
    finally:
        await conn.close()


def _pg_renew_op(pool: Any, hashes: list[str], ttl: float) -> Op:
    cycle = itertools.cycle(hashes)

    async def op() -> str:
        row = await pool.fetchrow(PG_RENEW, next(cycle), ttl)
        return OK if row is not None else _error(409, b"lease lost")

    return op


def _sqlite_renew_op(conn: Any, hashes: list[str], ttl: float) -> Op:
    cycle = itertools.cycle(hashes)

    async def op() -> str:
        params = {"hash": next(cycle), "ttl": ttl, "now": time.time()}
        async with conn.execute(SQLITE_RENEW, params) as cursor:
            row = await cursor.fetchone()
        return OK if row is not None else _error(409, b"lease lost")

    return op
