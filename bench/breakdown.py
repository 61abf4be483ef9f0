"""Where the open loop's slowest writes spent their time (``bench.open_loop``'s
``slowest``, from each answer's ``Server-Timing``), and the gateway's CPU per fenced write
against the bare proxy's per request, as the report prints them."""

from __future__ import annotations

from collections import Counter
from typing import Any

# What each phase of the breakdown is (docs/performance.md, "Where a write's time goes").
PHASE_MEANING = {
    "check-lease": "the lease read before the body came",
    "take-slot": "a slot of the fenced pool",
    "read-body": "the body read and hashed",
    "admit": "the admission: the pool, the statement, its commit",
    "wait-first": "Prefer: wait for the key's first attempt",
    "wait-older": "older generations' writes to settle",
    "read-claim": "the claim read right before the send",
    "release": "a claim undone",
    "upstream": "the send to the upstream's answer head",
    "between": "the gateway's own work between the phases",
    "outside": "outside the handler: network, driver, the event loop's queue",
}


def cpu_per_request(rate_row: dict[str, Any], slice_seconds: float) -> dict[str, float] | None:
    """The gateway's CPU per fenced write and the bare proxy's per request over one rate's
    window (ms), and their ratio. Each process's CPU time over the window (its warm-up
    slice included) divided by the requests it was sent in it; None when a reading is
    missing."""
    cpu = rate_row.get("cpu_percent") or {}
    span = rate_row.get("end_epoch", 0.0) - rate_row.get("start_epoch", 0.0)
    if cpu.get("server") is None or cpu.get("bare") is None or span <= 0:
        return None
    warm = max(1, round(rate_row["rate"] * slice_seconds))
    gateway = 10 * cpu["server"] * span / (rate_row["gateway"]["sent"] + warm)
    bare = 10 * cpu["bare"] * span / (rate_row["bare"]["sent"] + warm)
    if not bare:
        return None
    return {"gateway_ms": gateway, "bare_ms": bare, "ratio": gateway / bare}


def cpu_line(rate: float, found: dict[str, float]) -> str:
    return (
        f"CPU at {rate:g}/s: the gateway {found['gateway_ms']:.3f} ms a fenced write, the bare "
        f"proxy {found['bare_ms']:.3f} ms a request: {found['ratio']:.2f}x"
    )


def slowest_lines(rate: float, slowest: dict[str, Any]) -> list[str]:
    """The table of the slowest writes' phases at one rate, and their top cause."""
    head = ["phase", "median ms", "max ms", "all writes' median ms", "what it is"]
    body = [
        [
            name,
            f"{seen['median_ms']:.2f}",
            f"{seen['max_ms']:.2f}",
            f"{seen['all_median_ms']:.2f}",
            PHASE_MEANING.get(name, ""),
        ]
        for name, seen in slowest["phases"].items()
    ]
    lines = [
        f"the slowest 1 % at {rate:g}/s, {slowest['writes']} of {slowest['of']} writes "
        f"({slowest['latency_min_ms']:.1f} to {slowest['latency_max_ms']:.1f} ms): where "
        "their time went (Server-Timing)",
        _table(head, body),
        f"top cause: {slowest['top_cause']} (the largest phase of {slowest['top_cause_writes']} "
        f"of {slowest['writes']})",
        stalls_line(slowest.get("stalls") or []),
    ]
    return lines


def stalls_line(stalls: list[dict[str, Any]]) -> str:
    """How many writes took over 10 ms, and how many of them each phase was the largest
    part of (each is in the JSON with its moment, to be read beside the server's logs)."""
    if not stalls:
        return "no write over 10 ms"
    largest = Counter(
        max((k for k in stall if k not in ("at_epoch", "latency_ms")), key=lambda k: stall[k])
        for stall in stalls
    )
    parts = ", ".join(f"{name} {count}" for name, count in largest.most_common())
    return f"{len(stalls)} writes over 10 ms; the largest phase of each: {parts}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for n, row in enumerate([header, *rows]):
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [c.ljust(w) if i in (0, 4) else c.rjust(w) for i, (c, w) in pairs]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
