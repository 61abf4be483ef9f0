"""(c) A gateway replica frozen with SIGSTOP mid-request while the other one serves.

``test_frozen_mid_forward``: replica A is frozen while its forwards are at the upstream;
workers go on through replica B. Proves: A's records stay in flight only until their
deadline (meanwhile B answers the same key ``request-in-progress`` and holds newer
generations back with ``ordering-timeout``), then they are unknown and listed; newer
generations are admitted and forwarded through B; after SIGCONT, A's late answers and
settlements break nothing: the checker passes, and A serves on.

``test_frozen_between_admission_and_forward``: A is frozen after its admission of a write
was committed but before A forwarded it (made deterministic by holding the commit's
answer with a synchronous standby that never comes, then freezing A, then letting the
commit through). While A is frozen, its record passes its deadline and generation 2 of
the job writes through B. After SIGCONT nothing must reach the upstream for generation 1.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa

from verify.cluster import PgCluster
from verify.worker import History

from .conftest import LONG
from .harness import (
    ORDERING_WAIT,
    PAY,
    SLOW,
    ProcessGroup,
    Replica,
    Run,
    Scale,
    Written,
    acquire,
    check_run,
    database,
    events_of,
    http,
    raw_write,
    start_stack,
    summary,
    symptom,
    unknown_outcomes,
    wait_no_live_in_flight,
)

pytestmark = pytest.mark.postgres

SCALE = (
    Scale(jobs=300, workers=10, run_timeout=300)
    if LONG
    else Scale(jobs=10, workers=3, run_timeout=40)
)
DEADLINE = PAY.deadline(ORDERING_WAIT)
TTL = 2.0  # the stalled worker's leases: long enough to be admitted, short of the deadline


async def until(write: Any, done: set[str | None], allowed: set[str | None]) -> Written:
    """Send ``write()`` again until its reason is in ``done`` (2xx: ``None``); every other
    answer on the way must be in ``allowed``."""
    deadline = time.monotonic() + DEADLINE + 15
    while True:
        attempt: Written = await write()
        if attempt.reason in done and attempt.status is not None:
            return attempt
        assert attempt.reason in allowed and attempt.status is not None, attempt
        assert time.monotonic() < deadline, attempt
        await asyncio.sleep(0.25)


async def in_progress_then_held(write: Any) -> None:
    """Generation 2 of a job whose generation-1 write of s0 is in flight at the frozen
    replica, through the other replica: s0 is in progress; s1 waits for the older write
    (``ordering-timeout``) until that one's deadline passes, then goes out; s0 is then an
    unknown outcome, held."""
    early = await write("s0")
    assert (early.status, early.reason) == (409, "request-in-progress"), early
    await until(lambda: write("s1"), {None}, {"ordering-timeout"})
    held = await write("s0")
    assert (held.status, held.reason) == (409, "outcome-unknown"), held


async def healthy(session: aiohttp.ClientSession, replica: Replica) -> bool:
    answer = await http(session, "GET", replica.control + "/readyz", timeout=5)
    return answer.status == 200


@pytest.mark.timeout(300 if LONG else 90)
async def test_frozen_mid_forward(group: ProcessGroup, fault_db: str, script: History) -> None:
    upstream, (a, b) = await start_stack(group, fault_db, [PAY], delay=[0, 0.02])
    # Workers claim through both replicas and write through B, so that what is in flight
    # at A when it freezes is exactly the forwards below.
    run = Run(group, [a, b], fault_db, SCALE, upstreams=("pay",), write_via=[b])
    frozen_jobs = [f"frozen-{i}" for i in range(6 if LONG else 2)]
    try:
        async with aiohttp.ClientSession() as session:
            await run.enqueue()
            run.start_workers()
            leases = [await acquire(session, a, job, "stalled", ttl=TTL) for job in frozen_jobs]
            expired_by = time.monotonic() + TTL + 0.1
            late = [
                asyncio.ensure_future(
                    raw_write(
                        session,
                        "stalled",
                        lease,
                        a,
                        "pay",
                        "s0",
                        headers={"Verify-Fault": "delay=2"},
                        history=script,
                    )
                )
                for lease in leases
            ]
            for job in frozen_jobs:
                await upstream.wait_received(lambda e, job=job: e["job"] == job)
            a.freeze()

            await asyncio.sleep(expired_by - time.monotonic())  # the stalled leases expire

            async def take_over(job: str) -> None:
                taker = await acquire(session, b, job, "taker", ttl=120)
                assert taker["generation"] == 2

                def write(step: str) -> Any:
                    return raw_write(session, "taker", taker, b, "pay", step, history=script)

                await in_progress_then_held(write)

            await asyncio.gather(*(take_over(job) for job in frozen_jobs))
            listed = await unknown_outcomes(session, b)
            assert {i["job_id"] for i in listed} >= set(frozen_jobs)

            a.thaw()
            await asyncio.gather(*late)
            assert a.proc.alive() and await healthy(session, a)
            completed, parked = await run.until_settled()
            assert completed + parked == len(run.jobs), run.diagnostics()
            await run.stop_workers()

        async with database(fault_db) as engine:
            await wait_no_live_in_flight(engine)
            events = upstream.events()
            jobs = await run.job_rows()
            history = [*run.history(), *events_of(script)]
            problems = await check_run(
                engine, b, upstream, history=history, jobs=jobs, keys_of=run.keys
            )
        assert not problems, "\n".join(problems)
        for job in frozen_jobs:  # generation 1 once (before the freeze), then generation 2
            assert [e["generation"] for e in events if e["job"] == job] == [1, 2]
        print(summary(events, history))
    finally:
        await run.close()


@pytest.mark.timeout(90)
async def test_frozen_between_admission_and_forward(
    group: ProcessGroup, fault_db: str, script: History, pg_cluster: PgCluster
) -> None:
    upstream, (a, b) = await start_stack(group, fault_db, [PAY])
    dbname = sa.make_url(fault_db).database
    assert dbname is not None
    job = "paused-after-admission"
    async with aiohttp.ClientSession() as session:
        first = await acquire(session, b, job, "worker-1", ttl=TTL)
        expired_by = time.monotonic() + TTL + 0.1
        try:
            await pg_cluster.hold_commits()
            late = asyncio.ensure_future(
                raw_write(session, "worker-1", first, a, "pay", "s0", timeout=60, history=script)
            )
            deadline = time.monotonic() + 10
            while await pg_cluster.held_commits(dbname) == 0:  # A's admission, committing
                assert time.monotonic() < deadline, "A's admission never reached its commit"
                await asyncio.sleep(0.02)
            a.freeze()
        finally:
            await pg_cluster.release_commits()
        # The admission is committed now; A has not seen the answer (nor forwarded).
        await asyncio.sleep(expired_by - time.monotonic())  # worker 1's lease expires
        second = await acquire(session, b, job, "worker-2", ttl=120)
        assert second["generation"] == 2

        def write(step: str) -> Any:
            return raw_write(session, "worker-2", second, b, "pay", step, history=script)

        await in_progress_then_held(write)
        assert [(e["job"], e["generation"]) for e in upstream.events()] == [(job, 2)]

        a.thaw()
        woken = await late
        await asyncio.sleep(0.5)
        events = upstream.events()
        print(f"A's late answer: {woken}; upstream: {events}")
        async with database(fault_db) as engine:
            await wait_no_live_in_flight(engine)
            problems = await check_run(engine, b, upstream, history=events_of(script))
        with symptom():
            assert not problems, "\n".join(problems)
            # Generation 1's write is never forwarded: on waking, A judges its claim again
            # before the first byte and finds generation 2 admitted (and its claim past
            # its deadline).
            assert [e["generation"] for e in events] == [2]
            assert (woken.status, woken.reason) == (409, "stale-generation"), woken


@pytest.mark.timeout(90)
async def test_woken_after_a_newer_generation_was_admitted(
    group: ProcessGroup, fault_db: str, script: History, pg_cluster: PgCluster
) -> None:
    """A is frozen between its admission's commit and the forward, for less than the
    claim's deadline; meanwhile generation 2 of the job is granted and admitted through B
    (and held back: A's record is still in flight). On waking, A must not send
    generation 1 (once g+1 is admitted, no write of g is forwarded): it judges the fence
    again right before the first byte, answers ``stale-generation`` and frees the key;
    generation 2 then goes out, alone."""
    upstream, (a, b) = await start_stack(group, fault_db, [SLOW])
    dbname = sa.make_url(fault_db).database
    assert dbname is not None
    job = "woken-after-g2"
    async with aiohttp.ClientSession() as session:
        first = await acquire(session, b, job, "worker-1", ttl=120)
        try:
            await pg_cluster.hold_commits()
            late = asyncio.ensure_future(
                raw_write(session, "worker-1", first, a, "slow", "s0", timeout=60, history=script)
            )
            deadline = time.monotonic() + 10
            while await pg_cluster.held_commits(dbname) == 0:
                assert time.monotonic() < deadline, "A's admission never reached its commit"
                await asyncio.sleep(0.02)
            a.freeze()
        finally:
            await pg_cluster.release_commits()
        # The same owner acquiring again gets generation 2 at once (the lease is current).
        second = await acquire(session, b, job, "worker-1", ttl=120)
        assert second["generation"] == 2

        def write(step: str) -> Any:
            return raw_write(session, "worker-1", second, b, "slow", step, history=script)

        held = await write("s1")  # admitted (the fence is 2 now), then held back by A's s0
        assert (held.status, held.reason) == (503, "ordering-timeout"), held
        # A's claim is still in flight and (unless this machine is very slow) inside its
        # deadline: judging the deadline alone, A would send on waking.
        a.thaw()
        woken = await late
        assert (woken.status, woken.reason) == (409, "stale-generation"), woken
        assert upstream.events() == []
        for step in ("s1", "s0"):  # the key A held is free again
            sent = await write(step)
            assert sent.ok and not sent.replayed, sent
        events = upstream.events()
        assert [(e["job"], e["generation"]) for e in events] == [(job, 2), (job, 2)]
        async with database(fault_db) as engine:
            await wait_no_live_in_flight(engine)
            problems = await check_run(engine, b, upstream, history=events_of(script))
        assert not problems, "\n".join(problems)
