"""The nemesis: faults planned from the seed, then injected, overlapping, into the running
system, each healed at its end and every one at the end of the fault window.

The plan (``plan``) depends only on the seed and the run's shape (nemeses, replicas,
workers, seconds): every 1-4 s one fault of a nemesis drawn from the enabled ones, on a
target drawn from those not already under a fault of the same sort. ``faults.jsonl`` gets
the whole plan first (``"phase": "plan"``), then a line when each fault starts and ends.

Each nemesis is one entry of ``KINDS`` (a ``NemesisKind``: its targets, the databases it
applies to, what it needs from the machine (``NEEDS``), how a fault of it is drawn,
injected and healed); ``plan``, ``Nemesis`` and ``verify run``'s ``--nemesis`` read only
the table, so a new nemesis is a new entry:

- ``pause``: SIGSTOP a worker for the longest TTL (3 s) plus 0.5-3 s, then SIGCONT.
- ``kill``: kill -9 a replica, start it again (same addresses) after 0.5-3 s.
- ``freeze``: SIGSTOP a replica for 2-8 s, then SIGCONT: a gateway that stalls (a GC
  pause, a stopped VM) with writes admitted and not yet sent, while the other replicas
  admit the next generation.
- ``db-restart`` (PostgreSQL): ``pg_ctl restart -m fast`` or ``-m immediate``.
- ``partition``: drop the traffic of a replica's namespace to the upstream or (PostgreSQL)
  the database, all of it or 30 % of its packets, for 1-8 s.
- ``clock``: a replica's wall clock N minutes ahead (``+Nm``) or behind (``-Nm``, N in
  2..10; the monotonic clock stays real) for 1-8 s. On PostgreSQL (where the database's
  clock decides expiry) the running replica's clock moves (libfaketime reads its offset
  from a file, ``verify.stack.live_clock``), and while it is behind the workers send
  lapsed jobs' late writes to it (``Stack.steer``); on SQLite the replica is restarted
  under libfaketime (``FAKETIME=±Nm``) at both ends.
- ``failover`` (Patroni): the primary gives way, by ``patronictl switchover`` or by a
  kill -9 of its postmaster (Patroni promotes a synchronous standby); the fault ends once
  the cluster is whole again (every standby synchronous), so each failover starts from a
  cluster that can lose nothing.
- ``upstream``: the upstream cuts answers after applying, answers slowly, or answers 503
  without applying, for a share (0.2-0.5) of the writes, for 1-8 s.
- ``lock-loss`` (the lock workers' Redis, ``verify.locks``): Redis loses every lock and
  every fence counter, by ``FLUSHALL`` or by a kill -9 of the ``redis-server`` (no
  persistence), started again after 0.3-2 s; at any moment, so before, while (a share of
  the lock workers' writes is held at the upstream) and after writes of the holders.
- ``etcd-loss`` (the etcd lock workers' etcd, ``verify.etcd_locks``; not in ``all``,
  named on its own): etcd loses every lock at once (every lease revoked: each key goes
  with its lease, as an operator's revoke or a lease lapsed in a long pause does), or is
  killed -9 and comes back on its data after 0.3-2 s (locks and revisions kept, each
  lease given its TTL again once it is back).
- ``zk-loss`` (the ZooKeeper lock workers' ZooKeeper, ``verify.zk_locks``; not in ``all``,
  named on its own): ZooKeeper is paused (SIGSTOP) past the holders' session timeout, and
  expires their sessions, and their lock nodes with them, when it wakes (the holders are
  not told and write on); or it is killed -9 and started again on its data after longer
  than the session timeout, which loses nothing: it gives every session its timeout
  again from its start, and the holders' clients reconnect within it.
- ``store`` (SQLite and PostgreSQL; ``verify.outages``): the database breaks in the middle
  of requests: another process holds SQLite's write lock past the gateway's busy timeout
  by 0.2-1 s; on PostgreSQL the replicas' connections are terminated and new ones refused
  for 1-5 s.
- ``shutdown`` (``verify.outages``): the upstream answers late for a moment, so that
  writes wait behind older generations', then SIGTERM to a replica (its grace shorter
  than the ordering wait), started again 0.5-3 s after it exited.

A replica stopped by SIGTERM (``clock``, ``shutdown``) that is still running 5 s later is
killed, and ``faults.jsonl`` has a ``killed`` line for that fault (invariant 13 excuses
what a killed replica lost; ``verify.run.excused_windows``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final

from verify import netns, outages
from verify.etcd_locks import etcd_binary
from verify.events import JsonlWriter
from verify.locks import redis_binary
from verify.procs import Child, StartError
from verify.stack import Replica, Stack, live_clock
from verify.zk_locks import SESSION_SECONDS, ZkStore, zk_binary

MAX_TTL = 3.0
REST = 0.5  # seconds a target rests after a fault, unless its kind says otherwise


@dataclass(frozen=True)
class Fault:
    index: int
    at: float  # seconds after the window opened
    kind: str
    target: str
    duration: float
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def slot(self) -> str:
        """What two faults at once may not share."""
        return f"{KINDS[self.kind].slot}:{self.target}"

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "target": self.target,
            "at": round(self.at, 3),
            "duration": round(self.duration, 3),
            "params": self.params,
        }


# A kind's draw: (rng, pick, span, db) -> (target, duration, params). ``pick()`` draws the
# target among the free ones (a kind of one target gets it without a draw); ``span`` is
# the 1-8 s drawn for every fault. The draws' order is the plan's: keep it.
Draw = Callable[[random.Random, Callable[[], str], float, str], tuple[str, float, dict[str, Any]]]
Act = Callable[["Nemesis", Fault], Awaitable[None]]


@dataclass(frozen=True)
class NemesisKind:
    """One nemesis: everything ``plan``, ``Nemesis`` and ``verify run`` know of it."""

    name: str
    describe: str
    targets: str  # "workers", "replicas", or the one target's name ("db", "upstream")
    slot: str  # what two faults at once may not share: "process", "network", or its own
    draw: Draw
    inject: Act
    heal: Act
    databases: frozenset[str] = frozenset({"sqlite", "pg", "patroni"})
    needs: tuple[str, ...] = ()  # names in ``NEEDS``
    rest: float = REST  # seconds its target rests after it before the plan gives another
    heal_when_aborting: bool = False  # SIGCONT even when the run is being torn down
    # The databases whose ``all`` includes it (None: every one of ``databases``).
    in_all: frozenset[str] | None = None

    def in_all_of(self, db: str) -> bool:
        return db in (self.databases if self.in_all is None else self.in_all)


@dataclass(frozen=True)
class Need:
    """Something a nemesis needs from this machine, and what ``all`` does without it."""

    name: str
    missing: Callable[[], str | None]  # why it is missing, or None
    refusal: str  # {kind}, {why}: the message when a nemesis named needs it
    leave_out_of_all: bool  # False: ``all`` fails as a named one would


class Nemesis:
    """Carries out a plan against a running stack."""

    def __init__(self, stack: Stack, workers: dict[str, Child], faults: list[Fault]) -> None:
        self.stack = stack
        self.workers = workers
        self.faults = faults
        self.log = JsonlWriter(stack.out / "faults.jsonl")
        self.counts: Counter[str] = Counter()
        self.ending = asyncio.Event()
        self.slots: dict[str, asyncio.Lock] = {}
        self.partitions = 0
        self.last_heal = 0.0  # time.monotonic() of the last partition healed
        self.active: set[int] = set()
        self.aborting = False
        # each: from, to, how, healthy_before, began, primary_at
        self.failovers: list[dict[str, Any]] = []
        self.store_lock: Child | None = None  # the store nemesis's SQLite lock holder
        self.slowing = 0  # shutdown faults that have the upstream answer late
        for fault in faults:
            self.log.write({"phase": "plan", **fault.to_json()})

    def network_quiet_for(self) -> float:
        """Seconds since the last partition healed (0 while one is on; inf: never one)."""
        if self.partitions:
            return 0.0
        return time.monotonic() - self.last_heal if self.last_heal else float("inf")

    def replica(self, name: str) -> Replica:
        return next(r for r in self.stack.replicas if r.name == name)

    async def run(self, seconds: float) -> None:
        start = time.monotonic()
        tasks: list[asyncio.Task[None]] = []
        try:
            for fault in self.faults:
                delay = start + fault.at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self.execute(fault), name=f"fault-{fault.index}"))
            await asyncio.sleep(max(0.0, start + seconds - time.monotonic()))
        except asyncio.CancelledError:
            self.aborting = True  # the run's cleanup ends everything: no healing restarts
            for task in tasks:
                task.cancel()
            raise
        finally:
            self.ending.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.log.close()

    async def execute(self, fault: Fault) -> None:
        lock = self.slots.setdefault(fault.slot, asyncio.Lock())
        async with lock:
            if self.ending.is_set():
                self._note("skipped", fault)
                return
            self.counts[fault.kind] += 1
            self.active.add(fault.index)
            self._note("start", fault)
            try:
                await self.begin(fault)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.ending.wait(), fault.duration)
            except Exception as error:
                self._note("error", fault, error=f"{type(error).__name__}: {error}")
            finally:
                try:
                    await self.end(fault)
                except Exception as error:
                    self._note("error", fault, error=f"healing: {type(error).__name__}: {error}")
                self.active.discard(fault.index)
                self._note("end", fault)

    def note_killed(self, fault: Fault, seconds: float) -> None:
        """A replica that a SIGTERM did not end: it was killed (it lost what it held)."""
        self._note("killed", fault, after_seconds=round(seconds, 3))

    def note_waiter(self, fault: Fault, seconds: float | None) -> None:
        """A shutdown's SIGTERM: how long it looked for a write waiting behind an older
        generation's (None: none came)."""
        waited = None if seconds is None else round(seconds, 3)
        self._note("waiter", fault, found=seconds is not None, after_seconds=waited)

    def _note(self, phase: str, fault: Fault, **extra: Any) -> None:
        self.log.write({"phase": phase, "time": time.time(), **fault.to_json(), **extra})

    # -- the faults ---------------------------------------------------------------------------

    async def begin(self, fault: Fault) -> None:
        await KINDS[fault.kind].inject(self, fault)

    async def end(self, fault: Fault) -> None:
        kind = KINDS[fault.kind]
        if self.aborting and not kind.heal_when_aborting:
            return
        await kind.heal(self, fault)

    async def _fail_over(self, fault: Fault) -> None:
        """Move the primary; note when it went and how long the cluster had none."""
        cluster = self.stack.patroni
        assert cluster is not None
        # Timed from the command, with a primary to move (an earlier fault may have left
        # none for a while: that wait is not this failover's); whether every standby was
        # streaming then, since a switchover waits for a synchronous one to take over.
        await asyncio.to_thread(cluster.wait_primary, 60)
        healthy = await asyncio.to_thread(cluster.healthy)
        began = time.time()
        if fault.params["how"] == "switchover":
            old = await asyncio.to_thread(cluster.switchover)
        else:
            old = await asyncio.to_thread(cluster.kill_primary)
        new = await asyncio.to_thread(cluster.wait_primary, 60, other_than=old)
        ended = time.time()
        failover = {
            "from": old,
            "to": new.name,
            "how": fault.params["how"],
            "healthy_before": healthy,
            "began": began,
            "primary_at": ended,
        }
        self.failovers.append(failover)
        self._note("failover", fault, **failover, seconds=round(ended - began, 3))

    async def _start(self, replica: Replica, skew: str | None) -> None:
        for attempt in range(3):
            try:
                await replica.start(skew, timeout=30)
                return
            except StartError:
                replica.kill()
                if attempt == 2:
                    raise
                await asyncio.sleep(0.5)


# -- the plan ---------------------------------------------------------------------------------


def plan(
    seed: int,
    kinds: list[str],
    *,
    seconds: float,
    replicas: list[str],
    workers: list[str],
    db: str,
) -> list[Fault]:
    """The faults of a run, from its seed alone."""
    rng = random.Random(f"nemesis/{seed}")
    faults: list[Fault] = []
    busy: dict[str, float] = {}  # slot -> when it is free again (planned)
    t = rng.uniform(0.5, 2.0)
    while kinds and t < seconds:
        kind = rng.choice(kinds)
        pools = {"replicas": replicas, "workers": workers}
        fault = _draw(rng, len(faults), t, kind, pools, db, busy)
        if fault is not None:
            faults.append(fault)
            busy[fault.slot] = t + fault.duration + KINDS[kind].rest
        t += rng.uniform(1.0, 4.0)
    pools = {"replicas": replicas, "workers": workers}
    return _with_early(faults, seed, kinds, seconds, pools=pools, db=db)


# Kinds every run exercises within the first share of its window, whatever the draw (one
# kind among eleven may fall late or not at all). Each is added from a draw of its own,
# so the rest of the plan is the seed's as before.
@dataclass(frozen=True)
class Early:
    share: float  # it falls within this share of the run
    params: dict[str, Any] | None  # its params (None: the kind's draw's, as its target)
    seconds: float  # its duration, or the most the draw's may be (``params`` None)
    match: tuple[str, ...]  # a planned fault of the kind with these params equal counts
    clearance: float = 0.0  # seconds between its start and one of its kind already planned
    gap: float = 0.0  # seconds between its end and the next of its kind, or the reverse
    databases: frozenset[str] | None = None  # only on these (None: wherever the kind runs)


EARLY: Final = {
    # Redis losing its locks and fence counters (a FLUSHALL: the counters start again
    # while holders still write) is what the lease-source mutants need. Early, while the
    # counters are low: they regrow to the generations last admitted soon after, which is
    # when a lock's generation is issued twice. Done at once.
    "lock-loss": Early(0.15, {"how": "flush"}, 0.5, ("how",), clearance=3.0),
    # Answers that come after the gateway's timeout, for writes the upstream applied:
    # the one way a write is given up on with its outcome unknown that needs no other
    # fault to land at the right moment (a freeze delays answers only when the frozen
    # loop runs the exchange's timer before reading the socket). What the unknown-outcome
    # rules (held, not released; not re-sent) need on every seed.
    "upstream": Early(0.25, {"mode": "slow", "probability": 0.4}, 3.0, ("mode",)),
    # The database broken while writes are in the upstream's hands (the fault slows and
    # cuts answers around its outage): their unknown outcome is held against a database
    # that is down, and their workers must still be told the write may have been sent.
    # PostgreSQL seed 1 drew its only outage at 58 s, 1.4 s long, so whether a run saw
    # it was chance (unknown-settle-unguarded survived one run, was killed in the next).
    # PostgreSQL only: on SQLite (whose ``all`` has no ``store``) an outage holds every
    # replica up for the busy timeout, and another would leave ``store,shutdown``'s run
    # too little time for the rest.
    "store": Early(
        0.5, None, outages.PG_OUTAGE_MAX, (), clearance=3.0, gap=3.0, databases=frozenset({"pg"})
    ),
}


def _with_early(
    faults: list[Fault],
    seed: int,
    kinds: list[str],
    seconds: float,
    *,
    pools: dict[str, list[str]],
    db: str,
) -> list[Fault]:
    for name, early in EARLY.items():
        if name not in kinds or (early.databases is not None and db not in early.databases):
            continue
        kin = [f for f in faults if f.kind == name]
        wanted = early.params or {}
        alike = [f for f in kin if all(f.params.get(k) == wanted[k] for k in early.match)]
        if any(f.at <= early.share * seconds for f in alike):
            continue
        rng = random.Random(f"nemesis/{seed}/{name}")
        times = (round(rng.uniform(0.05, early.share) * seconds, 3) for _ in range(50))
        clear = (at for at in times if all(_apart(f, at, early) for f in kin))
        at = next(clear, None)
        if at is None:
            continue
        fault = _draw(rng, 0, at, name, pools, db, {})
        if fault is None:
            continue
        if early.params is not None:  # else the draw's, within ``early.seconds``
            fault = replace(fault, params=dict(early.params), duration=early.seconds)
        faults.append(fault)
    faults.sort(key=lambda f: f.at)
    return [replace(f, index=i) for i, f in enumerate(faults)]


def _apart(planned: Fault, at: float, early: Early) -> bool:
    """An early fault at ``at`` (lasting at most ``early.seconds``) neither starts near
    nor overlaps one of its kind already planned (whose healing would end it early), nor
    comes within ``early.gap`` of its ends."""
    if abs(planned.at - at) < early.clearance:
        return False
    gap = early.gap
    return at + early.seconds + gap <= planned.at or planned.at + planned.duration + gap <= at


def _draw(
    rng: random.Random,
    index: int,
    at: float,
    name: str,
    pools: dict[str, list[str]],
    db: str,
    busy: dict[str, float],
) -> Fault | None:
    span = round(rng.uniform(1.0, 8.0), 2)
    kind = KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown nemesis {name!r}")
    targets = pools.get(kind.targets, [kind.targets])
    free = [t for t in targets if busy.get(f"{kind.slot}:{t}", 0.0) <= at]
    if not free:
        return None
    pick = (lambda: rng.choice(free)) if kind.targets in pools else (lambda: free[0])
    target, duration, params = kind.draw(rng, pick, span, db)
    return Fault(index, at, name, target, duration, params)


# -- each kind: its draw, its fault and its healing ---------------------------------------


def _draw_pause(rng: random.Random, pick: Callable[[], str], span: float, db: str) -> Any:
    duration = round(MAX_TTL + rng.uniform(0.5, 3.0), 2)
    return pick(), duration, {}


def _draw_kill(rng: random.Random, pick: Callable[[], str], span: float, db: str) -> Any:
    target = pick()
    return target, round(rng.uniform(0.5, 3.0), 2), {}


def _draw_freeze(rng: random.Random, pick: Callable[[], str], span: float, db: str) -> Any:
    target = pick()
    return target, round(rng.uniform(2.0, 8.0), 2), {}


def _draw_clock(rng: random.Random, pick: Callable[[], str], span: float, db: str) -> Any:
    skew = f"{rng.choice('+-')}{rng.randint(2, 10)}m"
    if live_clock(db):  # moved in the running replica: no restart, no jobs abandoned
        return pick(), span, {"skew": skew, "live": True}
    return pick(), span, {"skew": skew}


def _draw_partition(rng: random.Random, pick: Callable[[], str], span: float, db: str) -> Any:
    to = rng.choice(["upstream", "database"]) if db != "sqlite" else "upstream"
    loss = rng.choice([None, 0.3])
    return pick(), span, {"to": to, "loss": loss}


def _draw_db_restart(rng: random.Random, pick: Callable[[], str], span: float, db: str) -> Any:
    return pick(), 3.0, {"mode": rng.choice(["fast", "immediate"])}


def _draw_failover(rng: random.Random, pick: Callable[[], str], span: float, db: str) -> Any:
    return pick(), 1.0, {"how": rng.choice(["switchover", "kill"])}


def _draw_upstream(rng: random.Random, pick: Callable[[], str], span: float, db: str) -> Any:
    mode = rng.choice(["cut", "slow", "5xx"])
    probability = round(rng.uniform(0.2, 0.5), 2)
    return pick(), span, {"mode": mode, "probability": probability}


def _draw_store_loss(lose: str) -> Draw:
    """A lock store losing its locks: half the time at once (``lose``: Redis's ``flush``,
    etcd's ``revoke``), else a kill -9 and a start again after 0.3-2 s (``restart``)."""

    def draw(rng: random.Random, pick: Callable[[], str], span: float, db: str) -> Any:
        if rng.random() < 0.5:
            return pick(), 0.5, {"how": lose}
        down = round(rng.uniform(0.3, 2.0), 2)
        return pick(), down, {"how": "restart"}

    return draw


async def _stop_worker(n: Nemesis, fault: Fault) -> None:
    n.workers[fault.target].signal(signal.SIGSTOP)


async def _continue_worker(n: Nemesis, fault: Fault) -> None:
    n.workers[fault.target].signal(signal.SIGCONT)


async def _kill_replica(n: Nemesis, fault: Fault) -> None:
    n.replica(fault.target).kill()


async def _start_replica(n: Nemesis, fault: Fault) -> None:
    await n._start(n.replica(fault.target), None)


async def _stop_replica(n: Nemesis, fault: Fault) -> None:
    n.replica(fault.target).signal(signal.SIGSTOP)


async def _continue_replica(n: Nemesis, fault: Fault) -> None:
    n.replica(fault.target).signal(signal.SIGCONT)


async def _skew_clock(n: Nemesis, fault: Fault) -> None:
    replica = n.replica(fault.target)
    skew = fault.params["skew"]
    if replica.clock_file is None:
        await _stop(n, fault, replica)
        await n._start(replica, skew)
        return
    replica.set_clock(skew)
    if skew.startswith("-"):
        n.stack.steer(replica)


async def _real_clock(n: Nemesis, fault: Fault) -> None:
    replica = n.replica(fault.target)
    if replica.clock_file is None:
        await _stop(n, fault, replica)
        await n._start(replica, None)
        return
    replica.set_clock(None)
    if fault.params["skew"].startswith("-"):
        n.stack.steer(None)


async def _stop(n: Nemesis, fault: Fault, replica: Replica) -> None:
    started = time.monotonic()
    if not await asyncio.to_thread(replica.stop):
        n.note_killed(fault, time.monotonic() - started)


async def _cut_network(n: Nemesis, fault: Fault) -> None:
    replica = n.replica(fault.target)
    assert replica.namespace is not None and n.stack.upstream is not None
    ports = [n.stack.upstream.port]
    if n.stack.resolving_port is not None:  # the resolver's upstream (--resolving) too
        ports.append(n.stack.resolving_port)
    if fault.params["to"] == "database":
        ports = n.stack.database_ports()
    n.partitions += 1
    for port in ports:
        await asyncio.to_thread(replica.namespace.cut, port, loss=fault.params["loss"])


async def _heal_network(n: Nemesis, fault: Fault) -> None:
    replica = n.replica(fault.target)
    assert replica.namespace is not None
    try:
        await asyncio.to_thread(replica.namespace.heal)
    finally:
        n.partitions -= 1
        n.last_heal = time.monotonic()


async def _restart_database(n: Nemesis, fault: Fault) -> None:
    assert n.stack.cluster is not None
    await asyncio.to_thread(n.stack.cluster.restart, fault.params["mode"])


async def _database_running(n: Nemesis, fault: Fault) -> None:
    assert n.stack.cluster is not None
    await asyncio.to_thread(n.stack.cluster.ensure_running)


async def _fail_over(n: Nemesis, fault: Fault) -> None:
    await n._fail_over(fault)


async def _cluster_whole(n: Nemesis, fault: Fault) -> None:
    assert n.stack.patroni is not None
    await asyncio.to_thread(n.stack.patroni.wait_healthy, 90)


async def _upstream_faults(n: Nemesis, fault: Fault) -> None:
    assert n.stack.upstream is not None
    await n.stack.upstream.set_faults(fault.params["mode"], fault.params["probability"])


async def _upstream_healthy(n: Nemesis, fault: Fault) -> None:
    assert n.stack.upstream is not None
    await n.stack.upstream.set_faults("none")


def _draw_zk_loss(rng: random.Random, pick: Callable[[], str], span: float, db: str) -> Any:
    """ZooKeeper paused for the session timeout and 1-3 s more (``lose``: the sessions
    expire as it wakes), or killed and started again after the session timeout and
    0.5-2 s more (``restart``: the sessions are kept)."""
    if rng.random() < 0.5:
        return pick(), round(SESSION_SECONDS + rng.uniform(1.0, 3.0), 2), {"how": "pause"}
    return pick(), round(SESSION_SECONDS + rng.uniform(0.5, 2.0), 2), {"how": "restart"}


async def _zk_back(n: Nemesis, fault: Fault) -> None:
    store = n.stack.lock_store_of(fault.target)
    assert isinstance(store, ZkStore)
    if fault.params["how"] == "restart":
        await asyncio.to_thread(store.start)
    else:
        await asyncio.to_thread(store.resume)


async def _lose_store(n: Nemesis, fault: Fault) -> None:
    store = n.stack.lock_store_of(fault.target)
    if fault.params["how"] == "restart":
        await asyncio.to_thread(store.kill)
    else:
        await asyncio.to_thread(store.lose)


async def _store_back(n: Nemesis, fault: Fault) -> None:
    if fault.params["how"] == "restart":
        await asyncio.to_thread(n.stack.lock_store_of(fault.target).start)


def _no_redis() -> str | None:
    return None if redis_binary() else "no redis-server on PATH (apt-get install redis-server)"


def _no_etcd() -> str | None:
    return None if etcd_binary() else "no etcd on PATH (apt-get install etcd-server)"


def _no_zookeeper() -> str | None:
    return None if zk_binary() else "no zkServer.sh (apt-get install zookeeper)"


def _no_faketime() -> str | None:
    return None if shutil.which("faketime") else "apt-get install faketime"


# What the nemeses need from this machine, in the order ``verify run`` asks.
NEEDS = {
    need.name: need
    for need in (
        Need("netns", netns.unavailable, "{kind} is not available here: {why}", True),
        Need("redis-server", _no_redis, "{kind} needs the lock workers' Redis: {why}", True),
        Need("etcd", _no_etcd, "{kind} needs the etcd lock workers' etcd: {why}", True),
        Need(
            "zookeeper",
            _no_zookeeper,
            "{kind} needs the ZooKeeper lock workers' ZooKeeper: {why}",
            True,
        ),
        Need("faketime", _no_faketime, "the {kind} nemesis needs libfaketime: {why}", False),
    )
}

# After a store outage the database rests this long. On SQLite an outage outlasts the
# busy timeout (10 s) and holds up every replica's start meanwhile (kill, shutdown and
# clock restart one), so ``all`` leaves it out there: beside the other nemeses it left
# the workload too little time for the rules they test (``.ci/run`` runs it on SQLite
# with ``shutdown`` in a run of its own).
STORE_REST = 20.0

# The nemeses, one entry each, in the order ``all`` lists them.
KINDS: dict[str, NemesisKind] = {
    kind.name: kind
    for kind in (
        NemesisKind(
            "pause", "SIGSTOP a worker past the longest TTL, then SIGCONT", "workers", "pause",
            _draw_pause, _stop_worker, _continue_worker, heal_when_aborting=True,
        ),
        NemesisKind(
            "kill", "kill -9 a replica, start it again after 0.5-3 s", "replicas", "process",
            _draw_kill, _kill_replica, _start_replica, rest=3.0,
        ),
        NemesisKind(
            "partition", "cut a replica off the upstream or the database (all or 30 % of its "
            "packets) for 1-8 s", "replicas", "network", _draw_partition, _cut_network,
            _heal_network, needs=("netns",),
        ),
        NemesisKind(
            "clock", "restart a replica under faketime (2-10 minutes off) for 1-8 s",
            "replicas", "process", _draw_clock, _skew_clock, _real_clock,
            needs=("faketime",), rest=3.0,
        ),
        NemesisKind(
            "upstream", "the upstream cuts, answers slowly or answers 503 to a share of writes",
            "upstream", "upstream", _draw_upstream, _upstream_faults, _upstream_healthy,
        ),
        NemesisKind(
            "db-restart", "pg_ctl restart -m fast or immediate", "db", "db-restart",
            _draw_db_restart, _restart_database, _database_running,
            databases=frozenset({"pg"}),
        ),
        NemesisKind(
            "failover", "the primary gives way (switchover or kill -9), until whole again",
            "db", "failover", _draw_failover, _fail_over, _cluster_whole,
            databases=frozenset({"patroni"}), rest=12.0,
        ),
        NemesisKind(
            "freeze", "SIGSTOP a replica for 2-8 s, then SIGCONT", "replicas", "process",
            _draw_freeze, _stop_replica, _continue_replica, rest=3.0, heal_when_aborting=True,
        ),
        NemesisKind(
            "lock-loss", "Redis loses every lock and fence counter (FLUSHALL or kill -9)",
            "redis", "lock-loss", _draw_store_loss("flush"), _lose_store, _store_back,
            needs=("redis-server",),
        ),
        NemesisKind(
            "etcd-loss", "etcd loses every lock (every lease revoked), or is killed -9 and "
            "comes back on its data after 0.3-2 s", "etcd", "etcd-loss",
            _draw_store_loss("revoke"), _lose_store, _store_back, needs=("etcd",),
            in_all=frozenset(),
        ),
        NemesisKind(
            "zk-loss", "ZooKeeper paused past the holders' session timeout (their sessions "
            "expire as it wakes), or killed -9 and started again on its data after longer "
            "than it (sessions kept)", "zookeeper", "zk-loss", _draw_zk_loss, _lose_store,
            _zk_back, needs=("zookeeper",), in_all=frozenset(),
        ),
        NemesisKind(
            "store", "the database breaks mid-request: SQLite's write lock held past the "
            "busy timeout, or PostgreSQL's connections cut and refused, for 1-5 s", "db",
            "store", outages.draw_store, outages.break_store, outages.heal_store,
            databases=frozenset({"sqlite", "pg"}), rest=STORE_REST, heal_when_aborting=True,
            in_all=frozenset({"pg"}),
        ),
        NemesisKind(
            "shutdown", "SIGTERM to a replica with writes waiting behind older generations', "
            "start it again after 0.5-3 s", "replicas", "process", outages.draw_shutdown,
            outages.shut_down, outages.restart, rest=3.0,
        ),
    )
}  # fmt: skip

NEMESES = tuple(KINDS)
# The nemeses of one database only: db-restart restarts the one PostgreSQL of --db pg,
# failover moves the primary of --db patroni's cluster. (store is of two.)
DATABASE_NEMESES = {
    k.name: next(iter(k.databases)) for k in KINDS.values() if len(k.databases) == 1
}
# The nemeses of the lock workers' Redis (verify.locks): they need redis-server.
LOCK_NEMESES = frozenset(k.name for k in KINDS.values() if "redis-server" in k.needs)
# The nemeses of the etcd lock workers' etcd (verify.etcd_locks).
ETCD_NEMESES = frozenset(k.name for k in KINDS.values() if "etcd" in k.needs)
# The nemeses of the ZooKeeper lock workers' ZooKeeper (verify.zk_locks).
ZK_NEMESES = frozenset(k.name for k in KINDS.values() if "zookeeper" in k.needs)
# Seconds a target rests after a fault of this kind before the plan gives it another (a
# failover's cluster needs about ten to be whole again).
AFTER = {k.name: k.rest for k in KINDS.values()}
