"""The pieces of ``verify run --stop-on-violation`` and ``verify mutants`` that need no
running system: the clock's skewed spans read from ``faults.jsonl``, the time of the
first safety violation, and the copy of the tree a mutant is applied to."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from verify import mutants
from verify.check import check
from verify.events import HistoryEvent, LedgerEntry, sha256_hex
from verify.mutants import copy_tree
from verify.mutations import MUTANTS
from verify.run import first_violation, skew_windows


def test_skew_windows_are_the_clock_faults_on_sqlite_only(tmp_path: Path) -> None:
    lines = [
        {"phase": "plan", "index": 0, "kind": "clock", "target": "replica-a"},
        {"phase": "start", "time": 10.0, "index": 0, "kind": "clock"},
        {"phase": "start", "time": 11.0, "index": 1, "kind": "pause"},
        {"phase": "end", "time": 15.5, "index": 0, "kind": "clock"},
        {"phase": "start", "time": 20.0, "index": 2, "kind": "clock"},  # never ended
    ]
    (tmp_path / "faults.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert skew_windows(tmp_path, "sqlite") == [(10.0, 15.5), (20.0, float("inf"))]
    assert skew_windows(tmp_path, "pg") == []
    assert skew_windows(tmp_path / "none", "sqlite") == []


def test_first_violation_is_when_its_evidence_was_complete() -> None:
    body = sha256_hex(b"b")
    history = [
        HistoryEvent(time=1.0, process="w1", type="invoke", f="claim", job=""),
        HistoryEvent(time=2.0, process="w1", type="ok", f="claim", job="j", generation=1),
        HistoryEvent(time=3.0, process="w2", type="invoke", f="claim", job=""),
        HistoryEvent(time=4.0, process="w2", type="ok", f="claim", job="j", generation=2),
        HistoryEvent(
            time=5.0, process="w1", type="invoke", f="write", job="j", generation=1,
            key="k", body_sha256=body,
        ),
    ]  # fmt: skip
    ledger = [LedgerEntry(time=6.0, job="j", generation=1, key="k", body_sha256=body)]
    report = check(history, ledger)
    assert [v.invariant for v in report.violations] == [7, 8]  # liveness is not counted
    assert first_violation(report) == 6.0
    assert first_violation(check(history, [])) is None


def test_the_copy_holds_what_git_would_add_and_not_what_it_ignores(tmp_path: Path) -> None:
    source, dest = tmp_path / "src", tmp_path / "dest"
    source.mkdir()
    subprocess.run(["git", "init", "-q", str(source)], check=True)
    (source / ".gitignore").write_text("ignored/\n")
    (source / "pkg").mkdir()
    (source / "pkg" / "tracked.py").write_text("A = 1\n")
    subprocess.run(["git", "-C", str(source), "add", "."], check=True)
    (source / "pkg" / "new.py").write_text("B = 2\n")  # untracked, not ignored
    (source / "ignored").mkdir()
    (source / "ignored" / "run.log").write_text("x")
    assert copy_tree(source, dest) == 3
    assert (dest / "pkg" / "tracked.py").read_text() == "A = 1\n"
    assert (dest / "pkg" / "new.py").exists()
    assert not (dest / "ignored").exists()


def test_mutants_lists_the_catalogue_and_refuses_an_unknown_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert mutants.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(m.name in listed for m in MUTANTS)
    assert mutants.main(["--only", "fence-job-lease,no-such-mutant"]) == 2
    assert "no mutant named 'no-such-mutant'" in capsys.readouterr().out
    assert mutants.main(["--db", "oracle", "--only", "fence-job-lease"]) == 2
