"""Where a fenced write's time goes (issue 47): each phase of a write through a real
gateway on a real database is one observation of ``fencegate_write_phase_seconds`` and
its database work of ``fencegate_db_seconds``; with ``gateway.server_timing`` the answer
says the same in a ``Server-Timing`` header, and a replay of it does not."""

from __future__ import annotations

import re
from typing import Any

from tests.support import Upstream, upstream_config

PHASE = 'fencegate_write_phase_seconds_count{{phase="{}"}}'
DB = 'fencegate_db_seconds_count{{operation="{}",phase="{}"}}'


async def _counts(stack: Any) -> dict[str, float]:
    text = await (await stack.control.get("/metrics")).text()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("fencegate_write_phase_seconds_count", "fencegate_db_seconds_count"))
    }


def _moved(before: dict[str, float], after: dict[str, float], series: str) -> float:
    return after.get(series, 0.0) - before.get(series, 0.0)


async def test_a_fenced_write_moves_each_of_its_phases_once(
    make_stack: Any, upstream: Upstream, backend: str
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-phases")
    assert (await stack.write("/pay/charges", lease, key="warm")).status == 201
    await stack.written()
    before = await _counts(stack)
    assert (await stack.write("/pay/charges", lease, key="p-1")).status == 201
    await stack.written()
    after = await _counts(stack)

    for phase in ("take-slot", "read-body", "admit", "forward", "settle"):
        assert _moved(before, after, PHASE.format(phase)) == 1, phase
    for phase in ("wait-older", "wait-first", "release", "audit"):
        assert _moved(before, after, PHASE.format(phase)) == 0, phase
    for operation in ("admit", "settle"):
        assert _moved(before, after, DB.format(operation, "statement")) == 1, operation
        # PostgreSQL: a connection of the pool waited for; SQLite has no pool.
        pooled = 1 if backend == "postgres" else 0
        assert _moved(before, after, DB.format(operation, "pool")) == pooled, operation
    if backend == "sqlite":  # the admission's and the settle's group transactions
        assert _moved(before, after, DB.format("group", "commit")) >= 1


async def test_an_audited_answer_is_timed(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-audit")
    before = await _counts(stack)
    assert (await stack.write("/pay/charges", lease, key="ok")).status == 201
    assert (await stack.write("/pay/charges", lease, key="ok")).status == 201  # a replay
    await stack.written()
    after = await _counts(stack)
    assert _moved(before, after, PHASE.format("audit")) == 1  # the replay's entry


TIMING = re.compile(r"([a-z-]+);dur=([0-9.]+)")


async def test_server_timing_names_the_steps_of_a_forwarded_write(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)], gateway={"server_timing": True})
    lease = await stack.lease("job-timing")
    resp = await stack.write("/pay/charges", lease, key="t-1")
    assert resp.status == 201
    steps = dict(TIMING.findall(resp.headers["Server-Timing"]))
    assert {"read-body", "admit", "upstream", "gateway"} <= set(steps)
    parts = sum(float(v) for k, v in steps.items() if k != "gateway")
    assert 0 < parts <= float(steps["gateway"])
    await stack.written()
    replay = await stack.write("/pay/charges", lease, key="t-1")
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert "Server-Timing" not in replay.headers  # not the stored answer's


async def test_no_server_timing_by_default(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-quiet")
    resp = await stack.write("/pay/charges", lease, key="q-1")
    assert resp.status == 201 and "Server-Timing" not in resp.headers


async def test_the_upkeep_vacuum_is_timed_beside_the_writes(
    make_stack: Any, upstream: Upstream, backend: str
) -> None:
    from gateway.service.admin import GATEWAY_STATE

    stack = await make_stack(upstreams=[upstream_config(upstream)])
    before = await _counts(stack)
    await stack.control.app[GATEWAY_STATE].store.vacuum_writing()
    after = await _counts(stack)
    vacuumed = 1 if backend == "postgres" else 0  # SQLite reuses the space itself
    assert _moved(before, after, DB.format("vacuum", "statement")) == vacuumed
