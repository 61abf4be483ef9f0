"""The lease store: every grant and every ownership check is one conditional statement.

A statement that matches zero rows means the caller lost; only then is the job read, to
tell the caller why (``rules.refusal_reason``). Nothing is decided from a read.
"""

from __future__ import annotations

import base64
import json
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from . import exceptions as exc
from . import rules, tokens
from .db import Clock, Dialect, direct_of
from .direct import Batched, Statement, is_unavailable
from .metrics import Metrics
from .rules import State
from .schema import job_tombstones, jobs, leases


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


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    job_id: str
    generation: int
    owner: str
    expires_at: float
    ttl_seconds: float
    payload: Any
    lease_token: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "job_id": self.job_id,
            "generation": self.generation,
            "owner": self.owner,
            "expires_at": rfc3339(self.expires_at),
            "ttl_seconds": self.ttl_seconds,
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
_LEASE_RETURNING = (
    jobs.c.job_id,
    jobs.c.generation,
    jobs.c.owner,
    jobs.c.lease_expires_at,
    jobs.c.lease_ttl_seconds,
    jobs.c.payload,
)

T = TypeVar("T")

# Errors that mean "the database is not there right now", translated in one place.
_UNAVAILABLE = (sa.exc.DBAPIError, OSError, TimeoutError)


class LeaseStore:
    """Jobs and leases on one database (SQLite or PostgreSQL)."""

    def __init__(
        self, engine: AsyncEngine, *, clock: Clock | None = None, metrics: Metrics | None = None
    ) -> None:
        self.engine = engine
        self.direct = direct_of(engine)
        self.dialect = Dialect(engine, clock)
        self.metrics = metrics or Metrics()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """One transaction; connection failures become ``StoreUnavailable``."""
        started = time.perf_counter()
        try:
            async with self.engine.begin() as conn:
                yield conn
        except _UNAVAILABLE as error:
            if isinstance(error, sa.exc.DBAPIError) and not _is_connection_error(error):
                raise
            self.metrics.store_errors.inc()
            raise exc.StoreUnavailable() from error
        finally:
            self.metrics.store_seconds.observe(time.perf_counter() - started)

    async def timed(self, call: Awaitable[T]) -> T:
        """A hot-path call sent straight to the driver (``direct``), measured and
        counted like ``transaction``."""
        started = time.perf_counter()
        try:
            return await call
        except exc.StoreUnavailable:
            self.metrics.store_errors.inc()
            raise
        finally:
            self.metrics.store_seconds.observe(time.perf_counter() - started)

    def _now_param(self) -> dict[str, float | None]:
        return {"now": self.dialect.injected_now()}

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
        now = self.dialect.now()
        stmt = (
            self.dialect.insert(jobs)
            .values(self._new_job_values(job_id, queue, payload, max_attempts, now))
            .on_conflict_do_nothing(index_elements=[jobs.c.job_id])
            .returning(*_JOB_COLUMNS)
        )
        async with self.transaction() as conn:
            row = (await conn.execute(stmt)).mappings().first()
        if row is None:
            raise exc.JobExists(f"a job with id {job_id!r} exists already", job_id=job_id)
        return JobRecord.from_row(row)

    @staticmethod
    def _new_job_values(
        job_id: str, queue: str, payload: Any, max_attempts: int, now: sa.ColumnElement[float]
    ) -> dict[str, Any]:
        # A job created again after a purge continues above its last generation.
        floor = (
            sa.select(job_tombstones.c.generation)
            .where(job_tombstones.c.job_id == job_id)
            .scalar_subquery()
        )
        return {
            "job_id": job_id,
            "queue": queue,
            "state": State.PENDING.value,
            "generation": sa.func.coalesce(floor, 0),
            "attempts": 0,
            "max_attempts": max_attempts,
            "payload": payload,
            "claimable_at": now,
            "created_at": now,
            "updated_at": now,
        }

    async def get_job(self, job_id: str) -> JobRecord:
        stmt = sa.select(*_JOB_COLUMNS).where(jobs.c.job_id == job_id)
        async with self.transaction() as conn:
            row = (await conn.execute(stmt)).mappings().first()
        if row is None:
            raise exc.JobNotFound(f"no job with id {job_id!r}", job_id=job_id)
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
        async with self.transaction() as conn:
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
        now = self.dialect.now()
        async with self.transaction() as conn:
            deleted = (
                await conn.execute(
                    sa.delete(jobs)
                    .where(
                        jobs.c.job_id == job_id,
                        sa.or_(jobs.c.state != State.LEASED.value, jobs.c.lease_expires_at <= now),
                    )
                    .returning(jobs.c.generation)
                )
            ).first()
            if deleted is None:
                exists = (
                    await conn.execute(sa.select(jobs.c.job_id).where(jobs.c.job_id == job_id))
                ).first()
                if exists is None:
                    raise exc.JobNotFound(f"no job with id {job_id!r}", job_id=job_id)
                raise exc.LeaseHeld("a current lease holds this job", job_id=job_id)
            # The job row is gone, so no write of it can be admitted any more; one admitted
            # before shows here, and the whole purge is undone.
            in_flight = (
                await conn.execute(
                    sa.select(_records.c.key)
                    .where(
                        _records.c.job_id == job_id,
                        _records.c.state == _IN_FLIGHT_RECORD,
                        _records.c.deadline > now,
                    )
                    .limit(1)
                )
            ).first()
            if in_flight is not None:
                raise exc.LeaseHeld(
                    "a write of this job is still in flight; purge it once that write has settled",
                    job_id=job_id,
                )
            await conn.execute(sa.delete(_records).where(_records.c.job_id == job_id))
            tomb = self.dialect.insert(job_tombstones).values(
                job_id=job_id, generation=deleted.generation, purged_at=now
            )
            await conn.execute(
                tomb.on_conflict_do_update(
                    index_elements=[job_tombstones.c.job_id],
                    set_={"generation": tomb.excluded.generation, "purged_at": now},
                )
            )

    # -- grants -------------------------------------------------------------------

    def _grant_values(
        self, owner: str, ttl: float, token_hash: str, now: sa.ColumnElement[float]
    ) -> dict[str, Any]:
        return {
            "state": State.LEASED.value,
            "generation": jobs.c.generation + 1,
            "owner": owner,
            "lease_token_hash": token_hash,
            "lease_ttl_seconds": ttl,
            "lease_expires_at": now + ttl,
            "claimable_at": now + ttl,
            "attempts": jobs.c.attempts + 1,
            "updated_at": now,
        }

    async def _record_grant(
        self,
        conn: AsyncConnection,
        row: sa.RowMapping,
        token: str,
        token_hash: str,
        now: sa.ColumnElement[float],
    ) -> LeaseRecord:
        await conn.execute(
            sa.insert(leases).values(
                token_hash=token_hash,
                job_id=row["job_id"],
                generation=row["generation"],
                owner=row["owner"],
                granted_at=now,
                expires_at=row["lease_expires_at"],
            )
        )
        return _lease(row, token)

    async def claim(self, *, queue: str, owner: str, ttl: float) -> LeaseRecord | None:
        """Lease the next claimable job of ``queue``: pending and due, or expired.
        One statement on PostgreSQL (the grant and its record; concurrent claims share
        it), one transaction on SQLite."""
        token, token_hash = tokens.new_token()
        params = {"queue": queue, "owner": owner, "ttl": float(ttl), "token_hash": token_hash}
        params.update(self._now_param())
        if self.direct.sqlite:
            row = await self.timed(self.direct.run(partial(_claim_sqlite, params)))
        else:
            row = await self.timed(self.direct.fetchrow_batched(_CLAIM_PG, params))
        if row is None:
            return None
        self.metrics.grants.labels("claim").inc()
        return _lease(row, token, decode=True)

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
        now = self.dialect.now()
        create = (
            self.dialect.insert(jobs)
            .values(self._new_job_values(job_id, queue, payload, max_attempts, now))
            .on_conflict_do_nothing(index_elements=[jobs.c.job_id])
        )
        grant = (
            sa.update(jobs)
            .where(
                jobs.c.job_id == job_id,
                sa.or_(
                    jobs.c.state == State.PENDING.value,
                    sa.and_(
                        jobs.c.state == State.LEASED.value,
                        sa.or_(jobs.c.lease_expires_at <= now, jobs.c.owner == owner),
                    ),
                ),
            )
            .values(self._grant_values(owner, ttl, token_hash, now))
            .returning(*_LEASE_RETURNING)
        )
        async with self.transaction() as conn:
            await conn.execute(create)
            row = (await conn.execute(grant)).mappings().first()
            if row is not None:
                lease = await self._record_grant(conn, row, token, token_hash, now)
                self.metrics.grants.labels("acquire").inc()
                return lease
            current = (
                await conn.execute(
                    sa.select(jobs.c.state, jobs.c.lease_expires_at).where(jobs.c.job_id == job_id)
                )
            ).first()
        if current is not None and current.state in rules.FINISHED:
            raise exc.JobFinished(f"job {job_id!r} is {current.state}", job_id=job_id)
        raise exc.LeaseHeld(
            "another current lease holds this job",
            job_id=job_id,
            lease_expires_at=rfc3339(current.lease_expires_at) if current else None,
        )

    # -- the current lease's operations ---------------------------------------------

    def _current(self, token: str, now: sa.ColumnElement[float]) -> list[sa.ColumnElement[bool]]:
        """The lease behind ``token`` is current: granted last, not ended, not expired."""
        return [
            jobs.c.lease_token_hash == _token_hash(token),
            jobs.c.state == State.LEASED.value,
            jobs.c.lease_expires_at > now,
        ]

    async def renew(self, token: str, ttl: float | None = None) -> LeaseRecord:
        if not tokens.is_well_formed(token):
            raise exc.InvalidLeaseToken()
        params = {"token_hash": tokens.hash_token(token), "ttl": None if ttl is None else ttl}
        params.update(self._now_param())
        row = await self.timed(self.direct.fetchrow_batched(_RENEW, params))
        if row is None:
            async with self.transaction() as conn:
                reason = await self._refusal(conn, token)
            self.metrics.losses.labels(reason).inc()
            raise exc.LOST_BY_REASON[reason]()
        self.metrics.renewals.inc()
        return _lease(row, None, decode=True)

    async def complete(self, token: str, result: Any = None) -> JobRecord:
        now = self.dialect.now()
        stmt = (
            sa.update(jobs)
            .where(*self._current(token, now))
            .values(
                state=State.COMPLETED.value,
                result=result,
                lease_token_hash=None,
                lease_expires_at=None,
                claimable_at=None,
                updated_at=now,
            )
            .returning(*_JOB_COLUMNS)
        )
        return JobRecord.from_row(await self._on_current(token, stmt))

    async def fail(self, token: str, error: str | None = None, retry_in: float = 0) -> JobRecord:
        """Back to pending after ``retry_in`` seconds, or ``failed`` when out of attempts."""
        now = self.dialect.now()
        exhausted = jobs.c.attempts >= jobs.c.max_attempts
        stmt = (
            sa.update(jobs)
            .where(*self._current(token, now))
            .values(
                state=sa.case((exhausted, State.FAILED.value), else_=State.PENDING.value),
                claimable_at=sa.case((exhausted, sa.null()), else_=now + retry_in),
                error=error,
                lease_token_hash=None,
                lease_expires_at=None,
                updated_at=now,
            )
            .returning(*_JOB_COLUMNS)
        )
        return JobRecord.from_row(await self._on_current(token, stmt))

    async def release(self, token: str) -> JobRecord:
        """Give the job back at once, without using up an attempt."""
        now = self.dialect.now()
        stmt = (
            sa.update(jobs)
            .where(*self._current(token, now))
            .values(
                state=State.PENDING.value,
                claimable_at=now,
                attempts=sa.case((jobs.c.attempts > 0, jobs.c.attempts - 1), else_=0),
                lease_token_hash=None,
                lease_expires_at=None,
                updated_at=now,
            )
            .returning(*_JOB_COLUMNS)
        )
        return JobRecord.from_row(await self._on_current(token, stmt))

    async def _on_current(self, token: str, stmt: sa.Update) -> sa.RowMapping:
        """Run ``stmt`` (conditional on the lease being current) or raise why not."""
        if not tokens.is_well_formed(token):
            raise exc.InvalidLeaseToken()
        async with self.transaction() as conn:
            row = (await conn.execute(stmt)).mappings().first()
            if row is not None:
                return row
            reason = await self._refusal(conn, token)
        self.metrics.losses.labels(reason).inc()
        raise exc.LOST_BY_REASON[reason]()

    async def _refusal(self, conn: AsyncConnection, token: str) -> str:
        now = self.dialect.now()
        row = (
            await conn.execute(
                sa.select(
                    leases.c.job_id,
                    leases.c.generation.label("lease_generation"),
                    jobs.c.state,
                    jobs.c.generation,
                    jobs.c.lease_expires_at,
                    now.label("now"),
                )
                .select_from(leases.outerjoin(jobs, jobs.c.job_id == leases.c.job_id))
                .where(leases.c.token_hash == _token_hash(token))
            )
        ).first()
        if row is None:
            raise exc.InvalidLeaseToken()
        job = None
        if row.state is not None:
            job = rules.Job(
                row.job_id, State(row.state), row.generation, lease_expires_at=row.lease_expires_at
            )
        return rules.refusal_reason(row.lease_generation, job, row.now)

    # -- maintenance --------------------------------------------------------------

    async def fail_exhausted(self) -> int:
        """Expired leases on their last attempt become ``failed`` (a worker that keeps
        crashing on a job must not get it forever). Returns how many."""
        now = self.dialect.now()
        stmt = (
            sa.update(jobs)
            .where(
                jobs.c.state == State.LEASED.value,
                jobs.c.lease_expires_at <= now,
                jobs.c.attempts >= jobs.c.max_attempts,
            )
            .values(
                state=State.FAILED.value,
                error="the lease expired on the last attempt",
                lease_token_hash=None,
                claimable_at=None,
                lease_expires_at=None,
                updated_at=now,
            )
        )
        async with self.transaction() as conn:
            return (await conn.execute(stmt)).rowcount

    async def purge_grants(self, older_than_seconds: float) -> int:
        """Forget grants older than the audit's retention (their tokens then answer
        'invalid' instead of 'stale'); the current grant of a job is always kept."""
        now = self.dialect.now()
        stmt = sa.delete(leases).where(
            leases.c.expires_at < now - older_than_seconds,
            ~sa.exists().where(
                jobs.c.job_id == leases.c.job_id, jobs.c.generation == leases.c.generation
            ),
        )
        async with self.transaction() as conn:
            return (await conn.execute(stmt)).rowcount


def _token_hash(token: str) -> str:
    return tokens.hash_token(token) if tokens.is_well_formed(token) else ""


def _lease(row: Mapping[Any, Any], token: str | None, *, decode: bool = False) -> LeaseRecord:
    """A grant's row; ``decode``: a driver's row, whose JSON is still text."""
    payload = row["payload"]
    return LeaseRecord(
        job_id=row["job_id"],
        generation=row["generation"],
        owner=row["owner"],
        expires_at=row["lease_expires_at"],
        ttl_seconds=row["lease_ttl_seconds"],
        payload=json.loads(payload) if decode and payload is not None else payload,
        lease_token=token,
    )


# The gateway's records of a job's writes (``gateway.schema.requests``): they belong to
# the job and go with it when it is purged.
_records = sa.table(
    "idempotency_records",
    sa.column("job_id"),
    sa.column("key"),
    sa.column("state"),
    sa.column("deadline"),
)
_IN_FLIGHT_RECORD = "in_flight"

# The hot path's statements, sent straight to the driver (``lease_core.direct``).
_LEASED = State.LEASED.value
_GRANT_SET = f"""
    state = '{_LEASED}', generation = jobs.generation + 1, owner = :owner,
    lease_token_hash = :token_hash, lease_ttl_seconds = :ttl,
    lease_expires_at = {{now}} + :ttl, claimable_at = {{now}} + :ttl,
    attempts = jobs.attempts + 1, updated_at = {{now}}
"""
_CLAIMABLE = """
    SELECT job_id FROM jobs
    WHERE queue = :queue AND claimable_at IS NOT NULL AND claimable_at <= {now}
      AND attempts < max_attempts
    ORDER BY claimable_at LIMIT 1
"""
_GRANTED = (
    "jobs.job_id, jobs.generation, jobs.owner, jobs.lease_expires_at, "
    "jobs.lease_ttl_seconds, jobs.payload"
)
# PostgreSQL: concurrent claims share one statement (``Batched``): every parameter is an
# array with one element per caller. For each queue asked for, as many candidates as
# callers (skipping rows other claims hold), in claimable order; the k-th caller of a
# queue gets its k-th candidate, or nothing when the queue had fewer. The grants and
# their records in the same statement.
_CLAIM_PG = Batched(
    Statement(
        f"""
WITH input AS (
    SELECT i.*, row_number() OVER (PARTITION BY i.queue ORDER BY i.n) AS k
    FROM unnest(CAST(:queue AS text[]), CAST(:owner AS text[]), CAST(:token_hash AS text[]),
                CAST(:ttl AS double precision[]))
         WITH ORDINALITY AS i(queue, owner, token_hash, ttl, n)
),
candidate AS (
    SELECT c.job_id, q.queue,
           row_number() OVER (PARTITION BY q.queue ORDER BY c.claimable_at, c.job_id) AS k
    FROM (SELECT queue, count(*) AS wanted FROM input GROUP BY queue) AS q
    CROSS JOIN LATERAL (
        SELECT j.job_id, j.claimable_at FROM jobs AS j
        WHERE j.queue = q.queue AND j.claimable_at IS NOT NULL
          AND j.claimable_at <= {{now}} AND j.attempts < j.max_attempts
        ORDER BY j.claimable_at LIMIT q.wanted
        FOR UPDATE SKIP LOCKED
    ) AS c
),
granted AS (
    UPDATE jobs SET
        state = '{_LEASED}', generation = jobs.generation + 1, owner = i.owner,
        lease_token_hash = i.token_hash, lease_ttl_seconds = i.ttl,
        lease_expires_at = {{now}} + i.ttl, claimable_at = {{now}} + i.ttl,
        attempts = jobs.attempts + 1, updated_at = {{now}}
    FROM candidate JOIN input AS i ON i.queue = candidate.queue AND i.k = candidate.k
    WHERE jobs.job_id = candidate.job_id
    RETURNING i.n, i.token_hash, {_GRANTED}
),
recorded AS (
    INSERT INTO leases (token_hash, job_id, generation, owner, granted_at, expires_at)
    SELECT token_hash, job_id, generation, owner, {{now}}, lease_expires_at FROM granted
)
SELECT * FROM granted
"""
    )
)
# SQLite (no data-modifying CTEs; the IMMEDIATE transaction keeps other writers out).
_CLAIM_SQLITE = Statement(
    f"UPDATE jobs SET {_GRANT_SET} WHERE job_id = ({_CLAIMABLE}) RETURNING {_GRANTED}"
)
_RECORD_GRANT_SQLITE = Statement(
    """
INSERT INTO leases (token_hash, job_id, generation, owner, granted_at, expires_at)
VALUES (:token_hash, :job_id, :generation, :owner, {now}, :lease_expires_at)
"""
)


def _claim_sqlite(params: dict[str, Any], conn: sqlite3.Connection) -> Mapping[str, Any] | None:
    row = conn.execute(_CLAIM_SQLITE.sqlite, params).fetchone()
    if row is None:
        return None
    granted = dict(row)
    conn.execute(_RECORD_GRANT_SQLITE.sqlite, {**params, **granted})
    return granted


_RENEW_ONE = Statement(
    f"""
UPDATE jobs SET
    lease_ttl_seconds = COALESCE(:ttl, lease_ttl_seconds),
    lease_expires_at = {{now}} + COALESCE(:ttl, lease_ttl_seconds),
    claimable_at = {{now}} + COALESCE(:ttl, lease_ttl_seconds),
    updated_at = {{now}}
WHERE lease_token_hash = :token_hash AND state = '{_LEASED}' AND lease_expires_at > {{now}}
RETURNING {_GRANTED}
"""
)
# PostgreSQL: concurrent renewals share one statement. A token asked for twice in one
# batch is renewed once, with its last caller's ttl, and every caller of it gets the
# renewed lease (as if the renewals ran one after the other at the same instant). Rows
# are locked in job_id order, so two batches never wait on each other in a cycle.
_RENEW = Batched(
    single=_RENEW_ONE,
    many=Statement(
        f"""
WITH clock AS (SELECT {{now}} AS now),
input AS (
    SELECT * FROM unnest(CAST(:token_hash AS text[]), CAST(:ttl AS double precision[]))
         WITH ORDINALITY AS i(token_hash, ttl, n)
),
wanted AS (
    SELECT DISTINCT ON (token_hash) token_hash, ttl FROM input ORDER BY token_hash, n DESC
),
locked AS (
    SELECT j.job_id FROM jobs AS j
    WHERE j.lease_token_hash IN (SELECT token_hash FROM wanted)
    ORDER BY j.job_id
    FOR UPDATE OF j
),
renewed AS (
    UPDATE jobs SET
        lease_ttl_seconds = COALESCE(w.ttl, jobs.lease_ttl_seconds),
        lease_expires_at = clock.now + COALESCE(w.ttl, jobs.lease_ttl_seconds),
        claimable_at = clock.now + COALESCE(w.ttl, jobs.lease_ttl_seconds),
        updated_at = clock.now
    FROM locked, wanted AS w, clock
    WHERE jobs.job_id = locked.job_id AND jobs.lease_token_hash = w.token_hash
      AND jobs.state = '{_LEASED}' AND jobs.lease_expires_at > clock.now
    RETURNING jobs.lease_token_hash, {_GRANTED}
)
SELECT i.n, renewed.* FROM input AS i JOIN renewed ON renewed.lease_token_hash = i.token_hash
"""
    ),
)


def _is_connection_error(error: sa.exc.DBAPIError) -> bool:
    """A DBAPI error that means the database is unreachable, not that our SQL is wrong."""
    if error.connection_invalidated or isinstance(
        error, sa.exc.OperationalError | sa.exc.InterfaceError
    ):
        return True
    return error.orig is not None and is_unavailable(error.orig)


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
            "cursor: not a cursor this server gave out", field="cursor"
        ) from error


__all__: Sequence[str] = ["JobPage", "JobRecord", "LeaseRecord", "LeaseStore"]
