"""``verify.check``: invariant 9's reasons come from the reasons table, and invariant 13
(``never-sent-held-unknown``) on crafted histories: a key held unknown whose write never
reached the upstream is named; one whose write the upstream applied, one whose attempt a
fault that loses writes unseen overlapped, and one this history never sent are not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fencegate_client.reasons import GATEWAY_REASONS, REASONS, Sent
from tests.unit.test_verify_check import Run, invariants, sha
from verify.check import GAVE_UP, LET_GO, NOT_FORWARDED, RECORD_LIFE, Report, check, main
from verify.events import HeldUnknown, JsonlWriter, read_unknowns


def held(run: Run, job: str, key: str, generation: int, **extra: object) -> HeldUnknown:
    return HeldUnknown(time=run.tick(), job=job, key=key, generation=generation, extra=extra)


def judged(
    run: Run, listed: list[HeldUnknown], excused: list[tuple[float, float]] | None = None
) -> Report:
    return check(run.history, run.ledger, held=listed, excused=excused or [])


def test_not_forwarded_is_the_tables_never_sent() -> None:
    never = {r.value for r in GATEWAY_REASONS if r in REASONS and REASONS[r].sent is Sent.NEVER}
    assert never == NOT_FORWARDED
    assert {"store-unavailable", "upstream-unavailable", "stale-generation"} <= NOT_FORWARDED
    for maybe in ("upstream-timeout", "upstream-connection-lost", "internal-error"):
        assert maybe not in NOT_FORWARDED
    assert GAVE_UP <= {r.value for r in REASONS if REASONS[r].sent is Sent.MAYBE}


@pytest.mark.parametrize("reason", ["store-unavailable", "upstream-unavailable"])
def test_9_a_never_sent_answer_whose_write_was_applied(reason: str) -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1", outcome="fail", status=503, reason=reason)
    run.complete("w1", "j1", 1)
    report = run.check()
    assert invariants(report) == [9]
    assert f"refused 503 {reason}" in report.violations[0].message


def _shutdown_waiter(run: Run) -> HeldUnknown:
    """A write of generation 2 waiting behind generation 1's, cut by a shutdown (no
    answer), never sent, then listed unknown after the restart (and another job done:
    liveness)."""
    run.claim("w9", "j9", 1)
    run.complete("w9", "j9", 1)
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k0")
    run.claim("w2", "j1", 2)
    run.write("w2", "j1", 2, "k1", applied=False, outcome="info")
    return held(run, "j1", "k1", 2, note="in flight past its deadline")


def test_13_a_never_sent_write_held_unknown_is_named() -> None:
    run = Run()
    listing = _shutdown_waiter(run)
    report = judged(run, [listing, held(run, "j1", "k1", 2)])  # listed twice: one violation
    assert invariants(report) == [13]
    violation = report.violations[0]
    assert violation.name == "never-sent-held-unknown"
    assert violation.where[0] == "unknowns"
    assert violation.events[0] == listing.to_json()
    assert "no write of it reached the upstream" in violation.message
    assert "1 attempt(s): info" in violation.message


def test_13_a_held_write_told_not_sent_is_named_with_its_answer() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1", applied=False, outcome="fail", status=503,
              reason="store-unavailable")  # fmt: skip
    run.complete("w1", "j1", 1)
    report = judged(run, [held(run, "j1", "k1", 1)])
    assert invariants(report) == [13]
    assert "fail 503 store-unavailable" in report.violations[0].message


def test_13_a_held_write_that_reached_the_upstream_passes() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1", outcome="fail", status=504, reason="upstream-timeout")
    run.complete("w1", "j1", 1)
    assert judged(run, [held(run, "j1", "k1", 1, note="no answer: TimeoutError")]).ok


def test_13_a_write_applied_after_the_listing_passes() -> None:
    """The ledger is read after the run: an application that came late still counts."""
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1", applied=False, outcome="fail", status=504,
              reason="upstream-timeout")  # fmt: skip
    listing = held(run, "j1", "k1", 1)
    run.apply("j1", 1, "k1")
    run.complete("w1", "j1", 1)
    assert judged(run, [listing]).ok


def test_13_the_join_is_per_generation() -> None:
    """Generation 1's write reached the upstream; the key held under generation 2 is
    generation 2's write, which never left."""
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1", outcome="info")
    run.claim("w2", "j1", 2)
    run.write("w2", "j1", 2, "k1", applied=False, outcome="info")
    report = judged(run, [held(run, "j1", "k1", 2)])
    assert 13 in invariants(report)


def test_13_a_fault_that_loses_writes_unseen_excuses_it() -> None:
    run = Run()
    listing = _shutdown_waiter(run)
    attempt = next(e for e in run.history if e.key == "k1" and e.type == "invoke")
    completion = next(e for e in run.history if e.key == "k1" and e.type == "info")
    # a kill -9 just before the attempt, and one well after its record's life: only the
    # first excuses it
    before = (attempt.time - 2, attempt.time - 0.5)
    assert invariants(judged(run, [listing], [before])) == [13]
    assert judged(run, [listing], [(attempt.time - 2, attempt.time + 0.5)]).ok
    late = completion.time + RECORD_LIFE - 0.5
    assert judged(run, [listing], [(late, late + 1)]).ok
    later = completion.time + RECORD_LIFE + 0.5
    assert 13 in invariants(judged(run, [listing], [(later, later + 1)]))


@pytest.mark.parametrize("reason", ["disconnected", "ServerDisconnectedError"])
def test_13_a_connection_the_gateway_closed_is_not_excused_by_a_later_fault(reason: str) -> None:
    """Issue 53: the shutdown's waiter, never sent, its connection closed by the stopping
    replica (``disconnected``); a partition to the upstream 10 s later excused it (the
    checker before, ``RECORD_LIFE``), though the replica had let it go by then."""
    run = Run()
    run.claim("w9", "j9", 1)
    run.complete("w9", "j9", 1)
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k0")
    run.claim("w2", "j1", 2)
    write = {"process": "w2", "f": "write", "job": "j1", "generation": 2, "key": "k1"}
    run.event(type="invoke", body_sha256=sha("body k1"), **write)
    closed = run.event(type="info", reason=reason, **write)
    listing = held(run, "j1", "k1", 2, note=None)
    partition = (closed.time + 10.0, closed.time + 12.0)
    assert partition[0] < closed.time + RECORD_LIFE  # the old widening reached it
    assert invariants(judged(run, [listing], [partition])) == [13]
    # a fault while the stopping replica may still have had it still excuses it
    soon = closed.time + LET_GO[reason] - 0.5
    assert judged(run, [listing], [(soon, soon + 1)]).ok
    # a refused connection: no gateway ever had it; only a fault during it excuses
    refused = {**write, "key": "k2"}
    run.event(type="invoke", body_sha256=sha("body k2"), **refused)
    never = run.event(type="info", reason="connection-refused", **refused)
    second = held(run, "j1", "k2", 2)
    assert invariants(judged(run, [second], [(never.time + 0.5, never.time + 1)])) == [13]


def test_13_a_key_this_history_never_sent_is_not_judged() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1")
    run.complete("w1", "j1", 1)
    assert judged(run, [held(run, "j1", "other", 1)]).ok
    assert check(run.history, run.ledger, held=None).ok  # no file: 13 not judged


def test_13_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = Run()
    listing = _shutdown_waiter(run)
    paths = {name: tmp_path / f"{name}.jsonl" for name in ("history", "ledger", "unknowns")}
    for name, records in (
        ("history", run.history),
        ("ledger", run.ledger),
        ("unknowns", [listing]),
    ):
        with JsonlWriter(paths[name]) as writer:
            for record in records:
                writer.write(record)
    assert read_unknowns(paths["unknowns"]) == [listing]
    base = [str(paths["history"]), str(paths["ledger"])]
    assert main(base) == 0
    assert main([*base, "--unknowns", str(paths["unknowns"])]) == 1
    assert "[13 never-sent-held-unknown] job 'j1'" in capsys.readouterr().out
    span = f"{listing.time - 10},{listing.time}"
    assert main([*base, "--unknowns", str(paths["unknowns"]), "--excused", span]) == 0
    paths["unknowns"].write_text(json.dumps({"time": 1, "job": "j1", "key": "k"}) + "\n")
    assert main([*base, "--unknowns", str(paths["unknowns"])]) == 2
