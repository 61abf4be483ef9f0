"""The checker itself: each violation it exists to catch is caught (no processes here).

A checker that passes everything would make every fault test pass; these cases keep it
honest.
"""

from __future__ import annotations

from typing import Any

from .checker import check
from .harness import Attempt

KEYS = {"job-1": ["k0", "k1"]}


def event(seq: int, key: str, generation: int, kind: str = "applied", job: str = "job-1") -> Any:
    answer = f'{{"key":"{key}","generation":{generation}}}'
    return {
        "seq": seq,
        "event": kind,
        "job": job,
        "key": key,
        "generation": generation,
        "status": 201,
        "answer": answer,
        "fault": "none",
    }


def saw(key: str, body: bytes, status: int = 201, replayed: bool = False) -> Attempt:
    return Attempt("w", "job-1", key, key, 1, "a", status=status, body=body, replayed=replayed)


def run_check(events: list[Any], attempts: list[Attempt] = (), **kwargs: Any) -> list[str]:  # type: ignore[assignment]
    return check(
        events=events,
        attempts=attempts,
        jobs=kwargs.pop("jobs", {"job-1": {"state": "completed"}}),
        keys_of=lambda job: KEYS[job],
        **kwargs,
    )


GOOD = [event(1, "k0", 1), event(2, "k1", 2)]


def test_a_correct_run_passes() -> None:
    attempts = [
        saw("k0", GOOD[0]["answer"].encode()),
        saw("k0", GOOD[0]["answer"].encode(), replayed=True),
    ]
    assert run_check(GOOD, attempts) == []


def test_a_step_applied_twice() -> None:
    [problem] = run_check([*GOOD, event(3, "k1", 2)], jobs={"job-1": {"state": "leased"}})
    assert "k1 applied 2 times" in problem


def test_a_duplicate_delivery_to_a_deduplicating_upstream_is_not_applied_twice() -> None:
    assert run_check([*GOOD, event(3, "k1", 2, kind="duplicate")]) == []


def test_a_generation_going_backwards() -> None:
    [problem] = run_check([event(1, "k0", 2), event(2, "k1", 1)])
    assert "received generation 1" in problem and "after generation 2" in problem


def test_a_completed_job_with_a_step_missing() -> None:
    [problem] = run_check([GOOD[0]])
    assert "completed but step k1 was applied 0 times" in problem


def test_a_2xx_that_is_not_the_upstreams_answer() -> None:
    [problem] = run_check(GOOD, [saw("k0", b'{"forged": true}', replayed=True)])
    assert "upstream answered" in problem
    [problem] = run_check([GOOD[0]], [saw("k1", b"{}")], jobs={"job-1": {"state": "leased"}})
    assert "never applied" in problem


def record(key: str, state: str, deadline: float = 0.0, body: bytes = b"") -> dict[str, Any]:
    return {
        "job_id": "job-1",
        "key": key,
        "state": state,
        "deadline": deadline,
        "status": 201,
        "body": body,
    }


def test_records_in_flight_unknown_and_listed() -> None:
    stored = record("k0", "completed", body=GOOD[0]["answer"].encode())
    listed = [{"job_id": "job-1", "key": "k1"}]
    ok = [stored, record("k1", "in_flight", deadline=10.0)]  # past its deadline: unknown
    assert run_check(GOOD, records=ok, db_now=20.0, listed_unknown=listed) == []

    problems = run_check(
        GOOD,
        records=[record("k0", "completed", body=b"{}"), record("k1", "in_flight", deadline=30.0)],
        db_now=20.0,
        listed_unknown=listed,
    )
    assert any("stored answer" in p for p in problems), problems
    assert any("still in flight" in p for p in problems), problems
    assert any("not unknown" in p for p in problems), problems

    [problem] = run_check(
        GOOD, records=[stored, record("k1", "unknown")], db_now=20.0, listed_unknown=[]
    )
    assert "does not list" in problem
