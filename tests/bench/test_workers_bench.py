"""``python -m bench.workers`` (serve --workers 2 against --workers 1, driven by wrk) in a
smoke run: it works and reports both runs and their ratio, never how fast. Sized to pass
on a loaded 2-core machine: SQLite only, one-second runs, a few connections. The run is
stopped with its whole process group on every path (``run_stopped``)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from bench.workers import WRK_MISSING
from tests.bench.test_bench_smoke import STOP_GRACE, TIMEOUT, run_stopped, run_without_tools
from tests.support import unavailable

pytestmark = pytest.mark.timeout(TIMEOUT + STOP_GRACE + 30)
SMALL = ("--duration", "1", "--warmup", "0", "--connections", "4", "--jobs", "4")


def test_two_workers_against_one_reports_both_runs_and_their_ratio(tmp_path: Path) -> None:
    if shutil.which("wrk") is None:
        unavailable("wrk", "install Debian's wrk package (apt-get install wrk)")
    out = tmp_path / "workers.json"
    result = run_stopped(
        [sys.executable, "-m", "bench.workers", "--backends", "sqlite", *SMALL, "--json", str(out)]
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    doc = json.loads(out.read_text())
    assert [(r["backend"], r["workers"]) for r in doc["runs"]] == [("sqlite", 1), ("sqlite", 2)]
    for run in doc["runs"]:
        assert run["requests"] > 0 and run["rps"] > 0, run
        assert run["non_2xx"] == 0 and run["socket_errors"] == 0, run
        assert run["p99_ms"] >= run["p50_ms"] > 0, run
    (ratio,) = doc["ratios"].values()
    assert ratio is not None and ratio > 0
    assert "sqlite   --workers 2 / --workers 1:" in result.stdout


def test_without_wrk_it_says_so_and_exits_2(tmp_path: Path) -> None:
    """No wrk on PATH: one sentence naming the package, exit 2, nothing started."""
    done = run_without_tools("bench.workers", tmp_path)
    assert done.returncode == 2, done
    assert done.stderr.strip() == WRK_MISSING
    assert done.stdout == ""
