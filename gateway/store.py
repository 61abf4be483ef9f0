"""The gateway's atomic statements: admit a write (lease check + fence + key claim in one
transaction), settle it, wait for older generations, resolve unknown outcomes.

Nothing authoritative lives in process memory: several replicas on one PostgreSQL
answer as one. The job row is locked (``FOR SHARE``) while a write is admitted, so a
reclaim cannot slip between the lease check and the fence update.

Every request's statements (admit, settle, the lease check) are plain SQL sent straight
to the driver (``lease_core.direct``); the rarer ones stay on SQLAlchemy.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import sqlalchemy as sa

from lease_core import rules, tokens
from lease_core.direct import Batched, Statement
from lease_core.rules import State
from lease_core.store import LeaseStore

from . import fence
from .fence import Presented, Record, RecordState
from .schema import requests


@dataclass(frozen=True, slots=True)
class Admission:
    """Everything the admit transaction learned, for ``fence`` to judge."""

    now: float
    presented: Presented | None
    highest: int | None = None
    claimed: bool = False
    attempt: str | None = None
    record: Record | None = None
    older_in_flight: bool = False
    # The key's record was taken over (retry policy): ``attempt`` is ours now, and
    # ``back_to`` is the record as it was, to return to if our attempt is never sent.
    back_to: Record | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    """A claimed write, as the database sees it right before it is sent."""

    now: float
    fence: int | None  # the job's fence: the highest generation admitted
    deadline: float | None  # None: the claim is no longer ours (released, taken over)


@dataclass(frozen=True, slots=True)
class WriteRequest:
    token_hash: str
    key: str
    fingerprint: str
    upstream: str
    method: str
    path: str
    deadline_in: float
    # The upstream's ``unknown_outcome`` is "retry": a record of this key whose outcome
    # is unknown is taken over in the admission itself, under the same lease check.
    retry: bool = False


class GatewayStore:
    def __init__(self, leases_store: LeaseStore) -> None:
        self.lease_store = leases_store
        self.dialect = leases_store.dialect

    # -- reading the lease --------------------------------------------------------

    async def check_lease(self, token_hash: str) -> Admission:
        """Read-only: may this token write now? (For refusals before the body is read.)"""
        params = {
            "token_hash": token_hash,
            "now": self.dialect.injected_now(),
            "in_flight": _IN_FLIGHT,
        }
        lease_store = self.lease_store
        row = await lease_store.timed(lease_store.direct.fetchrow(_PRESENTED, params))
        assert row is not None
        now = float(row["now"])
        presented, highest = _presented(row)
        return Admission(now=now, presented=presented, highest=highest)

    async def claim(self, job_id: str, key: str, attempt: str) -> Claim:
        """Read-only, right before a claimed write is sent: the job's fence, and the
        claim's deadline while the record is still our attempt, in flight."""
        params = {
            "job_id": job_id,
            "key": key,
            "attempt": attempt,
            "now": self.dialect.injected_now(),
        }
        lease_store = self.lease_store
        row = await lease_store.timed(lease_store.direct.fetchrow_batched(_CLAIM_STATE, params))
        assert row is not None
        deadline = row["deadline"]
        return Claim(
            now=float(row["now"]),
            fence=row["fence_generation"],
            deadline=None if deadline is None else float(deadline),
        )

    # -- admitting a write ----------------------------------------------------------

    async def admit(self, write: WriteRequest) -> Admission:
        """In one transaction: check the lease, raise the job's fence to this generation,
        claim the key (or read its record, and take it over when its outcome is unknown
        and the upstream's policy is retry), and see whether an older generation's write
        is still in flight. On PostgreSQL that is one statement (one round trip); on
        SQLite one IMMEDIATE transaction."""
        attempt = tokens.new_serial_id()
        direct = self.lease_store.direct
        timed = self.lease_store.timed
        if direct.sqlite:
            now = self.dialect.injected_now()
            assert now is not None  # SQLite's clock is always the process's
            return await timed(direct.run(partial(_admit_sqlite, write, attempt, now)))
        params: dict[str, Any] = {
            "token_hash": write.token_hash,
            "key": write.key,
            "fingerprint": write.fingerprint,
            "attempt": attempt,
            "upstream": write.upstream,
            "method": write.method,
            "path": write.path,
            "deadline_in": write.deadline_in,
            "retry": write.retry,
            "now": self.dialect.injected_now(),
        }
        row = await timed(direct.fetchrow_batched(_ADMIT_PG, params))
        assert row is not None
        now = float(row["now"])
        presented, highest = _presented(row)
        if presented is None:
            return Admission(now=now, presented=None)
        if fence.lease_reason(presented, now) is not None:
            return Admission(now=now, presented=presented, highest=highest)
        claimed = bool(row["claimed"])
        record = back_to = None
        if not claimed:
            if row["r_attempt"] is not None:
                record = _record(
                    {
                        **dict(row),
                        "state": row["r_state"],
                        "generation": row["r_generation"],
                        "attempt": row["r_attempt"],
                    },
                    decode=True,
                )
            else:  # claimed concurrently, after this statement's snapshot was taken
                found = await timed(
                    direct.fetchrow(_RECORD, {"job_id": presented.job_id, "key": write.key})
                )
                record = None if found is None else _record(found, decode=True)
            if row["taken_from"] is not None and record is not None:
                back_to = replace(
                    record, attempt=row["taken_from"], generation=row["taken_generation"]
                )
        ours = claimed or back_to is not None
        return Admission(
            now=now,
            presented=presented,
            highest=max(presented.generation, highest or 0),
            claimed=claimed,
            attempt=attempt if ours else None,
            record=record,
            older_in_flight=ours and bool(row["older_in_flight"]),
            back_to=back_to,
        )

    async def older_in_flight(self, job_id: str, generation: int) -> bool:
        now = self.dialect.now()
        stmt = sa.select(
            sa.exists().where(
                requests.c.job_id == job_id,
                requests.c.state == RecordState.IN_FLIGHT.value,
                requests.c.generation < generation,
                requests.c.deadline > now,
            )
        )
        async with self.lease_store.transaction() as conn:
            return bool((await conn.execute(stmt)).scalar())

    # -- settling ---------------------------------------------------------------------

    async def settle(
        self,
        job_id: str,
        key: str,
        attempt: str,
        *,
        state: RecordState,
        status: int | None,
        headers: list[tuple[str, str]] | None,
        body: bytes | None,
        note: str | None = None,
    ) -> None:
        """Store the answer of our attempt (completed, or unknown outcome): one
        statement, sent straight to the driver."""
        params: dict[str, Any] = {"job_id": job_id, "key": key, "attempt": attempt}
        lease_store = self.lease_store
        direct = lease_store.direct
        if fence.is_anonymous(key) and state is RecordState.COMPLETED:
            await lease_store.timed(direct.fetchrow(_FORGET, params))
            return
        params.update(
            state=state.value,
            status=status,
            headers=None if headers is None else json.dumps([list(h) for h in headers]),
            body=body,
            note=note,
            now=self.dialect.injected_now(),
        )
        await lease_store.timed(direct.fetchrow_batched(_SETTLE, params))

    async def release(self, job_id: str, key: str, attempt: str, back_to: Record | None) -> None:
        """Our attempt did not reach the upstream: undo the claim (or return the record to
        the state it had before we took it over)."""
        where = (requests.c.job_id == job_id, requests.c.key == key, requests.c.attempt == attempt)
        async with self.lease_store.transaction() as conn:
            if back_to is None:
                await conn.execute(sa.delete(requests).where(*where))
            else:
                await conn.execute(
                    sa.update(requests)
                    .where(*where)
                    .values(
                        state=RecordState.UNKNOWN.value,
                        attempt=back_to.attempt,
                        generation=back_to.generation,
                        updated_at=self.dialect.now(),
                    )
                )

    # -- operators: unknown outcomes ---------------------------------------------------

    async def list_unknown(self, limit: int = 100) -> list[dict[str, Any]]:
        """Keys whose outcome is unknown (including in-flight ones past their deadline)."""
        now = self.dialect.now()
        stmt = (
            sa.select(
                requests.c.job_id,
                requests.c.key,
                requests.c.state,
                requests.c.generation,
                requests.c.upstream,
                requests.c.method,
                requests.c.path,
                requests.c.status,
                requests.c.note,
                requests.c.updated_at,
            )
            .where(
                sa.or_(
                    requests.c.state == RecordState.UNKNOWN.value,
                    sa.and_(
                        requests.c.state == RecordState.IN_FLIGHT.value,
                        requests.c.deadline <= now,
                    ),
                )
            )
            .order_by(requests.c.updated_at.desc())
            .limit(limit)
        )
        async with self.lease_store.transaction() as conn:
            rows = (await conn.execute(stmt)).mappings().all()
        return [dict(row) for row in rows]

    async def resolve(
        self,
        job_id: str,
        key: str,
        *,
        applied: bool,
        status: int | None = None,
        headers: list[tuple[str, str]] | None = None,
        body: bytes | None = None,
    ) -> bool:
        """An operator's verdict on an unknown outcome. Applied: later duplicates replay
        the given answer. Not applied: the record goes, and the next request with this
        key is forwarded. False when the key is not (or no longer) unknown."""
        now = self.dialect.now()
        unknown = sa.or_(
            requests.c.state == RecordState.UNKNOWN.value,
            sa.and_(requests.c.state == RecordState.IN_FLIGHT.value, requests.c.deadline <= now),
        )
        where = (requests.c.job_id == job_id, requests.c.key == key, unknown)
        stmt: sa.Delete | sa.Update
        if applied:
            stmt = (
                sa.update(requests)
                .where(*where)
                .values(
                    state=RecordState.COMPLETED.value,
                    status=status,
                    headers=[list(h) for h in headers or []],
                    body=body or b"",
                    note="resolved by an operator: applied",
                    updated_at=now,
                )
            )
        else:
            stmt = sa.delete(requests).where(*where)
        async with self.lease_store.transaction() as conn:
            return (await conn.execute(stmt)).rowcount == 1

    # -- retention ---------------------------------------------------------------------

    async def purge_records(self, older_than_seconds: float) -> int:
        """Drop settled records (and grant history) past retention; never an unknown one."""
        now = self.dialect.now()
        async with self.lease_store.transaction() as conn:
            result = await conn.execute(
                sa.delete(requests).where(
                    requests.c.state == RecordState.COMPLETED.value,
                    requests.c.updated_at < now - older_than_seconds,
                )
            )
            return result.rowcount


# PostgreSQL: the lease check (the job row locked FOR SHARE so no reclaim slips in), the
# fence raise, the key claim, the existing record and the older-in-flight check, in one
# statement. Data-modifying CTEs run exactly once; the outer SELECT reads the snapshot
# from before them, so a record claimed here shows as claimed and r.* NULL.
#
# Concurrent admissions share one statement (``Batched``): every ``:name`` is then an
# array with one element per write, and ``n`` tells which write a row answers. Two
# writes of one job in one batch hold the same lease (one snapshot, one current lease),
# so the fence is raised once per job (DISTINCT ON); rows are locked in job_id (and key)
# order, so two batches cannot deadlock on them. A lone write is sent as arrays of one.
_ADMIT_BODY = """
WITH clock AS (SELECT {now} AS now),
input AS (
    SELECT * FROM unnest(
        CAST(:token_hash AS text[]), CAST(:key AS text[]), CAST(:fingerprint AS text[]),
        CAST(:attempt AS text[]), CAST(:upstream AS text[]), CAST(:method AS text[]),
        CAST(:path AS text[]), CAST(:deadline_in AS double precision[]),
        CAST(:retry AS boolean[])
    ) WITH ORDINALITY AS i(token_hash, key, fingerprint, attempt, upstream, method, path,
                           deadline_in, retry, n)
),
lease AS (
    SELECT i.n, l.job_id, l.generation, l.owner
    FROM input AS i JOIN leases AS l ON l.token_hash = i.token_hash
),
job AS (
    SELECT j.job_id, j.state, j.generation, j.owner, j.lease_expires_at, j.attempts,
           j.max_attempts
    FROM jobs AS j WHERE j.job_id IN (SELECT lease.job_id FROM lease)
    ORDER BY j.job_id
    FOR SHARE OF j
),
current_lease AS (
    SELECT lease.n, lease.job_id, lease.generation
    FROM lease
    JOIN job ON job.job_id = lease.job_id AND job.generation = lease.generation
            AND job.owner = lease.owner
    CROSS JOIN clock
    WHERE job.state = :leased AND job.lease_expires_at > clock.now
),
raised AS (
    INSERT INTO fences (job_id, generation, updated_at)
    SELECT DISTINCT ON (c.job_id) c.job_id, c.generation, clock.now
    FROM current_lease AS c CROSS JOIN clock
    ORDER BY c.job_id, c.generation DESC
    ON CONFLICT (job_id) DO UPDATE
        SET generation = excluded.generation, updated_at = excluded.updated_at
        WHERE fences.generation < excluded.generation
),
claim AS (
    INSERT INTO idempotency_records (job_id, key, fingerprint, state, generation, attempt,
                                     upstream, method, path, deadline, created_at, updated_at)
    SELECT c.job_id, i.key, i.fingerprint, :in_flight, c.generation, i.attempt, i.upstream,
           i.method, i.path, clock.now + i.deadline_in, clock.now, clock.now
    FROM current_lease AS c JOIN input AS i ON i.n = c.n CROSS JOIN clock
    ORDER BY c.job_id, i.key
    ON CONFLICT (job_id, key) DO NOTHING
    RETURNING attempt
),
held AS (
    SELECT r.job_id, r.key, r.attempt AS taken_from, r.generation AS taken_generation,
           i.attempt, c.generation, i.deadline_in
    FROM current_lease AS c
    JOIN input AS i ON i.n = c.n
    JOIN idempotency_records AS r ON r.job_id = c.job_id AND r.key = i.key
    CROSS JOIN clock
    WHERE i.retry AND r.fingerprint = i.fingerprint
      AND (r.state = :unknown OR (r.state = :in_flight AND r.deadline <= clock.now))
    ORDER BY r.job_id, r.key
    FOR UPDATE OF r
),
taken AS (
    UPDATE idempotency_records AS r
    SET state = :in_flight, generation = h.generation, attempt = h.attempt,
        deadline = clock.now + h.deadline_in, updated_at = clock.now
    FROM held AS h CROSS JOIN clock
    WHERE r.job_id = h.job_id AND r.key = h.key AND r.attempt = h.taken_from
    RETURNING r.attempt, h.taken_from, h.taken_generation
)
SELECT i.n, clock.now,
       lease.job_id, lease.generation AS lease_generation, lease.owner AS lease_owner,
       job.state, job.generation, job.owner, job.lease_expires_at, job.attempts,
       job.max_attempts,
       (SELECT f.generation FROM fences AS f WHERE f.job_id = lease.job_id) AS fence_generation,
       EXISTS (SELECT 1 FROM claim WHERE claim.attempt = i.attempt) AS claimed,
       r.fingerprint, r.state AS r_state, r.generation AS r_generation,
       r.attempt AS r_attempt, r.deadline, r.status, r.headers, r.body,
       taken.taken_from, taken.taken_generation,
       EXISTS (
           SELECT 1 FROM idempotency_records AS o
           WHERE o.job_id = lease.job_id AND o.state = :in_flight
             AND o.generation < lease.generation AND o.deadline > clock.now
       ) AS older_in_flight
FROM input AS i
CROSS JOIN clock
LEFT JOIN lease ON lease.n = i.n
LEFT JOIN job ON job.job_id = lease.job_id
LEFT JOIN idempotency_records AS r ON r.job_id = lease.job_id AND r.key = i.key
LEFT JOIN taken ON taken.attempt = i.attempt
"""
_ADMIT_PG = Batched(
    Statement(
        _ADMIT_BODY.replace(":leased", f"'{State.LEASED.value}'")
        .replace(":in_flight", f"'{RecordState.IN_FLIGHT.value}'")
        .replace(":unknown", f"'{RecordState.UNKNOWN.value}'")
    )
)

# The lease behind a token, its job, its fence and whether an older generation's write
# to the job is still in flight; always one row (job_id NULL: no such token; state NULL:
# the job has been purged since).
_PRESENTED = Statement(
    """
SELECT clock.now, l.job_id, l.generation AS lease_generation, l.owner AS lease_owner,
       j.state, j.generation, j.owner, j.lease_expires_at, j.attempts, j.max_attempts,
       f.generation AS fence_generation,
       EXISTS (
           SELECT 1 FROM idempotency_records AS o
           WHERE o.job_id = l.job_id AND o.state = :in_flight
             AND o.generation < l.generation AND o.deadline > clock.now
       ) AS older_in_flight
FROM (SELECT {now} AS now) AS clock
LEFT JOIN leases AS l ON l.token_hash = :token_hash
LEFT JOIN jobs AS j ON j.job_id = l.job_id
LEFT JOIN fences AS f ON f.job_id = l.job_id
"""
)

# A claimed write right before it is sent: the job's fence and, while the record is still
# this attempt's and in flight, its deadline; one row per write. Concurrent writes share
# one statement on PostgreSQL (``Batched``, like the admission).
_CLAIM_STATE = Batched(
    single=Statement(
        """
SELECT clock.now, f.generation AS fence_generation, r.deadline
FROM (SELECT {now} AS now) AS clock
LEFT JOIN fences AS f ON f.job_id = :job_id
LEFT JOIN idempotency_records AS r
    ON r.job_id = :job_id AND r.key = :key AND r.attempt = :attempt AND r.state = :in_flight
""".replace(":in_flight", f"'{RecordState.IN_FLIGHT.value}'")
    ),
    many=Statement(
        """
SELECT i.n, clock.now, f.generation AS fence_generation, r.deadline
FROM unnest(CAST(:job_id AS text[]), CAST(:key AS text[]), CAST(:attempt AS text[]))
     WITH ORDINALITY AS i(job_id, key, attempt, n)
CROSS JOIN (SELECT {now} AS now) AS clock
LEFT JOIN fences AS f ON f.job_id = i.job_id
LEFT JOIN idempotency_records AS r
    ON r.job_id = i.job_id AND r.key = i.key AND r.attempt = i.attempt
   AND r.state = :in_flight
""".replace(":in_flight", f"'{RecordState.IN_FLIGHT.value}'")
    ),
)

# SQLite: the admission's steps as statements of one IMMEDIATE transaction
# (``_admit_sqlite``).
_RAISE_FENCE_SQLITE = Statement(
    """
INSERT INTO fences (job_id, generation, updated_at) VALUES (:job_id, :generation, {now})
ON CONFLICT (job_id) DO UPDATE
    SET generation = excluded.generation, updated_at = excluded.updated_at
    WHERE fences.generation < excluded.generation
"""
)
_CLAIM_KEY_SQLITE = Statement(
    """
INSERT INTO idempotency_records (job_id, key, fingerprint, state, generation, attempt,
                                 upstream, method, path, deadline, created_at, updated_at)
VALUES (:job_id, :key, :fingerprint, :in_flight, :generation, :attempt, :upstream, :method,
        :path, {now} + :deadline_in, {now}, {now})
ON CONFLICT (job_id, key) DO NOTHING
RETURNING attempt
"""
)
_RECORD = Statement(
    """
SELECT fingerprint, state, generation, attempt, deadline, status, headers, body
FROM idempotency_records WHERE job_id = :job_id AND key = :key
"""
)
_TAKE_OVER_SQLITE = Statement(
    """
UPDATE idempotency_records
SET state = :in_flight, generation = :generation, attempt = :attempt,
    deadline = {now} + :deadline_in, updated_at = {now}
WHERE job_id = :job_id AND key = :key AND attempt = :taken_from
"""
)
_SETTLE = Batched(
    single=Statement(
        """
UPDATE idempotency_records
SET state = :state, status = :status, headers = :headers, body = :body, note = :note,
    updated_at = {now}
WHERE job_id = :job_id AND key = :key AND attempt = :attempt
"""
    ),
    many=Statement(
        """
UPDATE idempotency_records AS r
SET state = v.state, status = v.status, headers = CAST(v.headers AS json), body = v.body,
    note = v.note, updated_at = {now}
FROM unnest(CAST(:job_id AS text[]), CAST(:key AS text[]), CAST(:attempt AS text[]),
            CAST(:state AS text[]), CAST(:status AS integer[]), CAST(:headers AS text[]),
            CAST(:body AS bytea[]), CAST(:note AS text[]))
     WITH ORDINALITY AS v(job_id, key, attempt, state, status, headers, body, note, n)
WHERE r.job_id = v.job_id AND r.key = v.key AND r.attempt = v.attempt
RETURNING v.n
"""
    ),
)
_FORGET = Statement(
    "DELETE FROM idempotency_records WHERE job_id = :job_id AND key = :key AND attempt = :attempt"
)


_IN_FLIGHT = RecordState.IN_FLIGHT.value


def _admit_sqlite(
    write: WriteRequest, attempt: str, now: float, conn: sqlite3.Connection
) -> Admission:
    """``GatewayStore.admit`` on SQLite, run on the database thread inside BEGIN IMMEDIATE
    (which keeps every other writer out until it commits)."""
    row = conn.execute(
        _PRESENTED.sqlite, {"token_hash": write.token_hash, "now": now, "in_flight": _IN_FLIGHT}
    ).fetchone()
    presented, highest = _presented(row)
    if presented is None:
        return Admission(now=now, presented=None)
    if fence.lease_reason(presented, now) is not None:
        return Admission(now=now, presented=presented, highest=highest)
    params = {
        "job_id": presented.job_id,
        "generation": presented.generation,
        "now": now,
        "key": write.key,
        "fingerprint": write.fingerprint,
        "in_flight": RecordState.IN_FLIGHT.value,
        "attempt": attempt,
        "upstream": write.upstream,
        "method": write.method,
        "path": write.path,
        "deadline_in": write.deadline_in,
    }
    conn.execute(_RAISE_FENCE_SQLITE.sqlite, params)
    claimed = conn.execute(_CLAIM_KEY_SQLITE.sqlite, params).fetchone() is not None
    record = back_to = None
    if not claimed:
        found = conn.execute(_RECORD.sqlite, params).fetchone()
        record = None if found is None else _record(found, decode=True)
        if (
            write.retry
            and record is not None
            and record.fingerprint == write.fingerprint
            and fence.effective_state(record, now) is RecordState.UNKNOWN
        ):
            conn.execute(_TAKE_OVER_SQLITE.sqlite, {**params, "taken_from": record.attempt})
            back_to = record
    ours = claimed or back_to is not None
    return Admission(
        now=now,
        presented=presented,
        highest=max(presented.generation, highest or 0),
        claimed=claimed,
        attempt=attempt if ours else None,
        record=record,
        older_in_flight=ours and bool(row["older_in_flight"]),
        back_to=back_to,
    )


def _presented(row: Any) -> tuple[Presented | None, int | None]:
    """The lease a token presents and its job's fence, from a ``_PRESENTED`` row."""
    if row["job_id"] is None:
        return None, None
    if row["state"] is None:  # the job has been purged
        return Presented(row["job_id"], row["lease_generation"], row["lease_owner"], None), None
    presented = Presented(row["job_id"], row["lease_generation"], row["lease_owner"], _job(row))
    return presented, row["fence_generation"]


def _job(row: Any) -> rules.Job:
    """The job's columns of an admission row, for the rules to judge."""
    return rules.Job(
        row["job_id"],
        State(row["state"]),
        row["generation"],
        owner=row["owner"],
        lease_expires_at=row["lease_expires_at"],
        attempts=row["attempts"],
        max_attempts=row["max_attempts"],
    )


def _record(row: Any, *, decode: bool = False) -> Record:
    """A record's row; ``decode``: a driver's row, whose JSON is still text."""
    headers = row["headers"]
    if decode and isinstance(headers, str):
        headers = json.loads(headers)
    return Record(
        fingerprint=row["fingerprint"],
        state=RecordState(row["state"]),
        generation=row["generation"],
        attempt=row["attempt"],
        deadline=row["deadline"],
        status=row["status"],
        headers=[(str(k), str(v)) for k, v in headers] if headers is not None else None,
        body=row["body"],
    )
