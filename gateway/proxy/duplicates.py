"""Duplicates that wait: ``Prefer: wait=N`` (RFC 7240) on a fenced write whose key is
in flight.

``prefer_wait`` reads the preference (no I/O). ``Settles`` is how a waiting duplicate
learns early that its key's first attempt settled on this replica: the proxy ``notify``s
after each settle or release, and a waiter's ``watch`` wakes up. It is only a hint to
look again: the key's record in the database says whether the attempt settled (other
replicas settle too, and are found by polling), and the admission decides what the
duplicate gets.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.request import parse_http_list

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


# A waiting duplicate looks at its key's record again after this long, doubling up to
# POLL_MAX, unless this replica settles the key first.
POLL_FIRST = 0.02
POLL_MAX = 0.25


@dataclass(slots=True)
class DuplicateWait:
    """A request's ``Prefer: wait``, capped by ``gateway.max_prefer_wait_seconds``; or
    the wait the gateway grants a duplicate whose answer this replica is settling
    (``asked`` False: no ``Preference-Applied``)."""

    seconds: int  # the wait granted (above zero)
    until: float | None = None  # time.monotonic() at which it ends, once it has begun
    waited: bool = False  # it did wait (``Preference-Applied`` says so)
    poll: float = POLL_FIRST  # the next look at the record, after this long
    _db_now: float = 0.0  # the database's clock at the last admission ...
    _seen_at: float = 0.0  # ... and time.monotonic() then
    asked: bool = True  # by the client's ``Prefer: wait``

    @property
    def applied(self) -> str:
        return f"wait={self.seconds}"

    def begin(self, db_now: float) -> None:
        """The admission found the key in flight (by the database's clock ``db_now``)."""
        if self.until is None:
            self.until = time.monotonic() + self.seconds
        self._db_now, self._seen_at = db_now, time.monotonic()

    def database_now(self) -> float:
        """The database's clock as the last admission read it, moved on by this
        process's: only a hint that a record's deadline may have passed (the admission
        judges it by the database's own)."""
        return self._db_now + (time.monotonic() - self._seen_at)

    def left(self) -> float:
        return 0.0 if self.until is None else self.until - time.monotonic()


class Settles:
    """Per (job, key) being waited for on this replica: an event set when this replica
    settles or releases the key. Entries live only while somebody waits."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], tuple[asyncio.Event, int]] = {}

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

    def event(self, ident: tuple[str, str]) -> asyncio.Event:
        return self._events[ident][0]

    def notify(self, job_id: str, key: str) -> None:
        """The key's attempt on this replica settled or was released: wake its waiters
        (each takes a fresh event for its next wait)."""
        found = self._events.get((job_id, key))
        if found is not None:
            event, count = found
            self._events[(job_id, key)] = (asyncio.Event(), count)
            event.set()

    def __len__(self) -> int:
        return len(self._events)


@dataclass(slots=True)
class Watch:
    settles: Settles
    ident: tuple[str, str]

    def current(self) -> asyncio.Event:
        """The event the next notify sets: take it before reading the record, so a
        settle between the read and the wait is not missed."""
        return self.settles.event(self.ident)
