"""Background loops started in one place, named and referenced (never a bare
``asyncio.create_task`` whose task could be garbage-collected mid-flight)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

log = logging.getLogger("fencegate.tasks")

TASKS = web.AppKey("background_tasks", set[asyncio.Task[None]])


def every(
    app: web.Application, name: str, interval: float, step: Callable[[], Awaitable[object]]
) -> None:
    """Run ``step`` every ``interval`` seconds for the app's lifetime; errors are logged
    and the loop goes on."""

    async def loop() -> None:
        while True:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background task %s failed; retrying in %.0fs", name, interval)
            await asyncio.sleep(interval)

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(loop(), name=f"fencegate:{name}")
        app.setdefault(TASKS, set()).add(task)
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        app[TASKS].discard(task)

    app.cleanup_ctx.append(ctx)
