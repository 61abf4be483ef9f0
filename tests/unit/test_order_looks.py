"""``Order``: the writes of a job waiting for older generations' share their looks at the
database, on one schedule that backs off and starts again at a settle on this replica."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from gateway.fencing.deadlines import POLL_FIRST, POLL_MAX
from gateway.proxy.duplicates import Order, Settles


class Reads:
    """The look's read: counts its calls, answers ``lowest`` once let go."""

    def __init__(self, lowest: int | None) -> None:
        self.lowest = lowest
        self.calls = 0
        self.go = asyncio.Event()
        self.go.set()

    async def __call__(self) -> int | None:
        self.calls += 1
        answer = self.lowest  # as of when the read began
        await self.go.wait()
        return answer


async def test_concurrent_waiters_share_one_look() -> None:
    order, reads = Order(), Reads(1)
    reads.go.clear()
    looks = [asyncio.ensure_future(order.lowest(reads, since=0.0)) for _ in range(20)]
    await asyncio.sleep(0)
    reads.go.set()
    assert await asyncio.gather(*looks) == [1] * 20
    assert reads.calls == 1
    # Asked again for a look no older than that one: its answer, no read.
    assert await order.lowest(reads, since=0.0) == 1 and reads.calls == 1
    # A look due later than the last began: a new one.
    assert await order.lowest(reads, since=time.monotonic()) == 1 and reads.calls == 2


async def test_a_settle_during_a_look_takes_another_for_those_asked_after_it() -> None:
    order, reads = Order(), Reads(1)
    reads.go.clear()
    before = asyncio.ensure_future(order.lowest(reads))
    await asyncio.sleep(0)  # the look has begun, with generation 1 still in flight
    reads.lowest = None
    order.settled()  # ... which settles here now
    after = asyncio.ensure_future(order.lowest(reads))
    await asyncio.sleep(0)
    reads.go.set()
    assert await before == 1  # the look it joined
    assert await after is None  # a look that began after the settle
    assert reads.calls == 2


async def test_a_failed_look_leaves_the_next_to_a_waiter_that_joined_it() -> None:
    order = Order()
    go = asyncio.Event()

    async def failing() -> int | None:
        await go.wait()
        raise ConnectionError

    async def answering() -> int | None:
        return 5

    first = asyncio.ensure_future(order.lowest(failing))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(order.lowest(answering))
    await asyncio.sleep(0)
    go.set()
    with pytest.raises(ConnectionError):
        await first
    assert await second == 5


async def test_the_schedule_backs_off_and_starts_again_at_a_settle() -> None:
    order, reads = Order(), Reads(1)
    intervals = []
    for _ in range(6):
        began = time.monotonic()
        await order.lowest(reads, since=math.inf)  # a new look each time
        intervals.append(order.due - began)
    assert intervals == pytest.approx(
        [2 * POLL_FIRST, 4 * POLL_FIRST, 8 * POLL_FIRST, POLL_MAX, POLL_MAX, POLL_MAX], abs=0.01
    )
    order.settled()
    began = time.monotonic()
    await order.lowest(reads)
    assert order.due - began == pytest.approx(POLL_FIRST, abs=0.01)


async def test_a_settle_of_any_key_of_the_job_wakes_its_order() -> None:
    settles = Settles()
    with settles.order("job") as one, settles.order("job") as two, settles.watch("job", "k"):
        assert one is two
        event = one.event
        settles.notify("other-job", "k")
        assert not event.is_set()
        settles.notify("job", "k2")
        assert event.is_set() and one.settles == 1
        assert not one.event.is_set()  # a fresh event for the next wait
        assert len(settles) == 2  # the key and the job
    assert len(settles) == 0
    settles.notify("job", "k")  # nobody waits: nothing kept
    assert len(settles) == 0
