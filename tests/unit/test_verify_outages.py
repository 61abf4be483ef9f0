"""The store and shutdown nemeses of ``python -m verify run`` (``verify.outages``): where
``all`` takes them, what the plan draws, and the spans that excuse a held key from
invariant 13 (``verify.run.excused_windows``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from verify.nemesis import KINDS, plan
from verify.outages import (
    BUSY_TIMEOUT,
    LOCKED_AFTER,
    LOCKED_BEFORE,
    STOP_WAIT,
    WAITING,
)
from verify.run import SetupError, choose_nemeses, excused_windows
from verify.stack import ORDERING_WAIT_UNDER_SHUTDOWN, SHUTDOWN_GRACE_UNDER_NEMESIS


def test_all_takes_store_on_postgresql_and_shutdown_everywhere() -> None:
    """On SQLite ``store`` is named, not in ``all`` (its outage holds up every replica's
    start, which beside kill, shutdown and clock left the workload too little time)."""
    chosen, _ = choose_nemeses("all", "pg")
    assert {"store", "shutdown"} <= set(chosen)
    chosen, _ = choose_nemeses("all", "sqlite")
    assert "shutdown" in chosen and "store" not in chosen
    assert choose_nemeses("store,shutdown", "sqlite")[0] == ["store", "shutdown"]
    patroni, _ = choose_nemeses("all", "patroni")
    assert "shutdown" in patroni and "store" not in patroni
    with pytest.raises(SetupError, match="store needs --db"):
        choose_nemeses("store", "patroni")
    assert KINDS["store"].heal_when_aborting


def test_the_plan_draws_outages_past_the_busy_timeout_on_sqlite() -> None:
    for db, low, high in (("sqlite", BUSY_TIMEOUT + 0.2, BUSY_TIMEOUT + 1), ("pg", 1.0, 5.0)):
        faults = plan(5, ["store"], seconds=300, replicas=["a"], workers=[], db=db)
        assert len(faults) >= 8  # one at most every STORE_REST (20 s) after its healing
        assert all(low <= f.duration <= high for f in faults)
        assert {f.target for f in faults} == {"db"}
    stops = plan(5, ["shutdown"], seconds=120, replicas=["a", "b"], workers=[], db="pg")
    assert {f.target for f in stops} == {"a", "b"}
    assert all(0.4 <= f.params["slow"] <= 0.9 and 0.5 <= f.duration <= 3 for f in stops)


def test_half_the_shutdowns_on_sqlite_come_while_the_write_lock_is_held() -> None:
    """A locked shutdown (SIGTERM while the replica's admissions wait for the lock) is a
    draw of its own: leave its mark out and the plan is the one PostgreSQL's seed gives
    (the seed's plan as it was before locked shutdowns)."""
    shape: dict[str, Any] = {"seconds": 300, "replicas": ["a", "b"], "workers": []}
    on_sqlite = plan(7, ["shutdown"], db="sqlite", **shape)
    locked = [f for f in on_sqlite if f.params.get("locked")]
    assert 0.25 * len(on_sqlite) <= len(locked) <= 0.75 * len(on_sqlite)
    unmarked = [
        replace(f, params={k: v for k, v in f.params.items() if k != "locked"}) for f in on_sqlite
    ]
    assert unmarked == plan(7, ["shutdown"], db="pg", **shape)
    assert not any(f.params.get("locked") for f in plan(7, ["shutdown"], db="pg", **shape))
    assert LOCKED_AFTER > SHUTDOWN_GRACE_UNDER_NEMESIS  # the grace ends while locked
    assert LOCKED_BEFORE + LOCKED_AFTER < BUSY_TIMEOUT  # the admissions still commit
    assert LOCKED_AFTER < STOP_WAIT  # and the replica ends before it is killed


def _faults(path: Path, lines: list[tuple[str, int, str, float, dict[str, Any]]]) -> None:
    with (path / "faults.jsonl").open("w") as out:
        for phase, index, kind, at, params in lines:
            doc = {"phase": phase, "time": at, "index": index, "kind": kind, "params": params}
            out.write(json.dumps(doc) + "\n")


def test_the_excused_spans(tmp_path: Path) -> None:
    _faults(
        tmp_path,
        [
            ("start", 0, "kill", 10, {}),
            ("end", 0, "kill", 12, {}),
            ("start", 1, "partition", 20, {"to": "database", "loss": None}),
            ("end", 1, "partition", 25, {"to": "database", "loss": None}),
            ("start", 2, "partition", 30, {"to": "upstream", "loss": 0.3}),
            ("end", 2, "partition", 31, {"to": "upstream", "loss": 0.3}),
            ("start", 3, "shutdown", 40, {"slow": 0.5}),  # the store fine: judged
            ("end", 3, "shutdown", 42, {"slow": 0.5}),
            ("start", 4, "shutdown", 50, {"slow": 0.5}),
            ("killed", 4, "shutdown", 56, {"slow": 0.5}),
            ("end", 4, "shutdown", 57, {"slow": 0.5}),
            ("start", 5, "store", 60, {"how": "exclusive-lock"}),
            ("start", 6, "shutdown", 62, {"slow": 0.5}),  # while the store is down
            ("end", 6, "shutdown", 64, {"slow": 0.5}),
            ("end", 5, "store", 70, {"how": "exclusive-lock"}),
            ("start", 7, "upstream", 80, {"mode": "5xx", "probability": 0.3}),
            ("end", 7, "upstream", 81, {"mode": "5xx", "probability": 0.3}),
            ("start", 8, "upstream", 90, {"mode": "cut", "probability": 0.3}),
            ("end", 8, "upstream", 91, {"mode": "cut", "probability": 0.3}),
            ("start", 9, "freeze", 100, {}),  # never ended: to the end
        ],
    )
    assert excused_windows(tmp_path) == [
        (10, 12),
        (30, 31),
        (50, 57),
        (62, 64),
        (80, 81),
        (100, float("inf")),
    ]


def test_the_shutdown_looks_for_a_write_waiting_behind_an_older_one() -> None:
    """The gauge the shutdown nemesis reads before its SIGTERM (``waiter``), and the
    ordering wait it is given to outlast the grace by more than a look takes."""
    text = (
        "# TYPE fencegate_gateway_waiting_requests gauge\n"
        'fencegate_gateway_waiting_requests{wait="first"} 3.0\n'
        'fencegate_gateway_waiting_requests{wait="older"} 2.0\n'
    )
    found = WAITING.search(text)
    assert found is not None and float(found[1]) == 2.0
    idle = WAITING.search(text.replace('"older"} 2.0', '"older"} 0.0'))
    assert idle is not None and float(idle[1]) == 0.0
    assert ORDERING_WAIT_UNDER_SHUTDOWN - SHUTDOWN_GRACE_UNDER_NEMESIS >= 0.5
