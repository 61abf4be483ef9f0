"""``python -m verify run`` as a user runs it: real replicas, upstream, workers, faults.

(a) the baseline (workers straight to the upstream) under ``pause`` breaks the invariants;
(b, c) through the gateway, every nemesis the database allows breaks none, on SQLite and
on PostgreSQL with three replicas; (d) ``--seed`` repeats the fault plan; (e) the lock
workers under ``lock-loss``: the gateway binds a generation to its first holder (issue 44)
and breaks nothing (without the binding, invariant 12 breaks: the mutant
``source-generation-reissued``); (f) the etcd lock workers under ``etcd-loss``; (g) the
ZooKeeper lock workers under ``zk-loss``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import etcd_unavailable, postgres_unavailable, redis_unavailable, unavailable
from verify.cluster import PG_BIN
from verify.etcd_locks import etcd_binary
from verify.locks import redis_binary
from verify.zk_locks import zk_binary

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def verify(out: Path, *args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "verify", "run", "--out", str(out), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def summary(out: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((out / "run.json").read_text())
    return doc


def planned(out: Path) -> list[tuple[str, str, str]]:
    """The fault plan of a run: (kind, target, params), in order (no timings)."""
    lines = [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()]
    return [
        (f["kind"], f["target"], json.dumps(f["params"], sort_keys=True))
        for f in lines
        if f["phase"] == "plan"
    ]


def test_direct_baseline_under_pause_breaks_the_invariants(tmp_path: Path) -> None:
    out = tmp_path / "direct"
    result = verify(out, "--db", "sqlite", "--seconds", "20", "--nemesis", "pause", "--direct")
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith("seed: ")
    names = {v["name"] for v in summary(out)["violations"]}
    assert "stale-write" in names or "generations-decrease" in names, result.stdout
    assert names & {"acked-not-applied-once", "unacked-applied-twice"}, result.stdout
    assert (out / "history.jsonl").stat().st_size > 0
    assert (out / "ledger.jsonl").stat().st_size > 0


def test_gateway_under_every_nemesis_on_sqlite(tmp_path: Path) -> None:
    out = tmp_path / "sqlite"
    result = verify(out, "--db", "sqlite", "--seconds", "20", "--nemesis", "all")
    doc = summary(out)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr
    assert doc["violations"] == []
    assert sum(doc["faults"].values()) > 0 and doc["jobs_completed"] > 0
    assert doc["options"]["signed_workers"] == 1  # the signed tokens' stalled uploads


@pytest.mark.postgres
def test_gateway_under_every_nemesis_on_postgres(tmp_path: Path) -> None:
    if not (PG_BIN / "initdb").is_file():
        postgres_unavailable(f"no initdb in {PG_BIN} (set FENCEGATE_FAULTS_PG_BIN)")
    out = tmp_path / "pg"
    result = verify(out, "--db", "pg", "--seconds", "20", "--nemesis", "all")
    doc = summary(out)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr
    assert doc["violations"] == []
    assert doc["options"]["replicas"] == 3
    assert sum(doc["faults"].values()) > 0 and doc["jobs_completed"] > 0


def test_the_seed_repeats_the_fault_plan(tmp_path: Path) -> None:
    args = ["--db", "sqlite", "--seconds", "6", "--tail", "5", "--nemesis", "pause,kill,upstream"]
    first = verify(tmp_path / "one", *args, "--seed", "4242")
    second = verify(tmp_path / "two", *args, "--seed", "4242")
    other = verify(tmp_path / "three", *args, "--seed", "4243")
    for result in (first, second, other):
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    assert first.stdout.startswith("seed: 4242\n")
    plan = planned(tmp_path / "one")
    assert plan and plan == planned(tmp_path / "two")
    assert plan != planned(tmp_path / "three")


def test_lock_workers_under_lock_loss(tmp_path: Path) -> None:
    if redis_binary() is None:
        redis_unavailable("no redis-server (apt-get install redis-server)")
    out = tmp_path / "locks"
    result = verify(out, "--db", "sqlite", "--seconds", "20", "--nemesis", "lock-loss,pause")
    doc = summary(out)
    assert doc["options"]["lock_workers"] == 3
    assert doc["faults"].get("lock-loss", 0) > 0
    assert doc["jobs_completed"] > 0
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr
    assert doc["violations"] == []


def test_etcd_lock_workers_under_etcd_loss(tmp_path: Path) -> None:
    """etcd's locks (verify.etcd_locks) held by three workers while etcd loses every
    lease or is killed and comes back: their writes reach the upstream, and the gateway
    breaks no invariant."""
    if etcd_binary() is None:
        etcd_unavailable("no etcd (apt-get install etcd-server)")
    out = tmp_path / "etcd"
    result = verify(
        out, "--db", "sqlite", "--seconds", "20", "--nemesis", "etcd-loss,pause", "--seed", "3"
    )
    doc = summary(out)
    assert doc["options"]["etcd_lock_workers"] == 3
    assert doc["faults"].get("etcd-loss", 0) > 0
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert any(entry["job"].startswith("etcdlocks/") for entry in ledger)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr
    assert doc["violations"] == []


def test_zookeeper_lock_workers_under_zk_loss(tmp_path: Path) -> None:
    """ZooKeeper's locks (verify.zk_locks, kazoo's recipe) held by three workers while
    ZooKeeper is paused past their sessions' timeout or restarted on its data: their
    writes reach the upstream, and the gateway breaks no invariant."""
    if zk_binary() is None:
        unavailable("ZooKeeper", "no zkServer.sh (apt-get install zookeeper)")
    out = tmp_path / "zookeeper"
    result = verify(
        out, "--db", "sqlite", "--seconds", "20", "--nemesis", "zk-loss,pause", "--seed", "3"
    )
    doc = summary(out)
    assert doc["options"]["zk_lock_workers"] == 3
    assert doc["faults"].get("zk-loss", 0) > 0
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert any(entry["job"].startswith("zklocks/") for entry in ledger)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr
    assert doc["violations"] == []
