"""The verification's upstream whose unknown outcomes the gateway resolves itself (issue
53): the recording upstream's ``/dedupe/`` window and ledger keys, which of the workers'
jobs and keys go there, the operator leaving those keys to the gateway, and the history
a resolver that re-sends after the upstream forgot a key leaves (invariant 4)."""

from __future__ import annotations

import time
from pathlib import Path

from gateway.fencing.deadlines import RESOLVE_MARGIN, resolve_window
from gateway.fencing.profiles import upstream_key
from tests.unit.test_verify_check import Run, invariants
from verify.check import check
from verify.events import JsonlWriter
from verify.roles import RESOLVER_HANDS_OFF, gateways
from verify.stack import DEDUP_WINDOW, UPSTREAM_TIMEOUT
from verify.upstream import Upstream, _worker_key
from verify.worker import RESOLVING, UPSTREAM, always_cut, upstream_of


def test_a_key_is_forgotten_after_the_window(tmp_path: Path) -> None:
    with JsonlWriter(tmp_path / "ledger.jsonl") as ledger:
        upstream = Upstream(ledger, 1, None, dedup_window=4.0)
        upstream.first["j", "k"] = ("first", time.time() - 1.0)
        assert upstream.remembered("j", "k") == "first"
        upstream.first["j", "k"] = ("first", time.time() - 4.5)
        assert upstream.remembered("j", "k") is None
        kept_forever = Upstream(ledger, 1, None)
        kept_forever.first["j", "k"] = ("first", time.time() - 3600.0)
        assert kept_forever.remembered("j", "k") == "first"


def test_the_ledger_names_the_workers_key_only_for_its_digest() -> None:
    digest = upstream_key("job-1", "job-1-step0")
    assert _worker_key("job-1", digest, "job-1-step0") == "job-1-step0"
    assert _worker_key("job-1", digest, "job-1-step1") == digest  # not that key's digest
    assert _worker_key("job-2", digest, "job-1-step0") == digest  # nor that job's
    assert _worker_key("job-1", "job-1-step0", None) == "job-1-step0"


def test_a_share_of_jobs_and_of_their_keys() -> None:
    jobs = [f"job-{i:05d}" for i in range(2000)]
    resolving = [job for job in jobs if upstream_of(job) == RESOLVING]
    assert 0.2 < len(resolving) / len(jobs) < 0.3
    assert all(upstream_of(job) == UPSTREAM for job in jobs if job not in resolving)
    cut = [job for job in resolving if always_cut(job, f"{job}-step0")]
    assert 0.08 < len(cut) / len(resolving) < 0.22
    assert not any(always_cut(job, f"{job}-step0") for job in jobs if job not in resolving)


def test_the_operator_leaves_the_gateways_keys_past_the_resolvers_window() -> None:
    window = resolve_window(DEDUP_WINDOW, UPSTREAM_TIMEOUT)
    assert window > 0  # the resolver re-sends some
    # past a wrong window (its sign flipped) too, so an operator does not hide it
    assert RESOLVER_HANDS_OFF >= DEDUP_WINDOW + UPSTREAM_TIMEOUT + RESOLVE_MARGIN
    assert gateways({"upstream": RESOLVING, "resolvable": True})
    assert not gateways({"upstream": RESOLVING, "resolvable": False})
    assert not gateways({"upstream": UPSTREAM, "resolvable": True})


def test_4_a_held_write_re_sent_after_the_upstream_forgot_it() -> None:
    """The worker's write is applied and cut (held, unknown); the gateway re-sends it
    after the upstream forgot the key, which applies it again: never acknowledged,
    applied twice."""
    run = Run()
    run.claim("w1", "j", 1)
    run.write(
        "w1", "j", 1, "j-step0", outcome="fail", status=502, reason="upstream-connection-lost"
    )
    run.write(
        "w1", "j", 1, "j-step0", applied=False, outcome="fail", status=409,
        reason="outcome-unknown",
    )  # fmt: skip
    run.apply("j", 1, "j-step0")  # the re-send
    run.complete("w1", "j", 1)
    assert invariants(check(run.history, run.ledger)) == [4]
