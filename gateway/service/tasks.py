"""Background loops started in one place, named and referenced (never a bare
``asyncio.create_task`` whose task could be garbage-collected mid-flight)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from lease_core import exceptions as lease_exc

log = logging.getLogger("fencegate.tasks")

# At shutdown, how long a step in progress may finish before it is cancelled (part of
# the worst-case stop that deploy/kubernetes's grace period must cover).
STOP_TIMEOUT_SECONDS = 10


def every(
    app: web.Application, name: str, interval: float, step: Callable[[], Awaitable[object]]
) -> None:
    """Run ``step`` every ``interval`` seconds (first after one interval) for the app's
    lifetime; the cleanup context holds the task's reference. Errors are logged and the
    loop goes on. At shutdown a step in progress may finish (bounded), so no transaction
    is cut off mid-way."""
    stop = asyncio.Event()

    async def loop() -> None:
        while True:
            try:
                await asyncio.wait_for(stop.wait(), interval)
                return
            except TimeoutError:
                pass
            try:
                await step()
            except lease_exc.StoreUnavailable as error:
                # Expected while the database is down, failing over, or turned away (the
                # schema's floor): one line a round, not a traceback.
                log.warning(
                    "background task %s: %s Retrying in %.0fs.", name, error.detail, interval
                )
            except Exception:
                log.exception("background task %s failed; retrying in %.0fs", name, interval)

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(loop(), name=f"fencegate:{name}")
        yield
        stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), STOP_TIMEOUT_SECONDS)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app.cleanup_ctx.append(ctx)
