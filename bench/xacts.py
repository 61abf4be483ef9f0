"""PostgreSQL's transactions per fenced write, counted by PostgreSQL itself
(``python -m bench.run --open-loop`` on PostgreSQL).

``pg_stat_database.xact_commit + xact_rollback`` of the benchmark's database is read
before and after a batch of N first writes (fresh keys), the same N again (replays: same
token, key and body), and N refused stale writes (a token of generation 1 after another
owner took the job over), each batch sent one write at a time with nothing else using
the database. Every transaction counts, a read-only one too: the gateway's pooled
connections, any pre-ping, an audit row written apart.

- The counters are read on a connection to *another* database (the server's, from
  ``--postgres-url``), so the reading's own transactions count there, not here.
- Each backend adds its counts to the shared statistics when it goes idle, at most once
  a second; counts held back by that limit are flushed by the idle backend within 10 s
  (PostgreSQL 15: ``PGSTAT_MIN_INTERVAL``, ``PGSTAT_IDLE_INTERVAL``). So every reading
  waits ``SETTLE_SECONDS`` after the last request, then polls (with
  ``pg_stat_clear_snapshot()``, whatever ``stats_fetch_consistency`` says) until two
  readings a second apart agree.
- Each kind of write is warmed up first (every pooled connection prepares its
  statements once), and an idle window as long as a settle is counted too: what the
  gateway does on its own (its background tasks), shown beside the batches.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

SETTLE_SECONDS = 11.0
XACTS = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1"
OPERATIONS = ("first_write", "replay", "refusal")


async def read_xacts(conn: Any, database: str) -> int:
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    return int(await conn.fetchval(XACTS, database))


async def settled_xacts(conn: Any, database: str, settle: float) -> int:
    """The database's transactions once every backend's counts are in (see above)."""
    await asyncio.sleep(settle)
    before = await read_xacts(conn, database)
    deadline = time.monotonic() + 30
    while True:
        await asyncio.sleep(1.0)
        now = await read_xacts(conn, database)
        if now == before or time.monotonic() > deadline:
            return now
        before = now


Write = tuple[str, str]  # (Fencing-Token, Idempotency-Key)


async def send_all(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    writes: Sequence[Write],
    expect: tuple[int, str | None],
    concurrency: int = 1,
) -> int:
    """Send ``writes`` (``concurrency`` at a time); the number answered otherwise than
    ``expect``: (status, ``Idempotent-Replayed`` or the problem's reason, None: neither)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(token: str, key: str) -> bool:
        headers = {
            "Fencing-Token": token,
            "Idempotency-Key": key,
            "Content-Type": "application/json",
        }
        async with gate, session.post(url, data=body, headers=headers) as resp:
            text = await resp.read()
            status, mark = expect
            if resp.status != status:
                return False
            if resp.status == 201:
                return resp.headers.get("Idempotent-Replayed") == mark
            return mark is None or json.loads(text).get("reason") == mark

    if concurrency == 1:
        return sum([not await one(t, k) for t, k in writes])
    answers = await asyncio.gather(*(one(t, k) for t, k in writes))
    return sum(not ok for ok in answers)


async def count_transactions(
    admin_dsn: str,
    database: str,
    proxy_url: str,
    control_url: str,
    body: bytes,
    writes: int,
    tag: str,
    jobs: int = 8,
    settle: float = SETTLE_SECONDS,
) -> dict[str, Any]:
    """Transactions per first write, replay and refusal (``writes`` of each, one at a
    time), and in an idle window; see the module's docstring."""
    import asyncpg  # type: ignore[import-untyped]

    async def lease(session: aiohttp.ClientSession, job: str, ttl: float) -> str:
        async with session.put(
            f"{control_url}/v1/jobs/{job}/lease",
            json={"owner": f"{tag}-{ttl:g}", "ttl_seconds": ttl, "queue": "bench-xacts"},
        ) as resp:
            doc = await resp.json()
            if resp.status != 201:
                raise RuntimeError(f"leasing {job}: {resp.status} {doc}")
            token: str = doc["lease_token"]
            return token

    conn = await asyncpg.connect(admin_dsn)
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64),
            timeout=aiohttp.ClientTimeout(total=60),
            cookie_jar=aiohttp.DummyCookieJar(),
        ) as session:
            live = [await lease(session, f"{tag}-f{i}", 3600) for i in range(jobs)]
            old = [await lease(session, f"{tag}-s{i}", 1) for i in range(jobs)]
            await asyncio.sleep(1.2)  # their leases expire; another owner takes the jobs
            for i in range(jobs):
                await lease(session, f"{tag}-s{i}", 3600)

            def batch(tokens: list[str], name: str, count: int) -> list[Write]:
                cycle = itertools.cycle(tokens)
                return [(next(cycle), f"{tag}-{name}-{i}") for i in range(count)]

            first = (201, None)
            replayed = (201, "true")
            stale = (409, "stale-generation")
            # Warm-up, not counted: every pooled connection meets every statement.
            for concurrency in (32, 1):
                warm = batch(live, f"warm{concurrency}", 64)
                await send_all(session, proxy_url, body, warm, first, concurrency)
                await send_all(session, proxy_url, body, warm, replayed, concurrency)
                refused = batch(old, f"warm-stale{concurrency}", 64)
                await send_all(session, proxy_url, body, refused, stale, concurrency)

            counts: dict[str, Any] = {}
            start = await settled_xacts(conn, database, settle)
            began = time.monotonic()
            at = await settled_xacts(conn, database, settle)
            counts["idle"] = {
                "seconds": round(time.monotonic() - began, 1),
                "transactions": at - start,
            }
            firsts = batch(live, "first", writes)
            kinds = {
                "first_write": (firsts, first),
                "replay": (firsts, replayed),
                "refusal": (batch(old, "stale", writes), stale),
            }
            for name, (todo, expect) in kinds.items():
                unexpected = await send_all(session, proxy_url, body, todo, expect)
                after = await settled_xacts(conn, database, settle)
                counts[name] = {
                    "writes": writes,
                    "transactions": after - at,
                    "per_write": (after - at) / writes if writes else 0.0,
                    "unexpected_answers": unexpected,
                }
                at = after
            return counts
    finally:
        await conn.close()
