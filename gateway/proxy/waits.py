"""A request's bounded waits, holding no slot and no database connection between looks:
for its key's first attempt to settle (``Prefer: wait``), and for older generations'
writes to its job (the ordering barrier)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from gateway.fencing.deadlines import ORDERING_POLL, DuplicateWait
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
            left = wait.left()
            if left <= 0 or gone(request) or (stop is not None and stop.is_set()):
                return False, None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_either(settled, stop), min(wait.poll, left))
            if stop is not None and stop.is_set():
                return False, None
            wait.next_poll()
            record = await store.record(job_id, key)
            if record is None or record.state is not RecordState.IN_FLIGHT or record.overdue:
                return True, record  # overdue: its replica is gone (the record says what now)


async def _either(first: asyncio.Event, second: asyncio.Event | None) -> None:
    """Until ``first`` (or ``second``, when given) is set."""
    if second is None:
        await first.wait()
        return
    waits = [asyncio.ensure_future(first.wait()), asyncio.ensure_future(second.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def until_older_settled(
    store: GatewayStore,
    job_id: str,
    generation: int,
    seconds: float,
    stop: asyncio.Event | None = None,
) -> bool:
    """Within ``seconds``: until no older generation's write to this job is in flight;
    False at once when ``stop`` is set (the gateway shuts down)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if stop is None:
            await asyncio.sleep(ORDERING_POLL)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), ORDERING_POLL)
            if stop.is_set():
                return False
        if not await store.older_in_flight(job_id, generation):
            return True
    return False
