"""Concurrent calls coalesced into batches (``Coalescer``): how the PostgreSQL executor
(``lease_core.direct_postgres``) shares one statement among concurrent callers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Answer = TypeVar("Answer")


class Coalescer(Generic[Item, Answer]):
    """Concurrent calls coalesced into batches: while ``lanes`` batches are running,
    new calls queue and go in the next batch. A lone caller is sent at once, so
    batching adds no wait when there is no load. ``run_batch`` returns one answer
    per call (an exception instance answers that call with that exception).

    A lane that has answered a batch lets the event loop run once before it takes the
    next: the callers it just answered go on first (an HTTP handler writes its answer
    and its client can send again) instead of waiting behind the next batch's send. On
    PostgreSQL that made renewals and claims through the API faster
    (docs/performance-history.md, "Renewals on PostgreSQL, met")."""

    def __init__(
        self,
        run_batch: Callable[[list[Item]], Awaitable[list[Answer | BaseException]]],
        *,
        lanes: int,
        max_batch: int,
    ) -> None:
        self._run_batch = run_batch
        self._lanes = lanes
        self._max_batch = max_batch
        self._queued: list[tuple[Item, asyncio.Future[Answer]]] = []
        self._running = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, item: Item) -> asyncio.Future[Answer]:
        """Queue ``item``; the future its answer arrives on (cancelling it drops the
        answer, not the batch)."""
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._queued.append((item, future))
        if self._running < self._lanes:
            self._running += 1
            task = asyncio.ensure_future(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return future

    async def _drain(self) -> None:
        try:
            while self._queued:
                batch = self._queued[: self._max_batch]
                del self._queued[: self._max_batch]
                try:
                    answers = await self._run_batch([item for item, _ in batch])
                except BaseException as error:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    if not isinstance(error, Exception):
                        raise
                else:
                    for (_, future), answer in zip(batch, answers, strict=True):
                        if future.done():
                            continue
                        if isinstance(answer, BaseException):
                            future.set_exception(answer)
                        else:
                            future.set_result(answer)
                await asyncio.sleep(0)  # the answered callers run before the next send
        finally:
            self._running -= 1
