"""The one deadline policy: how long a claim on a key lasts, until when its write may
still be sent, how long a duplicate waits for its first attempt, and the resolver's
window. Every margin the gateway keeps against another replica's clock is here. No I/O
and no clock: the clocks' readings are passed in (``time.monotonic()`` by the caller,
the database's ``now`` as a statement read it).

A claim's deadline is the database's: past it, other replicas treat the record as
unknown (the SQL's ``past_deadline``, read as a record's ``overdue``) and may move on.
So the replica that holds a claim stops short of it, by ``MARGIN``, by its own clock and
by the database's, whichever ends first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

MARGIN: Final = 5.0
"""Seconds a claim's holder stops short of its deadline: the slack for a clock that runs
slower than the database's and for the send itself."""

FRESH_ADMISSION: Final = 0.25
"""An admission answered within this many seconds of being asked is itself the judgement
right before the send (the fence is the write's own generation, the claim just made): no
read follows it. A slower one (a stalled process, a commit held back) is judged again by
a read of the database, as a write that waited for older ones is, and so is every write
while an upstream resolves unknown outcomes: the resolver may claim an older write of
the job after the admission's snapshot."""

RESOLVE_MARGIN: Final = 1.0
"""The resolver's slack, in seconds: taken off the dedup window a re-send must fall in,
and added twice to a claimed record's deadline."""

POLL_FIRST: Final = 0.02
POLL_MAX: Final = 0.25
"""A wait looks at the database again after ``POLL_FIRST`` seconds, twice as long each
time up to ``POLL_MAX``, and sooner when this replica settles what it waits for: a
waiting duplicate at its key's record (its own looks), and the writes of a job waiting
for older generations' writes at the job's writes in flight (one look for all of them,
``gateway.proxy.duplicates.Order``; back to ``POLL_FIRST`` after a settle here)."""

BEHIND_WAIT_SECONDS: Final = 1
"""How long a duplicate waits for a settle of its key that this replica is writing behind
an answer already given: a settle takes milliseconds; past this, the database is in
trouble and the duplicate is told ``request-in-progress``."""


@dataclass(frozen=True, slots=True)
class Timing:
    """The settings a write's deadlines are made of (an upstream's and the gateway's)."""

    ordering_wait: float  # gateway.ordering_wait_seconds
    timeout: float  # the upstream's timeout_seconds
    connect_timeout: float  # the upstream's connect_timeout_seconds

    @property
    def claim_seconds(self) -> float:
        """Seconds a claim lasts from its admission: the wait for older writes, the
        exchange, and the margin."""
        return self.ordering_wait + self.timeout + self.connect_timeout + MARGIN

    def send_by_monotonic(self, asked: float) -> float:
        """The monotonic time after which a write claimed by an admission asked at
        ``asked`` stays unsent: its deadline less the margin, by this process's clock."""
        return asked + self.claim_seconds - MARGIN


def send_left(
    send_by_monotonic: float, now_monotonic: float, deadline: float | None, db_now: float
) -> float:
    """Seconds a claimed write may still be sent, right before its first byte: the lesser
    of this process's clock (``send_by_monotonic``) and the database's (its claim's ``deadline``
    less the margin; None: the claim is no longer ours)."""
    on_database = -1.0 if deadline is None else deadline - db_now
    return min(send_by_monotonic - now_monotonic, on_database - MARGIN)


def resolve_window(dedup_window: float, timeout: float) -> float:
    """How old an unknown outcome may be for a re-send to fall inside the upstream's
    deduplication window: the window less the exchange and the margin."""
    return dedup_window - timeout - RESOLVE_MARGIN


def resolve_claim_seconds(timeout: float, connect_timeout: float) -> float:
    """Seconds the resolver's claim on a record lasts: the exchange and twice the margin."""
    return timeout + connect_timeout + 2 * RESOLVE_MARGIN


def resolve_send_left(deadline: float | None, db_now: float) -> float:
    """Seconds the resolver's claim still allows a re-send, right before it, by the
    database's clock: its deadline less the margin (below zero: the claim is gone)."""
    return (-1.0 if deadline is None else deadline - db_now) - RESOLVE_MARGIN


@dataclass(slots=True)
class DuplicateWait:
    """A request's ``Prefer: wait``, capped by ``gateway.max_prefer_wait_seconds``; or
    the wait the gateway grants a duplicate whose answer this replica is settling
    (``asked`` False: no ``Preference-Applied``)."""

    seconds: int  # the wait granted (above zero)
    until_monotonic: float | None = None  # when it ends, once it has begun
    waited: bool = False  # it did wait (``Preference-Applied`` says so)
    poll: float = POLL_FIRST  # the next look at the record, after this long
    asked: bool = True  # by the client's ``Prefer: wait``

    @property
    def applied(self) -> str:
        return f"wait={self.seconds}"

    def begin(self, now_monotonic: float) -> None:
        """The admission found the key in flight: the wait runs from its first time."""
        if self.until_monotonic is None:
            self.until_monotonic = now_monotonic + self.seconds

    def left(self, now_monotonic: float) -> float:
        """Seconds of the wait left at ``now_monotonic`` (none before it has begun)."""
        if self.until_monotonic is None:
            return 0.0
        return self.until_monotonic - now_monotonic

    def next_poll(self) -> None:
        self.poll = min(self.poll * 2, POLL_MAX)
