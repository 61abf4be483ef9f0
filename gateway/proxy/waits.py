"""A request's bounded waits, holding no slot and no database connection between looks:
for its key's first attempt to settle (``Prefer: wait``), and for older generations'
writes to its job (the ordering barrier)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from gateway.fencing.deadlines import ORDERING_POLL, DuplicateWait
from gateway.fencing.fence import RecordState
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
) -> bool:
    """Until the key's record is no longer in flight (settled, released, or past its
    deadline), this replica's settle of the key wakes us, or the wait ends (False)."""
    with settles.watch(job_id, key) as watch:
        while True:
            settled = watch.current()
            left = wait.left()
            if left <= 0 or gone(request):
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(settled.wait(), min(wait.poll, left))
            wait.next_poll()
            record = await store.record(job_id, key)
            if record is None or record.state is not RecordState.IN_FLIGHT or record.overdue:
                return True  # overdue: its replica is gone; the admission says what it is now


async def until_older_settled(
    store: GatewayStore, job_id: str, generation: int, seconds: float
) -> bool:
    """Within ``seconds``: until no older generation's write to this job is in flight."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(ORDERING_POLL)
        if not await store.older_in_flight(job_id, generation):
            return True
    return False
