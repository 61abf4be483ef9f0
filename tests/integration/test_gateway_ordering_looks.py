"""The writes waiting for an older generation's write to their job share their looks at
the database, on SQLite and PostgreSQL, with a real upstream that holds the older write:
the looks per second do not grow with the number of waiters, a settle on the waiters'
replica releases them all at once (one look), and a settle on another replica is found
by the waiters' replica's own looks.

The looks are counted by the operation's series of ``fencegate_db_seconds``, as
``/metrics`` exports it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from aiohttp import web
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.fencing.deadlines import POLL_FIRST, POLL_MAX
from gateway.proxy.duplicates import Settles
from gateway.proxy.waits import until_older_settled
from gateway.records.schema import writing
from gateway.records.store import GatewayStore
from gateway.service.admin import GATEWAY_STATE
from lease_core.store import LeaseStore
from tests.gateway_helpers import ok, until_admitted
from tests.support import FakeClock, Stack

LOOK = ("lowest_in_flight", "statement")  # operation, phase
WINDOW_SECONDS = 1.0  # the waiters are counted waiting this long


def looks(stack: Stack) -> int:
    """The ordering looks a replica has made so far: the count of its ``/metrics``
    series, read from the series itself (a collection of the whole registry in the
    upstream's handler would hold up the event loop the gateway runs on)."""
    metrics = stack.control.app[GATEWAY_STATE].store.backend.metrics
    return sum(metrics.db_seconds.labels(*LOOK).counts)


@dataclass
class Arrival:
    key: str
    at: float  # time.monotonic() when the upstream received it
    looks: int  # the waiters' replica's looks by then


class Held:
    """A real upstream: the write with the key ``old`` is held until ``release`` is set;
    every other write is answered at once. Each write's arrival is recorded with the
    looks the waiters' replica (``counted``) had made by then."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.old_arrived = asyncio.Event()
        self.arrivals: list[Arrival] = []
        self.counted: Stack | None = None
        self.url = ""

    async def handler(self, request: web.Request) -> web.Response:
        await request.read()
        key = request.headers.get("Idempotency-Key", "")
        count = looks(self.counted) if self.counted is not None else 0
        self.arrivals.append(Arrival(key, time.monotonic(), count))
        if key == "old":
            self.old_arrived.set()
            await self.release.wait()
        return web.json_response({"key": key}, status=201)

    def reset(self) -> None:
        self.release, self.old_arrived, self.arrivals = asyncio.Event(), asyncio.Event(), []


async def held_upstream(aiohttp_server: Callable[..., Any]) -> Held:
    held = Held()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", held.handler)
    server = await aiohttp_server(app)
    held.url = str(server.make_url("")).rstrip("/")
    return held


def config(held: Held) -> dict[str, Any]:
    return {
        "upstreams": [{"name": "pay", "url": held.url, "timeout_seconds": 20}],
        "gateway": {"ordering_wait_seconds": 20},
    }


@dataclass
class Scene:
    old: asyncio.Future[Any]  # the older write, held at the upstream
    waiters: list[asyncio.Future[Any]]  # the newer generation's writes waiting for it
    looked: int  # the looks while they all waited ``seconds``
    seconds: float


async def waiting_behind_one_older_write(
    older_on: Stack,
    waiters_on: Stack,
    held: Held,
    engine: AsyncEngine,
    clock: FakeClock,
    job_id: str,
    count: int,
) -> Scene:
    """Generation 1's write held at the upstream (through ``older_on``), then ``count``
    writes of generation 2 admitted and waiting for it (through ``waiters_on``), counted
    while they wait."""
    held.reset()
    held.counted = waiters_on
    first = await older_on.lease(job_id, owner="a", ttl=1)
    old = asyncio.ensure_future(older_on.write("/pay/w", first, key="old"))
    await asyncio.wait_for(held.old_arrived.wait(), 5)
    clock.advance(1.5)
    second = await waiters_on.lease(job_id, owner="b", ttl=600)
    waiters = [
        asyncio.ensure_future(waiters_on.write("/pay/w", second, key=f"w{i}")) for i in range(count)
    ]
    for i in range(count):
        await until_admitted(engine, job_id, f"w{i}")
    before, began = looks(waiters_on), time.monotonic()
    await asyncio.sleep(WINDOW_SECONDS)
    looked, seconds = looks(waiters_on) - before, time.monotonic() - began
    assert not any(w.done() for w in waiters)  # all still waiting
    assert [a.key for a in held.arrivals] == ["old"]
    return Scene(old, waiters, looked, seconds)


async def right_after_a_look(stack: Stack) -> tuple[int, float]:
    """Until the replica has just made a look (due on its schedule): its next is due
    ``POLL_MAX`` later, once the schedule has backed off. The looks so far, and when they
    were last seen fewer (time.monotonic()): the look came after that, so the next
    scheduled one comes ``POLL_MAX`` after it at the soonest, however busy the machine."""
    before = looks(stack)
    deadline = time.monotonic() + 2 * POLL_MAX + 1
    while True:
        seen_fewer = time.monotonic()
        await asyncio.sleep(0.001)
        if looks(stack) != before:
            return looks(stack), seen_fewer
        assert time.monotonic() < deadline, "no look"


async def next_look(stack: Stack, after: int) -> float:
    """When the replica's looks pass ``after`` (time.monotonic())."""
    while looks(stack) <= after:
        await asyncio.sleep(0.001)
    return time.monotonic()


async def answered(scene: Scene) -> None:
    await ok(await scene.old)
    for waiter in scene.waiters:
        await ok(await waiter)


# The most looks a job's waiters may make in ``seconds``, however many they are: the
# schedule's first looks (POLL_FIRST, doubling), then one every POLL_MAX, and one more.
def bound(seconds: float) -> float:
    ramp, poll = 0, POLL_FIRST
    while poll < POLL_MAX:
        ramp, poll = ramp + 1, 2 * poll
    return ramp + seconds / POLL_MAX + 2


async def test_the_looks_do_not_grow_with_the_waiters_and_a_settle_here_releases_them(
    make_stack: Any, aiohttp_server: Callable[..., Any], clock: FakeClock, engine: AsyncEngine
) -> None:
    held = await held_upstream(aiohttp_server)
    stack = await make_stack(**config(held))
    scenes = {}
    for count in (2, 20):
        scene = await waiting_behind_one_older_write(
            stack, stack, held, engine, clock, f"job-{count}", count
        )
        scenes[count] = scene
        # Released right after a scheduled look: the next is POLL_MAX away, so only the
        # settle here can bring a look sooner.
        at_release, before_it = await right_after_a_look(stack)
        held.release.set()
        looked = asyncio.ensure_future(next_look(stack, at_release))
        await answered(scene)
        old, *forwarded = held.arrivals
        assert old.key == "old" and sorted(a.key for a in forwarded) == sorted(
            f"w{i}" for i in range(count)
        )
        # Every waiter went out after one look, the first after the older write
        # settled here (the sends after it are the machine's: a read of the claim, the
        # forward) ...
        assert max(a.looks for a in forwarded) == at_release + 1, (at_release, forwarded)
        # ... and that look came on the settle, not on the schedule (POLL_MAX after the
        # last look at the soonest).
        assert await looked < before_it + POLL_MAX
    rates = {count: scene.looked / scene.seconds for count, scene in scenes.items()}
    for scene in scenes.values():
        assert scene.looked <= bound(scene.seconds), rates
    # Ten times the waiters: about the same looks (a poll per waiter made 100 and 1,000).
    assert scenes[20].looked <= 2 * scenes[2].looked + 2, rates


async def test_a_settle_on_another_replica_is_found_by_the_waiters_replica(
    make_stack: Any, aiohttp_server: Callable[..., Any], clock: FakeClock, engine: AsyncEngine
) -> None:
    """The older write on replica A, twenty waiters on replica B (its own gateway, its
    own wakes; one database): A's settle wakes none of B's, B's next scheduled look,
    one for all of them, finds it."""
    held = await held_upstream(aiohttp_server)
    a = await make_stack(**config(held))
    b = await make_stack(**config(held))
    scene = await waiting_behind_one_older_write(a, b, held, engine, clock, "job-1", 20)
    assert scene.looked <= bound(scene.seconds)
    at_release, _ = await right_after_a_look(b)
    a_looks = looks(a)
    held.release.set()
    await answered(scene)
    old, *forwarded = held.arrivals
    assert old.key == "old" and len(forwarded) == 20
    # Found by one of B's looks, its next scheduled one or the one after.
    assert max(a.looks for a in forwarded) <= at_release + 2, (at_release, forwarded)
    assert looks(a) == a_looks  # A has no waiter: it looked for none


async def test_a_wait_ends_at_once_when_stopped_and_goes_on_a_settle_here(
    store: LeaseStore, engine: AsyncEngine, clock: FakeClock
) -> None:
    """Two writes of generation 2 wait for generation 1's, in flight: the one whose
    ``stop`` is set (a draining gateway) ends at once, False, without another look; the
    other goes on once the older write is out of flight and this replica says it
    settled."""
    records = GatewayStore(store)
    series = store.metrics.db_seconds.labels(*LOOK)
    async with engine.begin() as conn:
        await conn.execute(
            sa.insert(writing).values(
                job_id="job-1", key="old", generation=1, attempt="a", deadline=clock.now + 600
            )
        )
    settles, stop = Settles(), asyncio.Event()
    stopped = asyncio.ensure_future(until_older_settled(records, settles, "job-1", 2, 30, stop))
    going = asyncio.ensure_future(until_older_settled(records, settles, "job-1", 2, 30))
    await asyncio.sleep(4 * POLL_MAX)  # looking, backed off
    assert not stopped.done() and not going.done()
    stop.set()
    before = sum(series.counts)
    assert await asyncio.wait_for(stopped, POLL_MAX / 2.5) is False
    assert sum(series.counts) <= before + 1  # a look already going on, at most
    assert not going.done()
    async with engine.begin() as conn:
        await conn.execute(sa.delete(writing).where(writing.c.key == "old"))
    settles.notify("job-1", "old")
    assert await asyncio.wait_for(going, POLL_MAX / 2.5) is True
    assert len(settles) == 0
    # Stopped before it began: no look at all.
    stop_now = asyncio.Event()
    stop_now.set()
    before = sum(series.counts)
    assert await until_older_settled(records, settles, "job-1", 2, 30, stop_now) is False
    assert sum(series.counts) == before
