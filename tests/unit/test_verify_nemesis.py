"""The failover nemesis of ``python -m verify run --db patroni``: which nemeses each
database allows, the plan's failovers, and the figures the summary reports."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from verify.events import HistoryEvent
from verify.nemesis import AFTER, plan
from verify.run import SetupError, choose_nemeses, failover_figures

SHA = "0" * 64


def test_each_database_has_its_own_database_nemesis() -> None:
    patroni, _ = choose_nemeses("all", "patroni")
    assert "failover" in patroni and "db-restart" not in patroni
    pg, _ = choose_nemeses("all", "pg")
    assert "db-restart" in pg and "failover" not in pg
    sqlite, _ = choose_nemeses("all", "sqlite")
    assert not {"db-restart", "failover"} & set(sqlite)
    with pytest.raises(SetupError, match="failover needs --db patroni"):
        choose_nemeses("failover", "pg")
    with pytest.raises(SetupError, match="db-restart needs --db pg"):
        choose_nemeses("db-restart", "patroni")


def test_the_plan_spaces_failovers_and_uses_both_ways() -> None:
    faults = plan(7, ["failover"], seconds=600, replicas=["a"], workers=["w"], db="patroni")
    assert len(faults) >= 20
    assert {f.params["how"] for f in faults} == {"switchover", "kill"}
    starts = [f.at for f in faults]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) >= 1.0 + AFTER["failover"]
    # Partitions to the database exist on Patroni as on one PostgreSQL.
    cuts = plan(3, ["partition"], seconds=300, replicas=["a", "b"], workers=[], db="patroni")
    assert "database" in {f.params["to"] for f in cuts}


def write(out: Path, completions: list[HistoryEvent]) -> None:
    """The history: each completion after its invocation."""
    lines = []
    for done in completions:
        lines.append(json.dumps(event(done.time, "invoke").to_json()))
        lines.append(json.dumps(done.to_json()))
    (out / "history.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def event(
    t: float, kind: str, status: int | None = None, reason: str | None = None
) -> HistoryEvent:
    return HistoryEvent(
        time=t, process="w0", type=kind, f="write", job="j", generation=1, key="k",  # type: ignore[arg-type]
        status=status, reason=reason, body_sha256=None if kind == "info" else SHA,
    )  # fmt: skip


def test_the_failover_figures(tmp_path: Path) -> None:
    write(
        tmp_path,
        [
            event(99.0, "ok", 201),  # before: not counted
            event(101.0, "fail", 503, "store-unavailable"),
            event(102.0, "info"),
            event(103.0, "fail", 503, "store-unavailable"),
            event(104.5, "ok", 201),  # the first answered after the new primary (104)
            event(105.0, "fail", 503, "store-unavailable"),  # after: not counted
        ],
    )
    failovers = [
        {"how": "kill", "healthy_before": True, "began": 100.0, "primary_at": 104.0},
        {"how": "switchover", "healthy_before": False, "began": 110.0, "primary_at": 112.0},
    ]
    figures = failover_figures(tmp_path, failovers)
    assert figures == {
        "count": 2,
        "without_primary": [3.0, 4.0],
        "longest": {"seconds": 4.0, "how": "kill", "healthy_before": True},
        "from_degraded": 1,
        "first_write_after": [0.5, 0.5],
        "store_unavailable": 2,
        "unknown": 1,
    }
    assert failover_figures(tmp_path, []) is None


def test_lock_loss_and_slow_answers_fall_early_in_every_plan_and_leave_the_rest_as_drawn() -> None:
    """A run with the lock workers always loses Redis's locks within its first 15 %
    (seed 2 drew its only one at 52.6 s of 60), and every run has answers slower than the
    gateway's timeout within its first 25 % (seed 1 drew none: the unknown-outcome
    mutants then rest on a freeze's timing). Each early fault is added beside the seed's
    own draw, which stays as it was, and overlaps no fault of its kind."""
    from verify import nemesis as nem

    for db in ("sqlite", "pg"):
        kinds = [k for k, kind in nem.KINDS.items() if kind.in_all_of(db)]
        pools = {"replicas": ["replica-a", "replica-b"], "workers": ["w0", "w1", "l0"]}
        for seed in range(1, 30):
            faults = nem.plan(seed, kinds, seconds=60, db=db, **pools)
            flushes = [f for f in faults if f.kind == "lock-loss" and f.params["how"] == "flush"]
            assert any(f.at <= 9 for f in flushes), seed
            slow = [f for f in faults if f.kind == "upstream" and f.params["mode"] == "slow"]
            assert any(f.at <= 15 and f.duration >= 1 for f in slow), seed
            upstream = sorted((f.at, f.at + f.duration) for f in faults if f.kind == "upstream")
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(upstream)), (seed, upstream)
            assert [f.index for f in faults] == list(range(len(faults)))
            with pytest.MonkeyPatch.context() as m:  # the seed's own draw alone
                m.setattr(nem, "EARLY", {})
                drawn = nem.plan(seed, kinds, seconds=60, db=db, **pools)
            kept = [(f.at, f.kind, f.params) for f in faults]
            assert all((f.at, f.kind, f.params) in kept for f in drawn), seed
            assert len(faults) - len(drawn) <= 4, seed


def test_on_postgresql_the_store_breaks_within_the_first_half_of_every_plan() -> None:
    """Where ``all`` breaks the store (PostgreSQL), every run has an outage of it within
    its first half, apart from the others by 3 s; SQLite's plans get none added."""
    from verify import nemesis as nem

    pools = {"replicas": ["replica-a", "replica-b", "replica-c"], "workers": ["w0", "w1"]}
    kinds = [k for k, kind in nem.KINDS.items() if kind.in_all_of("pg")]
    for seed in range(1, 30):
        faults = nem.plan(seed, kinds, seconds=90, db="pg", **pools)
        outages = sorted((f.at, f.at + f.duration) for f in faults if f.kind == "store")
        assert any(start <= 45 for start, _ in outages), seed
        assert all(a[1] + 3 <= b[0] for a, b in itertools.pairwise(outages)), (seed, outages)
    kinds = ["store", "shutdown"]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(nem, "EARLY", {})
        drawn = [nem.plan(s, kinds, seconds=60, db="sqlite", **pools) for s in range(1, 30)]
    assert drawn == [nem.plan(s, kinds, seconds=60, db="sqlite", **pools) for s in range(1, 30)]
