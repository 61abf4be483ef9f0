"""``python -m verify run``: start the system, drive it with workers under the nemesis for
``--seconds``, let it settle (faults healed, unknown outcomes resolved), stop everything,
merge the histories and check them against the ledger.

Everything the run starts is ended in a ``finally`` (also on Ctrl-C and SIGTERM):
processes by their groups, the namespaces, the PostgreSQL cluster. Every child's output
is in a log file of ``--out`` (``replica-a.log``, ``upstream.log``, ``worker-w0.log``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verify import netns
from verify.check import Refresh, Report, Violation, check, check_files
from verify.cluster import PG_BIN, ClusterError
from verify.etcd_locks import SOURCE as ETCD_SOURCE
from verify.events import HistoryEvent, JsonlWriter, LedgerEntry, UnreadableFile, read_history
from verify.nemesis import KINDS, NEEDS, Nemesis, plan
from verify.patroni import PATRONI
from verify.procs import Child, StartError
from verify.roles import Control, Feeder, Observer, Operator, Tail
from verify.stack import (
    LET_GO,
    ORDERING_WAIT,
    ORDERING_WAIT_UNDER_SHUTDOWN,
    SHUTDOWN_ALONE,
    SHUTDOWN_GRACE,
    SHUTDOWN_GRACE_UNDER_NEMESIS,
    Stack,
)
from verify.zk_locks import SOURCE as ZK_SOURCE

TAIL_SECONDS = 15.0
PROGRESS_EVERY = 5.0
# --stop-on-violation judges a violation once its records are this old: longer than a
# worker waits for a write's answer (verify.worker.WRITE_TIMEOUT, 5 s).
SETTLED_AFTER = 6.0


class SetupError(Exception):
    """The run cannot start as asked (exit 2, with this message)."""


@dataclass
class Options:
    db: str
    seconds: float
    nemesis: list[str]
    direct: bool
    seed: int
    out: Path
    workers: int
    replicas: int
    min_completed: float
    tail: float = TAIL_SECONDS
    stop_on_violation: bool = False
    lock_workers: int = 0
    etcd_lock_workers: int = 0
    zk_lock_workers: int = 0
    signed_workers: int = 0
    resolving: bool = False
    notes: list[str] = field(default_factory=list)


def choose_nemeses(text: str, db: str) -> tuple[list[str], list[str]]:
    """(nemeses, notes) from ``--nemesis`` (``all``, ``none`` or a comma list)."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    notes: list[str] = []
    if words == ["none"]:
        return [], notes
    everything = words == ["all"]
    if everything:
        words = [n for n, kind in KINDS.items() if kind.in_all_of(db)]
    unknown = [w for w in words if w not in KINDS]
    if unknown:
        raise SetupError(f"unknown nemesis {', '.join(unknown)}: use {', '.join(KINDS)}, all")
    for word in words:
        if db not in KINDS[word].databases:
            raise SetupError(f"{word} needs --db {', '.join(sorted(KINDS[word].databases))}")
    for need in NEEDS.values():
        needing = [w for w in words if need.name in KINDS[w].needs]
        why = need.missing() if needing else None
        if why is None:
            continue
        if not everything or not need.leave_out_of_all:
            raise SetupError(need.refusal.format(kind=needing[0], why=why))
        words = [w for w in words if w not in needing]
        notes += [f"note: {kind} left out of `all`: {why}" for kind in needing]
    if db == "patroni" and shutil.which(PATRONI) is None:
        raise SetupError("--db patroni needs Patroni: apt-get install patroni etcd-server")
    if db in ("pg", "patroni") and not (PG_BIN / "initdb").is_file():
        raise SetupError(
            f"--db {db} needs the PostgreSQL server binaries in {PG_BIN}: apt-get install "
            "postgresql (or set FENCEGATE_FAULTS_PG_BIN)"
        )
    return words, notes


async def run(options: Options) -> int:
    """The whole run; the checker's exit code (0, 1, 2), or 2 when it could not start."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    started = time.monotonic()
    stack = Stack(
        options.out,
        db=options.db,
        replicas=options.replicas,
        seed=options.seed,
        use_netns=await asyncio.to_thread(netns.unavailable) is None,
        locks=options.lock_workers > 0,
        etcd=options.etcd_lock_workers > 0,
        zookeeper=options.zk_lock_workers > 0,
        shutdown_grace=(
            SHUTDOWN_GRACE_UNDER_NEMESIS if "shutdown" in options.nemesis else SHUTDOWN_GRACE
        ),
        signed=options.signed_workers > 0,
        ordering_wait=(
            ORDERING_WAIT_UNDER_SHUTDOWN
            if "shutdown" in options.nemesis and set(options.nemesis) <= SHUTDOWN_ALONE
            else ORDERING_WAIT
        ),
        resolving=options.resolving,
    )
    nemesis: Nemesis | None = None
    helpers: list[asyncio.Task[None]] = []
    names = [f"w{i}" for i in range(options.workers)]
    lock_names = [f"l{i}" for i in range(options.lock_workers)]
    etcd_names = [f"e{i}" for i in range(options.etcd_lock_workers)]
    zk_names = [f"z{i}" for i in range(options.zk_lock_workers)]
    signed_names = [f"s{i}" for i in range(options.signed_workers)]
    names += lock_names + etcd_names + zk_names + signed_names
    operator: Operator | None = None
    window_opened = time.time()
    try:
        try:
            await stack.start()
        except (StartError, ClusterError, netns.NetnsError, OSError) as error:
            print(f"verify: the system did not start: {error}")
            return 2
        print(
            f"started: {len(stack.replicas)} replica(s) on {options.db}"
            f"{' in network namespaces' if stack.namespaces else ' on 127.0.0.1'}, "
            f"upstream on port {stack.upstream.port if stack.upstream else '?'}"
            + (f", Redis on port {stack.lock_store.port}" if stack.lock_store else "")
            + (f", etcd on port {stack.etcd_store.port}" if stack.etcd_store else "")
            + (f", ZooKeeper on port {stack.zk_store.port}" if stack.zk_store else ""),
            flush=True,
        )
        control = Control(stack.replicas, stack.admin_token)
        observer = Observer([options.out / f"history-{n}.jsonl" for n in names])
        feeder = Feeder(control, 2 * options.workers, observer.claimed)
        try:
            await feeder.fill_until_ready()
        except ConnectionError as error:
            print(f"verify: {error}")
            return 2
        workers = {
            n: stack.spawn_worker(
                n,
                options.seed,
                options.direct,
                lock=n in lock_names,
                signed=n in signed_names,
                etcd=n in etcd_names,
                zookeeper=n in zk_names,
            )
            for n in names
        }
        faults = plan(
            options.seed,
            options.nemesis,
            seconds=options.seconds,
            replicas=[r.name for r in stack.replicas],
            workers=names,
            db=options.db,
        )
        nemesis = Nemesis(stack, workers, faults)
        operator = Operator(
            control,
            options.out / "ledger.jsonl",
            nemesis.network_quiet_for,
            options.out / "unknowns.jsonl",
        )
        stop_feeding, stop_operating = asyncio.Event(), asyncio.Event()
        helpers += [
            asyncio.create_task(feeder.run(stop_feeding), name="feeder"),
            asyncio.create_task(operator.run(stop_operating), name="operator"),
            asyncio.create_task(progress(observer, nemesis, workers), name="progress"),
        ]
        window_opened = time.time()
        faulting = asyncio.create_task(nemesis.run(options.seconds), name="nemesis")
        watching = asyncio.create_task(watch(options, names, window_opened), name="watch")
        await asyncio.wait([faulting, watching], return_when=asyncio.FIRST_COMPLETED)
        stopped_early = watching.done() and watching.result()
        if stopped_early:
            faulting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await faulting
            print(f"a violation after {watching.result()}; stopping the run", flush=True)
        else:
            watching.cancel()
            await faulting
            print(f"faults over after {time.monotonic() - started:.0f} s; settling", flush=True)
        stop_feeding.set()
        await asyncio.sleep(0.0 if stopped_early else options.tail)
        stop_operating.set()
        await asyncio.gather(*helpers[:2], return_exceptions=True)
        helpers[2].cancel()
        await asyncio.to_thread(_stop_workers, list(workers.values()))
        observer.update()
        # Every write the upstream received is in the ledger before it is stopped
        # (invariant 13 takes a key missing from the ledger as never received).
        if stack.upstream is not None and not await stack.upstream.wait_idle():
            print("verify: the upstream still had writes in hand at the end", flush=True)
    finally:
        for helper in helpers:
            helper.cancel()
        await asyncio.to_thread(stack.close)
        loop.remove_signal_handler(signal.SIGTERM)
    merge_histories(options.out, names)
    return finish(options, nemesis, operator, time.monotonic() - started, window_opened)


def _stop_workers(workers: list[Child]) -> None:
    for worker in workers:
        worker.signal(signal.SIGCONT)
        worker.signal(signal.SIGTERM)
    for worker in workers:
        worker.stop(timeout=5.0)


async def progress(observer: Observer, nemesis: Nemesis, workers: dict[str, Child]) -> None:
    started = time.monotonic()
    while True:
        await asyncio.sleep(PROGRESS_EVERY)
        observer.update()
        w = observer.writes
        faults = ", ".join(f"{k} {n}" for k, n in sorted(nemesis.counts.items())) or "none"
        dead = [name for name, child in workers.items() if not child.alive()]
        print(
            f"[{time.monotonic() - started:5.0f} s] ops {observer.ops}, writes ok {w['ok']} "
            f"refused {w['refused']} unknown {w['unknown']}, jobs completed "
            f"{len(observer.completed)}, faults {sum(nemesis.counts.values())} ({faults})"
            + (f", workers exited: {', '.join(dead)}" if dead else ""),
            flush=True,
        )


async def watch(options: Options, names: list[str], opened: float) -> str:
    """With ``--stop-on-violation``: check the files so far every few seconds and return
    when a safety invariant is broken ("N s": when its evidence was complete); otherwise
    wait forever. A partial history is judged soundly: history and ledger are both cut at
    the moment the reading began, so every write applied has its invoke and every
    acknowledgement its application in what is judged, and an operation still outstanding
    counts as one of unknown outcome."""
    if not options.stop_on_violation:
        await asyncio.Event().wait()
    while True:
        await asyncio.sleep(PROGRESS_EVERY)
        try:
            found = await asyncio.to_thread(_violation_so_far, options.out, options.db, names)
        except ValueError:  # a line being written: the next look reads it whole
            continue
        if found is not None:
            at, violation = found
            return (
                f"{at - opened:.1f} s: [{violation.invariant} {violation.name}] {violation.message}"
            )


def _violation_so_far(out: Path, db: str, names: list[str]) -> tuple[float, Violation] | None:
    """The first safety violation of the files so far and when it was complete, or None."""
    read_at = time.time()
    events: list[HistoryEvent] = []
    for name in names:
        for number, obj in enumerate(Tail(out / f"history-{name}.jsonl").read(), start=1):
            events.append(HistoryEvent.from_json(obj, number))
    # Both cut at the moment the reading began: a write applied by then was recorded
    # before it was sent, so its invoke is in the files read; an answer given by then
    # came after its application, which the ledger (read last) holds.
    ledger = [LedgerEntry.from_json(obj) for obj in Tail(out / "ledger.jsonl").read()]
    ledger = [entry for entry in ledger if entry.time <= read_at]
    events = sorted((e for e in events if e.time <= read_at), key=lambda event: event.time)
    let_go = [LedgerEntry.from_json(obj) for obj in Tail(out / LET_GO).read()]
    report = check(
        events,
        ledger,
        skewed=skew_windows(out, db),
        refreshed=lease_refreshes(out),
        let_go=[entry for entry in let_go if entry.time <= read_at],
    )
    # A violation whose records are all older than a write's longest wait for its answer:
    # an answer that would excuse it (``GAVE_UP``) has come by then.
    settled = [(at, v) for at, v in _safety(report) if at <= read_at - SETTLED_AFTER]
    return min(settled, key=lambda item: item[0]) if settled else None


def _seconds_after(report: Report | None, opened: float) -> float | None:
    """Seconds from the fault window's opening to the first safety violation, or None."""
    first = first_violation(report) if report is not None else None
    return None if first is None else round(first - opened, 1)


def _safety(report: Report) -> list[tuple[float, Violation]]:
    """The safety violations (not liveness), each with when it had all its records."""
    return [
        (max(record.time for record in v.records), v)
        for v in report.violations
        if v.invariant != 7 and v.records
    ]


def first_violation(report: Report) -> float | None:
    """The time the earliest safety violation (not liveness) had all its records."""
    times = [at for at, _ in _safety(report)]
    return min(times) if times else None


def merge_histories(out: Path, names: list[str]) -> None:
    """The workers' files merged by time into ``history.jsonl`` (file order kept on ties)."""
    events: list[tuple[float, int, int, dict[str, Any]]] = []
    for index, name in enumerate(names):
        for number, event in enumerate(Tail(out / f"history-{name}.jsonl").read()):
            events.append((float(event["time"]), index, number, event))
    events.sort(key=lambda item: item[:3])
    with JsonlWriter(out / "history.jsonl") as writer:
        for *_, event in events:
            writer.write(event)


def failover_figures(out: Path, failovers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the failovers cost the workers: the time the cluster had no primary, the time
    from the new primary to the first write answered 2xx, and the writes refused
    ``store-unavailable`` or left unknown (``info``) between a failover's start and the
    first write answered after it."""
    if not failovers:
        return None
    try:
        events = read_history(out / "history.jsonl")
    except (OSError, UnreadableFile):
        return None
    answered = sorted(
        e.time for e in events if e.f == "write" and e.type == "ok" and (e.status or 0) < 300
    )
    without, after, refused, unknown = [], [], 0, 0
    longest: dict[str, Any] = {}
    for failover in failovers:
        began, primary_at = failover["began"], failover["primary_at"]
        without.append(primary_at - began)
        if primary_at - began >= longest.get("seconds", -1.0):
            longest = {
                "seconds": round(primary_at - began, 2),
                "how": failover.get("how"),
                "healthy_before": failover.get("healthy_before"),
            }
        first = next((t for t in answered if t >= primary_at), None)
        if first is not None:
            after.append(first - primary_at)
        until = first if first is not None else primary_at
        for event in events:
            if event.f == "write" and began <= event.time <= until:
                refused += event.reason == "store-unavailable"
                unknown += event.type == "info"

    def median_max(values: list[float]) -> list[float] | None:
        return [round(statistics.median(values), 2), round(max(values), 2)] if values else None

    return {
        "count": len(failovers),
        "without_primary": median_max(without),
        "longest": longest,
        "from_degraded": sum(1 for f in failovers if f.get("healthy_before") is False),
        "first_write_after": median_max(after),
        "store_unavailable": refused,
        "unknown": unknown,
    }


@dataclass(frozen=True)
class FaultSpan:
    """One fault of ``faults.jsonl``, start to end (``inf``: it never ended); ``killed``:
    the SIGTERM that ended it had to be followed by a SIGKILL (a ``killed`` line)."""

    kind: str
    params: dict[str, Any]
    start: float
    end: float
    killed: bool


def fault_spans(out: Path) -> list[FaultSpan]:
    """Every fault the nemesis started, as its start, end and ``killed`` lines say."""
    faults: dict[int, dict[str, Any]] = {}
    for line in Tail(out / "faults.jsonl").read():
        if "time" not in line:
            continue
        fault = faults.setdefault(int(line["index"]), {"end": float("inf"), "killed": False})
        if line.get("phase") == "start":
            fault |= {"kind": line.get("kind"), "params": line.get("params") or {}}
            fault["start"] = float(line["time"])
        elif line.get("phase") == "killed":
            fault["killed"] = True
        elif line.get("phase") == "end":
            fault["end"] = float(line["time"])
    return [FaultSpan(**f) for f in faults.values() if "start" in f]


def skew_windows(out: Path, db: str) -> list[tuple[float, float]]:
    """The spans in which a replica ran under a skewed clock (the clock faults), where
    the replicas judge leases by their own clock (SQLite): invariant 11 does not judge
    expiry there. On PostgreSQL the database's clock decides, so a replica's skew
    excuses nothing."""
    if db != "sqlite":
        return []
    return [(f.start, f.end) for f in fault_spans(out) if f.kind == "clock"]


ETCD_PREFIX = ETCD_SOURCE + "/"  # the etcd lock workers' jobs
ZK_PREFIX = ZK_SOURCE + "/"  # the ZooKeeper lock workers' jobs
# The faults after which a lock store gives the leases it held their TTL again: etcd's
# restarts, and ZooKeeper's restarts and pauses (every session it holds gets its timeout
# again from the moment it serves; a session it expires as it wakes has lost its lock,
# and what is refused then needs no excuse).
REFRESHING = {"etcd-loss": (ETCD_PREFIX, {"restart"}), "zk-loss": (ZK_PREFIX, {"restart", "pause"})}


def lease_refreshes(out: Path) -> list[Refresh]:
    """The lock stores' restarts and pauses that refresh leases (``REFRESHING``, start to
    end): back, the store gave every lease it held its TTL again
    (``verify.check.Refresh``)."""
    spans: list[Refresh] = []
    for fault in fault_spans(out):
        refreshing = REFRESHING.get(fault.kind)
        if refreshing is not None and fault.params.get("how") in refreshing[1]:
            spans.append((refreshing[0], fault.start, fault.end))
    return spans


EXCUSING = frozenset({"kill", "freeze"})
STOPPING = frozenset({"shutdown", "clock"})  # faults that stop a replica with SIGTERM
STORE_DOWN = frozenset({"store", "db-restart", "failover"})


def excused_windows(out: Path) -> list[tuple[float, float]]:
    """The spans in which a write could be lost without the gateway knowing whether it
    left, or knowing it and unable to say so (invariant 13 does not judge the keys whose
    writes they overlap): a replica killed (``kill``, or a SIGTERM that had to be
    followed by a SIGKILL), stopped (``freeze``), or ended by a SIGTERM while its
    database was out of reach (``store``, ``db-restart``, ``failover``, a partition to
    the database: it could not give back its claims, and exiting loses them as a crash
    does); a partition between a replica and the upstream (a request sent can be lost on
    the way); and the upstream answering 503 without applying (``upstream`` in ``5xx``
    mode: received, not in the ledger). Every fault of those kinds, on any replica: the
    history does not say which replica a write went through."""
    faults = fault_spans(out)

    def store_down(fault: FaultSpan) -> bool:
        return fault.kind in STORE_DOWN or (
            fault.kind == "partition" and fault.params.get("to") == "database"
        )

    outages = [(f.start, f.end) for f in faults if store_down(f)]
    spans: list[tuple[float, float]] = []
    for fault in faults:
        kind, params, start, end = fault.kind, fault.params, fault.start, fault.end
        excusing = (
            kind in EXCUSING
            or fault.killed
            or (kind == "partition" and params.get("to") == "upstream")
            or (kind == "upstream" and params.get("mode") == "5xx")
            or (
                kind in STOPPING
                and not params.get("live")  # a clock moved without a restart stops nothing
                and any(a <= end and start <= b for a, b in outages)
            )
        )
        if excusing:
            spans.append((start, end))
    return spans


def finish(
    options: Options,
    nemesis: Nemesis | None,
    operator: Operator | None,
    elapsed: float,
    opened: float,
) -> int:
    out = options.out
    try:
        report: Report | None = check_files(
            out / "history.jsonl",
            out / "ledger.jsonl",
            min_completed=options.min_completed,
            skewed=skew_windows(out, options.db),
            unknowns=out / "unknowns.jsonl" if (out / "unknowns.jsonl").exists() else None,
            excused=excused_windows(out),
            refreshed=lease_refreshes(out),
            let_go=out / LET_GO if (out / LET_GO).exists() else None,
        )
    except UnreadableFile as error:
        print(f"verify check: unreadable: {error}")
        report = None
    if report is not None:
        print(report.render())
    faults = dict(sorted(nemesis.counts.items())) if nemesis else {}
    figures = failover_figures(out, nemesis.failovers) if nemesis else None
    summary = {
        "seed": options.seed,
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
        "seconds_elapsed": round(elapsed, 1),
        "operations": report.operations if report else None,
        "history_events": report.history_events if report else None,
        "writes_applied": report.writes_applied if report else None,
        "faults": faults,
        "unknown_outcomes_resolved": dict(operator.resolved) if operator else {},
        "violations": [v.to_json() for v in report.violations] if report else None,
        "jobs_claimed": report.jobs_claimed if report else None,
        "jobs_completed": report.jobs_completed if report else None,
        "completed_share": report.completed_share if report else None,
        "failovers": figures,
        "first_violation_seconds": _seconds_after(report, opened),
    }
    (out / "run.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    fault_text = ", ".join(f"{k} {n}" for k, n in faults.items()) or "none"
    if figures:
        print(
            f"failovers: {figures['count']} ({figures['from_degraded']} begun with a standby "
            f"not streaming), without a primary {figures['without_primary']} s (median, max; "
            f"the longest a {figures['longest'].get('how')}, begun "
            f"{'healthy' if figures['longest'].get('healthy_before') else 'degraded'}), "
            f"first write answered after the new primary "
            f"{figures['first_write_after']} s (median, max); writes refused "
            f"store-unavailable {figures['store_unavailable']}, held unknown "
            f"{figures['unknown']} during them"
        )
    if report is None:
        print(f"summary: faults {sum(faults.values())} ({fault_text}), no report")
        code = 2
    else:
        ops = sum(types.get("invoke", 0) for types in report.operations.values())
        names = sorted({v.name for v in report.violations})
        print(
            f"summary: {ops} operations, faults {sum(faults.values())} ({fault_text}), "
            f"violations {len(report.violations)}"
            f"{' (' + ', '.join(names) + ')' if names else ''}, "
            f"completed share {report.completed_share:.1%} "
            f"({report.jobs_completed} of {report.jobs_claimed} claimed jobs)"
        )
        code = 0 if report.ok else 1
    print(f"seed: {options.seed} (repeat with --seed {options.seed}); files in {out}")
    return code
