"""(f) Graceful shutdown: SIGTERM to a replica while a slow forward (the upstream answers
after about a second) is in flight through it.

Proves: the client still gets the upstream's answer; the key's record is settled
``completed`` with it (a duplicate through the other replica replays exactly that answer
without calling the upstream again); the process exits 0 within its
``shutdown_timeout_seconds``.
"""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from verify.worker import History

from .harness import (
    PAY,
    SLOW,
    ProcessGroup,
    acquire,
    check_run,
    database,
    events_of,
    raw_write,
    records,
    start_stack,
)

pytestmark = pytest.mark.postgres


@pytest.mark.timeout(60)
async def test_sigterm_lets_the_forward_in_flight_finish(
    group: ProcessGroup, fault_db: str, script: History
) -> None:
    upstream, (a, b) = await start_stack(group, fault_db, [PAY, SLOW], shutdown_timeout=10)
    async with aiohttp.ClientSession() as session:
        lease = await acquire(session, a, "graceful", "worker-1", ttl=300)
        in_flight = asyncio.ensure_future(
            raw_write(
                session,
                "worker-1",
                lease,
                a,
                "slow",
                "s0",
                headers={"Verify-Fault": "delay=1"},
                history=script,
            )
        )
        event = await upstream.wait_received(lambda e: e["job"] == "graceful")
        a.signal(signal.SIGTERM)
        answer = await in_flight
        assert answer.ok and not answer.replayed, answer
        assert answer.body == event["answer"].encode()
        assert await asyncio.to_thread(a.proc.popen.wait, 20) == 0, a.proc.output()
        assert "fencegate stopping" in a.proc.output()

        duplicate = await raw_write(session, "worker-1", lease, b, "slow", "s0", history=script)
        assert duplicate.ok and duplicate.replayed, duplicate
        assert duplicate.body == answer.body
    assert len(upstream.events()) == 1

    async with database(fault_db) as engine:
        [record], _ = await records(engine)
        assert (record["job_id"], record["state"], record["status"]) == (
            "graceful",
            "completed",
            201,
        )
        problems = await check_run(engine, b, upstream, history=events_of(script))
    assert not problems, "\n".join(problems)
