"""The nemeses of issue 52, whose faults fall in the middle of a fenced write's exchange:
``store`` breaks the database while requests are in hand, ``shutdown`` stops a replica
with writes waiting behind an older generation's. Their entries are in
``verify.nemesis.KINDS``; this module holds their draws, faults and healings.

- ``store``, with the upstream answering late and cutting half of its answers (after
  applying) from just before the database breaks until it is healed, so sent writes
  end without an answer while their unknown outcome cannot be recorded. SQLite: a
  process of its own holds ``BEGIN EXCLUSIVE`` on the run's database
  file past the gateway's busy timeout (``lease_core.direct_sqlite.BUSY_TIMEOUT_MS``, 10 s:
  the gateway's database thread waits that long for the lock, then gives up) by 0.2-1 s;
  healed by killing that process (the lock goes with it, also when the run is torn down:
  it is one of the run's children). PostgreSQL: ``ALTER DATABASE ... ALLOW_CONNECTIONS
  false`` and ``pg_terminate_backend`` of every connection to the run's database (the
  replicas'), for 1-5 s, then ``ALLOW_CONNECTIONS true``, asked again until the server
  takes it (a ``db-restart`` may be under way).
- ``shutdown``: the upstream answers every write 0.2-0.9 s late for a moment (so older
  generations' writes stay in flight and newer ones wait behind them), then SIGTERM to a
  replica as soon as its ``/metrics`` shows a write waiting behind an older
  generation's (or after 4 s more without one: ``waiter``), which has
  ``SHUTDOWN_GRACE_UNDER_NEMESIS`` (0.2 s, under the ordering wait) to finish; it is
  started again 0.5-3 s after it exited. A replica still running 5 s after
  the SIGTERM is killed (SIGKILL), and the fault log says so (``phase: killed``):
  invariant 13 excuses what such a replica lost.
  On SQLite, half the shutdowns (``"locked"``, a draw of their own, so the rest of a
  seed's plan is as before) come instead while another process holds the database's
  write lock: taken, then ``LOCKED_BEFORE`` s later (the replica's admissions waiting on
  its database thread for the lock) the SIGTERM, the lock held ``LOCKED_AFTER`` s past
  it (past the grace: the requests are cancelled while their admissions wait) and then
  given up, well within the thread's busy timeout, so the admissions still commit their
  claims (found by ``tests/faults/test_cancelled_admission.py``; the mutant
  ``admission-claim-orphaned``: a claim committed for a request that is gone, never
  sent, turns unknown).
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
import time
from typing import TYPE_CHECKING, Any

import aiohttp

from lease_core.direct_sqlite import BUSY_TIMEOUT_MS
from verify.procs import wait_for_line

if TYPE_CHECKING:
    from collections.abc import Callable

    from verify.nemesis import Fault, Nemesis
    from verify.procs import Child
    from verify.stack import Stack

DATABASE = "verify"  # the run's database on PostgreSQL (verify.stack)
BUSY_TIMEOUT = BUSY_TIMEOUT_MS / 1000
LOCKED = re.compile(r"^locked$", re.MULTILINE)
# A process that takes the write lock of a SQLite file and keeps it until it is killed.
LOCKER = (
    "import sqlite3, sys, time\n"
    "conn = sqlite3.connect(sys.argv[1], timeout=60, isolation_level=None)\n"
    "conn.execute('BEGIN EXCLUSIVE')\n"
    "print('locked', flush=True)\n"
    "time.sleep(3600)\n"
)
STOP_WAIT = 5.0  # seconds after the SIGTERM before a replica is killed
# shutdown: how long past the slow answers' delay a waiter is looked for, and how often
WAITER_SEARCH = 4.0
WAITER_POLL = 0.02
# a locked shutdown: the lock held this long before the SIGTERM, and this long after it
# (the grace, 0.2 s, and a second more; the replica must end within STOP_WAIT)
LOCKED_BEFORE = 1.0
LOCKED_AFTER = 1.2
WAITING = re.compile(r'^fencegate_gateway_waiting_requests\{wait="older"\} (\S+)$', re.MULTILINE)
# While the store is broken, the upstream answers after this many seconds and cuts this
# share of its answers after applying the write; the break comes CUT_DELAY[0] after the
# answers slow down, so every write admitted meanwhile is in the upstream's hands when
# it comes. With (0.2, 0.5) a break caught 3 to 6 writes of the run's 8 queue workers
# and 3 lock workers, and unknown-settle-unguarded survived some (issue 53).
CUT_DELAY = (0.5, 0.9)
CUT_SHARE = 0.5
HEAL_TRIES = 40  # ALLOW_CONNECTIONS true, every 0.5 s, until the server takes it


PG_OUTAGE_MAX = 5.0  # seconds PostgreSQL's connections stay refused, at most


def draw_store(rng: random.Random, pick: Callable[[], str], span: float, db: str) -> Any:
    outage = round(rng.uniform(1.0, PG_OUTAGE_MAX), 2)
    if db == "sqlite":  # the lock is held past the busy timeout, by a fifth of the outage
        return pick(), round(BUSY_TIMEOUT + outage / 5, 2), {"how": "exclusive-lock"}
    return pick(), outage, {"how": "connections-refused"}


def draw_shutdown(rng: random.Random, pick: Callable[[], str], span: float, db: str) -> Any:
    target = pick()
    slow = round(rng.uniform(0.4, 0.9), 2)
    down = round(rng.uniform(0.5, 3.0), 2)
    # A draw of its own (from what the seed's draw gave), so the plan is otherwise the
    # seed's as it was before the locked shutdowns.
    if db == "sqlite" and random.Random(f"shutdown/{target}/{slow}/{down}").random() < 0.5:
        return target, down, {"slow": slow, "locked": True}
    return target, down, {"slow": slow}


async def write_lock(stack: Stack, name: str) -> Child:
    """A process of the run's own (``name``, its log ``NAME.log``) holding the SQLite
    file's write lock until it is killed, once it holds it."""
    argv = [sys.executable, "-c", LOCKER, str(stack.out / "fencegate.db")]
    since = len(_read(stack.out / f"{name}.log"))
    locker = stack.children.spawn(name, argv)
    await wait_for_line(locker, LOCKED, 30, since)
    return locker


async def break_store(n: Nemesis, fault: Fault) -> None:
    """The database broken in the middle of exchanges: the upstream first answers late
    (so writes admitted just before are in its hands) and cuts a share of its answers
    after applying them, until the healing, so some sent writes end without an answer
    while the database cannot record their unknown outcome (issue 52, item 1)."""
    stack = n.stack
    if stack.upstream is not None:
        n.slowing += 1
        await stack.upstream.set_knobs(delay=list(CUT_DELAY), cut=CUT_SHARE, apply_before_cut=1.0)
        await asyncio.sleep(CUT_DELAY[0])
    if stack.db == "sqlite":
        n.store_lock = await write_lock(stack, "store-lock")
        return
    assert stack.cluster is not None
    await stack.cluster.execute(f'ALTER DATABASE "{DATABASE}" ALLOW_CONNECTIONS false')
    await stack.cluster.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        f"WHERE datname = '{DATABASE}' AND pid <> pg_backend_pid()"
    )


async def heal_store(n: Nemesis, fault: Fault) -> None:
    stack = n.stack
    try:
        if stack.db == "sqlite":
            locker, n.store_lock = n.store_lock, None
            if locker is not None:
                await asyncio.to_thread(locker.kill)
            return
        assert stack.cluster is not None
        for attempt in range(HEAL_TRIES):
            try:
                await stack.cluster.execute(f'ALTER DATABASE "{DATABASE}" ALLOW_CONNECTIONS true')
                return
            except Exception:
                if attempt == HEAL_TRIES - 1:
                    raise
                await asyncio.sleep(0.5)
    finally:
        if stack.upstream is not None:
            await stack.upstream.set_knobs(cut=0.0, apply_before_cut=0.5)
            n.slowing -= 1
            if not n.slowing:
                await stack.upstream.set_knobs(delay=[0.0, 0.0])


async def shut_down(n: Nemesis, fault: Fault) -> None:
    """Slow answers for a moment, then SIGTERM to the replica as soon as a write waits
    there behind an older generation's (``waiter``); wait for it to end. A ``locked``
    shutdown: SIGTERM while the replica's admissions wait for SQLite's write lock."""
    if fault.params.get("locked"):
        await _shut_down_locked(n, fault)
        return
    replica = n.replica(fault.target)
    upstream = n.stack.upstream
    assert upstream is not None
    slow = float(fault.params["slow"])
    n.slowing += 1
    try:
        await upstream.set_knobs(delay=[slow / 2, slow])
        # older generations' writes in flight, newer ones waiting
        waited = await waiter(replica.control, n.stack.admin_token, slow + WAITER_SEARCH)
        n.note_waiter(fault, waited)
        started = time.monotonic()
        ended = await asyncio.to_thread(replica.stop, STOP_WAIT)
        if not ended:
            n.note_killed(fault, time.monotonic() - started)
    finally:
        n.slowing -= 1
        if not n.slowing:
            await upstream.set_knobs(delay=[0.0, 0.0])


async def _shut_down_locked(n: Nemesis, fault: Fault) -> None:
    """Another process takes the database's write lock (unless the store nemesis holds it
    already); ``LOCKED_BEFORE`` s later, SIGTERM to the replica; the lock is given up
    ``LOCKED_AFTER`` s after that, past the grace; then wait for the replica to end."""
    replica = n.replica(fault.target)
    locker = None if n.store_lock is not None else await write_lock(n.stack, "shutdown-lock")
    try:
        await asyncio.sleep(LOCKED_BEFORE)
        started = time.monotonic()
        stopping = asyncio.ensure_future(asyncio.to_thread(replica.stop, STOP_WAIT))
        await asyncio.sleep(LOCKED_AFTER)
    finally:
        if locker is not None:
            await asyncio.to_thread(locker.kill)
    if not await stopping:
        n.note_killed(fault, time.monotonic() - started)


async def waiter(control: str, token: str, seconds: float) -> float | None:
    """Seconds until the replica had a write waiting behind an older generation's
    (``fencegate_gateway_waiting_requests{wait="older"}`` above 0, looked at every
    ``WAITER_POLL`` s), or None when none came within ``seconds``. A waiter caught at
    once has most of its wait (the ordering wait, 1 s under this nemesis) ahead of it,
    longer than the grace (0.2 s): the SIGTERM then finds it waiting, which only a
    moment's luck gave before (issue 53: the mutant release-only-on-store-unavailable
    survived)."""
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {token}"}
    timeout = aiohttp.ClientTimeout(total=1.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() - started < seconds:
            try:
                async with session.get(f"{control}/metrics", headers=headers) as resp:
                    found = WAITING.search(await resp.text())
            except (aiohttp.ClientError, TimeoutError):
                found = None
            if found is not None and float(found[1]) > 0:
                return time.monotonic() - started
            await asyncio.sleep(WAITER_POLL)
    return None


async def restart(n: Nemesis, fault: Fault) -> None:
    replica = n.replica(fault.target)
    if not replica.alive():
        await n._start(replica, None)


def _read(path: Any) -> str:
    try:
        return str(path.read_text(errors="replace"))
    except OSError:
        return ""
