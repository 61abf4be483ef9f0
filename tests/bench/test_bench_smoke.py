"""The benchmark's smoke run (``python -m bench.run --quick``): it starts every target in
its own process, drives each, and reports every row. This checks that it works, never its
speed: the numbers come from a full local run (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
import pytest

ROOT = Path(__file__).resolve().parents[2]
# A run's own limit; stopping it (TERM, then the group KILLed after STOP_GRACE) fits
# inside pytest's timeout for these tests (pytestmark), so the test itself always stops
# the run and removes its folder, whatever happens.
TIMEOUT = 150
STOP_GRACE = 20
pytestmark = pytest.mark.timeout(TIMEOUT + STOP_GRACE + 30)
# The smoke run's work, shrunk to pass on a loaded 2-core machine (it checks that every
# row is reported, never a speed): short runs, a small claim queue.
SMALL = ("--duration", "0.4", "--warmup", "0.1", "--seed-jobs", "200", "--claim-jobs", "2000")


def run_stopped(argv: list[str], timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (a benchmark) in a session of its own, its temporary files in a folder
    of its own (TMPDIR); on every path out, timeouts and pytest's own included, the run is
    stopped (TERM: it stops its servers and drops its database; then its whole process
    group KILLed) and the folder removed, so nothing is left to disturb the next test."""
    scratch = Path(tempfile.mkdtemp(prefix="fencegate-bench-smoke-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    env["TMPDIR"] = str(scratch)
    process = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, KILLed whole if need be
    )
    try:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                out, err = process.communicate(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                out, err = "", "(no output: the run did not stop within the grace)"
            pytest.fail(f"{argv[1:4]} took over {timeout} s:\n{out}\n{err}")
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()  # reaped, its pipes closed: no ResourceWarning later
        shutil.rmtree(scratch, ignore_errors=True)


def run_without_tools(module: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``python -m module --backends sqlite`` with a PATH that holds nothing: a bench
    whose tool (wrk, valgrind) is missing must say so and start nothing."""
    (tmp_path / "bin").mkdir()
    return subprocess.run(
        [sys.executable, "-m", module, "--backends", "sqlite"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(tmp_path / "bin")},
        cwd=ROOT,
        check=False,
    )


def run_quick(*args: str) -> subprocess.CompletedProcess[str]:
    return run_stopped([sys.executable, "-m", "bench.run", "--quick", *args])


def test_a_run_that_overstays_is_stopped_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeout path: a run that ignores TERM and has a child of its own is KILLed
    with its group, reaped, and its temporary folder removed."""
    said = tmp_path / "said"
    script = (
        "import os, signal, subprocess, sys, tempfile, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "folder = tempfile.mkdtemp()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "open(sys.argv[1], 'w').write(f'{os.getpgid(0)} {folder}')\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "STOP_GRACE", 1)
    with pytest.raises(pytest.fail.Exception, match="took over 3 s"):
        run_stopped([sys.executable, "-c", script, str(said)], timeout=3)
    group, folder = said.read_text().split(" ", 1)
    assert not Path(folder).exists()
    deadline = time.monotonic() + 10  # the orphaned child: KILLed, then reaped by init
    while time.monotonic() < deadline:
        try:
            os.killpg(int(group), 0)
        except ProcessLookupError:
            return  # the group is gone, the child included
        time.sleep(0.05)
    pytest.fail(f"process group {group} outlived the run")


@pytest.mark.postgres
def test_quick_benchmark_reports_every_target(pg_database_url: str, tmp_path: Path) -> None:
    # pg_database_url: skips locally / fails in CI when PostgreSQL is unreachable; the
    # benchmark creates (and drops) its own database on that server.
    out = tmp_path / "out.json"
    result = run_quick(
        *SMALL, "--backends", "sqlite,postgres", "--postgres-url", pg_database_url,
        "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    doc = json.loads(out.read_text())
    assert doc["failures"] == []
    rows = doc["rows"]

    writes = {(r["target"], r["backend"]) for r in rows if r["section"] == "writes"}
    assert writes == {
        ("upstream direct (reference)", None),
        ("bare aiohttp proxy (floor)", None),
        ("fencegate sqlite", "sqlite"),
        ("fencegate postgres", "postgres"),
    }
    lease = {(r["operation"], r["backend"], r["path"]) for r in rows if r["section"] == "lease"}
    assert lease == {
        (operation, backend, path)
        for operation in ("claims", "renewals")
        for backend in ("sqlite", "postgres")
        for path in ("HTTP API", "raw SQL")
    } | {("renewals", backend, "HTTP alone") for backend in ("sqlite", "postgres")} | {
        # PostgreSQL's renewals also against HTTP and the store's batched statement alone.
        ("renewals", "postgres", "HTTP + batched SQL")
    }
    for row in rows:
        name = row.get("target") if row["section"] == "writes" else row["operation"]
        assert row["ok"] > 0 and row["rps"] > 0, (name, row)
        assert row["errors"] == 0, (name, row["error_samples"])
        assert row["p50_ms"] > 0 and row["p99_ms"] >= row["p50_ms"], (name, row)

    gateways = [r for r in rows if r["section"] == "writes" and r["backend"] is not None]
    for row in gateways:
        # Ratios and verdicts are computed (not judged here) and the gateway's memory read.
        assert row["rps_ratio"] is not None and row["p99_ratio"] is not None
        assert row["rss_peak_mib"] and row["rss_start_mib"] and row["rss_end_mib"]
    [pg] = [r for r in gateways if r["backend"] == "postgres"]
    # Statistics were gathered with the leases taken (16 jobs here), not before.
    assert pg["stats"] == "fresh" and pg["planner_rows"]["leases"] >= 16, pg["planner_rows"]
    assert pg["autovacuum"] in ("on", "off") and pg["jobs"] == 16
    assert pg["load_generator"].startswith("bench.driver: lean client")
    table = result.stdout
    assert "bare aiohttp proxy (floor)" in table and "fencegate postgres" in table
    assert "not judged" in table
    # Beside the gateway's renewals, aiohttp's own CPU per renewal (HTTP alone) and the
    # rest, wherever both were sampled (a one-second run can miss a sample on a busy box).
    for backend in ("sqlite", "postgres"):
        cpu = [
            r["server_cpu_ms_per_request"]
            for r in rows
            if r["section"] == "lease"
            and r["backend"] == backend
            and r["operation"] == "renewals"
            and r["path"] in ("HTTP API", "HTTP alone")
        ]
        line = f"renewals on {backend}: the gateway's CPU"
        assert (line in table) == all(cpu), (cpu, table)
    [lean] = [r for r in rows if r["section"] == "lease" and r["path"] == "HTTP + batched SQL"]
    assert lean["ratio"] is not None and lean["ratio"] > 0, lean


def autovacuum(url: str) -> str:
    async def show() -> str:
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            return str(await conn.fetchval("SHOW autovacuum"))
        finally:
            await conn.close()

    return asyncio.run(show())


@pytest.mark.postgres
def test_quick_soak_reports_each_interval(pg_database_url: str, tmp_path: Path) -> None:
    """The soak mode: fenced writes only, on each database, throughput and p99 per
    interval and the last interval against the first (never judged in --quick)."""
    out = tmp_path / "soak.json"
    before = autovacuum(pg_database_url)
    wanted = "on" if before == "off" else "off"
    result = run_quick(
        "--soak", "3", "--soak-interval", "1", "--soak-bare", "--backends", "sqlite,postgres",
        "--postgres-url", pg_database_url, "--json", str(out), "--autovacuum", wanted,
    )  # fmt: skip
    assert autovacuum(pg_database_url) == before  # the server's setting is put back
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "last vs first: throughput" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    # The bare proxy soaked first, for the same length: the machine's drift, not judged.
    [bare] = [r for r in rows if r["backend"] is None]
    assert bare["target"].startswith("bare") and "soak_flat" not in bare
    assert "the machine's own drift, not judged" in result.stdout
    assert "fitted trend over the soak" in result.stdout
    assert {r["backend"] for r in rows} == {None, "sqlite", "postgres"}
    for row in rows:
        assert [i["start_seconds"] for i in row["intervals"]] == [0, 1, 2]
        assert all(i["rps"] > 0 and i["p99_ms"] >= i["p50_ms"] > 0 for i in row["intervals"])
        assert isinstance(row["soak_trend"], float)
        if row["backend"] is not None:
            assert row["soak_rps_change"] is not None and row["soak_flat"] in (True, False)
    # PostgreSQL's side of a long run: the records each write left, and the WAL.
    [pg] = [r for r in rows if r["backend"] == "postgres"]
    assert pg["autovacuum"] == wanted
    assert pg["postgres_change"]["wal_bytes"] > 0
    # Autovacuum passes over the records table during the run (pg_stat_user_tables'
    # autovacuum_count, read before and after): a whole count, never more than the
    # table's total; none when the run turned autovacuum off (only an anti-wraparound
    # vacuum could run then, and a table this new is far from one). With autovacuum on,
    # whether a pass falls inside a 3-second run is up to the server: nothing more to
    # assert then.
    passes = pg["postgres_change"]["autovacuums"]
    assert passes >= 0 and passes == int(passes), passes
    assert pg["postgres_after"]["autovacuums"] >= passes
    if wanted == "off":
        assert passes == 0, passes
    assert pg["postgres_after"]["live_rows"] + pg["postgres_after"]["dead_rows"] > 0
    assert "bytes per write" in result.stdout
    # The hot tables' updates over the run and the share of them heap-only (HOT).
    hot = pg["hot_tables"]
    assert set(hot) == {"idempotency_records", "writes_in_flight", "fences", "audit_log", "jobs"}
    records = hot["idempotency_records"]
    assert records["updates"] > 0 and 0 <= records["hot_updates"] <= records["updates"]
    assert records["hot_share"] == records["hot_updates"] / records["updates"]
    assert all(t["mib"] > 0 for t in hot.values()), hot
    assert "heap-only (HOT) updates over the run, per table:" in result.stdout
    assert "  idempotency_records: " in result.stdout
    assert pg["soak_last_to_second"] == pg["intervals"][-1]["rps"] / pg["intervals"][1]["rps"]
    # PostgreSQL's background work, read once a second, per interval of the soak.
    seen = [i["postgres"] for i in pg["intervals"]]
    assert all(
        set(s) == {"vacuum_seconds", "autovacuums", "checkpoints", "buffers_checkpoint",
                   "buffers_backend", "wal_bytes", "dead_rows"}
        for s in seen
    ), seen  # fmt: skip
    assert sum(s["wal_bytes"] for s in seen) > 0  # the writes' WAL, minute by minute
    # Seconds of vacuum seen in a 1-second interval: from readings about a second apart;
    # passes seen per interval: never more than the run's own count.
    assert all(0 <= s["vacuum_seconds"] <= 2.5 for s in seen), seen
    assert sum(s["autovacuums"] for s in seen) <= passes
    assert "vacuum s" in result.stdout and "WAL MiB" in result.stdout
    [lite] = [r for r in rows if r["backend"] == "sqlite"]
    assert all("postgres" not in i for i in lite["intervals"])
    # SQLite's files, read once a second: the log's largest size and the database file.
    files = [i["sqlite"] for i in lite["intervals"]]
    assert all(set(f) == {"log_bytes_max", "file_bytes"} for f in files), files
    assert all(f["file_bytes"] > 0 and f["log_bytes_max"] >= 0 for f in files), files
    assert max(f["log_bytes_max"] for f in files) > 0  # the writes went through the log
    assert "log MiB (largest)" in result.stdout


def test_quick_soak_checks_the_bare_proxy_in_each_interval(tmp_path: Path) -> None:
    """With --soak-check the last part of each interval goes to the bare proxy, so each
    interval carries the machine's speed beside the gateway's and their ratio (shown; the
    verdict stays on the gateway's own numbers). Driven by aiohttp's client (``--client
    aiohttp``)."""
    out = tmp_path / "soak.json"
    result = run_quick(
        "--soak", "4", "--soak-interval", "2", "--soak-check", "0.5", "--backends", "sqlite",
        "--json", str(out), "--client", "aiohttp",
    )  # fmt: skip
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    [row] = json.loads(out.read_text())["rows"]  # no bare soak of its own: only the checks
    assert row["backend"] == "sqlite" and [i["start_seconds"] for i in row["intervals"]] == [0, 2]
    # Driven by aiohttp's client here (the other runs use the default, the lean one).
    assert row["load_generator"].startswith("bench.driver: aiohttp client")
    for i in row["intervals"]:
        assert i["check_rps"] > 0 and i["check_p99_ms"] >= i["check_p50_ms"] > 0, i
        assert i["rps_ratio"] == i["rps"] / i["check_rps"]
        assert i["p99_ratio"] == i["p99_ms"] / i["check_p99_ms"]
    first, last = row["intervals"]
    # The verdict stays on the gateway's own numbers; the ratios are shown beside them.
    assert row["soak_rps_change"] == last["rps"] / first["rps"] - 1
    assert row["soak_ratio_rps_change"] == last["rps_ratio"] / first["rps_ratio"] - 1
    assert row["soak_bare_rps_change"] == last["check_rps"] / first["check_rps"] - 1
    assert "as ratios to it" in result.stdout and "÷ bare" in result.stdout


def test_soak_checks_keep_each_phase_apart() -> None:
    """The driver's bookkeeping: what starts and ends in an interval's check counts for the
    bare proxy, what crosses a switch of target counts for neither."""
    from bench.loops import OK, Recorder

    rec = Recorder(100.0, 110.0, interval=5.0, check=1.0)
    assert rec.phase(99.0) == (-1, False)  # the warm-up: the gateway's
    assert rec.phase(103.9) == (0, False) and rec.phase(104.0) == (0, True)
    assert rec.phase(105.0) == (1, False) and rec.phase(109.5) == (1, True)
    rec.record(101.0, 101.1, OK)  # the gateway's, interval 0
    rec.record(104.2, 104.3, OK)  # the check's, interval 0
    rec.record(103.95, 104.05, OK)  # across the switch to the check: neither
    rec.record(104.95, 105.05, OK)  # across the switch back: neither
    rec.record(105.5, 105.6, OK)  # the gateway's, interval 1
    assert rec.ok == 2 and rec.per_second == {1: 1, 5: 1}
    assert {k: len(v) for k, v in rec.per_interval.items()} == {0: 1, 1: 1}
    assert {k: len(v) for k, v in rec.per_check.items()} == {0: 1}


def test_soak_options_are_checked() -> None:
    for args, message in (
        (["--soak", "0"], "--soak: must be above zero"),
        (["--soak", "2", "--soak-interval", "5"], "--soak-interval"),
        (["--soak", "2", "--duration", "5"], "the soak's length is --soak"),
        (["--soak-png", "x.png"], "--soak-png: only with --soak"),
        (["--soak-bare"], "--soak-bare: only with --soak"),
        (["--soak-check", "1"], "--soak-check: only with --soak"),
        (["--soak", "4", "--soak-interval", "2", "--soak-check", "1.5"], "at most half"),
        (["--soak", "4", "--soak-interval", "2", "--soak-check", "0"], "above zero"),
    ):
        result = run_quick(*args)
        assert result.returncode != 0 and message in result.stderr, (args, result.stderr)


def test_the_soaks_trend_is_the_fitted_lines_change() -> None:
    """One noisy interval moves last-against-first a lot and the fitted trend little."""
    from bench.report import soak_trend

    assert soak_trend([100.0, 100.0, 100.0]) == 0.0
    assert abs(soak_trend([90.0, 100.0, 110.0]) - 0.2) < 1e-9  # +20 % of the mean
    flat_with_a_dip = [100.0] * 9 + [80.0]
    assert round(flat_with_a_dip[-1] / flat_with_a_dip[0] - 1, 9) == -0.2  # last vs first
    assert -0.11 < soak_trend(flat_with_a_dip) < 0  # about half of it
    assert soak_trend([5.0]) == 0.0


def test_sqlite_growth_reports_each_step() -> None:
    """bench.sqlite_growth: the gateway's admit and settle in process, the cost per write
    at each step of the records table's growth (that it works, not its speed)."""
    result = run_stopped(
        [sys.executable, "-m", "bench.sqlite_growth", "--writes", "96", "--step", "48",
         "--jobs", "4", "--concurrency", "4"],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    steps = [json.loads(line) for line in result.stdout.splitlines()]
    assert [s["records"] for s in steps] == [48, 96]
    for s in steps:
        assert s["us_per_write"] > 0 and s["cpu_us_per_write"] > 0 and s["file_mib"] > 0, s
        assert s["writes_per_write"] > 0, s  # every write commits pages (Linux: /proc)
