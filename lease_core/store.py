"""The lease store: every grant and every ownership check is one operation of the
catalogue (``lease_core/sql``), a conditional statement.

An operation that matches zero rows means the caller lost; only then is the job read, to
tell the caller why (the SQL's own verdict, ``lease_refusal``). Nothing is decided from a read.
"""

from __future__ import annotations

import base64
import json
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from fencegate_client.reasons import Reason

from . import exceptions as exc
from . import rules, tokens
from .backend import PURGE_BATCH, Backend
from .db import Clock
from .metrics import Metrics
from .schema import jobs

# How often purge_grants looks at every grant past the retention, not only those that
# crossed it since its last step.
GRANT_SWEEP_SECONDS = 86_400.0


def rfc3339(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class JobRecord:
    job_id: str
    queue: str
    state: str
    generation: int
    owner: str | None
    lease_expires_at: float | None
    attempts: int
    max_attempts: int
    payload: Any
    result: Any
    error: str | None
    created_at: float

    @classmethod
    def from_row(cls, row: sa.RowMapping) -> JobRecord:
        return cls(**{name: row[name] for name in cls.__slots__})

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "queue": self.queue,
            "state": self.state,
            "generation": self.generation,
            "owner": self.owner,
            "lease_expires_at": rfc3339(self.lease_expires_at),
            "attempts": self.attempts,
            "max_attempts": self.max_attempts,
            "payload": self.payload,
            "result": self.result,
            "error": self.error,
            "created_at": rfc3339(self.created_at),
        }


def seconds(value: float) -> int | float:
    """A number of seconds as the lease document gives it, whatever the database
    returned (SQLite an int for a whole REAL, PostgreSQL a float): a whole number as an
    integer (``30``, as it is usually asked for), else the fraction (``1.5``)."""
    number = float(value)
    return int(number) if number.is_integer() else number


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    job_id: str
    generation: int
    owner: str
    expires_at: float
    ttl_seconds: float
    payload: Any
    lease_token: str | None = None

    @classmethod
    def from_row(cls, row: Row, token: str | None = None) -> LeaseRecord:
        """A grant's row as the lease statements return it (its payload as the driver
        gives a JSON column); ``token``: the new lease's token, only when granted."""
        return cls(
            job_id=row["job_id"],
            generation=row["generation"],
            owner=row["owner"],
            expires_at=row["lease_expires_at"],
            ttl_seconds=row["lease_ttl_seconds"],
            payload=_json(row["payload"]),
            lease_token=token,
        )

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "job_id": self.job_id,
            "generation": self.generation,
            "owner": self.owner,
            "expires_at": rfc3339(self.expires_at),
            "ttl_seconds": seconds(self.ttl_seconds),
            "payload": self.payload,
        }
        if self.lease_token is not None:
            doc["lease_token"] = self.lease_token
        return doc


@dataclass(frozen=True, slots=True)
class JobPage:
    items: list[JobRecord]
    next_cursor: str | None


_JOB_COLUMNS = [jobs.c[name] for name in JobRecord.__slots__]
Row = Mapping[str, Any]


class LeaseStore:
    """Jobs and leases on one database (SQLite or PostgreSQL), through its handle
    (``backend``, shared with the gateway's records): every change is an operation of
    the catalogue (``backend.run``); listings read in ``backend.transaction()``."""

    def __init__(
        self, engine: AsyncEngine, *, clock: Clock | None = None, metrics: Metrics | None = None
    ) -> None:
        self.backend = Backend(engine, clock=clock, metrics=metrics)
        self.metrics = self.backend.metrics
        # purge_grants: the cutoff of its last step; when it next looks at all grants.
        self._grants_cutoff: float | None = None
        self._grants_sweep_due = -math.inf

    # -- jobs ---------------------------------------------------------------------

    async def enqueue(
        self,
        *,
        queue: str,
        job_id: str | None = None,
        payload: Any = None,
        max_attempts: int = 3,
    ) -> JobRecord:
        job_id = job_id or uuid.uuid4().hex
        row = await self.backend.run(
            "enqueue",
            job_id=job_id,
            queue=queue,
            payload=json.dumps(payload),
            max_attempts=max_attempts,
        )
        if row is None:
            raise exc.JobExists(f"A job with id {job_id!r} exists already.", job_id=job_id)
        return _job(row)

    async def get_job(self, job_id: str) -> JobRecord:
        stmt = sa.select(*_JOB_COLUMNS).where(jobs.c.job_id == job_id)
        async with self.backend.transaction() as conn:
            row = (await conn.execute(stmt)).mappings().first()
        if row is None:
            raise exc.JobNotFound(f"No job with id {job_id!r}.", job_id=job_id)
        return JobRecord.from_row(row)

    async def list_jobs(
        self,
        *,
        queue: str | None = None,
        state: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> JobPage:
        """Jobs in creation order, ``limit`` at a time; pass ``next_cursor`` on."""
        stmt = sa.select(*_JOB_COLUMNS).order_by(jobs.c.created_at, jobs.c.job_id)
        if queue is not None:
            stmt = stmt.where(jobs.c.queue == queue)
        if state is not None:
            stmt = stmt.where(jobs.c.state == state)
        if cursor is not None:
            after_ts, after_id = decode_cursor(cursor)
            stmt = stmt.where(sa.tuple_(jobs.c.created_at, jobs.c.job_id) > (after_ts, after_id))
        async with self.backend.transaction() as conn:
            rows = (await conn.execute(stmt.limit(limit + 1))).mappings().all()
        items = [JobRecord.from_row(row) for row in rows[:limit]]
        next_cursor = None
        if len(rows) > limit:
            last = items[-1]
            next_cursor = encode_cursor(last.created_at, last.job_id)
        return JobPage(items, next_cursor)

    async def purge_job(self, job_id: str) -> None:
        """Delete a job that no current lease holds, remembering its generation, and the
        gateway's records of its writes with it: a job created again under the same id
        starts without answers to replay. Refused while one of its writes is in flight
        (admitted before its lease ended): that record must settle first."""
        row = await self.backend.run("purge_job", job_id=job_id)
        if row is None or row["found"] is None:
            raise exc.JobNotFound(f"No job with id {job_id!r}.", job_id=job_id)
        if row["purged_generation"] is not None:
            return
        if row["writing"]:
            raise exc.LeaseHeld(
                "A write of this job is still in flight through the gateway; purge the job "
                "once that write has settled.",
                job_id=job_id,
            )
        raise exc.LeaseHeld(
            "A current lease holds this job; purge it once that lease has ended.", job_id=job_id
        )

    # -- grants -------------------------------------------------------------------

    async def claim(self, *, queue: str, owner: str, ttl: float) -> LeaseRecord | None:
        """Lease the next claimable job of ``queue``: pending and due, or expired."""
        token, token_hash = tokens.new_token()
        row = await self.backend.run(
            "claim", queue=queue, owner=owner, ttl=float(ttl), token_hash=token_hash
        )
        if row is None:
            return None
        self.metrics.grants.labels("claim").inc()
        return LeaseRecord.from_row(row, token)

    async def acquire(
        self,
        *,
        job_id: str,
        owner: str,
        ttl: float,
        queue: str,
        payload: Any = None,
        max_attempts: int = 3,
    ) -> LeaseRecord:
        """Lease a named job, creating it if absent.

        Granted when the job is pending, its lease expired, or the same owner holds it
        (a restarted process under the same name fences its predecessor off).
        """
        token, token_hash = tokens.new_token()
        row = await self.backend.run(
            "acquire",
            job_id=job_id,
            queue=queue,
            payload=json.dumps(payload),
            max_attempts=max_attempts,
            owner=owner,
            ttl=float(ttl),
            token_hash=token_hash,
        )
        if row is not None and row["granted"]:
            self.metrics.grants.labels("acquire").inc()
            return LeaseRecord.from_row(row, token)
        state = row["found_state"] if row is not None else None
        if state in rules.FINISHED:
            raise exc.JobFinished(
                f"Job {job_id!r} is {state}; it cannot be leased again.", job_id=job_id
            )
        ends = rfc3339(row["found_expires_at"]) if row is not None else None
        raise exc.LeaseHeld(
            f"Another current lease holds this job until {ends} (lease_expires_at), unless "
            "it is renewed, released or ended sooner: acquire it again after that."
            if ends is not None
            else "Another current lease holds this job.",
            job_id=job_id,
            lease_expires_at=ends,
        )

    # -- the current lease's operations ---------------------------------------------

    async def renew(self, token: str, ttl: float | None = None) -> LeaseRecord:
        row = await self._on_current("renew", token, ttl=None if ttl is None else float(ttl))
        self.metrics.renewals.inc()
        return LeaseRecord.from_row(row)

    async def complete(self, token: str, result: Any = None) -> JobRecord:
        return _job(await self._on_current("complete", token, result=json.dumps(result)))

    async def fail(self, token: str, error: str | None = None, retry_in: float = 0) -> JobRecord:
        """Back to pending after ``retry_in`` seconds, or ``failed`` when out of attempts."""
        return _job(await self._on_current("fail", token, error=error, retry_in=float(retry_in)))

    async def release(self, token: str) -> JobRecord:
        """Give the job back at once, without using up an attempt."""
        return _job(await self._on_current("release", token))

    async def _on_current(self, operation: str, token: str, **params: Any) -> Row:
        """Run ``operation`` (conditional on the token's lease being current) or raise
        why not."""
        if not tokens.is_well_formed(token):
            raise exc.InvalidLeaseToken()
        token_hash = tokens.hash_token(token)
        row = await self.backend.run(operation, token_hash=token_hash, **params)
        if row is not None:
            return row
        found = await self.backend.run("lease_refusal", token_hash=token_hash)
        if found is None:
            raise exc.InvalidLeaseToken()
        reason = Reason(found["refusal"] or Reason.STALE_GENERATION)
        self.metrics.losses.labels(reason).inc()
        raise exc.LOST_BY_REASON[reason]()

    # -- maintenance --------------------------------------------------------------

    async def fail_exhausted(self) -> int:
        """Expired leases on their last attempt become ``failed`` (a worker that keeps
        crashing on a job must not get it forever). Returns how many."""
        return await self.backend.count("fail_exhausted")

    async def purge_grants(self, older_than_seconds: float, *, batch: int = PURGE_BATCH) -> int:
        """Forget grants older than the audit's retention (their tokens then answer
        'invalid' instead of 'stale'); the current grant of a job is always kept.

        A step looks only at the grants that crossed the retention since the previous
        step: the current grants kept then (one per job, for ever) are not read again at
        every step. Such a grant becomes one to forget only when its job is granted
        again; the first step, and one every ``GRANT_SWEEP_SECONDS``, look at all old
        grants and find those. On SQLite that sweep goes in slices of ``batch`` grants,
        each its own short transaction (``Backend.slice_end``, as
        ``Backend.run_in_batches`` does); on PostgreSQL, where a delete holds up no
        other writer, in one statement."""
        now = self.backend.injected_now()
        now = time.time() if now is None else now  # schedules the sweep, decides nothing
        older = float(older_than_seconds)
        since = self._grants_cutoff
        full = since is None or now >= self._grants_sweep_due
        lo = -math.inf if full or since is None else since
        total = 0
        while True:
            until = math.inf
            if full:
                until = await self.backend.slice_end("grant_slice_end", since=lo, batch=batch)
            row = await self.backend.run("purge_grants", older_than=older, since=lo, until=until)
            assert row is not None
            total += int(row["changed"])
            self._grants_cutoff = cutoff = float(row["cutoff"])
            if until >= cutoff:
                break
            lo = until
        if full:
            self._grants_sweep_due = now + GRANT_SWEEP_SECONDS
        return total


def _json(value: Any) -> Any:
    """A JSON column as the driver gives it, decoded: text, or on SQLite a number (the
    column's numeric affinity stores the text of a number as that number)."""
    return json.loads(value) if isinstance(value, str) else value


def _job(row: Row) -> JobRecord:
    values = {name: row[name] for name in JobRecord.__slots__}
    values["payload"] = _json(values["payload"])
    values["result"] = _json(values["result"])
    return JobRecord(**values)


def encode_cursor(created_at: float, job_id: str) -> str:
    raw = json.dumps([created_at, job_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, job_id = json.loads(raw)
        if not isinstance(created_at, int | float) or not isinstance(job_id, str):
            raise ValueError
        if not rules.is_valid_id(job_id):
            raise ValueError
        return float(created_at), job_id
    except (ValueError, TypeError) as error:
        raise exc.InvalidRequest(
            "cursor: not a cursor this server gave out.", field="cursor"
        ) from error


__all__: Sequence[str] = ["JobPage", "JobRecord", "LeaseRecord", "LeaseStore"]
