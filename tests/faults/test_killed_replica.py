"""(d) A replica killed with SIGKILL while its forwards are at the upstream.

Proves: the killed replica's records are never settled, so until their deadline a retry
through the other replica is told ``request-in-progress``; after the deadline they are
unknown and ``GET /admin/unknown-outcomes`` lists them; a retry with the same key gets
409 ``outcome-unknown`` where the upstream holds such keys, and is forwarded again (same
key, to an upstream that deduplicates) where it says ``retry``. The checker passes.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter

import aiohttp
import pytest

from fencegate_client import step_key
from verify.worker import History

from .harness import (
    DEDUPE,
    ORDERING_WAIT,
    PAY,
    ProcessGroup,
    acquire,
    check_run,
    database,
    events_of,
    raw_write,
    start_stack,
    unknown_outcomes,
    wait_no_live_in_flight,
)

pytestmark = pytest.mark.postgres


@pytest.mark.timeout(90)
async def test_a_killed_replicas_forwards_become_unknown(
    group: ProcessGroup, fault_db: str, script: History
) -> None:
    upstream, (a, b) = await start_stack(group, fault_db, [PAY, DEDUPE])
    async with aiohttp.ClientSession() as session:
        hold = await acquire(session, a, "killed-hold", "worker-1", ttl=300)
        retry = await acquire(session, a, "killed-retry", "worker-2", ttl=300)
        slow = {"Verify-Fault": "delay=3"}
        in_flight = [
            asyncio.ensure_future(
                raw_write(session, "worker-1", hold, a, "pay", "s0", headers=slow, history=script)
            ),
            asyncio.ensure_future(
                raw_write(
                    session, "worker-2", retry, a, "dedupe", "s0", headers=slow, history=script
                )
            ),
        ]
        for job in ("killed-hold", "killed-retry"):
            await upstream.wait_received(lambda e, job=job: e["job"] == job)
        killed_at = time.monotonic()
        a.signal(signal.SIGKILL)
        assert await asyncio.to_thread(a.proc.popen.wait, 10) == -signal.SIGKILL
        attempts = list(await asyncio.gather(*in_flight))
        assert all(x.status is None for x in attempts), attempts  # the clients lost A

        # Within the deadline the other replica says: in progress, come back later.
        early = await raw_write(session, "worker-1", hold, b, "pay", "s0", history=script)
        assert (early.status, early.reason) == (409, "request-in-progress"), early

        # Past the deadline both are unknown outcomes, listed for an operator.
        deadline = killed_at + PAY.deadline(ORDERING_WAIT) + 15
        while True:
            listed = await unknown_outcomes(session, b)
            if {i["job_id"] for i in listed} == {"killed-hold", "killed-retry"}:
                break
            assert time.monotonic() < deadline, listed
            await asyncio.sleep(0.25)
        assert {(i["job_id"], i["upstream"], i["generation"]) for i in listed} == {
            ("killed-hold", "pay", 1),
            ("killed-retry", "dedupe", 1),
        }

        # hold: the key stays held. retry: forwarded again with the same key.
        held = await raw_write(session, "worker-1", hold, b, "pay", "s0", history=script)
        again = await raw_write(session, "worker-2", retry, b, "dedupe", "s0", history=script)
        assert (held.status, held.reason) == (409, "outcome-unknown"), held
        assert again.ok and not again.replayed, again
        events = upstream.events()
        assert Counter((e["job"], e["event"]) for e in events) == {
            ("killed-hold", "applied"): 1,
            ("killed-retry", "applied"): 1,
            ("killed-retry", "duplicate"): 1,
        }
        assert (events[-1]["key"], events[-1]["generation"]) == (step_key("killed-retry", "s0"), 1)
        assert [i["job_id"] for i in await unknown_outcomes(session, b)] == ["killed-hold"]

    async with database(fault_db) as engine:
        await wait_no_live_in_flight(engine)
        problems = await check_run(engine, b, upstream, history=events_of(script))
    assert not problems, "\n".join(problems)
