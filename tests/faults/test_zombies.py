"""(a) Zombies: verify's workers whose jobs lapse (``verify.worker``'s lapse conduct: no
look at the lease, renewals stop after the first step) stall past their leases and keep
writing when they wake, as process ``{id}/late``, while other workers have taken their
jobs over through the other replica. The other workers draw their conduct as in a
verification run, so their own lapsed jobs count too.

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
    Scale(jobs=400, workers=12, zombies=8, run_timeout=300)
    if LONG
    else Scale(jobs=12, workers=4, zombies=3, run_timeout=40)
)


@pytest.mark.timeout(300 if LONG else 90)
async def test_zombies_are_fenced_off_while_others_take_over(
    group: ProcessGroup, fault_db: str
) -> None:
    upstream, replicas = await start_stack(group, fault_db, delay=[0, 0.02])
    run = Run(group, replicas, fault_db, SCALE, upstreams=("pay", "dedupe"))
    try:
        await run.enqueue()
        run.start_zombies(rounds=3 if LONG else 1)
        run.start_workers()
        completed, parked = await run.until_settled()
        await run.zombies_done()
        assert (completed, parked) == (len(run.jobs), 0), run.diagnostics() + group.logs()
        await run.stop_workers()

        events = upstream.events()
        history = run.history()
        late = [e for e in history if e.process.endswith("/late") and e.type != "invoke"]
        assert any(e.process.startswith("zombie") for e in late), "no zombie woke up to write"
        assert any(e.f == "complete" for e in late), "no zombie completed late"
        for event in late:  # the writes after the stall, and the complete
            assert (event.status, event.reason) in {
                (409, "stale-generation"),
                (409, "lease-expired"),
            }, event
        # Nothing a lapsed worker sent after its stall reached the upstream: the upstream's
        # writes of a lapsed (job, generation) are exactly its forwards from before it.
        lapsed = {(e.job, e.generation) for e in late}
        before = [
            e
            for e in history
            if e.acknowledged
            and not e.replayed
            and (e.job, e.generation) in lapsed
            and not e.process.endswith("/late")
        ]
        received = [e for e in events if (e["job"], e["generation"]) in lapsed]
        assert len(received) == len(before), (received, before)

        await wait_no_live_in_flight(run.engine)
        problems = await check_run(
            run.engine,
            replicas[1],
            upstream,
            history=history,
            jobs=await run.job_rows(),
            keys_of=run.keys,
        )
        assert not problems, "\n".join(problems)
        print(summary(events, history))
    finally:
        await run.close()
