"""The lease service's states and the rules production uses in Python: ids, owners,
TTLs, and why a lease that is not current was refused.

Every grant, renewal and ending is one conditional SQL statement (``lease_core/sql/``);
the model those statements are held to (grant, renew, complete, fail, release, which
job is claimable, which lease is current) lives with the tests that hold them to it
(``tests/lease_model.py``), not here. No I/O: ``now`` is always a parameter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import StrEnum

ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@~+=-]{0,199}")
"""Job ids and queue names: 1 to 200 characters, URL-safe, no control characters."""

MAX_OWNER_LENGTH = 200


class State(StrEnum):
    PENDING = "pending"
    LEASED = "leased"
    COMPLETED = "completed"
    FAILED = "failed"


FINISHED = frozenset({State.COMPLETED, State.FAILED})


class RecordState(StrEnum):
    """The gateway's record of one (job, idempotency key): in_flight -> completed |
    unknown; unknown -> in_flight (retry policy) | completed (an operator: applied) |
    gone (an operator: not applied). In flight past its deadline counts as unknown."""

    IN_FLIGHT = "in_flight"
    COMPLETED = "completed"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Job:
    """The part of a job the rules look at."""

    job_id: str
    state: State
    generation: int
    owner: str | None = None
    lease_expires_at: float | None = None
    claimable_at: float | None = None
    attempts: int = 0
    max_attempts: int = 3


def is_valid_id(value: str) -> bool:
    return ID_PATTERN.fullmatch(value) is not None


def is_valid_owner(value: str) -> bool:
    return 0 < len(value) <= MAX_OWNER_LENGTH and value.isprintable()


def check_ttl(ttl: float, max_ttl: float) -> str | None:
    """Why ``ttl`` is refused, or None. TTLs are refused, never clamped."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl):
        return "must be a finite number"
    if ttl <= 0:
        return "must be above zero"
    if ttl > max_ttl:
        return f"must not exceed {max_ttl:g} (max_ttl_seconds)"
    return None
