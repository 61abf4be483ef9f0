"""(e) PostgreSQL restarted during a run, and taken away for a while: our own cluster,
never the shared server.

``test_postgres_restart_and_outage_during_a_run`` proves: while the database is away,
the gateway answers fenced writes, the lease API and ``/readyz`` quickly with 503 problem
documents (reason ``store-unavailable``) — not a 500, not a hang; when it is back, the
same ``fencegate serve`` processes recover by themselves (no restart), the workers finish,
and the checker passes (no step applied twice, order kept, every 2xx the upstream's
answer, nothing left in flight, every unknown outcome listed). An operator then resolves
what stayed unknown and every job completes with each step applied exactly once.

The two tests after it pin down, deterministically, what a client sees at the edges of an
outage: a request whose transaction the restart cuts off, and an answer already being
streamed when the settlement cannot be written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest
import sqlalchemy as sa

from verify.cluster import PgCluster
from verify.worker import History

from .conftest import LONG
from .harness import (
    DEDUPE,
    ORDERING_WAIT,
    PAY,
    PROBLEM,
    SLOW,
    Answer,
    ProcessGroup,
    Replica,
    Run,
    Scale,
    acquire,
    check_run,
    database,
    events_of,
    http,
    raw_write,
    resolve_unknowns,
    start_stack,
    step_body,
    summary,
    symptom,
    wait_no_live_in_flight,
)

pytestmark = pytest.mark.postgres

SCALE = (
    Scale(jobs=300, workers=12, run_timeout=300)
    if LONG
    else Scale(jobs=16, workers=4, run_timeout=40)
)
OUTAGE = 6.0 if LONG else 2.0  # seconds the database stays away
RESTARTS = 4 if LONG else 1
SLOW_ANSWER = 5.0  # "not a hang": the longest a 503 may take


def unavailable(answer: Answer, what: str) -> None:
    assert answer.status == 503, (what, answer)
    assert answer.headers["Content-Type"].startswith(PROBLEM), (what, answer)
    doc = json.loads(answer.body)
    assert (doc["status"], doc["reason"]) == (503, "store-unavailable"), (what, doc)


async def timed(coro: object) -> Answer:
    started = time.monotonic()
    answer: Answer = await coro  # type: ignore[misc]
    took = time.monotonic() - started
    assert took < SLOW_ANSWER, f"took {took:.1f}s: {answer}"
    return answer


async def probe_outage(
    session: aiohttp.ClientSession, replica: Replica, lease: dict[str, object], queue: str
) -> None:
    """Everything a client can ask while the database is away: a 503 problem, soon."""
    job = str(lease["job_id"])
    write = await timed(
        http(
            session,
            "POST",
            f"{replica.proxy}/pay/charges",
            json_body=step_body(job, "s0"),
            headers={"Fencing-Token": str(lease["lease_token"]), "Idempotency-Key": "probe"},
        )
    )
    unavailable(write, f"a fenced write through {replica.name}")
    assert write.headers.get("Retry-After") == "1"
    ready = await timed(http(session, "GET", f"{replica.control}/readyz"))
    unavailable(ready, f"/readyz of {replica.name}")
    claim = await timed(
        http(
            session,
            "POST",
            f"{replica.control}/v1/queues/{queue}/claim",
            json_body={"owner": "prober"},
        )
    )
    unavailable(claim, f"a claim through {replica.name}")


async def until_ready(session: aiohttp.ClientSession, replica: Replica, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            answer = await http(session, "GET", f"{replica.control}/readyz", timeout=5)
            if answer.status == 200:
                return
        except (aiohttp.ClientError, TimeoutError):
            pass
        assert time.monotonic() < deadline, f"{replica.name} never got ready again"
        await asyncio.sleep(0.1)


@pytest.mark.timeout(400 if LONG else 90)
async def test_postgres_restart_and_outage_during_a_run(
    group: ProcessGroup, fault_db: str, script: History, pg_cluster: PgCluster
) -> None:
    upstream, replicas = await start_stack(group, fault_db, [PAY, DEDUPE], delay=[0, 0.03])
    pids = [r.proc.pid for r in replicas]
    run = Run(group, replicas, fault_db, SCALE, upstreams=("pay", "dedupe"))
    try:
        async with aiohttp.ClientSession() as session:
            probe = await acquire(session, replicas[0], "outage-probe", "prober", ttl=300)
            await run.enqueue()
            run.start_workers()
            under_way = time.monotonic() + 20
            while sum(1 for e in run.history() if e.acknowledged) < 4:  # the run is under way
                assert time.monotonic() < under_way, run.diagnostics() + group.logs()
                await asyncio.sleep(0.05)

            for _ in range(RESTARTS):  # workers keep going meanwhile
                await asyncio.to_thread(pg_cluster.restart)
                await asyncio.sleep(0.5 if not LONG else 3.0)

            await asyncio.to_thread(pg_cluster.stop)
            try:
                outage_started = time.monotonic()
                for replica in replicas:
                    await probe_outage(session, replica, probe, run.queue)
                await asyncio.sleep(max(0.0, OUTAGE - (time.monotonic() - outage_started)))
            finally:
                await asyncio.to_thread(pg_cluster.start)

            # Back by themselves: the same processes, ready, writing.
            for replica in replicas:
                await until_ready(session, replica, timeout=30)
            assert [r.proc.pid for r in replicas] == pids
            assert all(r.proc.alive() for r in replicas)
            after = await raw_write(
                session, "prober", probe, replicas[1], "pay", "s0", history=script
            )
            assert after.ok and not after.replayed, after

            completed, parked = await run.until_settled()
            assert completed + parked == len(run.jobs), run.diagnostics() + group.logs()
            await run.stop_workers()

        await wait_no_live_in_flight(run.engine, timeout=PAY.deadline(ORDERING_WAIT) + 10)
        events = upstream.events()
        print(summary(events, run.history()))
        problems = await check_run(
            run.engine,
            replicas[0],
            upstream,
            history=[*run.history(), *events_of(script)],
            jobs=await run.job_rows(),
            keys_of=run.keys,
        )
        assert not problems, "\n".join(problems)

        resolved = await resolve_unknowns(replicas[0], events)
        await run.finish(replicas[1])
        problems = await check_run(
            run.engine,
            replicas[1],
            upstream,
            history=[*run.history(), *events_of(script)],
            jobs=await run.job_rows(),
            keys_of=run.keys,
        )
        assert not problems, "\n".join(problems)
        print(f"resolved by the operator: {resolved}")
    finally:
        await run.close()


@pytest.mark.timeout(60)
async def test_a_request_cut_off_by_the_restart_gets_a_503(
    group: ProcessGroup, fault_db: str, pg_cluster: PgCluster
) -> None:
    upstream, (replica,) = await start_stack(group, fault_db, [PAY], replicas=1)
    dbname = sa.make_url(fault_db).database
    async with aiohttp.ClientSession() as session:
        lease = await acquire(session, replica, "cut-off", "worker-1", ttl=300)
        async with database(fault_db) as engine, engine.connect() as conn:
            # Our transaction locks the job's row: the gateway's admission and the renewal
            # wait in the database when the restart terminates their sessions.
            await conn.begin()
            await conn.execute(sa.text("SELECT 1 FROM jobs WHERE job_id = 'cut-off' FOR UPDATE"))
            write = asyncio.ensure_future(
                http(
                    session,
                    "POST",
                    f"{replica.proxy}/pay/charges",
                    json_body=step_body("cut-off", "s0"),
                    headers={"Fencing-Token": lease["lease_token"], "Idempotency-Key": "k"},
                )
            )
            renew = asyncio.ensure_future(
                http(
                    session,
                    "POST",
                    f"{replica.control}/v1/leases/renew",
                    json_body={"lease_token": lease["lease_token"]},
                )
            )
            deadline = time.monotonic() + 10
            while await pg_cluster.lock_waits(dbname) < 2:
                assert time.monotonic() < deadline, "the requests never reached the lock"
                await asyncio.sleep(0.02)
            try:
                await asyncio.to_thread(pg_cluster.restart)
            finally:
                with contextlib.suppress(sa.exc.DBAPIError):
                    await conn.invalidate()
        cut_write, cut_renew = await write, await renew
    with symptom():
        unavailable(cut_write, "a write whose admission the restart cut off")
        # The renewal's session may be cut (503) or its statement may run once the
        # server is back (200); what it must never get is a 500.
        if cut_renew.status != 200:
            unavailable(cut_renew, "a renewal the restart cut off")
    assert upstream.events() == []


@pytest.mark.timeout(60)
async def test_an_answer_being_streamed_when_the_database_goes_is_not_left_hanging(
    group: ProcessGroup, fault_db: str, pg_cluster: PgCluster
) -> None:
    upstream, (replica,) = await start_stack(group, fault_db, [PAY, SLOW], replicas=1)
    async with aiohttp.ClientSession() as session:
        lease = await acquire(session, replica, "streamed", "worker-1", ttl=300)
        write = asyncio.ensure_future(
            raw_write(
                session,
                "worker-1",
                lease,
                replica,
                "slow",
                "s0",
                headers={"Verify-Fault": "delay=1.5"},
                timeout=3.5,  # the upstream answers after 1.5 s
            )
        )
        event = await upstream.wait_received(lambda e: e["job"] == "streamed")
        await asyncio.to_thread(pg_cluster.stop)  # before the upstream answers
        try:
            answer = await write
        finally:
            await asyncio.to_thread(pg_cluster.start)
    # Either the upstream's answer, whole (the settlement is lost; the record turns
    # unknown at its deadline), or a 503 problem; never a broken or endless answer.
    with symptom():
        assert answer.status is not None, answer
        if answer.ok:
            assert answer.body == event["answer"].encode(), answer
        else:
            assert (answer.status, answer.reason) == (503, "store-unavailable"), answer
