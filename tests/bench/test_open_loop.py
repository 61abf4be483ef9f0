"""The open-loop mode (``python -m bench.run --open-loop``): its smoke run on SQLite (that
it works and reports every rate, never its speed) and the bookkeeping that makes it an
open loop: each request sent at its scheduled time, its latency counted from then."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from bench.breakdown import stalls_line
from bench.open_loop import (
    LATE_SECONDS,
    Tally,
    body_of,
    phases_of,
    run_slice,
    schedule,
    slice_order,
    slowest_phases,
)
from bench.options import Options, build_parser, options_from
from tests.bench.test_bench_smoke import run_quick


def test_quick_open_loop_reports_each_rate(tmp_path: Path) -> None:
    out = tmp_path / "open.json"
    result = run_quick(
        "--open-loop", "--rates", "20,40", "--slice", "0.5", "--backends", "sqlite",
        "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    doc = json.loads(out.read_text())
    assert doc["failures"] == [] and doc["options"]["open_loop"] is True
    [row] = doc["rows"]
    assert row["section"] == "open-loop" and row["backend"] == "sqlite"
    assert row["jobs"] == 16 and row["body_bytes"] == 1024 and row["slice_seconds"] == 0.5
    assert [r["rate"] for r in row["rates"]] == [20, 40]
    for r in row["rates"]:
        for target in ("gateway", "bare"):
            seen = r[target]
            # 1 s at the rate, in two slices of 0.5 s (the warm-up ones not counted).
            assert seen["sent"] == r["rate"] and seen["ok"] == seen["sent"], (target, r)
            assert seen["errors"] == 0 and seen["late"] == 0, (target, row["error_samples"])
            assert seen["p99_ms"] >= seen["p50_ms"] > 0 and seen["achieved_rps"] > 0, seen
        assert r["added_p50_ms"] == r["gateway"]["p50_ms"] - r["bare"]["p50_ms"]
        assert r["added_p99_ms"] == r["gateway"]["p99_ms"] - r["bare"]["p99_ms"]
        assert r["saturated"] is False and r["in_flight_peak"] >= 1
    assert row["saturated_at"] is None and "transactions" not in row  # PostgreSQL only
    table = result.stdout
    assert "added p50" in table and "answered/s gw/bare" in table
    # Where the slowest writes' time went, from each answer's Server-Timing: real phases.
    for r in row["rates"]:
        slowest = r["gateway"]["slowest"]
        assert slowest["writes"] == 1 and slowest["of"] == r["gateway"]["ok"], slowest
        phases = slowest["phases"]
        assert {"read-body", "admit", "upstream", "between", "outside"} <= set(phases)
        assert phases["admit"]["median_ms"] > 0 and phases["upstream"]["max_ms"] > 0
        assert slowest["top_cause"] in phases
        assert "slowest" not in r["bare"]  # the bare proxy says nothing of its phases
        assert f"the slowest 1 % at {r['rate']:g}/s, 1 of " in table
        cpu = r["cpu_ms_per_request"]
        assert cpu["gateway_ms"] > 0 and cpu["ratio"] == cpu["gateway_ms"] / cpu["bare_ms"]
        assert f"CPU at {r['rate']:g}/s: the gateway " in table
    assert "top cause: " in table
    stalls = sum(len(r["gateway"]["slowest"]["stalls"]) for r in row["rates"])
    assert ("writes over 10 ms; the largest phase of each: " in table) == (stalls > 0)
    assert "the gateway kept up at every rate (saturated: over 1 % late by 1 s" in table


def test_a_request_held_up_by_a_slow_answer_counts_its_wait() -> None:
    """One connection (a lock): the first answer takes 0.3 s, the others 0.01 s. The
    requests scheduled meanwhile are sent on time and wait; each one's latency runs from
    its scheduled start, so the wait is in it (a closed loop would have counted 0.01 s)."""

    async def scenario() -> tuple[Tally, int]:
        connection = asyncio.Lock()
        answered = 0

        async def send() -> bool:
            nonlocal answered
            async with connection:
                await asyncio.sleep(0.3 if answered == 0 else 0.01)
                answered += 1
            return True

        tally = Tally()
        peak = await run_slice(send, rate=20.0, seconds=0.2, tally=tally)
        return tally, peak

    tally, peak = asyncio.run(scenario())
    assert tally.sent == tally.ok == 4 and tally.errors == 0
    first, *held = tally.latencies
    assert 0.3 <= first < 0.4
    # Scheduled at 0.05, 0.10, 0.15 s, answered at about 0.31, 0.32, 0.33 s.
    for i, latency in enumerate(held, start=1):
        assert latency >= 0.3 + 0.01 * i - 0.05 * i - 0.005, (i, latency)
    # The schedule never waited for the answers: every request started on time and all
    # four were in flight at once.
    assert max(tally.lags) < 0.05 and peak == 4
    # Answered from about 0.30 to 0.33 s: three answers after the first in 0.03 s.
    assert tally.answers_spanned == 3 and 0.02 < tally.answers_span < 0.1


def test_tally_counts_from_the_scheduled_start() -> None:
    tally = Tally()
    tally.record(scheduled=10.0, started=10.001, ended=10.005, ok=True)
    tally.record(scheduled=10.1, started=10.1, ended=10.1 + LATE_SECONDS + 0.2, ok=True)
    tally.record(scheduled=10.2, started=11.0, ended=11.5, ok=True)  # the client fell behind
    tally.record(scheduled=10.3, started=10.3, ended=10.4, ok=False)
    assert list(tally.latencies) == pytest.approx([0.005, LATE_SECONDS + 0.2, 1.3])
    assert list(tally.lags) == pytest.approx([0.001, 0.0, 0.8, 0.0])
    assert (tally.sent, tally.ok, tally.late, tally.errors) == (4, 3, 2, 1)
    assert tally.saturated(rate=1.0)  # 3 of 4 late or failed: over 1 %
    summary = tally.summary(rate=1.0)
    assert summary["saturated"] is True and summary["max_ms"] == pytest.approx(1300)
    calm = Tally()
    for i in range(200):
        calm.record(i / 100, i / 100, i / 100 + (2.0 if i == 0 else 0.01), ok=True)
    calm.answers_span, calm.answers_spanned = 1.99, 199  # answered at 100/s
    assert calm.late == 1 and not calm.saturated(rate=100)  # 0.5 % late: it keeps up
    assert calm.answered_rps() == pytest.approx(100)
    # Nothing late, but answered at 80/s of 100/s asked: it cannot keep up either.
    assert calm.saturated(rate=125) and not calm.saturated(rate=110)


def test_schedule_and_turns() -> None:
    assert schedule(5.0, 4.0, 1.0) == [5.0, 5.25, 5.5, 5.75]
    assert schedule(0.0, 1.0, 0.1) == [0.0]  # at least one request
    # Gateway first in one pair of slices, the bare proxy first in the next.
    assert slice_order(3) == ["gateway", "bare", "bare", "gateway", "gateway", "bare"]
    body = body_of(1024)
    assert len(body) == 1024 and json.loads(body)["amount"] == 1250


def test_open_loop_options() -> None:
    def parse(*argv: str) -> Options:
        return options_from(build_parser().parse_args(list(argv)))

    opts = parse("--open-loop", "--rates", "50,100", "--seconds", "3", "--db", "postgres")
    assert opts.rates == (50.0, 100.0) and opts.duration == 3.0
    assert opts.backends == ["postgres"] and opts.jobs == 64
    assert opts.slice == 1.0 and opts.xact_writes == 200
    full = parse("--open-loop")
    assert full.rates == (50.0, 100.0, 300.0, 1000.0) and full.duration == 10.0
    assert parse().duration == 20.0 and parse().jobs == 256
    for argv, message in (
        (["--rates", "50"], "--rates: only with --open-loop"),
        (["--slice", "1"], "--slice: only with --open-loop"),
        (["--open-loop", "--rates", "50,0"], "above zero"),
        (["--open-loop", "--rates", "fast"], "a comma list"),
        (["--open-loop", "--soak", "5"], "one mode at a time"),
    ):
        with pytest.raises(SystemExit, match=message):
            parse(*argv)


def test_the_added_latency_is_judged_at_300_writes_a_second() -> None:
    from bench.report import judge_open_loop

    def row(*rates: tuple[float, float, float, bool]) -> dict[str, Any]:
        return {
            "rates": [
                {"rate": r, "added_p50_ms": p50, "added_p99_ms": p99, "saturated": sat}
                for r, p50, p99, sat in rates
            ]
        }

    cases = [
        (row((50, 5.0, 9.0, False), (300, 0.9, 2.9, False)), True),
        (row((300, 1.1, 2.0, False)), False),
        (row((300, 0.5, 3.5, False)), False),
        (row((300, 0.5, 1.0, True)), None),  # not kept up with: the saturation says it
        (row((50, 0.1, 0.1, False)), None),  # 300/s not run
    ]
    for given, verdict in cases:
        judge_open_loop(given)
        assert given["latency_ok"] is verdict, given


def test_the_slowest_writes_phases_come_from_their_server_timing() -> None:
    """The slowest 1 % (at least one) of the writes, each split by its Server-Timing:
    the gateway's own time between its phases and the time outside it are what is left."""
    timings = [(0.002, "admit;dur=0.5, upstream;dur=0.4, gateway;dur=1.2", 1.0)] * 199
    timings.append((0.030, "admit;dur=20.0, upstream;dur=0.5, gateway;dur=21.5", 7.0))
    timings.append((0.020, "admit;dur=12.0, upstream;dur=0.5, gateway;dur=13.0", 5.0))
    timings.append((0.025, "admit;dur=1, wait-older;dur=15, upstream;dur=0.5, gateway;dur=17", 6.0))
    slowest = slowest_phases(timings)
    assert slowest["writes"] == 3 and slowest["of"] == 202
    phases = slowest["phases"]
    assert phases["admit"]["max_ms"] == 20.0 and phases["admit"]["all_median_ms"] == 0.5
    assert phases["admit"]["median_ms"] == 12.0
    assert phases["wait-older"]["max_ms"] == 15.0 and phases["wait-older"]["median_ms"] == 0.0
    assert phases["between"]["max_ms"] == pytest.approx(1.0)  # 21.5 - 20.0 - 0.5
    assert phases["outside"]["max_ms"] == pytest.approx(8.5)  # 30 - 21.5
    assert (slowest["top_cause"], slowest["top_cause_writes"]) == ("admit", 2)
    # Every write over 10 ms is a stall, kept with its moment and phases.
    assert [(w["at_epoch"], w["latency_ms"]) for w in slowest["stalls"]] == [
        (5.0, 20.0),
        (6.0, 25.0),
        (7.0, 30.0),
    ]
    assert slowest["stalls"][2]["admit"] == 20.0
    line = stalls_line(slowest["stalls"])
    assert line == "3 writes over 10 ms; the largest phase of each: admit 2, wait-older 1"
    assert stalls_line([]) == "no write over 10 ms"
    assert phases_of(0.001, "admit;dur=0.2") == {"admit": 0.2}  # no total: nothing derived
