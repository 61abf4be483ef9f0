"""The verification feeder counts a pending job as waiting only while it is young and
unclaimed: on SQLite, jobs enqueued under a clock minutes ahead stay pending, unclaimable,
for minutes, and must not hold new jobs back (the queue stalled when they did)."""

from __future__ import annotations

import time

from verify.roles import Feeder


def test_only_young_unclaimed_pending_jobs_count_as_waiting() -> None:
    claimed: set[str] = set()
    feeder = Feeder(control=None, target=4, claimed=claimed)  # type: ignore[arg-type]
    now = time.monotonic()
    feeder.born = {"old": now - Feeder.FRESH - 1, "young": now, "taken": now}
    claimed.add("taken")
    assert feeder.waiting(["old", "young", "taken"]) == 1
    assert feeder.waiting(["young", "unknown-to-us"]) == 2
