"""A request's bounded waits, holding no slot and no database connection between looks:
for its key's first attempt to settle (``Prefer: wait``), and for older generations'
writes to its job (the ordering barrier; its waiters share their looks: ``Order``)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from gateway.fencing.deadlines import DuplicateWait
from gateway.fencing.fence import Record, RecordState
from gateway.proxy.duplicates import Settles
from gateway.records.store import GatewayStore


def gone(request: web.Request) -> bool:
    """The client has gone away (its connection is closed)."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def until_settled(
    store: GatewayStore,
    settles: Settles,
    request: web.Request,
    job_id: str,
    key: str,
    wait: DuplicateWait,
    stop: asyncio.Event | None = None,
) -> tuple[bool, Record | None]:
    """Until the key's record is no longer in flight (settled, released, or past its
    deadline), this replica's settle of the key wakes us, or the wait ends (False), the
    client goes away or the gateway shuts down (``stop``). With the record last read
    (None: the key is free)."""
    with settles.watch(job_id, key) as watch:
        while True:
            settled = watch.current()
            left = wait.left(time.monotonic())
            if left <= 0 or gone(request) or (stop is not None and stop.is_set()):
                return False, None
            await _first((settled,) if stop is None else (settled, stop), min(wait.poll, left))
            if stop is not None and stop.is_set():
                return False, None
            wait.next_poll()
            record = await store.record(job_id, key)
            if record is None or record.state is not RecordState.IN_FLIGHT or record.overdue:
                return True, record  # overdue: its replica is gone (the record says what now)


async def until_older_settled(
    store: GatewayStore,
    settles: Settles,
    job_id: str,
    generation: int,
    seconds: float,
    stop: asyncio.Event | None = None,
) -> bool:
    """Within ``seconds``: until no older generation's write to this job is in flight
    (True), or the wait ends (False): its time is up, or ``stop`` is set (at once, or
    once a look going on has answered).

    The job's waiters on this replica share their looks (``Order``): one read of the
    lowest generation in flight answers each of them (it may go once nothing below its
    own generation is), on one schedule that backs off, and at once when this replica
    settles or releases a write of the job. Only the database says whether the older
    writes settled (another replica's are found by a scheduled look); a wake only brings
    the look forward."""
    began = time.monotonic()
    until = began + seconds
    with settles.order(job_id) as order:
        woken = order.event  # taken before each look: a settle during it is not missed
        while True:
            now = time.monotonic()
            if now >= until or (stop is not None and stop.is_set()):
                return False
            due = order.due
            await _first((woken,) if stop is None else (woken, stop), min(due, until) - now)
            if stop is not None and stop.is_set():
                return False
            # Woken by a settle: a look after it (``Order.lowest`` sees to that); else
            # the look due now, one for every waiter. Never one from before this wait.
            since = began if woken.is_set() else max(began, min(due, time.monotonic()))
            woken = order.event
            lowest = await order.lowest(lambda: store.lowest_in_flight(job_id), since=since)
            if lowest is None or lowest >= generation:
                return True


async def _first(events: tuple[asyncio.Event, ...], seconds: float) -> None:
    """Until one of ``events`` is set, or ``seconds`` have passed."""
    if seconds <= 0 or any(event.is_set() for event in events):
        return
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
