"""The checks of the fault suite (``verify.check`` on the workers' history, as
``verify.events`` records it, and ``verify.records``): each violation they exist to catch
is caught (no processes here).

A checker that passes everything would make every fault test pass; these cases keep it
honest.
"""

from __future__ import annotations

import json
from typing import Any

from verify.events import HistoryEvent, LedgerEntry, sha256_hex
from verify.records import stored_records

from .harness import problems, step_bytes

KEYS = {"job-1": ["k0", "k1"]}


def granted(asked: float, at: float, generation: int) -> list[HistoryEvent]:
    """Worker ``w{generation}``'s claim of job-1, granted at ``at`` (no TTL: untimed)."""
    common: dict[str, Any] = {"process": f"w{generation}#claim", "f": "claim", "job": "job-1"}
    return [
        HistoryEvent(time=asked, type="invoke", **common),
        HistoryEvent(time=at, type="ok", generation=generation, status=200, **common),
    ]


GRANTS = [*granted(0.0, 1.0, 1), *granted(14.0, 15.0, 2)]
SENT_COUNT = iter(range(1_000_000))


def answer(key: str, generation: int, seq: int) -> str:
    return json.dumps({"seq": seq, "job": "job-1", "key": key, "generation": generation})


def entry(t: float, key: str, generation: int, seq: int) -> LedgerEntry:
    """The upstream's application of ``key`` at ``t``, as verify.upstream writes it."""
    text = answer(key, generation, seq)
    return LedgerEntry(
        time=t,
        job="job-1",
        generation=generation,
        key=key,
        body_sha256=sha256_hex(step_bytes("job-1", key)),
        answer_sha256=sha256_hex(text.encode()),
        extra={"status": 201, "seq": seq, "answer": text},
    )


def received(applied: list[LedgerEntry], event: str = "applied") -> list[dict[str, Any]]:
    return [{**e.to_json(), "event": event} for e in applied]


def saw(
    t: float,
    key: str,
    generation: int,
    body: bytes | None,
    *,
    status: int | None = None,
    reason: str | None = None,
    replayed: bool = False,
) -> list[HistoryEvent]:
    """A write of ``key`` sent at ``t`` and answered (``body``; None: no answer) at
    ``t + 0.5``, as a process of its own."""
    common: dict[str, Any] = {
        "process": f"w{generation}#{next(SENT_COUNT)}",
        "f": "write",
        "job": "job-1",
        "generation": generation,
        "key": key,
    }
    sent = sha256_hex(step_bytes("job-1", key))
    invoke = HistoryEvent(time=t, type="invoke", body_sha256=sent, **common)
    if body is None:
        return [invoke, HistoryEvent(time=t + 0.5, type="info", **common)]
    status = 201 if status is None else status
    ok = 200 <= status <= 299
    end = HistoryEvent(
        time=t + 0.5,
        type="ok" if ok else "fail",
        status=status,
        reason=reason,
        body_sha256=sha256_hex(body),
        replayed=replayed if ok else None,
        **common,
    )
    return [invoke, end]


def check(
    writes: list[list[HistoryEvent]],
    applied: list[LedgerEntry],
    state: str = "completed",
    got: list[dict[str, Any]] | None = None,
) -> list[str]:
    return problems(
        [*GRANTS, *(e for w in writes for e in w)],
        applied,
        received(applied) if got is None else got,
        {"job-1": {"state": state}},
        lambda job: KEYS[job],
    )


GOOD = [entry(10.0, "k0", 1, 1), entry(20.0, "k1", 2, 2)]
SENT = [
    saw(9.0, "k0", 1, GOOD[0].extra["answer"].encode()),
    saw(19.0, "k1", 2, GOOD[1].extra["answer"].encode()),
    saw(30.0, "k0", 2, GOOD[0].extra["answer"].encode(), replayed=True),
]


def test_a_correct_run_passes() -> None:
    assert check(SENT, GOOD) == []


def test_a_step_applied_twice() -> None:
    twice = [*GOOD, entry(21.0, "k1", 2, 3)]
    [problem] = check(SENT, twice, state="leased")
    assert "acked-not-applied-once" in problem and "applied 2 times" in problem
    [problem] = check(SENT[:1], [GOOD[0], entry(11.0, "k0", 1, 2)], state="leased")
    assert "acked-not-applied-once" in problem
    unanswered = [saw(9.0, "k0", 1, None), saw(9.2, "k0", 1, None)]
    [problem] = check(unanswered, [GOOD[0], entry(11.0, "k0", 1, 2)], state="leased")
    assert "unacked-applied-twice" in problem


def test_a_duplicate_delivery_to_a_deduplicating_upstream_is_not_applied_twice() -> None:
    duplicate = received([entry(21.0, "k1", 2, 2)], event="duplicate")
    assert check(SENT, GOOD, got=[*received(GOOD), *duplicate]) == []


def test_a_generation_going_backwards() -> None:
    backwards = [entry(10.0, "k0", 2, 1), entry(20.0, "k1", 1, 2)]
    sent = [saw(9.0, "k0", 2, None), saw(8.0, "k1", 1, None)]
    found = check(sent, backwards, state="leased")
    assert any("generations-decrease" in p for p in found), found
    assert any("received generation 1" in p and "after generation 2" in p for p in found)


def test_a_lower_generation_received_after_a_higher_one_even_if_not_applied() -> None:
    dropped = received([entry(21.0, "k0", 1, 3)], event="dropped")
    [problem] = check(SENT, GOOD, got=[*received(GOOD), *dropped])
    assert "received generation 1" in problem and "dropped" in problem


def test_a_completed_job_with_a_step_missing() -> None:
    [problem] = check(SENT[:1], [GOOD[0]])
    assert "completed but step k1 was applied 0 times" in problem


def test_a_2xx_that_is_not_the_upstreams_answer() -> None:
    forged = saw(30.0, "k0", 2, b'{"forged": true}', replayed=True)
    found = check([*SENT[:2], forged], GOOD)
    assert any("replay-answer-differs" in p for p in found), found
    assert any("the upstream answered" in p for p in found), found
    found = check([SENT[0], saw(19.0, "k1", 2, b"{}")], [GOOD[0]], state="leased")
    assert any("acked-not-applied-once" in p and "applied 0 times" in p for p in found)
    assert any("never applied" in p for p in found), found
    wrong_status = saw(30.0, "k0", 2, GOOD[0].extra["answer"].encode(), status=200)
    [problem] = check([*SENT[:2], wrong_status], GOOD)
    assert "answered 200" in problem and "the upstream answered (201" in problem


def test_a_write_the_gateway_must_have_refused_or_nobody_sent() -> None:
    refused = saw(9.0, "k0", 1, b"{}", status=409, reason="stale-generation")
    found = check([refused, SENT[1]], GOOD, state="leased")
    assert any("refused-but-applied" in p for p in found), found
    [problem] = check(SENT[1:2], GOOD, state="leased")  # nobody sent k0
    assert "body-not-sent" in problem


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
    stored = record("k0", "completed", body=GOOD[0].extra["answer"].encode())
    listed = [{"job_id": "job-1", "key": "k1"}]
    ok = [stored, record("k1", "in_flight", deadline=10.0)]  # past its deadline: unknown
    assert stored_records(ok, 20.0, GOOD, listed) == []

    found = stored_records(
        [record("k0", "completed", body=b"{}"), record("k1", "in_flight", deadline=30.0)],
        20.0,
        GOOD,
        listed,
    )
    assert any("stored answer" in p for p in found), found
    assert any("still in flight" in p for p in found), found
    assert any("not unknown" in p for p in found), found

    [problem] = stored_records([stored, record("k1", "unknown")], 20.0, GOOD, [])
    assert "does not list" in problem
    [problem] = stored_records([record("k1", "completed", body=b"{}")], 20.0, [GOOD[0]], None)
    assert "never applied" in problem
