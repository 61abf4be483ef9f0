"""The checker: the upstream's log (what really happened), what the workers saw, and the
gateway's database, held against each other after a run with faults.

- per job, no step was applied twice;
- per job, the upstream never received a generation lower than one it had received;
- every completed job had every one of its steps applied exactly once;
- every 2xx a worker got (forwarded or replayed) is the answer the upstream gave for that
  (job, step);
- every answer stored for replay is the upstream's answer;
- no record is left in flight within its deadline, and every record whose outcome is
  unknown (or in flight past its deadline) is listed by ``GET /admin/unknown-outcomes``
  and nothing else is.

``check`` returns the violations as sentences; an empty list means the run was correct.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import aiohttp
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.fencing.fence import is_anonymous

from .harness import Attempt, Replica, records, unknown_outcomes


def applied_events(events: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(job, key) -> the upstream's first application of it."""
    first: dict[tuple[str, str], dict[str, Any]] = {}
    for event in events:
        if event["event"] == "applied":
            first.setdefault((event["job"], event["key"]), event)
    return first


def check(
    *,
    events: Sequence[dict[str, Any]],
    attempts: Sequence[Attempt],
    jobs: Mapping[str, Mapping[str, Any]],
    keys_of: Callable[[str], list[str]],
    records: Sequence[dict[str, Any]] | None = None,
    db_now: float | None = None,
    listed_unknown: Sequence[dict[str, Any]] | None = None,
) -> list[str]:
    problems: list[str] = []
    applied = Counter((e["job"], e["key"]) for e in events if e["event"] == "applied")
    first = applied_events(events)

    for (job, key), count in sorted(applied.items()):
        if count > 1:
            problems.append(f"job {job}: step {key} applied {count} times at the upstream")

    highest: dict[str, tuple[int, int]] = {}
    for event in sorted(events, key=lambda e: e["seq"]):
        job, generation = event["job"], event["generation"]
        if job in highest and generation < highest[job][0]:
            seen, seq = highest[job]
            problems.append(
                f"job {job}: the upstream received generation {generation} (key "
                f"{event['key']}, #{event['seq']}, {event['event']}) after generation {seen} "
                f"(#{seq})"
            )
        if job not in highest or generation > highest[job][0]:
            highest[job] = (generation, event["seq"])

    for job, row in sorted(jobs.items()):
        if row["state"] != "completed":
            continue
        for key in keys_of(job):
            if applied[(job, key)] != 1:
                problems.append(
                    f"job {job} is completed but step {key} was applied {applied[(job, key)]} times"
                )

    for attempt in attempts:
        if not attempt.ok or not attempt.key:
            continue
        event = first.get((attempt.job, attempt.key))
        what = "replayed" if attempt.replayed else "forwarded"
        if event is None:
            problems.append(
                f"{attempt.worker} got {attempt.status} ({what}) for job {attempt.job} step "
                f"{attempt.step}, which the upstream never applied"
            )
        elif (attempt.status, attempt.body) != (event["status"], event["answer"].encode()):
            problems.append(
                f"{attempt.worker} got {attempt.status} {attempt.body!r} ({what}) for job "
                f"{attempt.job} step {attempt.step}; the upstream answered {event['status']} "
                f"{event['answer']!r}"
            )

    if records is not None:
        assert db_now is not None
        problems += check_records(records, db_now, first, listed_unknown)
    return problems


async def check_run(
    engine: AsyncEngine,
    replica: Replica,
    *,
    events: Sequence[dict[str, Any]],
    attempts: Sequence[Attempt],
    jobs: Mapping[str, Mapping[str, Any]],
    keys_of: Callable[[str], list[str]],
) -> list[str]:
    """``check`` with the records read from the database and the unknown outcomes as
    ``replica`` lists them (call it once nothing is in flight any more)."""
    rows, now = await records(engine)
    async with aiohttp.ClientSession() as session:
        listed = await unknown_outcomes(session, replica)
    return check(
        events=events,
        attempts=attempts,
        jobs=jobs,
        keys_of=keys_of,
        records=rows,
        db_now=now,
        listed_unknown=listed,
    )


def check_records(
    records: Sequence[dict[str, Any]],
    db_now: float,
    first: Mapping[tuple[str, str], dict[str, Any]],
    listed_unknown: Sequence[dict[str, Any]] | None,
) -> list[str]:
    problems = []
    unknown = set()
    for record in records:
        job, key, state = record["job_id"], record["key"], record["state"]
        if state == "in_flight" and record["deadline"] > db_now:
            problems.append(f"job {job}: key {key} is still in flight after the run")
        elif state == "unknown" or state == "in_flight":
            unknown.add((job, key))
        elif state == "completed" and not is_anonymous(key):
            event = first.get((job, key))
            stored = (record["status"], bytes(record["body"] or b""))
            if event is None:
                problems.append(
                    f"job {job}: key {key} is stored as completed ({record['status']}) but the "
                    "upstream never applied it"
                )
            elif stored != (event["status"], event["answer"].encode()):
                problems.append(
                    f"job {job}: key {key} stored answer {stored!r} differs from the "
                    f"upstream's {event['status']} {event['answer']!r}"
                )
    if listed_unknown is not None:
        listed = {(i["job_id"], i["key"]) for i in listed_unknown}
        for job, key in sorted(unknown - listed):
            problems.append(
                f"job {job}: key {key} has an unknown outcome that /admin/unknown-outcomes "
                "does not list"
            )
        for job, key in sorted(listed - unknown):
            problems.append(f"/admin/unknown-outcomes lists job {job} key {key}, not unknown")
    return problems


def summary(events: Sequence[dict[str, Any]], attempts: Sequence[Attempt]) -> str:
    """One line about the run, for the test's output."""
    kinds = Counter(e["event"] for e in events)
    faults = Counter(e["fault"] for e in events)
    answers: defaultdict[str, int] = defaultdict(int)
    for attempt in attempts:
        label = (
            attempt.reason
            or (
                f"{attempt.status}{' replayed' if attempt.replayed else ''}"
                if attempt.status
                else ""
            )
            or "no answer"
        )
        answers[label] += 1
    return (
        f"upstream: {dict(kinds)} faults {dict(faults)}; "
        f"workers saw: {dict(sorted(answers.items()))}"
    )
