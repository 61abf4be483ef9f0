"""``verify.check`` and ``verify.events``: the verification run's checker and its files.

For each invariant 1-7, hand-written histories and ledgers that break it are caught (the
invariant and the records named), and clean ones pass: replays across generations, an
unknown outcome applied once, a refused stale write, a job retried by a second worker.
Properties: any run built by the rules has no violation; a stale write added to one is
named by invariants 1, 2 and 6. The files: round trip, and every way a file is unreadable
is exit 2 with its line.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verify.check import Refresh, Report, Violation, check, main
from verify.events import (
    HistoryEvent,
    JsonlWriter,
    LedgerEntry,
    UnreadableFile,
    read_history,
    read_ledger,
    sha256_hex,
)
from verify.run import lease_refreshes

ROOT = Path(__file__).resolve().parents[2]


def sha(text: str) -> str:
    return sha256_hex(text.encode())


@dataclass
class Run:
    """A run written by hand: history and ledger on one clock that ticks at every record."""

    history: list[HistoryEvent] = field(default_factory=list)
    ledger: list[LedgerEntry] = field(default_factory=list)
    clock: float = 0.0

    def tick(self) -> float:
        self.clock += 1.0
        return self.clock

    def event(self, **fields: Any) -> HistoryEvent:
        event = HistoryEvent(time=self.tick(), **fields)
        self.history.append(event)
        return event

    def apply(self, job: str, generation: int, key: str, answer: str | None = None) -> LedgerEntry:
        entry = LedgerEntry(
            time=self.tick(),
            job=job,
            generation=generation,
            key=key,
            body_sha256=sha(f"body {key}"),
            answer_sha256=None if answer is None else sha(answer),
        )
        self.ledger.append(entry)
        return entry

    def claim(
        self,
        process: str,
        job: str,
        generation: int,
        ttl: float | None = None,
        holder: str | None = None,
    ) -> HistoryEvent:
        self.event(process=process, type="invoke", f="claim", job=job)
        return self.event(
            process=process,
            type="ok",
            f="claim",
            job=job,
            generation=generation,
            ttl=ttl,
            holder=holder,
        )

    def renew(
        self, process: str, job: str, generation: int, ttl: float | None, outcome: str = "ok"
    ) -> HistoryEvent:
        self.event(process=process, type="invoke", f="renew", job=job, generation=generation)
        if outcome == "ok":
            return self.event(
                process=process,
                type="ok",
                f="renew",
                job=job,
                generation=generation,
                status=200,
                ttl=ttl,
            )
        return self.event(process=process, type="info", f="renew", job=job, generation=generation)

    def complete(self, process: str, job: str, generation: int) -> HistoryEvent:
        self.event(process=process, type="invoke", f="complete", job=job, generation=generation)
        return self.event(
            process=process, type="ok", f="complete", job=job, generation=generation, status=200
        )

    def fail(self, process: str, job: str, generation: int) -> HistoryEvent:
        """The holder gives its lease back (``POST /v1/leases/fail``: a parked job)."""
        self.event(process=process, type="invoke", f="fail", job=job, generation=generation)
        return self.event(
            process=process, type="ok", f="fail", job=job, generation=generation, status=200
        )

    def write(
        self,
        process: str,
        job: str,
        generation: int,
        key: str,
        *,
        applied: bool = True,
        outcome: str = "ok",
        status: int = 200,
        reason: str | None = None,
        answer: str | None = None,
    ) -> HistoryEvent:
        """Invoke, maybe apply upstream, then answer ``outcome`` (the completion returned)."""
        self.event(
            process=process,
            type="invoke",
            f="write",
            job=job,
            generation=generation,
            key=key,
            body_sha256=sha(f"body {key}"),
        )
        answer = answer or f"answer {job} {key}"
        if applied:
            self.apply(job, generation, key, answer)
        common: dict[str, Any] = {"process": process, "f": "write", "job": job, "key": key}
        if outcome == "info":
            return self.event(type="info", generation=generation, **common)
        return self.event(
            type=outcome,
            generation=generation,
            status=status,
            reason=reason,
            body_sha256=sha(answer),
            **common,
        )

    def check(self, min_completed: float = 0.0) -> Report:
        return check(self.history, self.ledger, min_completed=min_completed)


def only(report: Report, invariant: int) -> list[Violation]:
    return [v for v in report.violations if v.invariant == invariant]


def invariants(report: Report) -> list[int]:
    return [v.invariant for v in report.violations]


def records(*items: HistoryEvent | LedgerEntry) -> list[dict[str, Any]]:
    return [item.to_json() for item in items]


# --- clean runs --------------------------------------------------------------------------


def test_one_worker_one_job_is_clean() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1")
    run.complete("w1", "j1", 1)
    report = run.check()
    assert report.ok, report.render()
    assert (report.jobs_claimed, report.jobs_completed, report.completed_share) == (1, 1, 1.0)
    assert report.writes_applied == 1
    assert report.operations["write"] == {"invoke": 1, "ok": 1}
    assert "no violation" in report.render()


def test_replays_across_generations_are_clean() -> None:
    """A reclaimed job's new worker repeats its steps: the stored answers come back."""
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1")
    run.write("w1", "j1", 1, "k2")
    # w1 stalls; its lease expires; w2 takes the job and repeats every step.
    run.claim("w2", "j1", 2)
    run.write("w2", "j1", 2, "k1", applied=False)  # replayed
    run.write("w2", "j1", 2, "k2", applied=False)  # replayed
    run.write("w2", "j1", 2, "k3")
    run.complete("w2", "j1", 2)
    assert run.check().ok


def test_unknown_outcome_applied_once_is_clean() -> None:
    """A write timed out after the upstream applied it; the retry is held, then replayed."""
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1", outcome="info")
    held = run.write(
        "w1",
        "j1",
        1,
        "k1",
        applied=False,
        outcome="fail",
        status=409,
        reason="outcome-unknown",
        answer="problem",
    )
    assert held.reason == "outcome-unknown"
    run.write("w1", "j1", 1, "k1", applied=False)  # resolved by the operator: replayed
    run.write("w1", "j1", 1, "k2", applied=False, outcome="info")  # never arrived
    run.complete("w1", "j1", 1)
    assert run.check().ok


def test_refused_stale_write_is_clean() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1")
    run.claim("w2", "j1", 2)
    run.write("w2", "j1", 2, "k2")
    refused = run.write(
        "w1",
        "j1",
        1,
        "k3",
        applied=False,
        outcome="fail",
        status=409,
        reason="stale-generation",
        answer="problem",
    )
    run.complete("w2", "j1", 2)
    assert refused.reason == "stale-generation"
    assert [entry.key for entry in run.ledger] == ["k1", "k2"]
    assert run.check().ok


def test_job_retried_by_second_worker_is_clean() -> None:
    """w1 loses its lease mid-job; w2 gets a higher generation (not +1) and finishes."""
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1")
    run.event(process="w1", type="invoke", f="renew", job="j1", generation=1)
    run.event(
        process="w1",
        type="fail",
        f="renew",
        job="j1",
        generation=1,
        status=409,
        reason="lease-expired",
    )
    run.claim("w2", "j1", 3)
    run.write("w2", "j1", 3, "k1", applied=False)
    run.write("w2", "j1", 3, "k2")
    run.complete("w2", "j1", 3)
    run.claim("w1", "j2", 1)  # w1 goes on with another job
    run.write("w1", "j2", 1, "k1")  # keys are per job: j2's k1 is another step
    run.complete("w1", "j2", 1)
    report = run.check()
    assert report.ok, report.render()
    assert report.jobs_completed == 2


# --- 1: generations never decrease --------------------------------------------------------


def test_1_decrease_is_caught() -> None:
    run = Run()
    high = run.apply("j1", 2, "k2")
    low = run.apply("j1", 1, "k1")
    (violation,) = only(run.check(), 1)
    assert violation.name == "generations-decrease"
    assert violation.job == "j1"
    assert violation.events == records(high, low)


def test_1_equal_and_rising_generations_pass() -> None:
    run = Run()
    run.apply("j1", 1, "k1")
    run.apply("j1", 1, "k2")
    run.apply("j1", 4, "k3")
    run.apply("j2", 1, "k1")  # another job's generations are its own
    assert only(run.check(), 1) == []


# --- 2: generations not interleaved -----------------------------------------------------


def test_2_generation_coming_back_is_caught() -> None:
    run = Run()
    a = run.apply("j1", 2, "k1")
    b = run.apply("j1", 1, "k2")
    c = run.apply("j1", 2, "k3")
    report = run.check()
    (violation,) = only(report, 2)
    assert violation.name == "generations-interleave"
    assert violation.events == records(a, b, c)
    assert [v.events for v in only(report, 1)] == [records(a, b)]  # c is not a decrease


def test_2_older_generation_coming_back_is_caught() -> None:
    run = Run()
    a = run.apply("j1", 1, "k1")
    b = run.apply("j1", 2, "k2")
    c = run.apply("j1", 1, "k3")
    (violation,) = only(run.check(), 2)
    assert violation.events == records(a, b, c)


def test_2_blocks_of_generations_pass() -> None:
    run = Run()
    for generation, key in [(1, "a"), (1, "b"), (2, "c"), (2, "d"), (5, "e")]:
        run.apply("j1", generation, key)
    run.apply("j2", 1, "a")
    run.apply("j1", 5, "f")  # another job in between moves nothing of j1
    assert only(run.check(), 2) == []


# --- 3: acknowledged keys applied exactly once -----------------------------------------


def test_3_acknowledged_never_applied_is_caught() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    ack = run.write("w1", "j1", 1, "k1", applied=False)
    (violation,) = only(run.check(), 3)
    assert violation.name == "acked-not-applied-once"
    assert (violation.job, violation.events) == ("j1", records(ack))
    assert "applied 0 times" in violation.message


def test_3_acknowledged_applied_twice_is_caught() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    ack = run.write("w1", "j1", 1, "k1")
    run.claim("w2", "j1", 2)
    again = run.write("w2", "j1", 2, "k1")  # forwarded again instead of replayed
    report = run.check()
    (violation,) = only(report, 3)
    assert violation.events == records(ack, again, *run.ledger)
    assert only(report, 4) == []


def test_3_acknowledged_once_passes() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1")
    run.write("w1", "j1", 1, "k1", applied=False)
    assert only(run.check(), 3) == []


# --- 4: keys not acknowledged applied at most once ---------------------------------------


def test_4_unknown_outcome_applied_twice_is_caught() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1", outcome="info")
    run.write("w1", "j1", 1, "k1", outcome="info")
    (violation,) = only(run.check(), 4)
    assert violation.name == "unacked-applied-twice"
    assert violation.events == records(*run.history[2:], *run.ledger)


def test_4_key_only_in_the_ledger_applied_twice_is_caught() -> None:
    run = Run()
    first = run.apply("j1", 1, "ghost")
    second = run.apply("j1", 1, "ghost")
    (violation,) = only(run.check(), 4)
    assert violation.events == records(first, second)


def test_4_unacknowledged_applied_at_most_once_passes() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1", outcome="info")
    run.write("w1", "j1", 1, "k2", applied=False, outcome="info")
    run.write("w1", "j1", 1, "k3", applied=False, outcome="fail", status=502, answer="x")
    run.apply("j1", 1, "k4")  # same key in two jobs is two steps
    run.apply("j2", 1, "k4")
    report = run.check()
    assert only(report, 3) == only(report, 4) == []


# --- 5: a replay answers the first answer ----------------------------------------------


def test_5_replay_with_another_body_is_caught() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    first = run.write("w1", "j1", 1, "k1")
    run.ledger[-1] = LedgerEntry(**{**run.ledger[-1].to_json(), "answer_sha256": None})
    replay = run.write("w1", "j1", 1, "k1", applied=False, answer="something else")
    (violation,) = only(run.check(), 5)
    assert violation.name == "replay-answer-differs"
    assert violation.events == records(first, replay)


def test_5_answer_differing_from_the_upstreams_is_caught() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    entry = run.apply("j1", 1, "k1", answer="upstream said")
    ack = run.event(
        process="w1",
        type="ok",
        f="write",
        job="j1",
        generation=1,
        key="k1",
        status=200,
        body_sha256=sha("gateway said"),
    )
    (violation,) = only(run.check(), 5)
    assert violation.events == records(entry, ack)
    assert "ledger" in violation.message


def test_5_same_answers_pass() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1")
    run.claim("w2", "j1", 2)
    run.write("w2", "j1", 2, "k1", applied=False)
    run.write("w2", "j1", 2, "k1", applied=False)
    run.write("w2", "j1", 2, "k2", applied=False, outcome="fail", status=409, answer="p")
    assert only(run.check(), 5) == []


# --- 6: no stale write after a newer generation was granted and wrote --------------------


def test_6_stale_write_is_caught_with_its_grant() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1")
    grant = run.claim("w2", "j1", 2)
    run.write("w2", "j1", 2, "k2")
    newer = run.ledger[-1]
    run.write("w1", "j1", 1, "k3")  # the stale worker's write got through
    stale = run.ledger[-1]
    report = run.check()
    (violation,) = only(report, 6)
    assert violation.name == "stale-write"
    assert violation.job == "j1"
    assert violation.events == records(stale, newer, grant)
    assert [v.events for v in only(report, 1)] == [records(newer, stale)]


def test_6_names_the_first_newer_generation_to_write() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.claim("w2", "j1", 2)
    run.claim("w3", "j1", 3)
    run.write("w3", "j1", 3, "c")
    first_newer = run.ledger[-1]
    run.write("w2", "j1", 2, "b")
    run.write("w1", "j1", 1, "a")
    stale = run.ledger[-1]
    violations = only(run.check(), 6)
    assert [v.events[:2] for v in violations] == [
        records(run.ledger[1], first_newer),
        records(stale, first_newer),
    ]


def test_6_needs_the_grant_before_the_stale_application() -> None:
    run = Run()
    run.apply("j1", 2, "k2")  # no claim of generation 2 in the history
    run.apply("j1", 1, "k1")
    report = run.check()
    assert only(report, 6) == []
    assert invariants(report).count(1) == 1
    late = Run()
    late.apply("j1", 2, "k2")
    late.apply("j1", 1, "k1")
    late.claim("w2", "j1", 2)  # granted after the application: not this invariant's case
    assert only(late.check(), 6) == []


def test_6_older_writes_before_the_newer_generation_writes_are_8s_not_6s() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.claim("w2", "j1", 2)  # granted, and w1's write invoked after it lands first
    run.write("w1", "j1", 1, "k1")
    run.write("w2", "j1", 2, "k2")
    run.complete("w2", "j1", 2)
    # Not a stale write by invariant 6 (the newer generation had not written yet), but a
    # write invoked after a newer grant: invariant 8.
    assert invariants(run.check()) == [8]
    earlier = Run()
    earlier.claim("w1", "j1", 1)
    earlier.write("w1", "j1", 1, "k1")  # invoked before the newer grant: clean
    earlier.claim("w2", "j1", 2)
    earlier.write("w2", "j1", 2, "k2")
    earlier.complete("w2", "j1", 2)
    assert earlier.check().ok


def test_1_2_6_leave_out_a_write_the_gateway_gave_up_on() -> None:
    """Sent before the newer grant, answered 504 upstream-timeout, applied late (after the
    newer generation's write): the upstream took its time, the gateway could not stop it.
    The same late application answered 201 is the barrier broken."""
    for reason, status, expected in (("upstream-timeout", 504, []), (None, 201, [1, 2, 6])):
        run = Run()
        run.claim("w1", "j1", 1)
        run.write("w1", "j1", 1, "k0")
        run.event(
            process="w1",
            type="invoke",
            f="write",
            job="j1",
            generation=1,
            key="k1",
            body_sha256=sha("body k1"),
        )
        run.claim("w2", "j1", 2)
        run.write("w2", "j1", 2, "k2")
        run.apply("j1", 1, "k1")
        run.event(
            process="w1",
            type="ok" if status == 201 else "fail",
            f="write",
            job="j1",
            generation=1,
            key="k1",
            status=status,
            reason=reason,
            body_sha256=sha("answer"),
        )
        run.complete("w2", "j1", 2)
        report = run.check()
        assert sorted(set(invariants(report))) == expected, report.render()


def test_1_2_6_leave_out_only_the_write_given_up_on() -> None:
    """Issue 53: an attempt answered 504 upstream-timeout does not excuse every
    application of its key. Here it was lost; a retry of the key, sent after the newer
    generation wrote, was forwarded and applied (its 2xx is the entry's own answer,
    unreplayed): the barrier broken, which 1, 2 and 6 must name. The same 2xx replayed
    (from the gateway's store) does not say which attempt was applied: left out."""
    for replayed, expected in ((False, [1, 2, 6]), (True, [])):
        run = Run()
        run.claim("w1", "j1", 1)
        run.write("w1", "j1", 1, "k0")
        invoke: dict[str, Any] = {"process": "w1", "f": "write", "job": "j1", "generation": 1}
        run.event(type="invoke", key="k1", body_sha256=sha("body k1"), **invoke)
        run.claim("w2", "j1", 2)
        run.write("w2", "j1", 2, "k2")
        run.event(
            type="fail",
            key="k1",
            status=504,
            reason="upstream-timeout",
            body_sha256=sha("problem"),
            **invoke,
        )
        run.event(type="invoke", key="k1", body_sha256=sha("body k1"), **invoke)
        run.apply("j1", 1, "k1", answer="late")
        run.event(
            type="ok",
            key="k1",
            status=201,
            body_sha256=sha("late"),
            replayed=replayed,
            **invoke,
        )
        run.complete("w2", "j1", 2)
        report = run.check()
        assert sorted(set(invariants(report))) == expected, report.render()


def test_14_a_changed_body_under_a_used_key_answered_2xx_is_caught() -> None:
    """Issue 53: a retry that rebuilt its payload sends another body under a used key;
    the gateway must refuse it 422 idempotency-key-reused, not replay the first body's
    answer (which says the changed request's effect happened: it did not)."""
    for status, reason, expected in ((200, None, [14]), (422, "idempotency-key-reused", [])):
        run = Run()
        run.claim("w1", "j1", 1)
        run.write("w1", "j1", 1, "k1")
        common: dict[str, Any] = {"process": "w1", "f": "write", "job": "j1", "generation": 1}
        changed = run.event(type="invoke", key="k1", body_sha256=sha("rebuilt k1"), **common)
        answered = run.event(
            type="ok" if status == 200 else "fail",
            key="k1",
            status=status,
            reason=reason,
            body_sha256=sha("answer j1 k1") if status == 200 else sha("problem"),
            replayed=True if status == 200 else None,
            **common,
        )
        run.complete("w1", "j1", 1)
        report = run.check()
        assert invariants(report) == expected, report.render()
        if expected:
            (violation,) = report.violations
            assert violation.name == "acked-body-not-applied"
            assert violation.events[:3] == records(changed, answered, run.ledger[0])


# --- 8-11: what the gateway must not have forwarded ------------------------------------


def test_8_a_write_invoked_after_a_newer_grant_is_named_with_the_grant() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "step0")
    grant = run.claim("w2", "j1", 2)
    late = run.write("w1", "j1", 1, "w1-own-key")  # a zombie's new key, forwarded
    run.write("w2", "j1", 2, "step0", applied=False)  # replayed
    run.complete("w2", "j1", 2)
    report = run.check()
    assert invariants(report) == [8]
    (violation,) = report.violations
    assert violation.name == "applied-after-newer-grant"
    assert grant.to_json() in violation.events
    assert "generation 2 was granted" in violation.message
    assert late.key == "w1-own-key"


def test_8_a_write_in_flight_at_the_grant_is_not_named() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.event(
        process="w1",
        type="invoke",
        f="write",
        job="j1",
        generation=1,
        key="k1",
        body_sha256=sha("body k1"),
    )
    run.claim("w2", "j1", 2)
    run.apply("j1", 1, "k1")  # sent before the grant, applied after it: the barrier's case
    run.event(process="w1", type="info", f="write", job="j1", generation=1, key="k1")
    run.write("w2", "j1", 2, "k2")
    run.complete("w2", "j1", 2)
    assert run.check().ok


def test_9_a_write_refused_as_not_forwarded_that_the_ledger_holds() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    refused = run.write("w1", "j1", 1, "k1", outcome="fail", status=409, reason="stale-generation")
    run.complete("w1", "j1", 1)
    report = run.check()
    assert invariants(report) == [9]
    (violation,) = report.violations
    assert violation.name == "refused-but-applied"
    assert refused.to_json() in violation.events
    assert "refused 409 stale-generation" in violation.message


def test_9_an_upstream_failure_may_have_been_sent() -> None:
    maybe = ("upstream-timeout", "upstream-connection-lost", "outcome-unknown", "internal-error")
    for reason in (*maybe, None):
        run = Run()
        run.claim("w1", "j1", 1)
        run.write("w1", "j1", 1, "k1", outcome="fail", status=502, reason=reason)
        run.complete("w1", "j1", 1)
        assert run.check().ok, reason


def test_9_a_refused_retry_of_a_write_in_flight_is_not_named() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.event(
        process="w1",
        type="invoke",
        f="write",
        job="j1",
        generation=1,
        key="k1",
        body_sha256=sha("body k1"),
    )
    run.event(process="w1", type="info", f="write", job="j1", generation=1, key="k1")
    run.event(
        process="w1",
        type="invoke",
        f="write",
        job="j1",
        generation=1,
        key="k1",
        body_sha256=sha("body k1"),
    )
    run.apply("j1", 1, "k1")  # the first send, still in flight when the retry was refused
    run.event(
        process="w1",
        type="fail",
        f="write",
        job="j1",
        generation=1,
        key="k1",
        status=409,
        reason="request-in-progress",
        body_sha256=sha("problem"),
    )
    run.complete("w1", "j1", 1)
    assert run.check().ok


def test_10_an_applied_body_that_was_never_sent() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1", applied=False)
    entry = LedgerEntry(
        time=run.tick(), job="j1", generation=1, key="k1", body_sha256=sha("another body")
    )
    run.ledger.append(entry)
    run.complete("w1", "j1", 1)
    report = run.check()
    assert invariants(report) == [10, 14]  # 14: the body acknowledged was not applied
    (violation,) = only(report, 10)
    assert violation.name == "body-not-sent"
    assert "body differs" in violation.message
    assert violation.events[0] == entry.to_json()


def test_10_a_generation_the_writer_did_not_send() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1", applied=False)
    run.apply("j1", 7, "k1")  # the header rewritten on the way
    run.complete("w1", "j1", 1)
    assert invariants(run.check()) == [10]


def test_11_a_write_invoked_after_its_lease_expired() -> None:
    run = Run()
    claim = run.claim("w1", "j1", 1, ttl=2.0)  # time 2: held until 4
    run.tick(), run.tick(), run.tick()
    run.write("w1", "j1", 1, "k1")  # invoked at 6
    run.complete("w1", "j1", 1)
    report = run.check()
    assert invariants(report) == [11]
    (violation,) = report.violations
    assert violation.name == "applied-after-lease-over"
    assert claim.to_json() in violation.events
    assert "after its lease expired" in violation.message


def test_11_renewals_margin_and_unknown_renewals_keep_the_lease() -> None:
    renewed = Run()
    renewed.claim("w1", "j1", 1, ttl=2.0)
    renewed.renew("w1/renew", "j1", 1, ttl=2.0)  # ok at 4: held until 6
    renewed.tick()
    renewed.write("w1", "j1", 1, "k1")  # invoked at 6
    renewed.complete("w1", "j1", 1)
    assert renewed.check().ok
    margin = Run()
    margin.claim("w1", "j1", 1, ttl=2.0)
    margin.tick(), margin.tick(), margin.tick()
    margin.write("w1", "j1", 1, "k1")  # 2 s after expiry
    margin.complete("w1", "j1", 1)
    assert not check(margin.history, margin.ledger, expiry_margin=1.5).ok
    assert check(margin.history, margin.ledger, expiry_margin=2.5).ok
    unknown = Run()
    unknown.claim("w1", "j1", 1, ttl=2.0)
    unknown.renew("w1/renew", "j1", 1, ttl=None, outcome="info")
    unknown.tick(), unknown.tick()
    unknown.write("w1", "j1", 1, "k1")
    unknown.complete("w1", "j1", 1)
    assert unknown.check().ok
    untimed = Run()  # an older file: no ttl, no judgement
    untimed.claim("w1", "j1", 1)
    untimed.tick(), untimed.tick(), untimed.tick()
    untimed.write("w1", "j1", 1, "k1")
    untimed.complete("w1", "j1", 1)
    assert untimed.check().ok


def test_11_a_renewal_invoked_after_the_write_does_not_keep_the_lease_for_it() -> None:
    """Issue 53: a lease core that renews an expired lease would excuse the writes made
    before that renewal if every renewal counted; only those invoked before the write do."""
    run = Run()
    claim = run.claim("w1", "j1", 1, ttl=2.0)  # ok at 2: held until 4
    run.tick(), run.tick(), run.tick()
    run.write("w1", "j1", 1, "k1")  # invoked at 6
    run.renew("w1/renew", "j1", 1, ttl=2.0)  # invoked at 9, ok at 10: "held" until 12
    run.complete("w1", "j1", 1)
    report = run.check()
    assert invariants(report) == [11], report.render()
    assert claim.to_json() in report.violations[0].events
    in_flight = Run()  # invoked before the write, answered after it: it counts
    in_flight.claim("w1", "j1", 1, ttl=2.0)  # held until 4
    in_flight.event(process="w1/renew", type="invoke", f="renew", job="j1", generation=1)
    in_flight.tick(), in_flight.tick()
    in_flight.write("w1", "j1", 1, "k1")  # invoked at 6
    in_flight.event(
        process="w1/renew", type="ok", f="renew", job="j1", generation=1, status=200, ttl=2.0
    )  # ok at 9
    in_flight.complete("w1", "j1", 1)
    assert in_flight.check().ok, in_flight.check().render()


def test_11_a_skewed_replica_clock_excuses_the_expiry() -> None:
    run = Run()
    run.claim("w1", "j1", 1, ttl=2.0)  # at 2
    run.tick(), run.tick(), run.tick()
    run.write("w1", "j1", 1, "k1")  # invoked at 6
    run.complete("w1", "j1", 1)
    assert not run.check().ok
    assert check(run.history, run.ledger, skewed=[(1.5, 2.5)]).ok  # granted skewed
    assert check(run.history, run.ledger, skewed=[(5.5, 6.5)]).ok  # invoked skewed
    assert not check(run.history, run.ledger, skewed=[(3.0, 5.0)]).ok


def test_11_a_store_restart_gives_the_leases_it_held_their_ttl_again() -> None:
    """etcd, back from a restart, gives every lease it held its TTL again (and its election
    timeout): a write of a holder that let its lease lapse across the restart counts as
    held until then; other jobs, and leases gone or not yet granted, are judged as before."""
    run = Run()
    run.claim("w1", "j1", 1, ttl=2.0)  # ok at 2: held until 4
    run.tick(), run.tick(), run.tick()
    run.write("w1", "j1", 1, "k1")  # invoked at 6
    run.complete("w1", "j1", 1)
    assert invariants(run.check()) == [11]
    # Down at 3 while it lived, back at 4: held until 4 + 2 + 1.
    assert check(run.history, run.ledger, refreshed=[("j", 3.0, 4.0)]).ok
    for refresh in [("x", 3.0, 4.0), ("j", 5.5, 5.8), ("j", 0.5, 1.0), ("j", 2.2, 2.4)]:
        # another source's jobs; down after it lapsed (past the slack); down before it
        # was granted; back so early that TTL + 1 s still ends before the write
        assert invariants(check(run.history, run.ledger, refreshed=[refresh])) == [11], refresh


def test_15_a_job_granted_while_its_lease_is_current() -> None:
    """A claim ok of generation 2 before generation 1's lease could end (its claim's
    invoke plus its TTL) breaks 15; after it, or once 1 was completed or given back
    (failed: a parked job, which the finisher of the fault tests acquires by name at
    once), or for a lease
    source's holdings (a holder), or in a skewed clock's span, it does not."""
    early = Run()
    first = early.claim("w1", "j1", 1, ttl=3.0)  # invoked at 1: held at least until 4
    second = early.claim("w2", "j1", 2, ttl=3.0)  # ok at 4: before 4 - 0.1? no: at 4
    assert second.time == 4.0 and invariants(early.check()) == [7]
    early = Run()
    first = early.claim("w1", "j1", 1, ttl=5.0)  # held at least until 6
    second = early.claim("w2", "j1", 2, ttl=5.0)  # ok at 4
    report = early.check()
    assert invariants(report) == [7, 15], report.render()
    violation = next(v for v in report.violations if v.invariant == 15)
    assert first.to_json() in violation.events and second.to_json() in violation.events
    assert "granted 2.00 s before generation 1's lease could end" in violation.message
    assert invariants(check(early.history, early.ledger, skewed=[(3.5, 4.5)])) == [7]
    done = Run()
    done.claim("w1", "j1", 1, ttl=5.0)
    done.complete("w1", "j1", 1)  # invoked at 3
    done.claim("w2", "j1", 2, ttl=5.0)
    done.complete("w2", "j1", 2)
    assert done.check().ok
    parked = Run()
    parked.claim("w1", "j1", 1, ttl=10.0)  # held until 11, unless given back
    parked.fail("w1", "j1", 1)  # given back (parked) at 3: the job is claimable at once
    parked.claim("w2", "j1", 2, ttl=10.0)  # ok at 6
    parked.complete("w2", "j1", 2)
    assert parked.check().ok, parked.check().render()
    holders = Run()
    holders.claim("l0", "locks/a", 1, ttl=5.0, holder="x")
    holders.claim("l1", "locks/a", 2, ttl=5.0, holder="y")  # a lock store's own TTL
    holders.complete("l1", "locks/a", 2)
    assert 15 not in invariants(holders.check())


def test_16_a_write_let_go_gracefully_is_caught(tmp_path: Path) -> None:
    """The upstream saw the gateway close a write's connection gracefully before its
    answer (``let-go.jsonl``): a violation whatever the history says (the write given up
    on, ``upstream-timeout``, and applied in order); not judged without the file."""
    run = Run()
    run.claim("w1", "j1", 1, ttl=60.0)
    run.write("w1", "j1", 1, "k1", outcome="fail", status=504, reason="upstream-timeout")
    entry = run.ledger[-1]
    seen = LedgerEntry.from_json({**entry.to_json(), "time": entry.time + 1.0, "seen": "answer"})
    run.complete("w1", "j1", 1)
    assert run.check().ok, run.check().render()
    report = check(run.history, run.ledger, let_go=[seen])
    assert invariants(report) == [16], report.render()
    violation = report.violations[0]
    assert violation.name == "let-go-gracefully" and violation.job == "j1"
    assert "gracefully before the answer" in violation.message
    assert violation.events == [seen.to_json()]
    for name, records_ in (("history", run.history), ("ledger", run.ledger), ("let-go", [seen])):
        with JsonlWriter(tmp_path / f"{name}.jsonl") as out:
            for record in records_:
                out.write(record)
    args = [str(tmp_path / "history.jsonl"), str(tmp_path / "ledger.jsonl")]
    assert main(args) == 0
    assert main([*args, "--let-go", str(tmp_path / "let-go.jsonl")]) == 1


def test_11_a_write_invoked_after_its_job_completed() -> None:
    run = Run()
    run.claim("w1", "j1", 1, ttl=60.0)
    run.write("w1", "j1", 1, "k1")
    done = run.complete("w1", "j1", 1)
    run.write("w1", "j1", 1, "k2")
    report = run.check()
    assert invariants(report) == [11]
    assert done.to_json() in report.violations[0].events


def test_8_to_11_every_cause_excluded_names_the_latest() -> None:
    run = Run()
    run.claim("w1", "j1", 1)  # untimed: generation 2's grant is not judged (15)
    run.claim("w2", "j1", 2, ttl=60.0)
    run.write("w1", "j1", 1, "k1", applied=False, outcome="info")  # fenced: 8
    run.write(
        "w1", "j1", 1, "k1", outcome="fail", status=409, reason="stale-generation"
    )  # refused: 9, and the one applied
    run.complete("w2", "j1", 2)
    report = run.check()
    assert invariants(report) == [9]
    assert "invoked after generation 2 was granted" in report.violations[0].message


# --- 7: liveness ------------------------------------------------------------------------


def test_7_nothing_completed_fails() -> None:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1")
    report = run.check()
    assert invariants(report) == [7]
    (violation,) = report.violations
    assert (violation.name, violation.job, violation.events) == ("liveness", None, [])
    assert (report.jobs_claimed, report.jobs_completed, report.completed_share) == (1, 0, 0.0)


def test_7_nothing_claimed_fails() -> None:
    report = check([], [])
    assert invariants(report) == [7]
    assert report.completed_share == 0.0


def test_7_share_is_reported_and_checked_against_the_minimum() -> None:
    run = Run()
    for job in ("j1", "j2", "j3", "j4"):
        run.claim("w1", job, 1)
    run.complete("w1", "j1", 1)
    report = run.check()
    assert report.ok
    assert report.completed_share == 0.25
    assert "1 of 4 claimed jobs completed (25.0%)" in report.render()
    assert run.check(min_completed=0.25).ok
    assert invariants(run.check(min_completed=0.5)) == [7]


# --- properties -------------------------------------------------------------------------

OUTCOMES = st.sampled_from(["ok", "info-applied", "info-lost", "refused"])


@st.composite
def clean_runs(draw: st.DrawFn) -> Run:
    """Jobs, each worked by one worker per generation (rising, gaps allowed); every write
    is acknowledged and applied, or of unknown outcome (applied once or never), or refused
    and never applied; each new worker repeats the acknowledged steps (replays)."""
    run = Run()
    for j in range(draw(st.integers(1, 4))):
        job = f"j{j}"
        generation = 0
        acked: list[str] = []
        for w in range(draw(st.integers(1, 3))):
            generation += draw(st.integers(1, 3))
            process = f"w{j}.{w}"
            run.claim(process, job, generation)
            for key in acked:
                run.write(process, job, generation, key, applied=False)
            for n in range(draw(st.integers(0, 3))):
                key = f"{job}-g{generation}-{n}"
                outcome = draw(OUTCOMES)
                if outcome == "ok":
                    run.write(process, job, generation, key)
                    acked.append(key)
                elif outcome == "refused":
                    run.write(
                        process, job, generation, key, applied=False, outcome="fail", status=409
                    )
                else:
                    applied = outcome == "info-applied"
                    run.write(process, job, generation, key, applied=applied, outcome="info")
        run.complete(process, job, generation)
    return run


@given(clean_runs())
def test_runs_built_by_the_rules_have_no_violation(run: Run) -> None:
    report = run.check(min_completed=1.0)
    assert report.ok, report.render()


@given(clean_runs(), st.data())
def test_a_stale_write_is_named_by_1_2_and_6(run: Run, data: st.DataObject) -> None:
    by_job: dict[str, list[int]] = {}
    for entry in run.ledger:
        by_job.setdefault(entry.job, []).append(entry.generation)
    # Jobs whose ledger holds two generations, the older one from a claim before.
    candidates = sorted(job for job, gens in by_job.items() if gens[0] != gens[-1])
    if not candidates:
        return
    job = data.draw(st.sampled_from(candidates))
    old = by_job[job][0]
    stale = run.apply(job, old, "stale-key")
    report = run.check()
    for invariant in (1, 2, 6):
        named = [v for v in only(report, invariant) if stale.to_json() in v.events]
        assert len(named) == 1, (invariant, report.render())
    # Applied with no write sent under its key: invariant 10 names it too.
    assert set(invariants(report)) == {1, 2, 6, 10}


# --- the files ----------------------------------------------------------------------------


def write_run(tmp_path: Path, run: Run) -> tuple[Path, Path]:
    history, ledger = tmp_path / "history.jsonl", tmp_path / "ledger.jsonl"
    with JsonlWriter(history) as writer:
        for event in run.history:
            writer.write(event)
    with JsonlWriter(ledger) as writer:
        for entry in run.ledger:
            writer.write(entry)
    return history, ledger


def clean_run() -> Run:
    run = Run()
    run.claim("w1", "j1", 1)
    run.write("w1", "j1", 1, "k1")
    run.complete("w1", "j1", 1)
    return run


def test_files_round_trip_in_the_issues_field_order(tmp_path: Path) -> None:
    run = clean_run()
    history, ledger = write_run(tmp_path, run)
    first = history.read_text().splitlines()[0]
    assert first == (
        '{"time":1.0,"process":"w1","type":"invoke","f":"claim","job":"j1","generation":null,'
        '"key":null,"status":null,"reason":null,"body_sha256":null}'
    )
    assert read_history(history) == run.history
    assert [event.line for event in read_history(history)] == [1, 2, 3, 4, 5, 6]
    assert read_ledger(ledger) == run.ledger


def test_replayed_is_written_last_and_read_back() -> None:
    event = HistoryEvent(
        time=1.0, process="w1", type="ok", f="write", job="j1", generation=1, key="k",
        status=201, body_sha256=sha("a"), replayed=True,
    )  # fmt: skip
    assert list(event.to_json())[-1] == "replayed"
    assert HistoryEvent.from_json(event.to_json()) == event
    assert "replayed" not in HistoryEvent.from_json({**event.to_json(), "replayed": None}).to_json()


def test_unknown_fields_are_ignored_and_ledger_extras_kept(tmp_path: Path) -> None:
    history, ledger = write_run(tmp_path, clean_run())
    lines = [json.loads(line) for line in history.read_text().splitlines()]
    history.write_text("\n".join(json.dumps({**obj, "note": "x"}) for obj in lines) + "\n\n")
    entry = json.loads(ledger.read_text())
    entry.update(status=201, seq=7)
    ledger.write_text(json.dumps(entry) + "\n")
    (read,) = read_ledger(ledger)
    assert read.extra == {"status": 201, "seq": 7}
    assert read.to_json() == entry
    assert len(read_history(history)) == 6
    assert main([str(history), str(ledger)]) == 0


def test_main_exit_0_and_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    history, ledger = write_run(tmp_path, clean_run())
    assert main([str(history), str(ledger)]) == 0
    assert "no violation" in capsys.readouterr().out
    with JsonlWriter(ledger) as writer:  # applied a second time
        writer.write(read_ledger(ledger)[0])
    assert main([str(history), str(ledger)]) == 1
    out = capsys.readouterr().out
    assert "[3 acked-not-applied-once] job 'j1'" in out
    assert "  ledger:2 {" in out and "  history:4 {" in out
    assert main([str(history), str(ledger), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert report["violations"][0]["where"] == ["history:4", "ledger:1", "ledger:2"]


def test_main_min_completed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = clean_run()
    run.claim("w2", "j2", 1)
    history, ledger = write_run(tmp_path, run)
    assert main([str(history), str(ledger), "--min-completed", "0.5"]) == 0
    assert main([str(history), str(ledger), "--min-completed", "0.6"]) == 1
    with pytest.raises(SystemExit) as exc:
        main([str(history), str(ledger), "--min-completed", "2"])
    assert exc.value.code == 2
    capsys.readouterr()


BAD_LINES = {
    "not JSON": ('{"time": 1.0, "process": ', "not JSON"),
    "not an object": ("[1, 2]", "not a JSON object"),
    "missing field": ('{"time": 1.0, "process": "w1"}', "missing field(s): type, f, job"),
    "wrong type": (
        '{"time": 1.0, "process": "w1", "type": "ok", "f": "claim", "job": "j1",'
        ' "generation": "2", "key": null, "status": null, "reason": null, "body_sha256": null}',
        "generation: an integer",
    ),
    "bad enum": (
        '{"time": 1.0, "process": "w1", "type": "done", "f": "claim", "job": "j1",'
        ' "generation": 2, "key": null, "status": null, "reason": null, "body_sha256": null}',
        "type: one of",
    ),
    "no invoke": (
        '{"time": 1.0, "process": "w1", "type": "ok", "f": "claim", "job": "j1",'
        ' "generation": 2, "key": null, "status": null, "reason": null, "body_sha256": null}',
        "no invoke outstanding",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_main_exit_2_names_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    history, ledger = write_run(tmp_path, clean_run())
    with history.open("a") as handle:
        handle.write(BAD_LINES[case][0] + "\n")
    assert main([str(history), str(ledger)]) == 2
    err = capsys.readouterr().err
    assert f"{history}:7: " in err
    assert BAD_LINES[case][1] in err


def test_main_exit_2_on_a_missing_file_or_a_bad_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    history, ledger = write_run(tmp_path, clean_run())
    assert main([str(history), str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl: No such file" in capsys.readouterr().err
    ledger.write_text('{"time": 1, "job": "j1", "generation": 1, "key": "k1"}\n')
    assert main([str(history), str(ledger)]) == 2
    assert f"{ledger}:1: missing field(s): body_sha256" in capsys.readouterr().err
    ledger.write_bytes(b"\xff\n")
    assert main([str(history), str(ledger)]) == 2
    assert f"{ledger}:1: not UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"type": "ok", "f": "write", "key": "k", "status": 409, "body_sha256": sha("a")}, "2xx"),
        ({"type": "fail", "f": "write", "key": "k", "status": 201}, "non-2xx"),
        ({"type": "invoke", "f": "write", "key": "k"}, "body_sha256: required"),
        ({"type": "invoke", "f": "write", "body_sha256": sha("a")}, "key"),
        ({"type": "info", "f": "write", "key": "k", "body_sha256": sha("a")}, "null on info"),
        ({"type": "ok", "f": "claim"}, "generation granted"),
        ({"type": "ok", "f": "claim", "generation": True}, "generation: an integer"),
        ({"type": "invoke", "f": "write", "key": "k", "body_sha256": "ABC"}, "64 lowercase"),
        ({"type": "ok", "f": "renew", "time": float("nan")}, "not finite"),
        ({"type": "ok", "f": "renew", "job": ""}, "job: empty"),
        ({"type": "ok", "f": "renew", "replayed": False}, "replayed: .* on a write ok only"),
        ({"type": "ok", "f": "write", "key": "k", "status": 201, "replayed": 1}, "true or false"),
    ],
)
def test_events_refuse_what_the_conventions_forbid(fields: dict[str, Any], why: str) -> None:
    base: dict[str, Any] = {"time": 1.0, "process": "w1", "job": "j1"}
    with pytest.raises(ValueError, match=why):
        HistoryEvent(**{**base, **fields})


def test_a_queue_claim_may_invoke_without_a_job() -> None:
    run = Run()
    run.event(process="w1", type="invoke", f="claim", job="")
    run.event(process="w1", type="ok", f="claim", job="j9", generation=1)
    run.event(process="w1", type="invoke", f="claim", job="")
    run.event(process="w1", type="fail", f="claim", job="", status=204)
    assert run.check().jobs_claimed == 1


@pytest.mark.parametrize(
    ("second", "why"),
    [
        ({"type": "invoke", "f": "write", "key": "k2", "body_sha256": sha("b")}, "outstanding"),
        ({"type": "info", "f": "write", "key": "k2"}, "does not match the invoke at line 1"),
        ({"type": "info", "f": "renew"}, "does not match"),
    ],
)
def test_pairing_errors_are_unreadable(tmp_path: Path, second: dict[str, Any], why: str) -> None:
    path = tmp_path / "history.jsonl"
    common: dict[str, Any] = {"process": "w1", "job": "j1", "generation": 1}
    with JsonlWriter(path) as writer:
        writer.write(
            HistoryEvent(
                time=1.0, type="invoke", f="write", key="k1", body_sha256=sha("a"), **common
            )
        )
        writer.write(HistoryEvent(time=2.0, **common, **second))
    with pytest.raises(UnreadableFile, match=why) as exc:
        read_history(path)
    assert (exc.value.path, exc.value.line) == (str(path), 2)


def test_python_c_entry_point(tmp_path: Path) -> None:
    history, ledger = write_run(tmp_path, clean_run())
    code = "import sys; from verify.check import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(history), str(ledger)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "1 of 1 claimed jobs completed (100.0%)" in done.stdout


def test_11_zookeeper_paused_or_restarted_gives_its_sessions_their_timeout_again(
    tmp_path: Path,
) -> None:
    """ZooKeeper, paused or killed and started again, gives every session it holds its
    timeout again from the moment it serves (a holder whose client reconnects keeps its
    lock, however long the server was away): ``zk-loss``'s pauses and restarts refresh the
    ZooKeeper lock workers' leases as etcd's restarts refresh etcd's; its other faults,
    and other sources' jobs, do not."""
    job = "zklocks//verify-locks/lock-z0"
    run = Run()
    run.claim("z0", job, 7, ttl=4.5, holder="n1")  # ok at 2: held until 6.5
    while run.clock < 11:
        run.tick()
    run.write("z0", job, 7, "k1")  # invoked at 12, after the TTL: 11 without a refresh
    run.history[-2] = dataclasses.replace(run.history[-2], holder="n1")  # its invoke
    run.complete("z0", job, 7)
    assert invariants(run.check()) == [11]

    def refreshes(*faults: tuple[str, str, float, float]) -> list[Refresh]:
        lines = []
        for index, (kind, how, start, end) in enumerate(faults):
            fault = {"index": index, "kind": kind, "params": {"how": how}}
            lines += [
                {"phase": "plan", **fault},
                {"phase": "start", "time": start, **fault},
                {"phase": "end", "time": end, **fault},
            ]
        (tmp_path / "faults.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        return lease_refreshes(tmp_path)

    for how in ("pause", "restart"):
        # Away from 3 (while the lease lived) to 8: held until 8 + 4.5 + 1.
        refreshed = refreshes(("zk-loss", how, 3.0, 8.0))
        assert refreshed == [("zklocks/", 3.0, 8.0)]
        assert check(run.history, run.ledger, refreshed=refreshed).ok
    for faults in [
        (("zk-loss", "pause", 8.0, 9.0),),  # away only after the lease lapsed (and 1 s)
        (("etcd-loss", "restart", 3.0, 8.0),),  # etcd's restart: another source's jobs
        (("etcd-loss", "revoke", 3.0, 3.5), ("lock-loss", "restart", 3.0, 8.0)),
    ]:
        refreshed = refreshes(*faults)
        assert invariants(check(run.history, run.ledger, refreshed=refreshed)) == [11], faults
    assert refreshes(("etcd-loss", "restart", 3.0, 8.0)) == [("etcdlocks/", 3.0, 8.0)]
