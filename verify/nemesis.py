"""The nemesis: faults planned from the seed, then injected, overlapping, into the running
system, each healed at its end and every one at the end of the fault window.

The plan (``plan``) depends only on the seed and the run's shape (nemeses, replicas,
workers, seconds): every 1-4 s one fault of a nemesis drawn from the enabled ones, on a
target drawn from those not already under a fault of the same sort. ``faults.jsonl`` gets
the whole plan first (``"phase": "plan"``), then a line when each fault starts and ends.

- ``pause``: SIGSTOP a worker for the longest TTL (3 s) plus 0.5-3 s, then SIGCONT.
- ``kill``: kill -9 a replica, start it again (same addresses) after 0.5-3 s.
- ``freeze``: SIGSTOP a replica for 2-8 s, then SIGCONT: a gateway that stalls (a GC
  pause, a stopped VM) with writes admitted and not yet sent, while the other replicas
  admit the next generation.
- ``db-restart`` (PostgreSQL): ``pg_ctl restart -m fast`` or ``-m immediate``.
- ``partition``: drop the traffic of a replica's namespace to the upstream or (PostgreSQL)
  the database, all of it or 30 % of its packets, for 1-8 s.
- ``clock``: restart a replica under ``faketime -f +Nm`` (or ``-Nm``, N in 2..10; the
  monotonic clock stays real) for 1-8 s, then again with the real clock.
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
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from verify.events import JsonlWriter
from verify.procs import Child, StartError
from verify.stack import Replica, Stack

NEMESES = (
    "pause", "kill", "partition", "clock", "upstream", "db-restart", "failover", "freeze",
    "lock-loss",
)  # fmt: skip
# The nemeses of one database only: db-restart restarts the one PostgreSQL of --db pg,
# failover moves the primary of --db patroni's cluster.
DATABASE_NEMESES = {"db-restart": "pg", "failover": "patroni"}
# The nemeses of the lock workers' Redis (verify.locks): they need redis-server.
LOCK_NEMESES = frozenset({"lock-loss"})
MAX_TTL = 3.0
# Seconds a target rests after a fault of this kind before the plan gives it another (a
# failover's cluster needs about ten to be whole again).
AFTER = {"kill": 3.0, "clock": 3.0, "freeze": 3.0, "failover": 12.0}


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
        if self.kind in ("kill", "clock", "freeze"):
            return f"process:{self.target}"
        if self.kind == "partition":
            return f"network:{self.target}"
        return f"{self.kind}:{self.target}"

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "target": self.target,
            "at": round(self.at, 3),
            "duration": round(self.duration, 3),
            "params": self.params,
        }


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
        fault = _draw(rng, len(faults), t, kind, replicas, workers, db, busy)
        if fault is not None:
            faults.append(fault)
            busy[fault.slot] = t + fault.duration + AFTER.get(kind, 0.5)
        t += rng.uniform(1.0, 4.0)
    return faults


def _draw(
    rng: random.Random,
    index: int,
    at: float,
    kind: str,
    replicas: list[str],
    workers: list[str],
    db: str,
    busy: dict[str, float],
) -> Fault | None:
    def free(targets: list[str], sort: str) -> list[str]:
        return [t for t in targets if busy.get(f"{sort}:{t}", 0.0) <= at]

    span = round(rng.uniform(1.0, 8.0), 2)
    if kind == "pause":
        targets = free(workers, "pause")
        if not targets:
            return None
        duration = round(MAX_TTL + rng.uniform(0.5, 3.0), 2)
        return Fault(index, at, kind, rng.choice(targets), duration)
    if kind in ("kill", "clock", "freeze"):
        targets = free(replicas, "process")
        if not targets:
            return None
        if kind == "freeze":
            return Fault(index, at, kind, rng.choice(targets), round(rng.uniform(2.0, 8.0), 2))
        if kind == "kill":
            return Fault(index, at, kind, rng.choice(targets), round(rng.uniform(0.5, 3.0), 2))
        skew = f"{rng.choice('+-')}{rng.randint(2, 10)}m"
        return Fault(index, at, kind, rng.choice(targets), span, {"skew": skew})
    if kind == "partition":
        targets = free(replicas, "network")
        if not targets:
            return None
        to = rng.choice(["upstream", "database"]) if db != "sqlite" else "upstream"
        loss = rng.choice([None, 0.3])
        return Fault(index, at, kind, rng.choice(targets), span, {"to": to, "loss": loss})
    if kind == "db-restart":
        if busy.get("db-restart:db", 0.0) > at:
            return None
        return Fault(index, at, kind, "db", 3.0, {"mode": rng.choice(["fast", "immediate"])})
    if kind == "failover":
        if busy.get("failover:db", 0.0) > at:
            return None
        return Fault(index, at, kind, "db", 1.0, {"how": rng.choice(["switchover", "kill"])})
    if kind == "upstream":
        if busy.get("upstream:upstream", 0.0) > at:
            return None
        mode = rng.choice(["cut", "slow", "5xx"])
        probability = round(rng.uniform(0.2, 0.5), 2)
        return Fault(index, at, kind, "upstream", span, {"mode": mode, "probability": probability})
    if kind == "lock-loss":
        if busy.get("lock-loss:redis", 0.0) > at:
            return None
        if rng.random() < 0.5:
            return Fault(index, at, kind, "redis", 0.5, {"how": "flush"})
        down = round(rng.uniform(0.3, 2.0), 2)
        return Fault(index, at, kind, "redis", down, {"how": "restart"})
    raise ValueError(f"unknown nemesis {kind!r}")


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

    def _note(self, phase: str, fault: Fault, **extra: Any) -> None:
        self.log.write({"phase": phase, "time": time.time(), **fault.to_json(), **extra})

    # -- the faults ---------------------------------------------------------------------------

    async def begin(self, fault: Fault) -> None:
        kind, params = fault.kind, fault.params
        if kind == "pause":
            self.workers[fault.target].signal(signal.SIGSTOP)
        elif kind == "kill":
            self.replica(fault.target).kill()
        elif kind == "freeze":
            self.replica(fault.target).signal(signal.SIGSTOP)
        elif kind == "clock":
            replica = self.replica(fault.target)
            await asyncio.to_thread(replica.stop)
            await self._start(replica, params["skew"])
        elif kind == "partition":
            replica = self.replica(fault.target)
            assert replica.namespace is not None and self.stack.upstream is not None
            ports = [self.stack.upstream.port]
            if params["to"] == "database":
                ports = self.stack.database_ports()
            self.partitions += 1
            for port in ports:
                await asyncio.to_thread(replica.namespace.cut, port, loss=params["loss"])
        elif kind == "db-restart":
            assert self.stack.cluster is not None
            await asyncio.to_thread(self.stack.cluster.restart, params["mode"])
        elif kind == "failover":
            await self._fail_over(fault)
        elif kind == "upstream":
            assert self.stack.upstream is not None
            await self.stack.upstream.set_faults(params["mode"], params["probability"])
        elif kind == "lock-loss":
            store = self.stack.lock_store
            assert store is not None
            if params["how"] == "flush":
                await asyncio.to_thread(store.flush)
            else:
                await asyncio.to_thread(store.kill)

    async def end(self, fault: Fault) -> None:
        kind = fault.kind
        if self.aborting and kind not in ("pause", "freeze"):
            return
        if kind == "pause":
            self.workers[fault.target].signal(signal.SIGCONT)
        elif kind == "freeze":
            self.replica(fault.target).signal(signal.SIGCONT)
        elif kind == "kill":
            await self._start(self.replica(fault.target), None)
        elif kind == "clock":
            replica = self.replica(fault.target)
            await asyncio.to_thread(replica.stop)
            await self._start(replica, None)
        elif kind == "partition":
            replica = self.replica(fault.target)
            assert replica.namespace is not None
            try:
                await asyncio.to_thread(replica.namespace.heal)
            finally:
                self.partitions -= 1
                self.last_heal = time.monotonic()
        elif kind == "db-restart":
            assert self.stack.cluster is not None
            await asyncio.to_thread(self.stack.cluster.ensure_running)
        elif kind == "failover":
            assert self.stack.patroni is not None
            await asyncio.to_thread(self.stack.patroni.wait_healthy, 90)
        elif kind == "upstream":
            assert self.stack.upstream is not None
            await self.stack.upstream.set_faults("none")
        elif kind == "lock-loss" and fault.params["how"] == "restart":
            store = self.stack.lock_store
            assert store is not None
            await asyncio.to_thread(store.start)

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
