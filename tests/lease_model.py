"""The lease rules as pure functions over frozen values: the model that the SQL
statements of ``lease_core/sql/`` are held to (tests/unit/test_rules.py,
tests/integration/test_lease_api.py, test_sql_verdicts.py). Production decides each of
these in one conditional statement and has no use for them; the states, ``Job``,
``is_expired`` and ``refusal_reason`` are production's own (``lease_core.rules``),
re-exported so a test reads one module."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fencegate_client.reasons import Reason
from lease_core.rules import (
    FINISHED,
    ID_PATTERN,
    MAX_OWNER_LENGTH,
    Job,
    RecordState,
    State,
    check_ttl,
    is_valid_id,
    is_valid_owner,
)

__all__ = [
    "FINISHED",
    "ID_PATTERN",
    "MAX_OWNER_LENGTH",
    "Job",
    "Lease",
    "RecordState",
    "State",
    "can_acquire",
    "check_ttl",
    "complete",
    "fail",
    "grant",
    "is_claimable",
    "is_current",
    "is_expired",
    "is_valid_id",
    "is_valid_owner",
    "refusal_reason",
    "release",
    "renew",
]


@dataclass(frozen=True, slots=True)
class Lease:
    """One grant: the token's view of a job."""

    job_id: str
    generation: int
    owner: str
    expires_at: float


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


def is_expired(job: Job, now: float) -> bool:
    return (
        job.state is State.LEASED
        and job.lease_expires_at is not None
        and (job.lease_expires_at <= now)
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
