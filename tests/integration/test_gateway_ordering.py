"""Per job, writes reach upstreams in generation order, on SQLite and PostgreSQL: a write
of g+1 waits (bounded) for g's write in flight, times out with 503 ordering-timeout, and
once g+1 is admitted no write of g is forwarded.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.gateway_helpers import ok, problem, until_admitted, until_in_flight
from tests.support import FakeClock, Upstream, upstream_config


async def test_interleaved_generations_reach_the_upstream_in_order(
    make_stack: Any, upstream: Upstream, clock: FakeClock, engine: AsyncEngine
) -> None:
    """Two workers take turns on one job; each turn starts a write while the previous
    generation's is still in flight. The upstream must see generations never go down."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream, timeout_seconds=2)],
        gateway={"ordering_wait_seconds": 3},
    )
    upstream.delay = 0.1
    leases: list[dict[str, Any]] = []
    writes: list[asyncio.Future[Any]] = []
    stale: list[Any] = []
    for turn in range(6):
        if leases:
            clock.advance(1.5)
        lease = await stack.lease("job-1", owner="ab"[turn % 2], ttl=1)
        assert lease["generation"] == turn + 1
        if leases:  # the previous worker wakes up: refused, its generation is behind
            stale.append(await stack.write("/pay/w", leases[-1], key=f"late-{turn}"))
        leases.append(lease)
        writes.append(asyncio.ensure_future(stack.write("/pay/w", lease, key=f"w-{turn}")))
        await until_admitted(engine, "job-1", f"w-{turn}")
    assert len(upstream.received) < 6  # the later ones are still queued behind the first
    answers = await asyncio.gather(*writes)
    for resp in stale:
        await problem(resp, 409, "stale-generation")
    # A write still waiting when a newer generation is admitted may be refused (see
    # test_a_waiting_write_is_not_forwarded_once_a_newer_generation_is_admitted); the
    # first and the newest write go through, and nothing ever goes backwards. A waiting
    # write judged after the clock moved past its lease but before the next grant is
    # refused as lease-expired (nobody newer holds the job yet): which one it meets
    # depends on how fast the loaded machine runs the two coroutines.
    forwarded = []
    for turn, resp in enumerate(answers):
        if resp.status == 201:
            await ok(resp)
            forwarded.append(turn + 1)
        elif (await resp.json(content_type=None)).get("reason") == "lease-expired":
            await problem(resp, 409, "lease-expired")
        else:
            await problem(resp, 409, "stale-generation")
    generations = [int(r["generation"]) for r in upstream.received]
    assert generations == forwarded
    assert generations == sorted(set(generations))
    assert generations[0] == 1 and generations[-1] == 6
    assert upstream.max_in_flight == 1  # each generation waited for the one before


async def test_newer_generation_waits_for_the_older_write_in_flight(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream, timeout_seconds=2)],
        gateway={"ordering_wait_seconds": 2},
    )
    upstream.delay = 0.4
    old = await stack.lease("job-1", owner="a", ttl=1)
    started = time.monotonic()
    old_write = asyncio.ensure_future(stack.write("/pay/w", old, key="old"))
    await until_in_flight(upstream)
    clock.advance(1.5)
    new = await stack.lease("job-1", owner="b", ttl=10)
    new_resp = await stack.write("/pay/w", new, key="new")
    await ok(new_resp)
    finished = time.monotonic()
    await ok(await old_write)
    assert [(r["generation"], r["key"]) for r in upstream.received] == [("1", "old"), ("2", "new")]
    # The newer write started only after the older one settled: they never overlapped,
    # and together they took two upstream delays.
    assert upstream.max_in_flight == 1
    assert finished - started >= 2 * upstream.delay
    # Now that generation 2 has written, generation 1 is refused.
    doc = await problem(await stack.write("/pay/w", old, key="old-2"), 409, "stale-generation")
    assert (doc["generation"], doc["highest_generation"]) == (1, 2)
    assert len(upstream.received) == 2


async def test_ordering_timeout_is_bounded_and_frees_the_key(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream, timeout_seconds=2)],
        gateway={"ordering_wait_seconds": 0.1},
    )
    upstream.delay = 0.7
    old = await stack.lease("job-1", owner="a", ttl=1)
    old_write = asyncio.ensure_future(stack.write("/pay/w", old, key="old"))
    await until_in_flight(upstream)
    clock.advance(1.5)
    new = await stack.lease("job-1", owner="b", ttl=10)

    started = time.monotonic()
    resp = await stack.write("/pay/w", new, key="new", body={"amount": 2})
    waited = time.monotonic() - started
    doc = await problem(resp, 503, "ordering-timeout")
    assert int(resp.headers["Retry-After"]) >= 1
    assert doc["job_id"] == "job-1" and doc["generation"] == 2
    assert 0.1 <= waited < 0.6  # bounded by ordering_wait_seconds, not the upstream
    assert upstream.in_flight == 1  # the old write is still going

    await ok(await old_write)
    assert [r["key"] for r in upstream.received] == ["old"]  # "new" was not forwarded
    # The refused write's key is free: the retry goes through.
    upstream.delay = 0
    await ok(await stack.write("/pay/w", new, key="new", body={"amount": 2}))
    assert [(r["generation"], r["key"]) for r in upstream.received] == [("1", "old"), ("2", "new")]
    [entry] = await stack.audit(reason="ordering-timeout")
    assert (entry["status"], entry["generation"], entry["idempotency_key"]) == (503, 2, "new")


async def test_a_write_of_g_is_refused_once_g_plus_1_is_admitted(
    make_stack: Any, upstream: Upstream, clock: FakeClock, engine: AsyncEngine
) -> None:
    """While g+1 is admitted and waiting, g's worker is already refused: it can never
    slip a write in behind the newer generation."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream, timeout_seconds=6)],
        gateway={"ordering_wait_seconds": 6},
    )
    upstream.delay = 1.5  # long enough that a loaded CI machine still sees it in flight
    old = await stack.lease("job-1", owner="a", ttl=1)
    old_write = asyncio.ensure_future(stack.write("/pay/w", old, key="old-1"))
    await until_in_flight(upstream)
    clock.advance(1.5)
    new = await stack.lease("job-1", owner="b", ttl=10)
    new_write = asyncio.ensure_future(stack.write("/pay/w", new, key="new-1"))
    await until_admitted(engine, "job-1", "new-1")  # admitted, waiting for old-1
    assert [r["key"] for r in upstream.received] == [] and upstream.in_flight == 1
    doc = await problem(await stack.write("/pay/w", old, key="old-2"), 409, "stale-generation")
    assert doc["highest_generation"] == 2
    await ok(await old_write)
    await ok(await new_write)
    assert [r["key"] for r in upstream.received] == ["old-1", "new-1"]


async def test_same_generation_writes_do_not_wait_for_each_other(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream, timeout_seconds=2)],
        gateway={"ordering_wait_seconds": 0.1},
    )
    upstream.delay = 1.0  # all four must overlap at the upstream even on a loaded machine
    lease = await stack.lease("job-1")
    resps = await asyncio.gather(*(stack.write("/pay/w", lease, key=f"k{i}") for i in range(4)))
    for resp in resps:
        await ok(resp)
    assert upstream.max_in_flight == 4


async def test_other_jobs_do_not_wait(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream, timeout_seconds=5)],
        gateway={"ordering_wait_seconds": 0.1},
    )
    upstream.delay = 1.5
    slow = await stack.lease("job-1", owner="a", ttl=1)
    slow_write = asyncio.ensure_future(stack.write("/pay/w", slow, key="slow"))
    await until_in_flight(upstream)
    clock.advance(1.5)
    await stack.lease("job-1", owner="b", ttl=10)  # job-1 moves on...
    other = await stack.lease("job-2", owner="b", ttl=10)
    other = await stack.lease("job-2", owner="b", ttl=10)  # ...and job-2 is at generation 2
    assert other["generation"] == 2
    await ok(await stack.write("/pay/w", other, key="other"))  # no ordering-timeout
    await ok(await slow_write)
    assert upstream.max_in_flight == 2


async def test_keyless_writes_are_ordered_too(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream, timeout_seconds=5, require_idempotency_key=False)],
        gateway={"ordering_wait_seconds": 0.1},
    )
    upstream.delay = 2.0
    old = await stack.lease("job-1", owner="a", ttl=1)
    old_write = asyncio.ensure_future(stack.write("/pay/w", old, key=None))
    await until_in_flight(upstream)
    clock.advance(1.5)
    new = await stack.lease("job-1", owner="b", ttl=10)
    await problem(await stack.write("/pay/w", new, key=None), 503, "ordering-timeout")
    await ok(await old_write)
    upstream.delay = 0
    await ok(await stack.write("/pay/w", new, key=None))
    assert [r["generation"] for r in upstream.received] == ["1", "2"]


async def test_a_waiting_write_is_not_forwarded_once_a_newer_generation_is_admitted(
    make_stack: Any, upstream: Upstream, clock: FakeClock, engine: AsyncEngine
) -> None:
    """g-1 is in flight, g's write was admitted and waits for it; then g+1 is granted and
    its write admitted. From then on no write of g may be forwarded: when g-1 settles,
    g's waiting write must be refused, not sent after all."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream, timeout_seconds=8)],
        gateway={"ordering_wait_seconds": 8},
    )
    upstream.delay = 2.0  # long enough that a loaded CI machine still sees w1 in flight
    first = await stack.lease("job-1", owner="a", ttl=1)
    first_write = asyncio.ensure_future(stack.write("/pay/w", first, key="w1"))
    await until_in_flight(upstream)
    clock.advance(1.5)
    second = await stack.lease("job-1", owner="b", ttl=1)
    second_write = asyncio.ensure_future(stack.write("/pay/w", second, key="w2"))
    await until_admitted(engine, "job-1", "w2")
    clock.advance(1.5)
    third = await stack.lease("job-1", owner="c", ttl=10)
    third_write = asyncio.ensure_future(stack.write("/pay/w", third, key="w3"))
    await until_admitted(engine, "job-1", "w3")
    assert upstream.received == []  # w1 still in flight; w2 and w3 waiting

    await ok(await first_write)
    second_resp = await second_write
    await ok(await third_write)
    await problem(second_resp, 409, "stale-generation")
    assert [r["generation"] for r in upstream.received] == ["1", "3"]


@pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_a_retried_unknown_key_is_taken_over_with_the_lease_check(
    make_stack: Any, upstream: Upstream, engine: AsyncEngine
) -> None:
    """``unknown_outcome = "retry"``: generation 1 retries a key whose outcome is unknown
    while generation 2 takes the job. The take-over of the key is judged in the same
    statement as the lease and the fence, so either generation 1's retry goes out before
    generation 2 is granted (and generation 2's write waits for it), or it is refused.
    Here a lock on the key's record holds generation 1 inside its admission; on a gateway
    that took the key over in a second statement, generation 2 wrote in between and the
    upstream saw generations 1, 2, 1."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream, unknown_outcome="retry", timeout_seconds=5)],
        gateway={"ordering_wait_seconds": 5},
    )
    first = await stack.lease("job-1", owner="a")
    upstream.status = 502  # no answer that tells: the key's outcome is unknown
    await ok(await stack.write("/pay/c", first, key="k"), 502)
    upstream.status = 201
    async with engine.connect() as locker:
        await locker.execute(
            sa.text(
                "SELECT 1 FROM idempotency_records WHERE job_id = 'job-1' AND key = 'k' FOR UPDATE"
            )
        )
        retry = asyncio.ensure_future(stack.write("/pay/c", first, key="k"))
        await asyncio.sleep(0.3)  # generation 1 is now inside its admission
        second = asyncio.ensure_future(stack.lease("job-1", owner="a"))  # a restart
        written = asyncio.ensure_future(_write_when_granted(stack, second))
        await asyncio.sleep(0.5)
        await locker.rollback()
    retried, late = await asyncio.gather(retry, written)
    if retried.status == 201:
        await ok(retried)
    else:
        await problem(retried, 409, "stale-generation")
    await ok(late)
    generations = [int(r["generation"]) for r in upstream.received]
    assert generations == sorted(generations), generations
    assert generations[-1] == 2


async def _write_when_granted(stack: Any, granted: asyncio.Future[Any]) -> Any:
    lease = await granted
    return await stack.write("/pay/c", lease, key="k2")


@pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_a_write_the_database_failed_before_it_was_sent_frees_its_key(
    make_stack: Any, upstream: Upstream, clock: FakeClock, engine: AsyncEngine
) -> None:
    """Generation 2's write is admitted (its key claimed) and waits for generation 1's
    write in flight; then its connection to the database dies. It is answered 503
    store-unavailable, and since it was never sent, its claim is undone: the retry goes
    through. (It used to stay in flight until its deadline and then count as an unknown
    outcome, held for an operator, though it never reached the upstream.)"""
    stack = await make_stack(
        upstreams=[upstream_config(upstream, timeout_seconds=5)],
        gateway={"ordering_wait_seconds": 5},
    )
    upstream.delay = 1.0
    old = await stack.lease("job-1", owner="a", ttl=1)
    old_write = asyncio.ensure_future(stack.write("/pay/w", old, key="old"))
    await until_in_flight(upstream)
    clock.advance(1.5)
    new = await stack.lease("job-1", owner="b", ttl=30)
    new_write = asyncio.ensure_future(stack.write("/pay/w", new, key="new"))
    await until_admitted(engine, "job-1", "new")
    async with engine.connect() as locker:
        # The waiting write polls for older writes in flight (writes_in_flight): hold
        # it inside a poll, then cut that poll's connection, as a database restart would.
        await locker.execute(sa.text("LOCK TABLE writes_in_flight IN ACCESS EXCLUSIVE MODE"))
        deadline = time.monotonic() + 5
        while True:
            waiting = (
                (
                    await locker.execute(
                        sa.text(
                            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
                        )
                    )
                )
                .scalars()
                .all()
            )
            if waiting:
                break
            assert time.monotonic() < deadline, "the waiting write never polled"
            await asyncio.sleep(0.01)
        for pid in waiting:
            await locker.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        await locker.rollback()
    await problem(await new_write, 503, "store-unavailable")
    await ok(await old_write)
    assert [r["key"] for r in upstream.received] == ["old"]
    upstream.delay = 0
    await ok(await stack.write("/pay/w", new, key="new"))
    assert [(r["generation"], r["key"]) for r in upstream.received] == [("1", "old"), ("2", "new")]
