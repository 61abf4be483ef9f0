"""The lease rules as pure functions over frozen values.

No I/O, no asyncio, no SQLAlchemy: ``now`` is always a parameter (seconds since the
epoch, from whichever clock is authoritative). ``lease_core.store`` carries out the same
rules as single conditional SQL statements; the unit tests hold both to these functions.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from enum import StrEnum

from fencegate_client.reasons import Reason

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


@dataclass(frozen=True, slots=True)
class Lease:
    """One grant: the token's view of a job."""

    job_id: str
    generation: int
    owner: str
    expires_at: float


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


def is_expired(job: Job, now: float) -> bool:
    return (
        job.state is State.LEASED
        and job.lease_expires_at is not None
        and (job.lease_expires_at <= now)
    )


def is_claimable(job: Job, now: float) -> bool:
    """Pending and due, or leased with an expired lease and attempts left."""
    if job.attempts >= job.max_attempts:
        return False
    if job.state is State.PENDING:
        return job.claimable_at is None or job.claimable_at <= now
    return is_expired(job, now)


def can_acquire(job: Job, owner: str, now: float) -> bool:
    """A named acquire: the job is free, expired, or already held by this owner."""
    if job.state is State.PENDING:
        return True
    if job.state is State.LEASED:
        return is_expired(job, now) or job.owner == owner
    return False


def grant(job: Job, owner: str, ttl: float, now: float) -> tuple[Job, Lease]:
    """A new lease: the generation grows, the attempt is counted."""
    expires = now + ttl
    granted = replace(
        job,
        state=State.LEASED,
        generation=job.generation + 1,
        owner=owner,
        lease_expires_at=expires,
        claimable_at=expires,
        attempts=job.attempts + 1,
    )
    return granted, Lease(job.job_id, granted.generation, owner, expires)


def is_current(lease: Lease, job: Job, now: float) -> bool:
    """Only the current lease may renew, complete, fail or release."""
    return (
        job.job_id == lease.job_id
        and job.state is State.LEASED
        and job.generation == lease.generation
        and job.owner == lease.owner
        and not is_expired(job, now)
    )


def refusal_reason(lease_generation: int, job: Job | None, now: float) -> Reason:
    """Why a lease that is not current was refused (a ``LeaseLost`` reason)."""
    if job is None or job.generation > lease_generation:
        return Reason.STALE_GENERATION
    if job.state is not State.LEASED:
        return Reason.LEASE_ENDED
    if is_expired(job, now):
        return Reason.LEASE_EXPIRED
    return Reason.STALE_GENERATION


def renew(job: Job, ttl: float, now: float) -> Job:
    expires = now + ttl
    return replace(job, lease_expires_at=expires, claimable_at=expires)


def complete(job: Job) -> Job:
    return replace(job, state=State.COMPLETED, claimable_at=None, lease_expires_at=None)


def fail(job: Job, retry_in: float, now: float) -> Job:
    """Back to pending after ``retry_in`` seconds, or failed when out of attempts."""
    if job.attempts >= job.max_attempts:
        return replace(job, state=State.FAILED, claimable_at=None, lease_expires_at=None)
    return replace(job, state=State.PENDING, claimable_at=now + retry_in, lease_expires_at=None)


def release(job: Job, now: float) -> Job:
    """Give the job back at once; a release does not use up an attempt."""
    return replace(
        job,
        state=State.PENDING,
        claimable_at=now,
        lease_expires_at=None,
        attempts=max(job.attempts - 1, 0),
    )
