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
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.request import parse_http_list

from gateway.fencing.deadlines import DuplicateWait as DuplicateWait  # the wait's policy

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
