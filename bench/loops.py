"""The measuring loops of the load driver: N concurrent closed loops over one operation
each, a warm-up thrown away, then only what starts and ends inside the timed window
counts (``Recorder``); throughput, percentiles and, for a soak, the same per interval."""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.common import percentile
from gateway.upstream import UpstreamError

OK, EMPTY, ERROR = "ok", "empty", "error"
LOAD_STARTED = "bench load started at"

Op = Callable[[], Awaitable[str]]


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


def split(items: Sequence[str], parts: int) -> list[list[str]]:
    """Loop i gets items i, i + parts, i + 2 * parts, ..."""
    return [list(items[i::parts]) or [items[i % len(items)]] for i in range(parts)]
