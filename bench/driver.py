"""The load driver: one process, asyncio, N concurrent closed loops.

Its HTTP client (``--client``): ``lean`` (the default), the gateway's own client
(``gateway/upstream/``: an ``asyncio.Protocol`` per pooled connection, answers
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

The loops and their bookkeeping are ``bench.loops``; the raw SQL floors' modes are
``bench.floors``. This module is the HTTP modes and the command.
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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

if __package__ in (None, ""):  # run as a file: python bench/driver.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import run as run_on_loop
from bench.floors import mode_floor
from bench.loops import EMPTY, OK, Op, _error, run_loops, split
from gateway.upstream import UpstreamClient

# Printed once the writes' leases are taken; with --go-file the driver then waits for that
# file, so the orchestrator can gather statistics of a database that holds the leases.
LEASES_TAKEN = "bench leases taken"
CLIENTS = ("aiohttp", "lean")


def load_generator(client: str) -> str:
    return f"bench.driver: {client} client, one closed loop per connection"


WRITE_BODY = b'{"amount":1250,"currency":"EUR","customer":"cus_bench","description":"bench"}'
FAKE_TOKEN = "fgl_" + "A" * 32
JSON_HEADERS = {"Content-Type": "application/json"}

# One POST of the timed phase: (url, body, headers) -> (status, body).
Post = Callable[[str, bytes, dict[str, str]], Awaitable[tuple[int, bytes]]]


# -- HTTP modes ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def poster(
    client: str, session: aiohttp.ClientSession, concurrency: int, timeout: float = 60.0
) -> AsyncIterator[Post]:
    """The timed phase's POST, through the chosen client (``--client``); ``timeout``:
    the lean client's deadline per request (aiohttp's is the session's)."""
    if client == "aiohttp":

        async def post_aiohttp(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
            async with session.post(url, data=body, headers=headers) as resp:
                return resp.status, await resp.read()

        yield post_aiohttp
        return
    lean = UpstreamClient(connections_per_host=concurrency + 8, keepalive_seconds=60)

    async def post_lean(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        async with await lean.request(
            "POST", url, headers.items(), body, timeout=timeout, connect_timeout=10
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
