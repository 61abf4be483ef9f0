"""The gateway's own account of a run, held against the upstream's: what ``verify.check``
cannot see from the two files, for a test that can also read the gateway's database and
its list of unknown outcomes (``tests/faults``).

- ``completed_jobs``: every job the database says completed had each of its steps
  applied exactly once;
- ``acknowledged``: every 2xx a worker got for a key (forwarded or replayed, a write
  ``ok`` of the history) is the upstream's first answer to it, status and body's hash
  (``verify.check``'s invariant 5 compares the bodies' hashes only);
- ``received_in_order``: per job, the upstream never received a generation lower than
  one it had received before: every write received counts, applied or not (a duplicate
  at a deduplicating upstream, a write cut before it was applied);
- ``stored_records``: no record is in flight within its deadline after the run; every
  answer stored for replay is the upstream's first answer to its key; the records whose
  outcome is unknown (or in flight past their deadline) are exactly those ``GET
  /admin/unknown-outcomes`` lists.

Each returns its problems as sentences; an empty list means none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gateway.fencing.fence import is_anonymous
from verify.events import HistoryEvent, LedgerEntry, sha256_hex

Step = tuple[str, str]


def first_applied(ledger: Iterable[LedgerEntry]) -> dict[Step, LedgerEntry]:
    """(job, key) -> the upstream's first application of it."""
    first: dict[Step, LedgerEntry] = {}
    for entry in ledger:
        first.setdefault((entry.job, entry.key), entry)
    return first


def answer_of(entry: LedgerEntry) -> tuple[int, bytes]:
    """(status, body) the upstream answered an application with (``verify.upstream``)."""
    return int(entry.extra["status"]), str(entry.extra["answer"]).encode()


def completed_jobs(
    jobs: Mapping[str, Mapping[str, Any]],
    keys_of: Callable[[str], Sequence[str]],
    ledger: Sequence[LedgerEntry],
) -> list[str]:
    applied = Counter((entry.job, entry.key) for entry in ledger)
    return [
        f"job {job} is completed but step {key} was applied {applied[job, key]} times"
        for job, row in sorted(jobs.items())
        if row["state"] == "completed"
        for key in keys_of(job)
        if applied[job, key] != 1
    ]


def acknowledged(history: Iterable[HistoryEvent], ledger: Sequence[LedgerEntry]) -> list[str]:
    """Each write ``ok`` of ``history`` (a 2xx a worker got, forwarded or replayed): its
    status and the sha256 of its body are the upstream's first answer to its key's."""
    first = first_applied(ledger)
    problems = []
    for event in history:
        if not event.acknowledged:
            continue
        job, key, status = event.job, event.key, event.status
        entry = first.get((job, str(key)))
        if entry is None:
            problems.append(f"job {job}: key {key} answered {status}, never applied")
            continue
        upstream_status, upstream_body = answer_of(entry)
        if (status, event.body_sha256) != (upstream_status, sha256_hex(upstream_body)):
            problems.append(
                f"job {job}: key {key} answered {status} (body sha256 "
                f"{event.body_sha256}); the upstream answered {answer_of(entry)!r}"
            )
    return problems


def received_in_order(received: Iterable[Mapping[str, Any]]) -> list[str]:
    """``received``: the upstream's ``--received`` lines, in the order received."""
    problems = []
    highest: dict[str, tuple[int, int]] = {}  # job -> (generation, line)
    for line, write in enumerate(received, 1):
        job, generation = write["job"], write["generation"]
        if job in highest and generation < highest[job][0]:
            seen, where = highest[job]
            problems.append(
                f"job {job}: the upstream received generation {generation} (key "
                f"{write['key']}, #{line}, {write['event']}) after generation {seen} (#{where})"
            )
        if job not in highest or generation > highest[job][0]:
            highest[job] = (generation, line)
    return problems


def stored_records(
    records: Sequence[Mapping[str, Any]],
    db_now: float,
    ledger: Sequence[LedgerEntry],
    listed_unknown: Sequence[Mapping[str, Any]] | None,
) -> list[str]:
    """``records``: the gateway's idempotency records (rows of ``requests``) at
    ``db_now``, the database's clock; ``listed_unknown``: ``/admin/unknown-outcomes``'s
    items (None: not compared)."""
    first = first_applied(ledger)
    problems = []
    unknown = set()
    for record in records:
        job, key, state = record["job_id"], record["key"], record["state"]
        if state == "in_flight" and record["deadline"] > db_now:
            problems.append(f"job {job}: key {key} is still in flight after the run")
        elif state in ("unknown", "in_flight"):
            unknown.add((job, key))
        elif state == "completed" and not is_anonymous(key):
            entry = first.get((job, key))
            stored = (record["status"], bytes(record["body"] or b""))
            if entry is None:
                problems.append(
                    f"job {job}: key {key} is stored as completed ({record['status']}) but the "
                    "upstream never applied it"
                )
            elif stored != answer_of(entry):
                problems.append(
                    f"job {job}: key {key} stored answer {stored!r} differs from the "
                    f"upstream's {answer_of(entry)!r}"
                )
    if listed_unknown is not None:
        listed = {(item["job_id"], item["key"]) for item in listed_unknown}
        problems += [
            f"job {job}: key {key} has an unknown outcome that /admin/unknown-outcomes "
            "does not list"
            for job, key in sorted(unknown - listed)
        ]
        problems += [
            f"/admin/unknown-outcomes lists job {job} key {key}, not unknown"
            for job, key in sorted(listed - unknown)
        ]
    return problems
