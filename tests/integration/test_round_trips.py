"""What a fenced write costs the database, counted by the gateway's own metric of
database transactions (``fencegate_store_transaction_seconds``: one observation per
catalogue operation and per read transaction), on SQLite and PostgreSQL.

A first write is two operations: the admission and the settle. The admission, answered
at once, is itself the judgement right before the send; an admission that took long, a
write that waited for older ones, and every write while an upstream's unknown outcomes
are resolved by the gateway, is read again (``FRESH_ADMISSION``). A
replay and a refused stale write are one operation on the answer's path, their audit
entry written behind the answer (and shared with concurrent ones on PostgreSQL).
"""

from __future__ import annotations

import re
from typing import Any

from gateway.fencing import machine as request_machine
from tests.gateway_helpers import ok, problem, replayed
from tests.support import Upstream, upstream_config

COUNT = re.compile(r"^fencegate_store_transaction_seconds_count (\S+)$", re.MULTILINE)


async def transactions(stack: Any) -> int:
    """The database transactions the replica made so far, its settles and audit entries
    written."""
    await stack.written()
    text = await (await stack.control.get("/metrics")).text()
    found = COUNT.search(text)
    assert found is not None, text
    return int(float(found.group(1)))


async def first_write_cost(stack: Any) -> int:
    """The transactions of one first write, after a warm-up write of the same lease."""
    lease = await stack.lease("job-1")
    await ok(await stack.write("/pay/charges", lease, key="warm-up"))
    before = await transactions(stack)
    await ok(await stack.write("/pay/charges", lease, key="charge-1"))
    return await transactions(stack) - before


async def test_reading_the_count_costs_nothing(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    first = await transactions(stack)
    assert await transactions(stack) == first


async def test_a_first_write_is_admitted_and_settled(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    assert await first_write_cost(stack) == 2  # admit, settle


async def test_a_slow_admission_is_read_again_before_the_send(
    make_stack: Any, upstream: Upstream, monkeypatch: Any
) -> None:
    """No admission is fresh enough: the read right before the send comes back."""
    monkeypatch.setattr(request_machine, "FRESH_ADMISSION", -1.0)
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    assert await first_write_cost(stack) == 3  # admit, the read, settle


async def test_with_a_resolver_every_write_is_read_again(
    make_stack: Any, upstream: Upstream
) -> None:
    """An upstream whose unknown outcomes the gateway re-sends: the resolver may claim an
    older write of the job after an admission's snapshot, so the read stays."""
    stack = await make_stack(
        upstreams=[
            upstream_config(upstream),
            upstream_config(upstream, name="mail", profile="stripe", unknown_outcome="resolve"),
        ]
    )
    assert await first_write_cost(stack) == 3  # admit, the read, settle


async def test_a_replay_and_a_stale_write_are_one_each_and_their_audit(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    first = await stack.lease("job-1")
    await ok(await stack.write("/pay/charges", first, key="charge-1"))
    before = await transactions(stack)
    await replayed(await stack.write("/pay/charges", first, key="charge-1"))
    assert await transactions(stack) - before == 2  # admit (the record read), its audit

    second = await stack.lease("job-1")  # the same owner again: generation 2
    assert second["generation"] == first["generation"] + 1
    await ok(await stack.write("/pay/charges", second, key="charge-2"))
    before = await transactions(stack)
    await problem(await stack.write("/pay/charges", first, key="charge-3"), 409, "stale-generation")
    assert await transactions(stack) - before == 2  # admit (refused by the fence), audit
    assert [r["generation"] for r in upstream.received] == ["1", "2"]
