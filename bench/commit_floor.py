"""The floor of a first fenced write's added latency on PostgreSQL: two durable commits,
one after the other, by one client, on the benchmark's own database (issue 55). A first
write commits twice (its admission, then its settle): no gateway on this database can
add less than that to a write, so the open loop's added latency is read beside it, in
the same run on the same server, and holds as a ratio on any machine.

Each commit is one single-statement INSERT in autocommit (one round trip, then the WAL
flushed as the server's ``synchronous_commit`` says), as the gateway's admission and
settle are one statement and one commit each."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

WARMUP = 20
SAMPLES = 300


async def two_commits(dsn: str, samples: int = SAMPLES) -> dict[str, Any]:
    """p50 and p99 (ms) of two durable commits in a row, over ``samples`` pairs after
    ``WARMUP``; with the server's ``synchronous_commit`` and ``fsync``, which decide
    what a commit waits for."""
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncio.wait_for(asyncpg.connect(dsn), 10)
    try:
        await conn.execute("CREATE TABLE IF NOT EXISTS bench_commit_floor (n bigint)")
        taken: list[float] = []
        for i in range(WARMUP + samples):
            began = time.perf_counter()
            await conn.execute("INSERT INTO bench_commit_floor VALUES ($1)", i)
            await conn.execute("INSERT INTO bench_commit_floor VALUES ($1)", i)
            if i >= WARMUP:
                taken.append((time.perf_counter() - began) * 1000)
        synchronous_commit = await conn.fetchval("SHOW synchronous_commit")
        fsync = await conn.fetchval("SHOW fsync")
        await conn.execute("DROP TABLE bench_commit_floor")
    finally:
        await conn.close()
    taken.sort()
    return {
        "p50_ms": statistics.median(taken),
        "p99_ms": taken[min(len(taken) - 1, int(0.99 * len(taken)))],
        "samples": samples,
        "synchronous_commit": synchronous_commit,
        "fsync": fsync,
    }
