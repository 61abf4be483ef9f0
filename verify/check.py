"""The checker: what a run's ``history.jsonl`` and ``ledger.jsonl`` must satisfy.

``check(history, ledger)`` is pure; ``check_files`` and ``main`` read the two files
(``verify.events``). A step's identity is ``(job, key)``; the ledger's order is the order
the upstream applied writes. The invariants (docs/verification.md says why each):

1. ``generations-decrease``: per job, the generations applied never decrease.
2. ``generations-interleave``: per job, once the ledger moves from generation g to another,
   g never appears again.
3. ``acked-not-applied-once``: every key acknowledged (a write ``ok``, replays included)
   was applied exactly once.
4. ``unacked-applied-twice``: every key not acknowledged was applied at most once.
5. ``replay-answer-differs``: all 2xx answers to one key have the same ``body_sha256``,
   equal to the ledger's ``answer_sha256`` of its first application where it has one.
6. ``stale-write``: no write of generation g was applied after the first application of a
   generation g' > g of its job, where g' had been granted (a claim ``ok``) before it.
7. ``liveness``: the share of claimed jobs completed; nothing completed (or a share under
   ``min_completed``) is a violation.

``python -m verify check HISTORY LEDGER [--min-completed X] [--json]``: 0 no violation,
1 violation, 2 a file cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from verify.events import (
    F,
    HistoryEvent,
    LedgerEntry,
    Record,
    Type,
    UnreadableFile,
    read_history,
    read_ledger,
)

NAMES = {
    1: "generations-decrease",
    2: "generations-interleave",
    3: "acked-not-applied-once",
    4: "unacked-applied-twice",
    5: "replay-answer-differs",
    6: "stale-write",
    7: "liveness",
}

Step = tuple[str, str]
"""``(job, key)``: the identity of a write."""


@dataclass(frozen=True)
class Violation:
    """One broken invariant, with the records (history events, ledger entries) that break it."""

    invariant: int
    job: str | None
    message: str
    records: tuple[Record, ...] = ()

    @property
    def name(self) -> str:
        return NAMES[self.invariant]

    @property
    def events(self) -> list[dict[str, Any]]:
        """The records as their files' lines."""
        return [record.to_json() for record in self.records]

    @property
    def where(self) -> list[str]:
        """``history:LINE`` / ``ledger:LINE`` of each record (no line: built in memory)."""
        return [_where(record) for record in self.records]

    def to_json(self) -> dict[str, Any]:
        return {
            "invariant": self.invariant,
            "name": self.name,
            "job": self.job,
            "message": self.message,
            "events": self.events,
            "where": self.where,
        }


def _where(record: Record) -> str:
    kind = "history" if isinstance(record, HistoryEvent) else "ledger"
    return kind if record.line is None else f"{kind}:{record.line}"


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    jobs_claimed: int = 0
    jobs_completed: int = 0
    completed_share: float = 0.0
    min_completed: float = 0.0
    operations: dict[str, dict[str, int]] = field(default_factory=dict)
    """Count of history events by ``f``, then ``type``."""
    history_events: int = 0
    writes_applied: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "violations": [violation.to_json() for violation in self.violations],
            "jobs_claimed": self.jobs_claimed,
            "jobs_completed": self.jobs_completed,
            "completed_share": self.completed_share,
            "min_completed": self.min_completed,
            "operations": self.operations,
            "history_events": self.history_events,
            "writes_applied": self.writes_applied,
        }

    def render(self) -> str:
        """Human text: the counts, then each violation with its records as JSON lines."""
        ops = "; ".join(
            f"{f} " + ", ".join(f"{n} {t}" for t, n in types.items())
            for f, types in self.operations.items()
        )
        lines = [
            f"history: {self.history_events} events ({ops or 'none'})",
            f"ledger: {self.writes_applied} writes applied",
            f"liveness: {self.jobs_completed} of {self.jobs_claimed} claimed jobs completed "
            f"({self.completed_share:.1%})",
        ]
        if self.ok:
            lines.append("no violation of invariants 1-7")
            return "\n".join(lines)
        lines.append(f"{len(self.violations)} violation(s):")
        for v in self.violations:
            job = f" job {v.job!r}:" if v.job is not None else ""
            lines.append(f"[{v.invariant} {v.name}]{job} {v.message}")
            for where, event in zip(v.where, v.events, strict=True):
                lines.append(f"  {where} {json.dumps(event, separators=(',', ':'))}")
        return "\n".join(lines)


def check(
    history: Sequence[HistoryEvent],
    ledger: Sequence[LedgerEntry],
    *,
    min_completed: float = 0.0,
) -> Report:
    """Check invariants 1-7 of a run; the violations in invariant order, then ledger order."""
    report = Report(min_completed=min_completed)
    report.history_events = len(history)
    report.writes_applied = len(ledger)
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for event in history:
        counts[event.f][event.type] += 1
    report.operations = {
        f: {t: counts[f][t] for t in get_args(Type) if counts[f][t]}
        for f in get_args(F)
        if f in counts
    }

    by_job: dict[str, list[LedgerEntry]] = defaultdict(list)
    for entry in ledger:
        by_job[entry.job].append(entry)
    applied: dict[Step, list[LedgerEntry]] = defaultdict(list)
    for entry in ledger:
        applied[entry.job, entry.key].append(entry)
    writes: dict[Step, list[HistoryEvent]] = defaultdict(list)
    for event in history:
        if event.f == "write" and event.key is not None:
            writes[event.job, event.key].append(event)
    grants: dict[tuple[str, int], HistoryEvent] = {}
    for event in history:
        if event.f == "claim" and event.type == "ok" and event.generation is not None:
            known = grants.get((event.job, event.generation))
            if known is None or event.time < known.time:
                grants[event.job, event.generation] = event

    v = report.violations
    for entries in by_job.values():
        v.extend(generations_decrease(entries))
    for entries in by_job.values():
        v.extend(generations_interleave(entries))
    v.extend(applied_once(writes, applied))
    v.extend(same_answer(writes, applied))
    for entries in by_job.values():
        v.extend(stale_writes(entries, grants))
    v.extend(liveness(history, report))
    v.sort(key=lambda violation: violation.invariant)
    return report


def generations_decrease(entries: Iterable[LedgerEntry]) -> Iterable[Violation]:
    """1: one job's ledger entries, each generation at least the highest before it."""
    highest: LedgerEntry | None = None
    for entry in entries:
        if highest is not None and entry.generation < highest.generation:
            yield Violation(
                1,
                entry.job,
                f"generation {entry.generation} (key {entry.key!r}) applied after generation "
                f"{highest.generation} (key {highest.key!r})",
                (highest, entry),
            )
        elif highest is None or entry.generation >= highest.generation:
            highest = entry


def generations_interleave(entries: Iterable[LedgerEntry]) -> Iterable[Violation]:
    """2: one job's ledger entries, a generation left never comes back."""
    left: dict[int, tuple[LedgerEntry, LedgerEntry]] = {}
    previous: LedgerEntry | None = None
    for entry in entries:
        if previous is not None and entry.generation != previous.generation:
            left.setdefault(previous.generation, (previous, entry))
            if entry.generation in left:
                last, moved = left[entry.generation]
                yield Violation(
                    2,
                    entry.job,
                    f"generation {entry.generation} (key {entry.key!r}) applied again after "
                    f"the ledger moved on to generation {moved.generation}",
                    (last, moved, entry),
                )
        previous = entry


def applied_once(
    writes: dict[Step, list[HistoryEvent]], applied: dict[Step, list[LedgerEntry]]
) -> Iterable[Violation]:
    """3 and 4: an acknowledged key applied exactly once, any other at most once."""
    for step in sorted(writes.keys() | applied.keys()):
        events = writes.get(step, [])
        entries = applied.get(step, [])
        acks = [event for event in events if event.acknowledged]
        job, key = step
        if acks and len(entries) != 1:
            yield Violation(
                3,
                job,
                f"key {key!r} acknowledged {len(acks)} time(s) but applied {len(entries)} times",
                (*acks, *entries),
            )
        elif not acks and len(entries) > 1:
            yield Violation(
                4,
                job,
                f"key {key!r} never acknowledged but applied {len(entries)} times",
                (*events, *entries),
            )


def same_answer(
    writes: dict[Step, list[HistoryEvent]], applied: dict[Step, list[LedgerEntry]]
) -> Iterable[Violation]:
    """5: every 2xx answer to a key is the first answer (the ledger's, where it has it)."""
    for step in sorted(writes):
        acks = [event for event in writes[step] if event.acknowledged]
        if not acks:
            continue
        first: Record = acks[0]
        expected = acks[0].body_sha256
        upstream = applied.get(step, [])
        if upstream and upstream[0].answer_sha256 is not None:
            first, expected = upstream[0], upstream[0].answer_sha256
        differ = [event for event in acks if event.body_sha256 != expected]
        if differ:
            job, key = step
            yield Violation(
                5,
                job,
                f"{len(differ)} of {len(acks)} 2xx answers to key {key!r} differ from the first "
                f"answer ({_where(first)})",
                (first, *differ),
            )


def stale_writes(
    entries: Iterable[LedgerEntry], grants: dict[tuple[str, int], HistoryEvent]
) -> Iterable[Violation]:
    """6: one job's ledger entries, none of a generation g after a granted g' > g wrote."""
    firsts: list[LedgerEntry] = []  # each generation's first application, in ledger order
    seen: set[int] = set()
    for entry in entries:
        for newer in firsts:
            grant = grants.get((entry.job, newer.generation))
            if (
                newer.generation > entry.generation
                and grant is not None
                and grant.time < entry.time
            ):
                yield Violation(
                    6,
                    entry.job,
                    f"generation {entry.generation} write (key {entry.key!r}) applied after "
                    f"generation {newer.generation} had been granted and had written",
                    (entry, newer, grant),
                )
                break
        if entry.generation not in seen:
            seen.add(entry.generation)
            firsts.append(entry)


def liveness(history: Iterable[HistoryEvent], report: Report) -> Iterable[Violation]:
    """7: the share of claimed jobs completed, set on ``report``; none is a violation."""
    claimed = {e.job for e in history if e.f == "claim" and e.type == "ok"}
    completed = {e.job for e in history if e.f == "complete" and e.type == "ok"} & claimed
    report.jobs_claimed = len(claimed)
    report.jobs_completed = len(completed)
    report.completed_share = len(completed) / len(claimed) if claimed else 0.0
    if not completed:
        yield Violation(7, None, f"no job completed ({len(claimed)} claimed)")
    elif report.completed_share < report.min_completed:
        yield Violation(
            7,
            None,
            f"{report.completed_share:.1%} of claimed jobs completed "
            f"({len(completed)} of {len(claimed)}), under the minimum "
            f"{report.min_completed:.1%}",
        )


def check_files(history: str | Path, ledger: str | Path, *, min_completed: float = 0.0) -> Report:
    """Read both files (``UnreadableFile``) and check them."""
    return check(read_history(history), read_ledger(ledger), min_completed=min_completed)


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a share between 0 and 1, not {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m verify check``: 0 no violation, 1 a violation, 2 a file unreadable."""
    parser = argparse.ArgumentParser(
        prog="python -m verify check",
        description="Check a verification run's history and ledger (docs/verification.md).",
    )
    parser.add_argument("history", type=Path, help="history.jsonl")
    parser.add_argument("ledger", type=Path, help="ledger.jsonl")
    parser.add_argument(
        "--min-completed",
        type=_share,
        default=0.0,
        metavar="SHARE",
        help="fail when fewer claimed jobs completed (0-1; default 0: fail only on none)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = check_files(args.history, args.ledger, min_completed=args.min_completed)
    except UnreadableFile as exc:
        print(f"verify check: unreadable: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.render())
    return 0 if report.ok else 1
