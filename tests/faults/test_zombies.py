"""(a) Zombies: workers stall past their leases (no renewal: raw HTTP, so no client-side
check stops them) and keep writing when they wake, while other workers have taken their
jobs over through the other replica.

Proves: every write a zombie makes after its stall is refused by the gateway
(``stale-generation`` when someone took over, ``lease-expired`` when nobody had yet) and
none of them reaches the upstream; its late ``complete`` is refused too; and the run as a
whole passes the checker (each step of each job applied exactly once, in generation order,
and every 2xx a worker saw is the upstream's own answer).
"""

from __future__ import annotations

import pytest

from .conftest import LONG
from .harness import (
    ProcessGroup,
    Run,
    Scale,
    check_run,
    start_stack,
    summary,
    wait_no_live_in_flight,
)

pytestmark = pytest.mark.postgres

SCALE = (
    Scale(jobs=400, steps=5, workers=12, zombies=8, ttl=1.0, run_timeout=300)
    if LONG
    else Scale(jobs=12, steps=4, workers=4, zombies=3, ttl=1.0, run_timeout=40)
)
STALL = SCALE.ttl + 0.8  # well past the lease


@pytest.mark.timeout(300 if LONG else 90)
async def test_zombies_are_fenced_off_while_others_take_over(
    group: ProcessGroup, fault_db: str
) -> None:
    upstream, replicas = await start_stack(group, fault_db, delay=[0, 0.02])
    run = Run(replicas, fault_db, SCALE, upstreams=("pay", "dedupe"))
    try:
        await run.enqueue()
        run.start_zombies(stall=STALL, rounds=3 if LONG else 1)
        run.start_workers()
        completed, parked = await run.until_settled()
        await run.zombies_done()
        assert (completed, parked) == (len(run.jobs), 0), run.diagnostics() + group.logs()
        await run.stop_workers()

        events = upstream.events()
        zombie_writes = [a for a in run.attempts if a.zombie and a.after_stall]
        assert zombie_writes, "no zombie woke up to write"
        for attempt in zombie_writes:
            assert (attempt.status, attempt.reason) in {
                (409, "stale-generation"),
                (409, "lease-expired"),
            }, attempt
        # Nothing a zombie sent after its stall reached the upstream: the upstream's writes
        # of a zombie's (job, generation) are exactly its forwards from before the stall.
        zombie_grants = {(g.job, g.generation) for g in run.grants if g.owner.startswith("zombie")}
        before = [
            a for a in run.attempts if a.zombie and not a.after_stall and a.ok and not a.replayed
        ]
        received = [e for e in events if (e["job"], e["generation"]) in zombie_grants]
        assert len(received) == len(before), (received, before)

        await wait_no_live_in_flight(run.engine)
        problems = await check_run(
            run.engine,
            replicas[1],
            upstream,
            attempts=run.attempts,
            grants=run.grants,
            jobs=await run.job_rows(),
            keys_of=run.keys,
        )
        assert not problems, "\n".join(problems)
        print(summary(events, run.attempts))
    finally:
        await run.close()
