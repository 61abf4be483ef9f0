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
   (1, 2 and 6 leave out a write whose cause the gateway answered ``GAVE_UP``: it stopped
   waiting for it, and an upstream may still apply it after the next generation's; not
   when another cause got the entry's own answer unreplayed: that one was applied.)
7. ``liveness``: the share of claimed jobs completed; nothing completed (or a share under
   ``min_completed``) is a violation.

8-11 ask of each applied write which writes sent could have caused it: the write invokes
of its job, key and generation, invoked before it was applied, with its body. It is a
violation when there is none (10), or when every one of them was one the gateway must not
have forwarded: refused with a reason that says it was not forwarded (9), invoked after a
newer generation of its job had been granted (8), or invoked after its lease was over,
expired or completed (11). The violation is named by the latest such write.

8. ``applied-after-newer-grant``: a write invoked after a claim ``ok`` of a newer
   generation of its job is never applied.
9. ``refused-but-applied``: a write answered with a reason of ``NOT_FORWARDED`` (the
   gateway's reasons whose ``sent`` is ``never`` in the reasons table) is never applied.
10. ``body-not-sent``: an applied write's body is one sent under its job, key and
    generation before it was applied.
11. ``applied-after-lease-over``: a write invoked more than ``expiry_margin`` seconds after
    its lease was over (the latest of the claim and renew ``ok``s invoked before it, plus
    its ``ttl``, or a complete ``ok``) is never applied, unless a renew of that lease with
    an unknown outcome was invoked before it, or a replica's clock was skewed
    (``skewed``) when the lease was granted or renewed or the write invoked.

12. ``two-holders-one-generation``: per job and generation, the applied writes come from
    one holder only. A lease source whose fence counter is lost (a Redis ``FLUSHALL``, a
    restart without persistence) hands out a generation again, to a new holder; the
    history names each holder (``holder``) and an applied write's holder is that of its
    causes. Leases are ``(job, generation, holder)`` for 8 and 11: a grant of a higher
    generation made before a write's own lease was asked for is of the counter's earlier
    life, and does not exclude the write (8).

13. ``never-sent-held-unknown``: a key the gateway held as an unknown outcome
    (``unknowns.jsonl``) under generation g had a write of its job, key and g reach the
    upstream (the ledger has it), unless a fault that can lose a write unseen (``excused``:
    kill -9, SIGSTOP, a partition to the upstream, the upstream's 503) overlapped its
    attempts. ``Causes.held_unknown`` says why this is sound.

14. ``acked-body-not-applied``: a write acknowledged (2xx) was sent with the body applied
    under its ``(job, key)``. A retry whose body differs from the first (a worker that
    rebuilds its payload) must be refused ``idempotency-key-reused``, not answered with
    the other body's outcome.

15. ``granted-while-current``: a claim ``ok`` of the gateway's own leases (no ``holder``)
    comes after every older generation's lease of its job could have ended: each claim
    and renew ``ok`` of that lease holds it at least until its invoke plus its ``ttl``
    (the lease core dates a lease from when it handles the call, after the worker
    invoked it), unless a complete or a fail (the lease given back) of it was invoked
    before the claim, or a replica's
    clock was skewed (``skewed``) at the grant or the claim. A lease core that hands a
    job out early (a claimable time judged with slack) breaks it while the gateway still
    fences the old holder off.

16. ``let-go-gracefully``: the gateway never closes a connection to the upstream
    gracefully (a FIN) while a write it sent on it is unanswered: a graceful close leaves
    the kernel retransmitting the write's unacknowledged bytes after the gateway gave up
    on it, and a partition that heals delivers it then, after the next generation's
    writes or past the upstream's deduplication window. It resets such a connection
    (``gateway.upstream.connection``). The upstream sees the FIN (``verify.upstream
    --let-go``, ``let-go.jsonl``, each line a ledger entry of such a write, its ``time``
    when seen); whether the bytes arrived late is only chance (a partition falling on a
    write in flight), the graceful close is not. Not judged without the file.

``python -m verify check HISTORY LEDGER [--min-completed X] [--expiry-margin S]
[--clock-skew FROM,TO ...] [--unknowns FILE] [--let-go FILE] [--excused FROM,TO ...]
[--json]``: 0 no violation, 1 violation, 2 a file cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, get_args

from fencegate_client.reasons import GATEWAY_REASONS, REASONS, Reason, Sent
from verify.events import (
    F,
    HeldUnknown,
    HistoryEvent,
    LedgerEntry,
    Record,
    Type,
    UnreadableFile,
    read_history,
    read_ledger,
    read_unknowns,
)

NAMES = {
    1: "generations-decrease",
    2: "generations-interleave",
    3: "acked-not-applied-once",
    4: "unacked-applied-twice",
    5: "replay-answer-differs",
    6: "stale-write",
    7: "liveness",
    8: "applied-after-newer-grant",
    9: "refused-but-applied",
    10: "body-not-sent",
    11: "applied-after-lease-over",
    12: "two-holders-one-generation",
    13: "never-sent-held-unknown",
    14: "acked-body-not-applied",
    15: "granted-while-current",
    16: "let-go-gracefully",
}

REISSUED: Final = Reason.GENERATION_REISSUED.value
"""The refusal of a lease source's generation presented by a holder other than the one it
was first admitted for (the source lost its counter and handed the generation out again)."""

NOT_FORWARDED: Final = frozenset(
    reason.value
    for reason in GATEWAY_REASONS
    if reason in REASONS and REASONS[reason].sent is Sent.NEVER
)
"""The gateway's answers that say the write was never sent: the reasons of the gateway
whose ``sent`` is ``never`` in the reasons table (``fencegate_client.reasons``), the one
place that says so; a write answered one of these must not reach the upstream (9), nor be
left held as unknown (13). Those whose ``sent`` is ``maybe`` (``upstream-timeout``,
``upstream-connection-lost``, ``outcome-unknown``, ``internal-error``) or ``yes`` are not
among them: such a write may have been sent. ``store-unavailable`` is: the gateway answers
it only for a write it did not send."""

GAVE_UP: Final = frozenset({"upstream-timeout"})
"""The gateway's answers that say it stopped waiting for a write it had sent: the outcome
is unknown, and the upstream may still apply it later (a request delayed in the network,
or slow at the upstream), after the next generation's writes, which the gateway admits
once it stopped waiting. Invariants 1, 2 and 6 leave such a write out of the order; 3-5
and 8-11 still count it. Not from the reasons table: ``sent`` says whether a write left,
not whether the gateway stopped waiting while the upstream may still apply it. Not
``upstream-connection-lost`` (sent ``maybe`` too): the connection failed, so the gateway
did not leave a request standing that the upstream reads later; in ``verify run`` only
the upstream cuts a connection, after applying."""

RECORD_LIFE: Final = 15.0
"""Seconds after a write's invoke, or its completion when that came later, in which the
gateway may still be handling it (waiting on a locked SQLite file, 10 s at most, then its
settle): a fault that excuses a held key (13) excuses the writes it overlaps so widened.
Shorter for an attempt whose connection says the gateway let go of it (``LET_GO``)."""

LET_GO: Final = {"connection-refused": 0.0, "disconnected": 7.0, "ServerDisconnectedError": 7.0}
"""An ``info`` completion's ``reason`` that bounds how long after it the gateway may still
have held the write (13), in seconds. ``connection-refused``: no connection was made, so
no gateway had the request. ``disconnected`` (the queue workers' name for aiohttp's
``ServerDisconnectedError``, which the lock and signed workers record as is): the gateway
closed the connection without answering, which it does only when its process ends (kill
-9) or is stopping (SIGTERM, past its grace): what that request held is let go, or gone,
once the process has ended, which ``verify run`` makes happen within 5 s of a SIGTERM (a
SIGKILL then, and a ``killed`` line whose span excuses); 2 s more for bytes written before
the end to cross the network. Issue 53: with ``RECORD_LIFE`` for them, a partition 10 s
after a shutdown excused the shutdown's own never-sent waiter."""

EXPIRY_MARGIN: Final = 0.5
"""Seconds a write must be invoked after its lease was over to count as invoked after it:
the history's and the ledger's times and the database's clock are one machine's, and a
client sees a grant after the database made it, so this only absorbs the clock's grain."""

Refresh = tuple[str, float, float]
"""``(job prefix, down, back)``: a lease source's store restarted (went down at ``down``,
served again from ``back``), giving every lease of the jobs under the prefix that was
alive when it went down its TTL again once it was back (``REFRESH_EXTEND``): etcd does
so when a leader takes over (its lessor's ``Promote``), ZooKeeper when it serves again
after a pause or a restart (every session it holds gets its timeout from then)."""

REFRESH_EXTEND: Final = 1.0
"""Seconds etcd adds to each lease's TTL when a leader takes over (its election timeout,
1 s by default), so that no lease expires before its holder could reach the new leader."""

REFRESH_SLACK: Final = 1.0
"""Seconds a lease may have been past its TTL at a restart and still be refreshed: etcd
revokes expired leases in rounds (every 500 ms), so one just past its TTL may still be
there when the store goes down."""

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
    kind = (
        "history"
        if isinstance(record, HistoryEvent)
        else "unknowns"
        if isinstance(record, HeldUnknown)
        else "ledger"
    )
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
            lines.append(f"no violation of invariants 1-{max(NAMES)}")
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
    expiry_margin: float = EXPIRY_MARGIN,
    skewed: Sequence[tuple[float, float]] = (),
    held: Sequence[HeldUnknown] | None = None,
    excused: Sequence[tuple[float, float]] = (),
    refreshed: Sequence[Refresh] = (),
    let_go: Sequence[LedgerEntry] = (),
) -> Report:
    """Check invariants 1-16 of a run; the violations in invariant order, then ledger order.

    ``skewed``: the spans of time (``time.time()``, from, to) in which a replica that
    judges leases by its own clock (SQLite) ran with a skewed clock; invariant 11 does
    not judge the leases granted or renewed, nor the writes invoked, in them.
    ``held``: the keys the gateway was seen holding as unknown outcomes (``unknowns.jsonl``;
    None: invariant 13 is not judged); ``excused``: the spans in which a replica or the
    network could lose a write without the gateway knowing whether it left (13);
    ``refreshed``: restarts of a lease source's store that gave its leases their TTL
    again (``Refresh``; 11); ``let_go``: the writes whose connection the upstream saw
    closed gracefully before their answer (16)."""
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
    causes = Causes(history, expiry_margin, skewed, refreshed)
    # The order at the upstream (1, 2, 6) is judged without the writes the gateway gave
    # up on (``GAVE_UP``): an upstream may still apply those after the next generation's.
    ordered = {
        job: [entry for entry in entries if not causes.given_up(entry)]
        for job, entries in by_job.items()
    }
    for entries in ordered.values():
        v.extend(generations_decrease(entries))
    for entries in ordered.values():
        v.extend(generations_interleave(entries))
    v.extend(applied_once(writes, applied))
    v.extend(same_answer(writes, applied))
    v.extend(acked_body(history, applied))
    for entries in ordered.values():
        v.extend(stale_writes(entries, grants))
    v.extend(causes.violations(ledger))
    v.extend(causes.two_holders(ledger))
    if held is not None:
        v.extend(causes.held_unknown(held, ledger, excused))
    v.extend(granted_while_current(history, causes.in_skew))
    v.extend(let_go_gracefully(let_go))
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


def acked_body(
    history: Iterable[HistoryEvent], applied: dict[Step, list[LedgerEntry]]
) -> Iterable[Violation]:
    """14: every 2xx to a write is for a body applied under its ``(job, key)``. Keys
    never applied are 3's to name. Reported per acknowledgement: its invoke, the answer
    and the key's applications."""
    outstanding: dict[str, HistoryEvent] = {}
    for event in history:
        if event.type == "invoke":
            outstanding[event.process] = event
            continue
        invoke = outstanding.pop(event.process, None)
        if invoke is None or not event.acknowledged or invoke.key is None:
            continue
        entries = applied.get((invoke.job, invoke.key), [])
        if entries and all(entry.body_sha256 != invoke.body_sha256 for entry in entries):
            yield Violation(
                14,
                invoke.job,
                f"key {invoke.key!r} answered {event.status} to a body other than the one "
                f"applied under it ({len(entries)} application(s)): a changed request "
                "under a used key must be refused idempotency-key-reused",
                (invoke, event, *entries),
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


Lease = tuple[str, int, str]
"""``(job, generation, holder)``: one lease (holder ``""``: a lease of the gateway's own,
whose generation is never handed out twice)."""


def lease_of(event: HistoryEvent) -> Lease:
    assert event.generation is not None
    return event.job, event.generation, event.holder or ""


class Causes:
    """Invariants 8-11: for each applied write, the writes sent that could have caused it.

    A cause of a ledger entry is a write invoke of its job, key and generation with its
    body, invoked at or before it was applied. A cause is *excluded* when the gateway must
    not have forwarded it: its completion is a refusal of ``NOT_FORWARDED`` (9), a newer
    generation of its job had been granted before it was invoked (8), or its lease was
    over before it was invoked (11). An entry with no cause (10), or whose every cause is
    excluded, is a violation, named by its latest cause's exclusion."""

    def __init__(
        self,
        history: Sequence[HistoryEvent],
        margin: float,
        skewed: Sequence[tuple[float, float]],
        refreshed: Sequence[Refresh] = (),
    ) -> None:
        self.margin = margin
        self.skewed = tuple(skewed)
        self.refreshed = sorted(refreshed, key=lambda r: r[1])
        self.sent: dict[tuple[str, str, int], list[HistoryEvent]] = defaultdict(list)
        self.completion: dict[int, HistoryEvent] = {}  # id(invoke) -> its completion
        self.granted: dict[str, list[HistoryEvent]] = defaultdict(list)
        # Each lease's claim and renew oks, and when each was invoked (id(ok) -> time): a
        # grant counts for a write only if it was asked for before the write (11).
        self.grants_of: dict[Lease, list[HistoryEvent]] = defaultdict(list)
        self.asked_at: dict[int, float] = {}
        self.ended: dict[Lease, HistoryEvent] = {}
        self.unknown_renew: dict[Lease, HistoryEvent] = {}
        self.asked: dict[Lease, float] = {}  # a holder's lease: when its claim was invoked
        outstanding: dict[str, HistoryEvent] = {}
        for event in history:
            if event.type == "invoke":
                outstanding[event.process] = event
                if event.f == "write" and event.key is not None and event.generation is not None:
                    self.sent[event.job, event.key, event.generation].append(event)
                continue
            invoke = outstanding.pop(event.process, None)
            if invoke is not None:
                self.completion[id(invoke)] = event
                if invoke.f == "claim" and event.type == "ok" and event.holder is not None:
                    self.asked.setdefault(lease_of(event), invoke.time)
                if invoke.f == "renew" and event.type == "info":
                    self._renew_unknown(invoke)
            if event.type == "ok" and event.generation is not None:
                self.asked_at[id(event)] = event.time if invoke is None else invoke.time
                self._ok(event)
        for invoke in outstanding.values():  # never answered: unknown
            if invoke.f == "renew":
                self._renew_unknown(invoke)

    def _renew_unknown(self, invoke: HistoryEvent) -> None:
        if invoke.generation is None:
            return
        lease = lease_of(invoke)
        known = self.unknown_renew.get(lease)
        if known is None or invoke.time < known.time:
            self.unknown_renew[lease] = invoke

    def _ok(self, event: HistoryEvent) -> None:
        lease = lease_of(event)
        if event.f == "claim":
            self.granted[event.job].append(event)
        if event.f in ("claim", "renew"):
            self.grants_of[lease].append(event)
        elif event.f in ENDS_LEASE and lease not in self.ended:
            self.ended[lease] = event

    def in_skew(self, at: float) -> bool:
        return any(start <= at <= end for start, end in self.skewed)

    def exclusion(self, invoke: HistoryEvent) -> tuple[int, str, tuple[Record, ...]] | None:
        """Why the gateway must not have forwarded this write invoke, or None."""
        completion = self.completion.get(id(invoke))
        if (
            completion is not None
            and completion.type == "fail"
            and completion.reason in NOT_FORWARDED
        ):
            return 9, f"refused {completion.status} {completion.reason}", (completion,)
        assert invoke.generation is not None
        # A holder's lease (a lease source's): only the grants made after its own was
        # asked for; a higher generation granted before it is of the counter's earlier
        # life (lost since), which the gateway cannot know of unless it wrote.
        since = float("-inf")
        if invoke.holder is not None:
            asked = self.asked.get(lease_of(invoke))
            since = float("inf") if asked is None else asked
        newer = [
            grant
            for grant in self.granted.get(invoke.job, [])
            if grant.generation is not None
            and grant.generation > invoke.generation
            and since < grant.time < invoke.time
        ]
        if newer:
            grant = min(newer, key=lambda g: g.time)
            return 8, f"invoked after generation {grant.generation} was granted", (grant,)
        return self.over(invoke)

    def over(self, invoke: HistoryEvent) -> tuple[int, str, tuple[Record, ...]] | None:
        """Invariant 11: the write was invoked after its lease was over."""
        lease = lease_of(invoke)
        ended = self.ended.get(lease)
        if ended is not None and invoke.time > ended.time + self.margin:
            return 11, f"invoked after its lease was ended ({ended.f})", (ended,)
        # Only the grants asked for before the write: a renewal invoked after it cannot
        # have kept the lease for it (a lease core that renews an expired lease would
        # otherwise excuse the writes made before that renewal).
        grants = [
            g
            for g in self.grants_of.get(lease, [])
            if self.asked_at.get(id(g), g.time) <= invoke.time
        ]
        if not grants or any(g.ttl is None for g in grants):
            return None  # nothing granted before it, or a grant of unknown length
        until = max(g.time + (g.ttl or 0.0) for g in grants)
        first = min(g.time for g in grants)
        last = max(grants, key=lambda g: g.time)
        for prefix, down, back in self.refreshed:
            # The store went down while the lease lived: back, it gave it its TTL again.
            if invoke.job.startswith(prefix) and first <= down <= until + REFRESH_SLACK:
                until = max(until, back + (last.ttl or 0.0) + REFRESH_EXTEND)
        if invoke.time <= until + self.margin:
            return None
        unknown = self.unknown_renew.get(lease)
        if unknown is not None and unknown.time < invoke.time:
            return None  # a renewal that may have held the lease longer
        if self.in_skew(invoke.time) or any(self.in_skew(g.time) for g in grants):
            return None
        return (
            11,
            f"invoked {invoke.time - until:.2f} s after its lease expired (last {last.f} ok "
            f"with ttl {last.ttl:g} s)",
            (last,),
        )

    def causes_of(self, entry: LedgerEntry) -> tuple[list[HistoryEvent], list[HistoryEvent]]:
        """(the writes sent under the entry's job, key and generation before it was
        applied, those of them with its body: its causes)."""
        sent = [
            e
            for e in self.sent.get((entry.job, entry.key, entry.generation), [])
            if e.time <= entry.time
        ]
        return sent, [e for e in sent if e.body_sha256 == entry.body_sha256]

    def given_up(self, entry: LedgerEntry) -> bool:
        """The entry may be the application of a write the gateway gave up on: a cause of
        it was answered ``GAVE_UP``, and no cause got the entry's own answer from the
        upstream (a 2xx not ``replayed`` whose body is the entry's ``answer_sha256``). The
        upstream's answers differ per application, and the gateway answers from its store
        only with ``Idempotent-Replayed``, so such a cause is the request that was applied
        here, and the gateway waited for it: whatever another attempt of the key was
        answered, this application is in the order (1, 2, 6)."""
        causes = self.causes_of(entry)[1]
        completions = [self.completion.get(id(cause)) for cause in causes]
        if entry.answer_sha256 is not None and any(
            c is not None
            and c.type == "ok"
            and c.replayed is False
            and c.body_sha256 == entry.answer_sha256
            for c in completions
        ):
            return False
        return any(c is not None and c.reason in GAVE_UP for c in completions)

    def violations(self, ledger: Iterable[LedgerEntry]) -> Iterable[Violation]:
        for entry in ledger:
            sent, causes = self.causes_of(entry)
            where = f"generation {entry.generation} write (key {entry.key!r})"
            if not causes:
                what = (
                    "no write was sent under its job, key and generation before it"
                    if not sent
                    else f"its body differs from the {len(sent)} sent under its key before it"
                )
                yield Violation(10, entry.job, f"{where} applied, but {what}", (entry, *sent))
                continue
            exclusions = [self.exclusion(cause) for cause in causes]
            if any(exclusion is None for exclusion in exclusions):
                continue
            latest = max(range(len(causes)), key=lambda i: causes[i].time)
            invariant, _, evidence = exclusions[latest] or (0, "", ())
            yield Violation(
                invariant,
                entry.job,
                f"{where} applied although the gateway must not have forwarded it: "
                + "; ".join(
                    f"{_where(cause)} {exclusion[1]}"
                    for cause, exclusion in zip(causes, exclusions, strict=True)
                    if exclusion is not None
                ),
                (entry, causes[latest], *evidence),
            )

    def holder_of(self, entry: LedgerEntry) -> tuple[str, HistoryEvent] | None:
        """The one holder of an applied write's causes, with its latest cause; None when
        the causes name none, or more than one."""
        causes = self.causes_of(entry)[1]
        holders = {cause.holder for cause in causes}
        if len(holders) != 1 or None in holders:
            return None
        latest = max(causes, key=lambda cause: cause.time)
        assert latest.holder is not None
        return latest.holder, latest

    def two_holders(self, ledger: Iterable[LedgerEntry]) -> Iterable[Violation]:
        """12: per job and generation, the applied writes of one holder only. Reported
        once per generation: each holder's first applied write, its cause and its grant."""
        firsts: dict[tuple[str, int], dict[str, tuple[LedgerEntry, HistoryEvent]]] = {}
        for entry in ledger:
            found = self.holder_of(entry)
            if found is not None:
                holder, cause = found
                firsts.setdefault((entry.job, entry.generation), {}).setdefault(
                    holder, (entry, cause)
                )
        for (job, generation), holders in firsts.items():
            if len(holders) < 2:
                continue
            records: list[Record] = []
            for holder, (entry, cause) in holders.items():
                grant = next(
                    (
                        g
                        for g in self.grants_of.get((job, generation, holder), [])
                        if g.f == "claim"
                    ),
                    None,
                )
                records += [entry, cause, *([grant] if grant is not None else [])]
            names = ", ".join(
                f"{holder[:8]} (key {entry.key!r})" for holder, (entry, _) in holders.items()
            )
            yield Violation(
                12,
                job,
                f"generation {generation} writes applied from {len(holders)} holders: {names}",
                tuple(records),
            )

    def held_unknown(
        self,
        held: Iterable[HeldUnknown],
        ledger: Iterable[LedgerEntry],
        excused: Sequence[tuple[float, float]],
    ) -> Iterable[Violation]:
        """13: no write that never reached the upstream is left held as unknown.

        A key the gateway listed as an unknown outcome under generation g is judged by
        the writes of its job, key and generation: the ledger's (did any reach the
        upstream?) and the history's invokes before the listing (its attempts). It is a
        violation when the ledger has none, the history has at least one attempt, and no
        attempt overlaps an ``excused`` span (widened by ``RECORD_LIFE`` after the attempt
        was answered, or by ``LET_GO`` after a connection the gateway let go of).
        Reported once per key and generation: the first listing, the attempts and their
        completions.

        Why the join is sound. The gateway stamps every write it forwards with the
        record's job and generation (``Fencing-Job``, ``Fencing-Generation``) and its key,
        and the ledger has one line per write the upstream received and applied, so a
        record whose write reached the upstream has a ledger entry of that job, key and
        generation, whichever attempt sent it (a held key is not forwarded again, so the
        record's generation is that of the write that left). An unknown record with an
        entry is therefore never blamed, even if the entry came late (the ledger is read
        after the run). The other ways a write can leave and still have no entry are what
        ``excused`` must cover, and ``verify run`` passes them from its faults: the
        network dropping the request on its way (a partition to the upstream), the
        upstream receiving it without applying it (its ``5xx`` fault), and a replica that
        lost the write with its memory (kill -9, a SIGTERM that had to be followed by a
        SIGKILL, a replica stopped by SIGSTOP past the record's deadline: its in-flight
        record is listed as unknown by the others, as a crashed replica's must be). The
        upstream of ``verify run`` never crashes during the run and is stopped only once
        it has no write in hand, so no write it received is missing from the ledger. What
        is left, a write never sent held unknown, is the gateway's own doing: it knew it
        had not sent it (a waiter cancelled by a shutdown, a claim it could not give back
        while the database was down) and left the claim to turn into an unknown outcome,
        which an operator would then resolve for nothing. A key without attempts (a write
        this history does not know) is not judged: invariant 10 speaks for writes nobody
        sent."""
        reached = {(entry.job, entry.key, entry.generation) for entry in ledger}
        first: dict[tuple[str, str, int], HeldUnknown] = {}
        for record in held:
            known = first.get((record.job, record.key, record.generation))
            if known is None or record.time < known.time:
                first[record.job, record.key, record.generation] = record
        for write, record in first.items():
            if write in reached:
                continue
            attempts = [e for e in self.sent.get(write, []) if e.time <= record.time]
            if not attempts or any(self._excused(a, excused) for a in attempts):
                continue
            completions = [self.completion.get(id(a)) for a in attempts]
            answered = ", ".join(
                "no answer"
                if c is None
                else f"{c.type} {c.status or ''} {c.reason or ''}".replace("  ", " ").strip()
                for c in completions
            )
            note = record.extra.get("note")
            yield Violation(
                13,
                record.job,
                f"key {record.key!r} held as an unknown outcome under generation "
                f"{record.generation}"
                + (f" (note {note!r})" if note else "")
                + f", but no write of it reached the upstream; its {len(attempts)} "
                f"attempt(s): {answered}",
                (
                    record,
                    *(
                        event
                        for a, c in zip(attempts, completions, strict=True)
                        for event in (a, c)
                        if event is not None
                    ),
                ),
            )

    def _excused(self, attempt: HistoryEvent, excused: Sequence[tuple[float, float]]) -> bool:
        """Whether an excused span overlaps the time the gateway may have had the write."""
        completion = self.completion.get(id(attempt))
        end = max(attempt.time, completion.time if completion is not None else attempt.time)
        let_go = None
        if completion is not None and completion.type == "info" and completion.reason:
            let_go = LET_GO.get(completion.reason)
        end += RECORD_LIFE if let_go is None else let_go
        return any(start <= end and attempt.time <= stop for start, stop in excused)


ENDS_LEASE: Final = frozenset({"complete", "fail"})
"""The operations by which a holder ends its own lease: ``complete``, and ``fail`` (the
lease given back, its job pending again: a parked job), after which the job may be
granted again at once (15) and no write of that lease may be forwarded (11)."""


GRANT_MARGIN: Final = 0.1
"""Seconds a claim ``ok`` must come before an older lease's certain end to show that lease
was current when the job was granted again (15): one machine's clock, and the lease core
dates a lease after its call was invoked; this only absorbs rounding."""


def granted_while_current(
    history: Iterable[HistoryEvent], in_skew: Callable[[float], bool]
) -> Iterable[Violation]:
    """15: per job of the gateway's own leases, no generation granted while an older one's
    lease was certainly current (its latest claim or renew ``ok``'s invoke plus its
    ``ttl``), unless that lease was completed or given back first or a clock was skewed."""
    outstanding: dict[str, HistoryEvent] = {}
    # job -> generation -> (the lease's certain end, the grant that gives it)
    ends: dict[str, dict[int, tuple[float, HistoryEvent]]] = defaultdict(dict)
    completed: dict[tuple[str, int], float] = {}  # a complete's invoke, per lease
    for event in history:
        if event.holder is not None:
            continue
        if event.type == "invoke":
            outstanding[event.process] = event
            if event.f in ENDS_LEASE and event.generation is not None:
                completed.setdefault((event.job, event.generation), event.time)
            continue
        invoke = outstanding.pop(event.process, None)
        if event.type != "ok" or event.f not in ("claim", "renew") or invoke is None:
            continue
        if event.generation is None or event.ttl is None:
            continue
        if event.f == "claim":
            for generation, (end, grant) in sorted(ends[event.job].items()):
                if generation >= event.generation or end - GRANT_MARGIN <= event.time:
                    continue
                if completed.get((event.job, generation), float("inf")) <= invoke.time:
                    continue
                if in_skew(event.time) or in_skew(grant.time):
                    continue
                yield Violation(
                    15,
                    event.job,
                    f"generation {event.generation} granted {end - event.time:.2f} s before "
                    f"generation {generation}'s lease could end (its {grant.f} ok, ttl "
                    f"{grant.ttl:g} s)",
                    (grant, invoke, event),
                )
        end = invoke.time + event.ttl
        known = ends[event.job].get(event.generation)
        if known is None or end > known[0]:
            ends[event.job][event.generation] = (end, event)


def let_go_gracefully(let_go: Iterable[LedgerEntry]) -> Iterable[Violation]:
    """16: no write's connection closed gracefully before its answer."""
    for entry in let_go:
        yield Violation(
            16,
            entry.job,
            f"generation {entry.generation} write (key {entry.key!r}): the gateway closed "
            "its connection to the upstream gracefully before the answer (a FIN, not a "
            "reset), so the kernel could deliver its bytes after the gateway let go of it",
            (entry,),
        )


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


def check_files(
    history: str | Path,
    ledger: str | Path,
    *,
    min_completed: float = 0.0,
    expiry_margin: float = EXPIRY_MARGIN,
    skewed: Sequence[tuple[float, float]] = (),
    unknowns: str | Path | None = None,
    excused: Sequence[tuple[float, float]] = (),
    refreshed: Sequence[Refresh] = (),
    let_go: str | Path | None = None,
) -> Report:
    """Read the files (``UnreadableFile``) and check them; ``unknowns``: an
    ``unknowns.jsonl`` for invariant 13 (None: not judged); ``let_go``: a
    ``let-go.jsonl`` for 16 (None: not judged)."""
    return check(
        read_history(history),
        read_ledger(ledger),
        min_completed=min_completed,
        expiry_margin=expiry_margin,
        skewed=skewed,
        held=None if unknowns is None else read_unknowns(unknowns),
        excused=excused,
        refreshed=refreshed,
        let_go=() if let_go is None else read_ledger(let_go),
    )


def _refresh(text: str) -> Refresh:
    prefix, _, span = text.partition(",")
    if not prefix:
        raise argparse.ArgumentTypeError(f"PREFIX,FROM,TO, not {text!r}")
    return (prefix, *_span(span))


def _span(text: str) -> tuple[float, float]:
    try:
        start, end = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"FROM,TO in seconds, not {text!r}") from None
    if end < start:
        raise argparse.ArgumentTypeError(f"TO before FROM in {text!r}")
    return start, end


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"seconds, 0 or more, not {text}")
    return value


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
    parser.add_argument(
        "--expiry-margin",
        type=_seconds,
        default=EXPIRY_MARGIN,
        metavar="SECONDS",
        help="invariant 11: how long after its lease's expiry a write must be invoked to "
        f"count (default {EXPIRY_MARGIN:g})",
    )
    parser.add_argument(
        "--clock-skew",
        type=_span,
        action="append",
        default=[],
        metavar="FROM,TO",
        help="a span (time.time() seconds) in which a replica judging leases by its own "
        "clock ran skewed: invariant 11 leaves its leases and writes alone (repeatable)",
    )
    parser.add_argument(
        "--unknowns",
        type=Path,
        default=None,
        metavar="FILE",
        help="unknowns.jsonl: the keys the gateway held as unknown outcomes (invariant 13; "
        "without it 13 is not judged)",
    )
    parser.add_argument(
        "--let-go",
        type=Path,
        default=None,
        metavar="FILE",
        help="let-go.jsonl: the writes whose connection the upstream saw closed gracefully "
        "before their answer (invariant 16; without it 16 is not judged)",
    )
    parser.add_argument(
        "--excused",
        type=_span,
        action="append",
        default=[],
        metavar="FROM,TO",
        help="a span (time.time() seconds) in which a replica or the network could lose a "
        "write without the gateway knowing whether it left (kill -9, SIGSTOP, a partition "
        "to the upstream, the upstream's 5xx): invariant 13 leaves the writes it overlaps "
        "alone (repeatable)",
    )
    parser.add_argument(
        "--lease-refresh",
        type=_refresh,
        action="append",
        default=[],
        metavar="PREFIX,FROM,TO",
        help="a lease source's store down from FROM and back at TO (time.time() seconds), "
        "giving the leases of the jobs under PREFIX it held then their TTL again, as etcd "
        "does when a leader takes over: invariant 11 counts them so (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = check_files(
            args.history,
            args.ledger,
            min_completed=args.min_completed,
            expiry_margin=args.expiry_margin,
            skewed=args.clock_skew,
            unknowns=args.unknowns,
            excused=args.excused,
            refreshed=args.lease_refresh,
            let_go=args.let_go,
        )
    except UnreadableFile as exc:
        print(f"verify check: unreadable: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.render())
    return 0 if report.ok else 1
