"""(b) Upstreams that hang, reset connections or answer slowly, under a run of workers on
two replicas: one upstream holds unknown outcomes (``hold``), one deduplicates by key and
is retried (``retry``).

Proves: with faults on, every key ends completed or unknown (held), none is applied twice,
no record is left in flight, every unknown one is listed by ``/admin/unknown-outcomes``,
and every 2xx a worker saw is the upstream's own answer. Then an operator resolves the
unknown outcomes from the upstream's records, the faults stop, a last worker finishes
every job, and each completed job has each of its steps applied exactly once.
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import LONG
from .harness import (
    DEDUPE,
    ORDERING_WAIT,
    PAY,
    ProcessGroup,
    Run,
    Scale,
    check_run,
    resolve_unknowns,
    start_stack,
    summary,
    wait_no_live_in_flight,
)

pytestmark = pytest.mark.postgres

SCALE = (
    Scale(jobs=400, workers=16, run_timeout=300)
    if LONG
    else Scale(jobs=16, workers=6, run_timeout=30)
)
# verify.upstream's fault mix: a pause of up to 50 ms before every answer; 4 % hang, 8 %
# cut the connection (half of them before applying), 10 % dribble the answer out.
FAULTS: dict[str, Any] = {
    "delay": [0, 0.05],
    "hang": 0.04,
    "cut": 0.08,
    "dribble": 0.1,
    "apply_before_cut": 0.5,
}


@pytest.mark.timeout(400 if LONG else 90)
async def test_hanging_resetting_and_slow_upstreams(group: ProcessGroup, fault_db: str) -> None:
    upstream, replicas = await start_stack(group, fault_db, [PAY, DEDUPE], seed=7, **FAULTS)
    run = Run(group, replicas, fault_db, SCALE, upstreams=("pay", "dedupe"))
    try:
        await run.enqueue()
        run.start_workers()
        await run.until_settled()
        await run.stop_workers()

        # Every forward has settled or passed its deadline: nothing is left in flight.
        await wait_no_live_in_flight(run.engine, timeout=PAY.deadline(ORDERING_WAIT) + 10)
        events = upstream.events()
        print(summary(events, run.history()))
        faults = {e["fault"] for e in events}
        # The faults did happen (seed 7 draws a dribble, a cut and a hang within the first
        # 26 requests; a run makes at least 64).
        assert {"hang", "cut", "dribble"} <= faults, faults
        problems = await check_run(
            run.engine,
            replicas[0],
            upstream,
            history=run.history(),
            jobs=await run.job_rows(),
            keys_of=run.keys,
        )
        assert not problems, "\n".join(problems)
        held = [e for e in run.history() if e.reason == "outcome-unknown"]
        assert {run.upstream_of(e.job) for e in held} <= {"pay"}, held
        # ^ only the ``hold`` upstream holds keys; ``retry`` (a share of the jobs, verify's
        # ``upstream_of``) forwards again.
        assert {run.upstream_of(job) for job in run.jobs} == {"pay", "dedupe"}

        # The operator settles the unknown outcomes from the upstream's records; the faults
        # stop; one worker finishes every job.
        resolved = await resolve_unknowns(replicas[1], events)
        await upstream.set_knobs(delay=0, hang=0, cut=0, dribble=0)
        await run.finish(replicas[0])
        events = upstream.events()
        problems = await check_run(
            run.engine,
            replicas[1],
            upstream,
            history=run.history(),
            jobs=await run.job_rows(),
            keys_of=run.keys,
        )
        assert not problems, "\n".join(problems)
        jobs = await run.job_rows()
        assert {row["state"] for row in jobs.values()} == {"completed"}
        print(f"resolved by the operator: {len(resolved)}; " + summary(events, run.history()))
    finally:
        await run.close()
