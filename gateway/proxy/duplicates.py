"""Writes that wait on this replica: duplicates (``Prefer: wait=N``, RFC 7240, on a
fenced write whose key is in flight), and writes waiting for older generations' writes
to their job (the ordering barrier).

``prefer_wait`` reads the preference (no I/O). ``Settles`` is how a waiter learns early
that a write it waits for settled on this replica: the proxy ``notify``s after each
settle or release of a (job, key), which wakes the duplicates of that key (``watch``)
and the writes waiting in the job's order (``order``). It is only a hint to look again:
the database says whether the write settled (other replicas settle too, and are found
by polling), and the admission, or the machine, decides what the waiter gets.

The writes of one job waiting for older generations share their looks (``Order``): one
read of the lowest generation in flight answers every one of them, on one schedule, so
the reads do not grow with the number of waiters.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.request import parse_http_list

from gateway.fencing.deadlines import POLL_FIRST, POLL_MAX

# ``token [ BWS "=" BWS word ]`` of RFC 7240, where ``word`` is a token or a quoted string.
_PREFERENCE = re.compile(
    r'\s*([!#$%&\'*+\-.^_`|~0-9A-Za-z]+)\s*(?:=\s*("(?:[^"\\]|\\.)*"|[^\s;,]*))?\s*(?:;.*)?',
    re.DOTALL,
)
_SECONDS = re.compile(r"[0-9]{1,10}")


def prefer_wait(values: Iterable[str]) -> int | None:
    """The seconds of the ``wait`` preference among the ``Prefer`` header values (each
    a comma-separated list), or None when there is none or it is malformed (RFC 7240:
    a preference the server cannot read is ignored). The first ``wait`` counts; other
    preferences are ignored."""
    for value in values:
        # The header's list items, commas inside quoted strings kept (the stdlib's parser).
        for item in filter(None, parse_http_list(value)):
            match = _PREFERENCE.fullmatch(item)
            if match is None or match.group(1).lower() != "wait":
                continue
            seconds = (match.group(2) or "").strip('"')
            return int(seconds) if _SECONDS.fullmatch(seconds) else None
    return None


class Settles:
    """Per (job, key) being waited for on this replica: an event set when this replica
    settles or releases the key; per job whose writes wait for older generations', its
    ``Order``, woken when this replica settles or releases any key of the job. Entries
    live only while somebody waits."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], tuple[asyncio.Event, int]] = {}
        self._orders: dict[str, Order] = {}

    @contextmanager
    def watch(self, job_id: str, key: str) -> Iterator[Watch]:
        ident = (job_id, key)
        event, count = self._events.get(ident, (asyncio.Event(), 0))
        self._events[ident] = (event, count + 1)
        try:
            yield Watch(self, ident)
        finally:
            event, count = self._events[ident]
            if count <= 1:
                del self._events[ident]
            else:
                self._events[ident] = (event, count - 1)

    @contextmanager
    def order(self, job_id: str) -> Iterator[Order]:
        """The job's ``Order``, shared by its writes waiting here for older generations'."""
        order = self._orders.get(job_id)
        if order is None:
            order = self._orders[job_id] = Order()
        order.waiters += 1
        try:
            yield order
        finally:
            order.waiters -= 1
            if order.waiters <= 0:
                del self._orders[job_id]

    def event(self, ident: tuple[str, str]) -> asyncio.Event:
        return self._events[ident][0]

    def notify(self, job_id: str, key: str) -> None:
        """The key's attempt on this replica settled or was released: wake its waiters
        (each takes a fresh event for its next wait), and the writes of the job waiting
        for older generations' (their next look comes at once)."""
        found = self._events.get((job_id, key))
        if found is not None:
            event, count = found
            self._events[(job_id, key)] = (asyncio.Event(), count)
            event.set()
        order = self._orders.get(job_id)
        if order is not None:
            order.settled()

    def __len__(self) -> int:
        """How many keys and jobs are waited for here."""
        return len(self._events) + len(self._orders)


@dataclass(slots=True)
class Watch:
    settles: Settles
    ident: tuple[str, str]

    def current(self) -> asyncio.Event:
        """The event the next notify sets: take it before reading the record, so a
        settle between the read and the wait is not missed."""
        return self.settles.event(self.ident)


@dataclass(frozen=True, slots=True)
class Look:
    """One read of a job's lowest generation in flight: when it began (monotonic), after
    how many of this replica's settles of the job, and what it found (None: nothing in
    flight)."""

    began: float
    settles: int
    lowest: int | None


class Order:
    """The writes of one job waiting on this replica for older generations' writes.

    They share their looks at the database: one at a time, each answering every waiter
    (the job's lowest generation in flight), on one schedule: due ``POLL_FIRST`` after
    the first waiter came, then twice as long after each look up to ``POLL_MAX``; a
    settle or release of the job's writes here (``settled``) wakes every waiter, and the
    look that follows, one for all of them, starts the schedule again from
    ``POLL_FIRST``. However many wait, the job costs this replica one read per due time
    and per settle of its own. No I/O of its own: the read is the caller's."""

    def __init__(self) -> None:
        self.waiters = 0
        self.settles = 0  # this replica's settles and releases of the job's writes
        self.event = asyncio.Event()  # set at the next one (then replaced)
        self.due = time.monotonic() + POLL_FIRST  # when the next look is due
        self._poll = 2 * POLL_FIRST  # after that one, the next is due this much later
        self._last: Look | None = None
        self._looking: asyncio.Event | None = None  # set when the look going on ends

    def settled(self) -> None:
        """A write of the job settled, or was released, on this replica: wake the
        waiters; the schedule starts again."""
        self.settles += 1
        self._poll = POLL_FIRST
        event, self.event = self.event, asyncio.Event()
        event.set()

    async def lowest(
        self, read: Callable[[], Awaitable[int | None]], *, since: float = -math.inf
    ) -> int | None:
        """The job's lowest generation in flight, as found by a look that began at or
        after ``since`` (monotonic) and after every settle here so far: the last look's
        answer if it qualifies, else the one going on if that qualifies (waited for),
        else a new one (``read``), never two at once."""
        settles = self.settles
        while True:
            last = self._last
            if last is not None and last.began >= since and last.settles >= settles:
                return last.lowest
            looking = self._looking
            if looking is None:
                return await self._look(read)
            await looking.wait()  # then its answer, or (it failed or was not fresh) ours

    async def _look(self, read: Callable[[], Awaitable[int | None]]) -> int | None:
        began, settles = time.monotonic(), self.settles
        self.due = began + self._poll
        self._poll = min(2 * self._poll, POLL_MAX)
        looking = self._looking = asyncio.Event()
        try:
            lowest = await read()
            self._last = Look(began, settles, lowest)
            return lowest
        finally:
            self._looking = None
            looking.set()
