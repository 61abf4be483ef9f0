"""The load driver: one process, asyncio, N concurrent closed loops.

Its HTTP client (``--client``): ``lean`` (the default), the gateway's own client
(``gateway/upstream_client.py``: an ``asyncio.Protocol`` per pooled connection, answers
parsed by httptools), about half the CPU per request of ``aiohttp``'s ``ClientSession``
(the other choice, which drove the runs recorded before 2026-12-04).
On this two-core machine the driver shares the cores with what it measures, so a
leaner load generator leaves more of them to the system under test, as wrk would; the
raw SQL floors' driver is asyncpg, lean already. Both clients send the same requests.

Modes (each run is its own process, started by ``bench.run``):

- ``writes``: fenced writes. Before the timed phase every job gets a live lease through
  the control API (``PUT /v1/jobs/{id}/lease``, a long TTL); each loop then sends
  ``POST`` requests with its jobs' ``Fencing-Token`` and a fresh ``Idempotency-Key``.
  Without ``--control`` (the bare proxy, the upstream itself) the same requests carry a
  well-formed but made-up token.
- ``claims``: ``POST /v1/queues/{queue}/claim`` from every loop.
- ``renewals``: every loop holds leases (acquired before the timed phase) and renews them.
- ``floor-claims``: the lease store's claim statement (``UPDATE jobs ... WHERE job_id =
  (SELECT ... FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING``) sent straight to the database
  with asyncpg / aiosqlite from concurrent tasks: the floor for claims.
- ``floor-renewals``: the store's renew statement, straight to the database.

A warm-up is run and thrown away; then only requests that start and end inside the
timed window count. The result (JSON) goes to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import secrets
import sys
import time
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

if __package__ in (None, ""):  # run as a file: python bench/driver.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import percentile
from bench.common import run as run_on_loop
from gateway.upstream_client import UpstreamClient, UpstreamError

OK, EMPTY, ERROR = "ok", "empty", "error"
LOAD_STARTED = "bench load started at"
# Printed once the writes' leases are taken; with --go-file the driver then waits for that
# file, so the orchestrator can gather statistics of a database that holds the leases.
LEASES_TAKEN = "bench leases taken"
CLIENTS = ("aiohttp", "lean")


def load_generator(client: str) -> str:
    return f"bench.driver: {client} client, one closed loop per connection"


WRITE_BODY = b'{"amount":1250,"currency":"EUR","customer":"cus_bench","description":"bench"}'
FAKE_TOKEN = "fgl_" + "A" * 32
JSON_HEADERS = {"Content-Type": "application/json"}

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

Op = Callable[[], Awaitable[str]]
# One POST of the timed phase: (url, body, headers) -> (status, body).
Post = Callable[[str, bytes, dict[str, str]], Awaitable[tuple[int, bytes]]]


_ERRORS: list[str] = []


def _error(status: int, body: bytes) -> str:
    if len(_ERRORS) < 5:
        _ERRORS.append(f"{status}: {body[:300].decode(errors='replace')}")
    return ERROR


@dataclass
class Recorder:
    """Counts and latencies of what completed inside the timed window."""

    window_start: float
    window_end: float
    latencies: array[float] = field(default_factory=lambda: array("d"))
    ok: int = 0
    errors: int = 0
    empty_at: float | None = None
    per_second: dict[int, int] = field(default_factory=dict)
    interval: float = 0.0  # > 0: latencies also kept per interval of this many seconds
    per_interval: dict[int, array[float]] = field(default_factory=dict)
    # > 0: the last ``check`` seconds of each interval go to the check target (the
    # soak's bare proxy, the machine's speed now); kept apart, per interval.
    check: float = 0.0
    per_check: dict[int, array[float]] = field(default_factory=dict)

    def phase(self, at: float) -> tuple[int, bool]:
        """The interval ``at`` falls in, and whether it is in that interval's check."""
        if self.interval <= 0 or at < self.window_start:
            return -1, False
        slot, into = divmod(at - self.window_start, self.interval)
        return int(slot), self.check > 0 and into >= self.interval - self.check

    def record(self, started: float, ended: float, outcome: str) -> None:
        if outcome == EMPTY:
            if self.empty_at is None or started < self.empty_at:
                self.empty_at = started
            return
        if started < self.window_start or ended > self.window_end:
            return
        if outcome != OK:
            self.errors += 1
            return
        slot, checking = self.phase(ended)
        if self.check > 0 and self.phase(started) != (slot, checking):
            return  # across a switch of target: neither phase's
        if checking:
            self.per_check.setdefault(slot, array("d")).append(ended - started)
            return
        self.ok += 1
        self.latencies.append(ended - started)
        second = int(ended - self.window_start)
        self.per_second[second] = self.per_second.get(second, 0) + 1
        if self.interval > 0:
            self.per_interval.setdefault(slot, array("d")).append(ended - started)


def _interval_row(rec: Recorder, slot: int) -> dict[str, Any]:
    own = sorted(rec.per_interval.get(slot, ()))
    row = {
        "start_seconds": slot * rec.interval,
        "rps": len(own) / (rec.interval - rec.check),
        "p50_ms": percentile(own, 0.50) * 1000,
        "p99_ms": percentile(own, 0.99) * 1000,
    }
    if rec.check > 0:
        checked = sorted(rec.per_check.get(slot, ()))
        row["check_rps"] = len(checked) / rec.check
        row["check_p50_ms"] = percentile(checked, 0.50) * 1000
        row["check_p99_ms"] = percentile(checked, 0.99) * 1000
    return row


async def run_loops(
    ops: Sequence[Op],
    warmup: float,
    duration: float,
    interval: float = 0.0,
    *,
    check_ops: Sequence[Op] = (),
    check: float = 0.0,
) -> dict[str, Any]:
    """Run each op in its own closed loop for ``warmup + duration`` seconds; with an
    ``interval``, throughput and latencies per interval too (the soak's curve). With
    ``check_ops``, loop i runs ``check_ops[i]`` instead for the last ``check`` seconds of
    each interval: the soak reads the bare proxy's speed beside the gateway's, minute by
    minute, so the machine's own drift divides out."""
    began = time.perf_counter()
    wall_began = time.time()
    print(f"{LOAD_STARTED} {wall_began:.3f}", flush=True)
    rec = Recorder(
        began + warmup,
        began + warmup + duration,
        interval=interval,
        check=check if check_ops else 0.0,
    )

    async def loop(op: Op, check_op: Op | None) -> None:
        clock = time.perf_counter
        while True:
            started = clock()
            if started >= rec.window_end or rec.empty_at is not None:
                return
            chosen = op
            if check_op is not None and rec.phase(started)[1]:
                chosen = check_op
            try:
                outcome = await chosen()
            except (aiohttp.ClientError, UpstreamError, OSError, TimeoutError) as error:
                outcome = _error(0, f"{type(error).__name__}: {error}".encode())
            rec.record(started, clock(), outcome)

    checks: Sequence[Op | None] = check_ops or [None] * len(ops)
    await asyncio.gather(*(loop(op, c) for op, c in zip(ops, checks, strict=True)))
    end = rec.window_end
    exhausted = rec.empty_at is not None and rec.empty_at < rec.window_end
    if exhausted:
        assert rec.empty_at is not None
        end = rec.empty_at
    window = max(end - rec.window_start, 1e-9)
    # The time the loops spent on their own target (the checks' share left out).
    own_window = window * (1 - rec.check / interval) if rec.check else window
    lat = sorted(rec.latencies)
    seconds = int(window)
    return {
        "ok": rec.ok,
        "errors": rec.errors,
        "error_samples": list(_ERRORS),
        "rps": rec.ok / own_window if window > 0.05 else 0.0,
        "p50_ms": percentile(lat, 0.50) * 1000,
        "p90_ms": percentile(lat, 0.90) * 1000,
        "p99_ms": percentile(lat, 0.99) * 1000,
        "max_ms": (lat[-1] * 1000) if lat else 0.0,
        "window_seconds": window,
        "exhausted": exhausted,
        "window_start_epoch": wall_began + warmup,
        "window_end_epoch": wall_began + warmup + window,
        "per_second": [rec.per_second.get(s, 0) for s in range(seconds)],
        "check_seconds": rec.check,
        "intervals": [
            _interval_row(rec, slot)
            for slot in range(int(window // interval) if interval > 0 else 0)
        ],
    }


# -- HTTP modes ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def poster(
    client: str, session: aiohttp.ClientSession, concurrency: int
) -> AsyncIterator[Post]:
    """The timed phase's POST, through the chosen client (``--client``)."""
    if client == "aiohttp":

        async def post_aiohttp(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
            async with session.post(url, data=body, headers=headers) as resp:
                return resp.status, await resp.read()

        yield post_aiohttp
        return
    lean = UpstreamClient(connections_per_host=concurrency + 8, keepalive_seconds=60)

    async def post_lean(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        async with await lean.request(
            "POST", url, headers.items(), body, timeout=60, connect_timeout=10
        ) as resp:
            return resp.status, await resp.read()

    try:
        yield post_lean
    finally:
        await lean.close()


def new_session(concurrency: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency + 8, limit_per_host=concurrency + 8),
        timeout=aiohttp.ClientTimeout(total=60),
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent",),
    )


async def acquire_leases(
    session: aiohttp.ClientSession, control: str, job_ids: Sequence[str], ttl: float
) -> list[str]:
    """A live lease per job, through the control API (before the timed phase)."""
    gate = asyncio.Semaphore(16)

    async def one(job_id: str) -> str:
        async with (
            gate,
            session.put(
                f"{control}/v1/jobs/{job_id}/lease",
                json={"owner": f"bench-{job_id}", "ttl_seconds": ttl, "queue": "bench-writes"},
            ) as resp,
        ):
            text = await resp.text()
            if resp.status != 201:
                raise SystemExit(f"acquiring a lease for {job_id}: {resp.status} {text[:300]}")
            token: str = json.loads(text)["lease_token"]
            return token

    return list(await asyncio.gather(*(one(j) for j in job_ids)))


def split(items: Sequence[str], parts: int) -> list[list[str]]:
    """Loop i gets items i, i + parts, i + 2 * parts, ..."""
    return [list(items[i::parts]) or [items[i % len(items)]] for i in range(parts)]


async def leases_taken(go_file: str | None, timeout: float = 600.0) -> None:
    """Say the leases are taken; with ``go_file``, wait until it exists."""
    print(LEASES_TAKEN, flush=True)
    if go_file is None:
        return
    deadline = time.monotonic() + timeout
    while not Path(go_file).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{go_file} never appeared")
        await asyncio.sleep(0.05)


async def mode_writes(args: argparse.Namespace) -> dict[str, Any]:
    if args.check_target and not 0 < args.check_seconds < args.interval:
        raise SystemExit("--check-target: needs 0 < --check-seconds < --interval")
    concurrency = args.concurrency
    jobs = max(args.jobs, concurrency)
    job_ids = [f"{args.tag}-w{i}" for i in range(jobs)]
    async with (
        new_session(concurrency) as session,
        poster(args.client, session, concurrency) as post,
    ):
        if args.control:
            tokens = await acquire_leases(session, args.control, job_ids, args.ttl)
        else:
            tokens = [FAKE_TOKEN] * jobs
        await leases_taken(args.go_file)

        def make(url: str, loop_index: int, loop_tokens: list[str]) -> Op:
            cycle = itertools.cycle(loop_tokens)
            counter = itertools.count()
            prefix = f"{args.tag}-{loop_index}-{secrets.token_hex(3)}"

            async def op() -> str:
                headers = {
                    "Fencing-Token": next(cycle),
                    "Idempotency-Key": f"{prefix}-{next(counter)}",
                    "Content-Type": "application/json",
                }
                status, body = await post(url, WRITE_BODY, headers)
                return OK if status == 201 else _error(status, body)

            return op

        parts = split(tokens, concurrency)
        ops = [make(args.target, i, t) for i, t in enumerate(parts)]
        check_ops = (
            [make(args.check_target, i, t) for i, t in enumerate(parts)]
            if args.check_target
            else []
        )
        result = await run_loops(
            ops,
            args.warmup,
            args.duration,
            args.interval,
            check_ops=check_ops,
            check=args.check_seconds,
        )
    result["jobs"] = jobs
    return result


async def mode_claims(args: argparse.Namespace) -> dict[str, Any]:
    concurrency = args.concurrency
    async with (
        new_session(concurrency) as session,
        poster(args.client, session, concurrency) as post,
    ):
        url = f"{args.control}/v1/queues/{args.queue}/claim"

        def make(loop_index: int) -> Op:
            payload = json.dumps(
                {"owner": f"claimer-{loop_index}", "ttl_seconds": args.ttl}
            ).encode()

            async def op() -> str:
                status, body = await post(url, payload, JSON_HEADERS)
                if status == 200:
                    return OK
                if status == 204:
                    return EMPTY
                return _error(status, body)

            return op

        return await run_loops([make(i) for i in range(concurrency)], args.warmup, args.duration)


async def mode_renewals(args: argparse.Namespace) -> dict[str, Any]:
    concurrency = args.concurrency
    jobs = max(args.jobs, concurrency)
    job_ids = [f"{args.tag}-r{i}" for i in range(jobs)]
    async with (
        new_session(concurrency) as session,
        poster(args.client, session, concurrency) as post,
    ):
        tokens = await acquire_leases(session, args.control, job_ids, args.ttl)
        url = f"{args.control}/v1/leases/renew"

        def make(loop_tokens: list[str]) -> Op:
            payloads = itertools.cycle(
                [
                    json.dumps({"lease_token": t, "ttl_seconds": args.ttl}).encode()
                    for t in loop_tokens
                ]
            )

            async def op() -> str:
                status, body = await post(url, next(payloads), JSON_HEADERS)
                return OK if status == 200 else _error(status, body)

            return op

        ops = [make(t) for t in split(tokens, concurrency)]
        result = await run_loops(ops, args.warmup, args.duration)
    result["jobs"] = jobs
    return result


# -- raw SQL floors ----------------------------------------------------------------------


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


MODES = ("writes", "claims", "renewals", "floor-claims", "floor-renewals")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Fencegate benchmark load driver.")
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--target", help="writes: the URL to POST to")
    parser.add_argument("--control", help="base URL of the control listener")
    parser.add_argument("--database-url", help="floor modes: the gateway's database URL")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--client",
        choices=CLIENTS,
        default="lean",
        help="the HTTP client of the timed phase (leases are taken with aiohttp's either way)",
    )
    parser.add_argument("--jobs", type=int, default=256, help="jobs holding a lease")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument(
        "--interval", type=float, default=0.0, help="writes: also report per interval (seconds)"
    )
    parser.add_argument("--ttl", type=float, default=3600.0, help="lease TTL (seconds)")
    parser.add_argument("--queue", default="bench")
    parser.add_argument("--job-prefix", default="", help="floor-renewals: leased jobs' id prefix")
    parser.add_argument("--pool-size", type=int, default=20, help="floor modes on PostgreSQL")
    parser.add_argument("--tag", default="bench", help="prefix of job ids and keys")
    parser.add_argument("--out", help="write the result (JSON) here, else to stdout")
    parser.add_argument(
        "--go-file", help="writes: once the leases are taken, wait for this file to exist"
    )
    parser.add_argument(
        "--check-target",
        help="writes with --interval: the URL the loops write to instead during the last "
        "--check-seconds of each interval (the soak's bare proxy)",
    )
    parser.add_argument("--check-seconds", type=float, default=0.0)
    return parser


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.mode == "writes":
        result = await mode_writes(args)
    elif args.mode == "claims":
        result = await mode_claims(args)
    elif args.mode == "renewals":
        result = await mode_renewals(args)
    else:
        result = await mode_floor(args, args.mode.removeprefix("floor-"))
    result["mode"] = args.mode
    result["concurrency"] = args.concurrency
    floor = args.mode.startswith("floor-")
    result["load_generator"] = load_generator("the database's own" if floor else args.client)
    result["driver_pid"] = os.getpid()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run_on_loop(run(args))
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            out.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
