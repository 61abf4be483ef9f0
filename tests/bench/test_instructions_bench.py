"""``python -m bench.instructions`` (instructions per fenced write against the bare
proxy's per request, counted by callgrind) in a smoke run: it starts both targets under
valgrind, counts, and reports the ratio; never how many. Sized for a loaded 2-core
machine: SQLite only, a few requests. The run is stopped with its whole process group on
every path (``run_stopped``)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from bench.instructions import VALGRIND_MISSING
from tests.bench.test_bench_smoke import STOP_GRACE, TIMEOUT, run_stopped, run_without_tools
from tests.support import unavailable

pytestmark = pytest.mark.timeout(TIMEOUT + STOP_GRACE + 30)
SMALL = ("--requests", "5", "--warmup", "3", "--jobs", "2")


def test_it_counts_both_targets_and_prints_their_ratio(tmp_path: Path) -> None:
    if shutil.which("valgrind") is None:
        unavailable("valgrind", "install Debian's valgrind package (apt-get install valgrind)")
    out = tmp_path / "instructions.json"
    result = run_stopped(
        [
            sys.executable,
            "-m",
            "bench.instructions",
            "--backends",
            "sqlite",
            *SMALL,
            "--json",
            str(out),
        ]
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    doc = json.loads(out.read_text())
    assert [c["target"] for c in doc["counts"]] == ["bare", "sqlite"]
    for count in doc["counts"]:
        assert count["requests"] == 5 and count["instructions"] > 0, count
    # A fenced write does everything the bare proxy does and more.
    assert doc["ratios"]["sqlite"] > 1, doc
    assert "instructions per fenced write / the bare proxy's per request" in result.stdout


def test_without_valgrind_it_says_so_and_exits_2(tmp_path: Path) -> None:
    """No valgrind on PATH: one sentence naming the package, exit 2, nothing started."""
    done = run_without_tools("bench.instructions", tmp_path)
    assert done.returncode == 2, done
    assert done.stderr.strip() == VALGRIND_MISSING
    assert done.stdout == ""
