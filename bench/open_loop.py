"""The open-loop driver (``python -m bench.run --open-loop``): fenced writes at fixed
rates, each request sent at its scheduled time whatever happened to the ones before it.

A closed loop waits for an answer before it sends again, so a slow answer delays the
requests behind it and is counted once (coordinated omission). Here request i of a slice
is scheduled at ``t0 + i / rate`` and sent then, as a task of its own, on one keep-alive
client shared by all (``--client``, as the closed loops: the lean one by default; its
pool holds ``--pool`` connections per target, far more than a rate up to 1,000/s needs
while the target keeps up). Its latency runs from its **scheduled** start to its answer:
time spent waiting for the client, a connection or a slow answer before it counts.

The gateway and the bare proxy take turns in slices of ``--slice`` seconds at the same
rate (gateway first in one pair of slices, bare first in the next), so the machine's
drift hits both alike; each slice is drained (its answers awaited) before the next one
starts, so neither target's backlog lands in the other's slice. Per rate: one warm-up
slice each, not counted, then ``--seconds`` of slices each. Every request carries a
fresh ``Idempotency-Key``, a 1 KB JSON body and the ``Fencing-Token`` of one of
``--jobs`` jobs in turn, each holding a live lease taken through the control API
(``bench.driver.acquire_leases``); the bare proxy gets the very same requests.

A rate is *saturated* when more than 1 % of the gateway's requests were late by over
1 s or failed (an error, a timeout), or when its answers came at under 90 % of the rate
(from each slice's first answer to its last); the rates after it are not run. The result (JSON)
goes to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import secrets
import sys
import time
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

if __package__ in (None, ""):  # run as a file: python bench/open_loop.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import percentile
from bench.common import run as run_on_loop
from bench.driver import CLIENTS, acquire_leases
from gateway.upstream import UpstreamClient, UpstreamError

LATE_SECONDS = 1.0  # an answer this long after its scheduled start is late
SATURATED_SHARE = 0.01  # more than this share late or failed: the gateway cannot keep up
SATURATED_RATE = 0.9  # answering under this share of the rate: it cannot keep up either
TIMEOUT_SECONDS = 30.0  # a request unanswered this long is an error
TARGETS = ("gateway", "bare")
EPOCH_OFFSET = time.time() - time.perf_counter()  # perf_counter() readings as epoch seconds


def body_of(size: int) -> bytes:
    """A JSON body of exactly ``size`` bytes (a charge, padded)."""
    head = b'{"amount":1250,"currency":"EUR","customer":"cus_bench","description":"'
    return head + b"x" * max(0, size - len(head) - 2) + b'"}'


# One request: sent at its scheduled time, True when answered as a first write should be;
# or that and the answer's ``Server-Timing`` (the gateway's, ``gateway.server_timing``).
Send = Callable[[], Awaitable[bool | tuple[bool, str | None]]]
# The share of the slowest writes whose phases the breakdown shows (at least one write).
SLOWEST_SHARE = 0.01
# Every write slower than this is kept with its phases and moment too (a stall).
STALL_SECONDS = 0.010
# The breakdown's columns beyond the gateway's own steps: time outside the gateway's
# handler (the network, the driver, the event loop's queue before the handler ran, the
# answer's way back), and the gateway's own time between its timed phases.
OUTSIDE, BETWEEN = "outside", "between"


@dataclass
class Tally:
    """One target's requests at one rate, over its counted slices."""

    sent: int = 0
    ok: int = 0
    errors: int = 0
    late: int = 0  # answered, but over LATE_SECONDS after the scheduled start
    latencies: array[float] = field(default_factory=lambda: array("d"))  # ok answers only
    lags: array[float] = field(default_factory=lambda: array("d"))  # the client's own delay
    answers_span: float = 0.0  # seconds from each slice's first answer to its last
    answers_spanned: int = 0  # the answers after each slice's first
    # Each ok answer's latency, ``Server-Timing`` (when it had one) and scheduled start
    # (epoch seconds: the slowest ones' moments, to be read beside the database's logs).
    timings: list[tuple[float, str, float]] = field(default_factory=list)

    def record(
        self, scheduled: float, started: float, ended: float, ok: bool, timing: str | None = None
    ) -> None:
        """A request scheduled at ``scheduled``, whose task began at ``started`` (the
        client's own lag) and was answered at ``ended``. Its latency is ``ended -
        scheduled``: a request held up by the answers before it counts its wait."""
        self.sent += 1
        self.lags.append(started - scheduled)
        if not ok:
            self.errors += 1
            return
        self.ok += 1
        latency = ended - scheduled
        self.latencies.append(latency)
        if latency > LATE_SECONDS:
            self.late += 1
        if timing:
            self.timings.append((latency, timing, scheduled + EPOCH_OFFSET))

    def answered_rps(self) -> float:
        """Answers a second while a slice was being answered (each slice's first answer
        to its last): the rate itself when the target keeps up, its capacity when the
        answers queue up behind it."""
        return self.answers_spanned / self.answers_span if self.answers_span > 0 else 0.0

    def saturated(self, rate: float) -> bool:
        """More than 1 % of the requests late by over 1 s or failed, or answered at under
        90 % of the rate (a slice's queue is drained before the next, so a backlog that
        stays under 1 s still shows as the rate not answered)."""
        if not self.sent:
            return False
        failed = (self.late + self.errors) > SATURATED_SHARE * self.sent
        return failed or self.answered_rps() < SATURATED_RATE * rate

    def summary(self, rate: float) -> dict[str, Any]:
        lat = sorted(self.latencies)
        lags = sorted(self.lags)
        return {
            "sent": self.sent,
            "ok": self.ok,
            "errors": self.errors,
            "late": self.late,
            "achieved_rps": self.answered_rps(),
            "p50_ms": percentile(lat, 0.50) * 1000,
            "p90_ms": percentile(lat, 0.90) * 1000,
            "p99_ms": percentile(lat, 0.99) * 1000,
            "max_ms": (lat[-1] * 1000) if lat else 0.0,
            "client_lag_p99_ms": percentile(lags, 0.99) * 1000,
            "saturated": self.saturated(rate),
            **({"slowest": slowest_phases(self.timings)} if self.timings else {}),
        }


def phases_of(latency: float, timing: str) -> dict[str, float]:
    """One answer's phases, ms: its ``Server-Timing`` entries (``name;dur=ms``), what the
    gateway spent between them (``between``: its ``gateway`` total less the others) and
    the time outside its handler (``outside``: the latency less that total)."""
    phases: dict[str, float] = {}
    for entry in timing.split(","):
        name, _, rest = entry.strip().partition(";dur=")
        if rest:
            phases[name] = phases.get(name, 0.0) + float(rest)
    total = phases.pop("gateway", None)
    if total is not None:
        phases[BETWEEN] = max(0.0, total - sum(phases.values()))
        phases[OUTSIDE] = max(0.0, latency * 1000 - total)
    return phases


def slowest_phases(timings: Sequence[tuple[float, str, float]]) -> dict[str, Any]:
    """Where the slowest 1 % of the writes (at least one) spent their time: per phase its
    median and max among them, and its median over all writes; the top cause, the phase
    that took the most of most of them (how many); and every stall (a write over
    ``STALL_SECONDS``) with when it was sent and its phases."""
    ordered = sorted(timings, key=lambda t: t[0])
    count = max(1, math.ceil(len(ordered) * SLOWEST_SHARE))
    slow = [phases_of(latency, timing) for latency, timing, _ in ordered[-count:]]
    every = [phases_of(latency, timing) for latency, timing, _ in ordered]
    names = list(dict.fromkeys(name for phases in every for name in phases))
    table = {}
    for name in names:
        mine = sorted(p.get(name, 0.0) for p in slow)
        table[name] = {
            "median_ms": percentile(mine, 0.5),
            "max_ms": mine[-1],
            "all_median_ms": percentile(sorted(p.get(name, 0.0) for p in every), 0.5),
        }
    tops = Counter(max(p, key=lambda name: p[name]) for p in slow if p)
    cause, times = tops.most_common(1)[0] if tops else ("-", 0)
    return {
        "writes": count,
        "of": len(ordered),
        "latency_min_ms": ordered[-count][0] * 1000,
        "latency_max_ms": ordered[-1][0] * 1000,
        "phases": table,
        "top_cause": cause,
        "top_cause_writes": times,
        "stalls": [
            {"at_epoch": at, "latency_ms": latency * 1000, **phases_of(latency, timing)}
            for latency, timing, at in ordered
            if latency > STALL_SECONDS
        ],
    }


def schedule(t0: float, rate: float, seconds: float) -> list[float]:
    """The scheduled starts of one slice: ``t0 + i / rate`` for as many requests as the
    slice holds at that rate (at least one)."""
    count = max(1, round(rate * seconds))
    return [t0 + i / rate for i in range(count)]


async def run_slice(
    send: Send,
    rate: float,
    seconds: float,
    tally: Tally | None,
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """Send ``rate * seconds`` requests, each at its scheduled time as a task of its own
    (the scheduler never waits for an answer), then wait for all their answers. Records
    each into ``tally`` (None: a warm-up). Returns the most requests in flight at once."""
    tasks: set[asyncio.Task[None]] = set()
    in_flight = peak = 0
    t0 = clock()
    answers: list[float] = []  # when each ok answer came

    async def one(at: float) -> None:
        nonlocal in_flight
        started = clock()
        timing = None
        try:
            answer = await send()
            ok, timing = answer if isinstance(answer, tuple) else (answer, None)
        except (aiohttp.ClientError, UpstreamError, OSError, TimeoutError):
            ok = False
        ended = clock()
        in_flight -= 1
        if tally is not None:
            tally.record(at, started, ended, ok, timing)
            if ok:
                answers.append(ended)

    for at in schedule(t0, rate, seconds):
        delay = at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        in_flight += 1
        peak = max(peak, in_flight)
        task = asyncio.get_running_loop().create_task(one(at))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    while tasks:
        await asyncio.gather(*list(tasks))
    if tally is not None and len(answers) > 1:
        tally.answers_span += max(answers) - min(answers)
        tally.answers_spanned += len(answers) - 1
    return peak


def slice_order(pairs: int) -> list[str]:
    """The targets' turns at one rate: gateway then bare, then bare then gateway, ..."""
    order: list[str] = []
    for pair in range(pairs):
        order += list(TARGETS) if pair % 2 == 0 else list(reversed(TARGETS))
    return order


def rate_row(rate: float, tallies: dict[str, Tally], peak: int) -> dict[str, Any]:
    gateway, bare = tallies["gateway"].summary(rate), tallies["bare"].summary(rate)
    return {
        "rate": rate,
        "gateway": gateway,
        "bare": bare,
        "added_p50_ms": gateway["p50_ms"] - bare["p50_ms"],
        "added_p99_ms": gateway["p99_ms"] - bare["p99_ms"],
        "in_flight_peak": peak,
        "saturated": gateway["saturated"],
    }


async def run_rates(
    senders: dict[str, Send], rates: Sequence[float], seconds: float, slice_seconds: float
) -> list[dict[str, Any]]:
    """Every rate in order, up to and including the first the gateway saturates at."""
    rows = []
    pairs = max(1, math.ceil(seconds / slice_seconds - 1e-9))
    for rate in rates:
        began = time.time()
        for target in TARGETS:  # warm-up: connections opened, caches filled, not counted
            await run_slice(senders[target], rate, slice_seconds, None)
        tallies = {t: Tally() for t in TARGETS}
        peak = 0
        for target in slice_order(pairs):
            peak = max(peak, await run_slice(senders[target], rate, slice_seconds, tallies[target]))
        row = rate_row(rate, tallies, peak)
        row["start_epoch"], row["end_epoch"] = began, time.time()
        rows.append(row)
        g, b = row["gateway"], row["bare"]
        print(
            f"open loop {rate:g}/s: gateway p50 {g['p50_ms']:.2f} p99 {g['p99_ms']:.2f} ms, "
            f"bare p50 {b['p50_ms']:.2f} p99 {b['p99_ms']:.2f} ms, "
            f"late {g['late']}/{b['late']}, errors {g['errors']}/{b['errors']}",
            flush=True,
        )
        if row["saturated"]:
            print(f"open loop: the gateway saturates at {rate:g}/s; stopping", flush=True)
            break
    return rows


_ERRORS: list[str] = []


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    body = body_of(args.body_bytes)
    job_ids = [f"{args.tag}-o{i}" for i in range(args.jobs)]
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=args.pool)
    async with (
        aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=TIMEOUT_SECONDS),
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent",),
        ) as session,
        timed_poster(args.client, session, args.pool) as post,
    ):
        tokens = await acquire_leases(session, args.control, job_ids, args.ttl)
        prefix = f"{args.tag}-{secrets.token_hex(3)}"

        def sender(target: str, url: str) -> Send:
            cycle = itertools.cycle(tokens)
            counter = itertools.count()

            async def send() -> tuple[bool, str | None]:
                headers = {
                    "Fencing-Token": next(cycle),
                    "Idempotency-Key": f"{prefix}-{target}-{next(counter)}",
                    "Content-Type": "application/json",
                }
                status, answer, timing = await post(url, body, headers)
                if status != 201 and len(_ERRORS) < 5:
                    _ERRORS.append(f"{target} {status}: {answer[:300].decode(errors='replace')}")
                return status == 201, timing

            return send

        senders = {"gateway": sender("gateway", args.gateway), "bare": sender("bare", args.bare)}
        began = time.time()
        rows = await run_rates(senders, args.rates, args.seconds, args.slice)
    return {
        "rates": rows,
        "saturated_at": next((r["rate"] for r in rows if r["saturated"]), None),
        "window_start_epoch": began,
        "window_end_epoch": time.time(),
        "error_samples": list(_ERRORS),
        "jobs": args.jobs,
        "body_bytes": len(body),
        "pool_per_target": args.pool,
        "slice_seconds": args.slice,
        "seconds_per_rate": args.seconds,
        "load_generator": f"bench.open_loop: {args.client} client, a task per request at "
        f"its scheduled time, up to {args.pool} connections per target",
        "driver_pid": os.getpid(),
    }


# A POST through the chosen client: the answer's status, body and ``Server-Timing``.
TimedPost = Callable[[str, bytes, dict[str, str]], Awaitable[tuple[int, bytes, str | None]]]


@contextlib.asynccontextmanager
async def timed_poster(
    client: str, session: aiohttp.ClientSession, pool: int
) -> AsyncIterator[TimedPost]:
    """``bench.driver.poster``'s POST, keeping the answer's ``Server-Timing`` header."""
    if client == "aiohttp":

        async def post_aiohttp(
            url: str, body: bytes, headers: dict[str, str]
        ) -> tuple[int, bytes, str | None]:
            async with session.post(url, data=body, headers=headers) as resp:
                return resp.status, await resp.read(), resp.headers.get("Server-Timing")

        yield post_aiohttp
        return
    lean = UpstreamClient(connections_per_host=pool + 8, keepalive_seconds=60)

    async def post_lean(
        url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None]:
        async with await lean.request(
            "POST", url, headers.items(), body, timeout=TIMEOUT_SECONDS, connect_timeout=10
        ) as resp:
            timing = next((v for k, v in resp.headers if k.lower() == "server-timing"), None)
            return resp.status, await resp.read(), timing

    try:
        yield post_lean
    finally:
        await lean.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Fencegate's open-loop benchmark driver.")
    parser.add_argument("--gateway", required=True, help="the gateway's URL to POST to")
    parser.add_argument("--bare", required=True, help="the bare proxy's URL to POST to")
    parser.add_argument("--control", required=True, help="the gateway's control listener")
    parser.add_argument(
        "--rates",
        type=lambda text: [float(r) for r in text.split(",") if r.strip()],
        default=[50.0, 100.0, 300.0, 1000.0],
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="per rate and target")
    parser.add_argument("--slice", type=float, default=1.0, help="seconds of each slice")
    parser.add_argument("--jobs", type=int, default=64, help="jobs holding a live lease")
    parser.add_argument("--body-bytes", type=int, default=1024)
    parser.add_argument("--pool", type=int, default=512, help="connections per target")
    parser.add_argument("--client", choices=CLIENTS, default="lean")
    parser.add_argument("--ttl", type=float, default=3600.0, help="lease TTL (seconds)")
    parser.add_argument("--tag", default="open", help="prefix of job ids and keys")
    parser.add_argument("--out", help="write the result (JSON) here, else to stdout")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run_on_loop(main_async(args))
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
