"""``verify.check`` on the leases of a source that can hand one generation out twice (a
Redis lock whose fence counter was lost: ``verify.locks``, the ``lock-loss`` nemesis).

Invariant 12 ``two-holders-one-generation``: hand-made histories where two holders' writes
under one generation of a job were both applied are caught, with each holder's first
write, its invoke and its grant; the clean ones pass (the second holder refused, one
holder writing many times, two holders of one generation of two jobs, a new generation
after the refusal). Invariants 8 and 11 stay sound: a higher generation granted in the
counter's earlier life does not exclude a write of its new life, and one holder's
release does not end another's lease of the same generation. ``holder`` round-trips.
"""

from __future__ import annotations

import pytest

from tests.unit.test_verify_check import Run, invariants, only, sha
from verify.check import REISSUED, Report, check
from verify.events import HistoryEvent, LedgerEntry

JOB = "locks/lock-0"
A, B, C = "a" * 32, "b" * 32, "c" * 32


def broken(report: Report) -> list[int]:
    """The safety invariants broken (these runs are too short to judge liveness by)."""
    return [invariant for invariant in invariants(report) if invariant != 7]


class Locks(Run):
    """A ``Run`` whose leases are a Redis lock's holdings, each named by its holder."""

    def acquire(
        self, process: str, holder: str, generation: int, ttl: float = 60.0
    ) -> HistoryEvent:
        self.event(process=process, type="invoke", f="claim", job=JOB)
        return self.event(
            process=process,
            type="ok",
            f="claim",
            job=JOB,
            generation=generation,
            status=200,
            ttl=ttl,
            holder=holder,
        )

    def send(self, process: str, holder: str, generation: int, step: int) -> HistoryEvent:
        return self.event(
            process=process,
            type="invoke",
            f="write",
            job=JOB,
            generation=generation,
            key=f"{holder[:16]}-step{step}",
            body_sha256=sha(f"body {holder[:16]}-step{step}"),
            holder=holder,
        )

    def answer(
        self, invoke: HistoryEvent, status: int = 201, reason: str | None = None
    ) -> HistoryEvent:
        return self.event(
            process=invoke.process,
            type="ok" if status < 300 else "fail",
            f="write",
            job=JOB,
            generation=invoke.generation,
            key=invoke.key,
            status=status,
            reason=reason,
            body_sha256=sha(f"answer {invoke.key}"),
            holder=invoke.holder,
        )

    def applies(self, invoke: HistoryEvent) -> LedgerEntry:
        assert invoke.key is not None and invoke.generation is not None
        entry = LedgerEntry(
            time=self.tick(),
            job=JOB,
            generation=invoke.generation,
            key=invoke.key,
            body_sha256=sha(f"body {invoke.key}"),
            answer_sha256=sha(f"answer {invoke.key}"),
        )
        self.ledger.append(entry)
        return entry

    def written(self, process: str, holder: str, generation: int, step: int) -> LedgerEntry:
        """A write sent, applied and answered 201."""
        invoke = self.send(process, holder, generation, step)
        entry = self.applies(invoke)
        self.answer(invoke)
        return entry

    def refused(self, process: str, holder: str, generation: int, reason: str) -> None:
        self.answer(self.send(process, holder, generation, 0), 409, reason)

    def release(self, process: str, holder: str, generation: int) -> HistoryEvent:
        common = {"process": process, "f": "complete", "job": JOB, "generation": generation}
        self.event(type="invoke", holder=holder, **common)  # type: ignore[arg-type]
        return self.event(type="ok", status=200, holder=holder, **common)  # type: ignore[arg-type]


# --- 12: two holders, one generation ------------------------------------------------------


def test_12_two_holders_applied_under_one_generation() -> None:
    """a(1), b(2), e(2), f(3): b and e of two holders, the counter lost in between."""
    run = Locks()
    run.acquire("l0", A, 1)
    run.written("l0", A, 1, 0)
    run.release("l0", A, 1)
    grant_b = run.acquire("l0", B, 2)
    first = run.written("l0", B, 2, 0)
    run.release("l0", B, 2)
    # FLUSHALL: the counter starts again; the new holders climb back to the fence.
    run.acquire("l1", C, 1)
    run.refused("l1", C, 1, "stale-generation")
    run.release("l1", C, 1)
    grant_e = run.acquire("l1", "e" * 32, 2)
    second = run.written("l1", "e" * 32, 2, 0)
    run.release("l1", "e" * 32, 2)
    run.acquire("l1", "f" * 32, 3)
    run.written("l1", "f" * 32, 3, 0)
    run.release("l1", "f" * 32, 3)
    report = run.check()
    assert broken(report) == [12], report.render()
    (violation,) = report.violations
    assert violation.name == "two-holders-one-generation"
    assert violation.job == JOB
    assert "generation 2 writes applied from 2 holders" in violation.message
    for record in (first, second, grant_b, grant_e):
        assert record.to_json() in violation.events


def test_12_the_old_holders_write_in_flight_as_the_new_one_writes() -> None:
    run = Locks()
    run.acquire("l0", A, 3)
    late = run.send("l0", A, 3, 1)  # held at the upstream
    run.acquire("l1", B, 3)  # the counter lost, climbed back to 3
    run.written("l1", B, 3, 0)
    run.applies(late)
    run.answer(late)
    report = run.check()
    assert broken(report) == [12], report.render()
    assert "2 holders" in only(report, 12)[0].message


def test_12_three_holders_are_one_violation_naming_all() -> None:
    run = Locks()
    for process, holder in (("l0", A), ("l1", B), ("l2", C)):
        run.acquire(process, holder, 4)
        run.written(process, holder, 4, 0)
        run.written(process, holder, 4, 1)
    (violation,) = only(run.check(), 12)
    assert "3 holders" in violation.message
    assert len([r for r in violation.records if isinstance(r, LedgerEntry)]) == 3


# --- 12: clean ----------------------------------------------------------------------------


def test_12_the_second_holder_refused_is_clean() -> None:
    """The gateway binds a generation to its first holder: the next is refused, takes
    the next generation and writes under it."""
    run = Locks()
    run.acquire("l0", A, 3)
    run.written("l0", A, 3, 0)
    run.written("l0", A, 3, 1)
    run.acquire("l1", B, 3)
    run.refused("l1", B, 3, REISSUED)
    run.release("l1", B, 3)
    run.acquire("l1", C, 4)
    run.written("l1", C, 4, 0)
    run.release("l1", C, 4)
    assert not broken(run.check()), run.check().render()


def test_12_one_generation_of_two_jobs_and_queue_jobs_are_not_judged() -> None:
    run = Locks()
    run.acquire("l0", A, 1)
    run.written("l0", A, 1, 0)
    run.history.append(
        HistoryEvent(time=run.tick(), process="l1", type="invoke", f="claim", job="locks/lock-1")
    )
    run.history.append(
        HistoryEvent(
            time=run.tick(),
            process="l1",
            type="ok",
            f="claim",
            job="locks/lock-1",
            generation=1,
            ttl=60.0,
            holder=B,
        )
    )
    run.claim("w1", "j1", 1, ttl=60.0)  # the gateway's own lease: no holder
    run.write("w1", "j1", 1, "k1")
    run.write("w1", "j1", 1, "k2")
    assert not broken(run.check()), run.check().render()


def test_12_a_write_whose_causes_name_two_holders_is_not_judged() -> None:
    """The same key, body and generation sent by two holders: whose it was cannot be
    told, so it counts for neither."""
    run = Locks()
    run.acquire("l0", A, 2)
    run.written("l0", A, 2, 0)
    run.acquire("l1", B, 2)
    shared = run.event(
        process="l1",
        type="invoke",
        f="write",
        job=JOB,
        generation=2,
        key=f"{A[:16]}-step0",
        body_sha256=sha(f"body {A[:16]}-step0"),
        holder=B,
    )
    run.answer(shared)  # a replay: not applied again
    assert not only(run.check(), 12)


# --- 8 and 11 stay sound --------------------------------------------------------------------


def test_8_a_higher_generation_of_the_counters_earlier_life_excludes_nothing() -> None:
    run = Locks()
    run.acquire("l0", A, 5)  # never writes; then the counter is lost
    run.acquire("l1", B, 3)  # asked for after 5 was granted: 5 is of the earlier life
    run.written("l1", B, 3, 0)
    assert not broken(run.check()), run.check().render()
    # Of the same life (granted after B asked): B's later write must have been refused.
    same = Locks()
    same.acquire("l1", B, 3)
    same.acquire("l0", A, 5)
    same.written("l1", B, 3, 0)
    assert broken(same.check()) == [8]


def test_8_the_gateways_own_leases_judge_every_newer_grant() -> None:
    run = Run()
    run.claim("w2", "j1", 5, ttl=60.0)
    run.claim("w1", "j1", 3, ttl=60.0)
    run.write("w1", "j1", 3, "k1")
    assert broken(run.check()) == [8]


def test_11_one_holders_release_does_not_end_anothers_lease_of_its_generation() -> None:
    run = Locks()
    run.acquire("l0", A, 2)
    run.release("l0", A, 2)
    run.acquire("l1", B, 2)  # the counter lost in between
    run.written("l1", B, 2, 0)
    assert not broken(run.check()), run.check().render()
    after = Locks()
    after.acquire("l0", A, 2)
    after.written("l0", A, 2, 0)
    after.release("l0", A, 2)
    after.written("l0", A, 2, 1)  # after its own release
    assert broken(after.check()) == [11]


def test_11_a_holders_lease_expires_by_its_own_ttl() -> None:
    run = Locks()
    run.acquire("l0", A, 2, ttl=2.0)
    run.tick(), run.tick(), run.tick()
    run.written("l0", A, 2, 0)
    assert broken(run.check()) == [11]


# --- the field --------------------------------------------------------------------------------


def test_holder_round_trips_and_is_never_empty() -> None:
    event = HistoryEvent(
        time=1.0, process="l0", type="ok", f="claim", job=JOB, generation=1, ttl=2.0, holder=A
    )
    line = event.to_json()
    assert list(line)[-2:] == ["ttl", "holder"]
    assert HistoryEvent.from_json(line) == event
    plain = HistoryEvent(time=1.0, process="w0", type="invoke", f="claim", job="")
    assert "holder" not in plain.to_json()
    with pytest.raises(ValueError, match="holder"):
        HistoryEvent(time=1.0, process="l0", type="invoke", f="claim", job="", holder="")
    with pytest.raises(ValueError, match="holder"):
        HistoryEvent.from_json({**line, "holder": 7})
    assert check([event], []).violations[0].name == "liveness"
