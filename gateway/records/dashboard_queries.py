"""The dashboard's reads: audit entries counted per time bucket and reason, per upstream
the writes forwarded, replayed and refused, and one job's timeline (grants, forwarded
writes, refusals and replays).

Times are seconds since the epoch (floats) in the database and RFC 3339 strings in the
answers. Counting is done by the database (``GROUP BY`` the bucket number), so a month of
audit costs one indexed range scan, not a month of rows in Python.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from gateway.fencing import fence
from gateway.records.schema import audit, requests
from lease_core.backend import Backend
from lease_core.schema import jobs, leases
from lease_core.store import rfc3339

# The bucket sizes picked when the caller names none: the smallest that keeps the chart
# under ``TARGET_BUCKETS`` bars.
NICE_BUCKETS = (
    1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
    86400, 604800,
)  # fmt: skip
TARGET_BUCKETS = 120
MAX_BUCKETS = 1000
MAX_BUCKET_SECONDS = 31 * 86400
DEFAULT_WINDOW_SECONDS = 86400.0
MAX_WINDOW_SECONDS = 366 * 86400
# Events of each kind a timeline reads at most (the newest ones).
MAX_TIMELINE = 2000

# Within one instant a grant comes before the writes it allows, a write before the
# refusals that it causes.
_KIND_ORDER = {"grant": 0, "forward": 1, "refusal": 2, "replay": 2}


@dataclass(frozen=True, slots=True)
class Window:
    """``[since, until)`` cut into buckets of ``bucket_seconds`` aligned to the epoch."""

    since: float
    until: float
    bucket_seconds: int

    @property
    def first_bucket(self) -> int:
        return math.floor(self.since / self.bucket_seconds)

    @property
    def bucket_count(self) -> int:
        return max(1, math.ceil(self.until / self.bucket_seconds) - self.first_bucket)


def default_bucket(span: float) -> int:
    for size in NICE_BUCKETS:
        if span / size <= TARGET_BUCKETS:
            return size
    return min(MAX_BUCKET_SECONDS, math.ceil(span / TARGET_BUCKETS))


def _bucket_number(backend: Backend, bucket_seconds: int) -> sa.ColumnElement[Any]:
    # The size is a validated int written into the statement, so the expression in the
    # select list and in GROUP BY is the same text (PostgreSQL compares them textually;
    # two bind parameters would not match).
    size = sa.literal_column(str(int(bucket_seconds)), sa.Float)
    return backend.floor(audit.c.at / size)


async def refusals_over_time(
    backend: Backend,
    window: Window,
    *,
    upstream: str | None = None,
    job_id: str | None = None,
    configured: Collection[str] = (),
    records_since: float | None = None,
) -> dict[str, Any]:
    """Refusals audited in ``[since, until)`` per bucket and reason, every bucket present
    (empty ones with no counts) so a chart can draw them as they come; replays
    (``idempotent-replay``) are counted apart, per bucket and in all. Per upstream
    (``configured`` ones always listed), the writes forwarded, replayed and refused
    (``upstream_counts``); the forwarded ones are counted from ``records_since`` (the
    oldest admission the idempotency records surely still hold) when that is later than
    ``since``. The replicas that answered in the window, for the table's filter, and the
    oldest entry of the audit (``first_at``), whatever the window."""
    stmt = _audited(backend, window, upstream=upstream, job_id=job_id)
    forwarded_since = window.since if records_since is None else max(window.since, records_since)
    forwarded_q = _forwarded(forwarded_since, window.until, upstream=upstream, job_id=job_id)
    async with backend.transaction() as conn:
        rows = (await conn.execute(stmt)).all()
        forwarded = {name: int(n) for name, n in (await conn.execute(forwarded_q)).all()}
        first_at = (await conn.execute(_first_entry(upstream, job_id))).scalar()

    # Configured upstreams, and those written to in the window (one removed since);
    # any other name (an unknown upstream that anyone can ask for) is counted as None.
    named = set(forwarded) | (set(configured) if upstream is None else {upstream})
    tally = _tally(rows, window, named)
    known = [r.value for r in fence.GATEWAY_REASONS]
    order = {reason: i for i, reason in enumerate(known)}
    present = sorted(tally.totals, key=lambda r: (order.get(r, len(order)), r))
    per_upstream = tally.per_upstream
    for name in named:
        per_upstream.setdefault(name, _no_writes())["forwarded"] = forwarded.get(name, 0)
    return {
        "since": rfc3339(window.since),
        "until": rfc3339(window.until),
        "bucket_seconds": window.bucket_seconds,
        # Refusals only: ``reasons``, ``totals`` and each bucket's ``counts``/``total``.
        "reasons": present,
        # Every reason the audit can hold (the table's filter), replays included.
        "known_reasons": known,
        "totals": {r: tally.totals[r] for r in present},
        "replays": tally.replay_total,
        "buckets": _buckets(window, tally, present),
        # Per upstream in the window, by name (None, last: refusals that named no
        # configured upstream): ``forwarded`` from ``forwarded_since`` on.
        "upstream_counts": [
            {"upstream": name, **per_upstream[name]}
            for name in sorted(per_upstream, key=lambda u: (u is None, u or ""))
        ],
        "forwarded_since": rfc3339(forwarded_since),
        "replicas": sorted(tally.replicas),
        # The oldest entry the audit keeps (same filters, any time), or None: the page
        # picks its window from it ("since the first entry").
        "first_at": None if first_at is None else rfc3339(float(first_at)),
    }


def _first_entry(upstream: str | None, job_id: str | None) -> sa.Select[Any]:
    """The time of the audit's oldest entry (one end of the index on ``at``)."""
    stmt = sa.select(sa.func.min(audit.c.at))
    if upstream is not None:
        stmt = stmt.where(audit.c.upstream == upstream)
    if job_id is not None:
        stmt = stmt.where(audit.c.job_id == job_id)
    return stmt


def _audited(
    backend: Backend, window: Window, *, upstream: str | None, job_id: str | None
) -> sa.Select[Any]:
    """The audit's entries in the window, summed per bucket, reason, upstream and
    replica."""
    bucket = _bucket_number(backend, window.bucket_seconds).label("bucket")
    stmt = (
        # A grouped entry stands for ``count`` requests.
        sa.select(
            bucket,
            audit.c.reason,
            audit.c.upstream,
            audit.c.replica,
            sa.func.sum(audit.c.count).label("n"),
        )
        .where(audit.c.at >= window.since, audit.c.at < window.until)
        .group_by(bucket, audit.c.reason, audit.c.upstream, audit.c.replica)
    )
    if upstream is not None:
        stmt = stmt.where(audit.c.upstream == upstream)
    if job_id is not None:
        stmt = stmt.where(audit.c.job_id == job_id)
    return stmt


@dataclass(slots=True)
class _Tally:
    """The audit's sums of one window: refusals per bucket and reason, replays apart,
    what each upstream refused and replayed, the replicas that answered."""

    counts: list[dict[str, int]]
    replays: list[int]
    totals: dict[str, int] = field(default_factory=dict)
    replay_total: int = 0
    per_upstream: dict[str | None, dict[str, int]] = field(default_factory=dict)
    replicas: set[str] = field(default_factory=set)


def _tally(rows: Sequence[Sequence[Any]], window: Window, named: set[str]) -> _Tally:
    """Sum the audit's rows into the window's buckets; an upstream not in ``named`` is
    counted as None."""
    first = window.first_bucket
    tally = _Tally(
        counts=[{} for _ in range(window.bucket_count)], replays=[0] * window.bucket_count
    )
    counts, totals = tally.counts, tally.totals
    for number, reason, name, replica, n in rows:
        index = int(number) - first
        inside = 0 <= index < len(counts)
        if replica is not None:
            tally.replicas.add(replica)
        replayed = reason == fence.Reason.IDEMPOTENT_REPLAY
        kind = "replayed" if replayed else "refused"
        row = tally.per_upstream.setdefault(name if name in named else None, _no_writes())
        row[kind] += int(n)
        # A replay is the stored answer of a write that was forwarded once: the worker
        # got what it asked for, nothing was refused. Counted apart, never charted.
        if replayed:
            tally.replay_total += int(n)
            if inside:
                tally.replays[index] += int(n)
            continue
        if inside:
            counts[index][reason] = counts[index].get(reason, 0) + int(n)
        totals[reason] = totals.get(reason, 0) + int(n)
    return tally


def _buckets(window: Window, tally: _Tally, present: list[str]) -> list[dict[str, Any]]:
    """Every bucket of the window, the empty ones too, with its refusals and replays."""
    size = window.bucket_seconds
    first = window.first_bucket
    return [
        {
            "start": rfc3339((first + i) * size),
            "end": rfc3339((first + i + 1) * size),
            "counts": {r: c[r] for r in present if r in c},
            "total": sum(c.values()),
            "replays": tally.replays[i],
        }
        for i, c in enumerate(tally.counts)
    ]


def _no_writes() -> dict[str, int]:
    return {"forwarded": 0, "replayed": 0, "refused": 0}


def _forwarded(
    since: float, until: float, *, upstream: str | None, job_id: str | None
) -> sa.Select[Any]:
    """Fenced writes forwarded per upstream, admitted in ``[since, until)``.

    Read from the idempotency records, one per (job, key) and admitted write (a write
    without a key has one too), created when the write is admitted and forwarded and
    deleted if nothing of it was sent: every replica's writes are there, in the one
    database, so the count is the same whichever replica answers, and no write pays for
    it. The replicas' own counters (``fencegate_gateway_decisions``) count only their
    own process since it started; a counter table would cost every write an update of a
    row that all replicas contend for. A record's ``created_at`` is not indexed, but
    it never exceeds its ``updated_at``, which is: the range on ``updated_at`` limits
    the read to records that changed hands since ``since``, bounded on both sides (to
    infinity): to a planner with no statistics "since" alone is a third of the table,
    read whole, where a range is a small part of the index. A record counts once
    however often its write was sent (a retry after an unknown outcome, the resolver's
    re-sends), and completed records are purged ``idempotency_retention_seconds`` after
    they changed hands, so the caller counts only from then on (``records_since``)."""
    stmt = (
        sa.select(requests.c.upstream, sa.func.count().label("n"))
        .where(
            requests.c.updated_at >= since,
            requests.c.updated_at <= math.inf,
            requests.c.created_at >= since,
            requests.c.created_at < until,
        )
        .group_by(requests.c.upstream)
    )
    if upstream is not None:
        stmt = stmt.where(requests.c.upstream == upstream)
    if job_id is not None:
        stmt = stmt.where(requests.c.job_id == job_id)
    return stmt


async def job_timeline(backend: Backend, job_id: str, limit: int) -> dict[str, Any]:
    """Grants, forwarded writes (with their outcome) and the gateway's own answers for one
    job, oldest first; at most the newest ``limit`` events."""
    async with backend.transaction() as conn:
        grants = (await conn.execute(_grants(job_id, limit))).mappings().all()
        writes = (await conn.execute(_writes(job_id, limit))).mappings().all()
        answers = (await conn.execute(_answers(job_id, limit))).mappings().all()
        job = (await conn.execute(_job(job_id))).mappings().first()

    events = [*_grant_events(grants), *_write_events(writes), *_answer_events(answers)]
    # A source that had more than ``limit`` rows is complete only back to its oldest row
    # read: older events of the other sources are dropped too, so no gap shows as calm.
    cutoff = max(
        (
            float(rows[limit - 1][column])
            for rows, column in ((grants, "granted_at"), (writes, "created_at"), (answers, "at"))
            if len(rows) > limit
        ),
        default=-math.inf,
    )
    events = sorted((e for e in events if e[0] >= cutoff), key=lambda e: e[:3])
    truncated = cutoff > -math.inf or len(events) > limit
    return {
        "job_id": job_id,
        "job": None
        if job is None
        else {**job, "lease_expires_at": rfc3339(job["lease_expires_at"])},
        "events": [e[3] for e in events[-limit:]],
        "truncated": truncated,
    }


# Each source of the timeline reads one row more than ``limit``: whether it had more.


def _grants(job_id: str, limit: int) -> sa.Select[Any]:
    return (
        sa.select(leases.c.generation, leases.c.owner, leases.c.granted_at, leases.c.expires_at)
        .where(leases.c.job_id == job_id)
        .order_by(leases.c.granted_at.desc(), leases.c.generation.desc())
        .limit(limit + 1)
    )


def _writes(job_id: str, limit: int) -> sa.Select[Any]:
    return (
        sa.select(
            requests.c.key,
            requests.c.generation,
            requests.c.upstream,
            requests.c.method,
            requests.c.path,
            requests.c.state,
            requests.c.status,
            requests.c.note,
            requests.c.created_at,
            requests.c.updated_at,
            requests.c.settled_at,
        )
        .where(requests.c.job_id == job_id)
        .order_by(requests.c.created_at.desc())
        .limit(limit + 1)
    )


def _answers(job_id: str, limit: int) -> sa.Select[Any]:
    return (
        sa.select(
            audit.c.id,
            audit.c.at,
            audit.c.reason,
            audit.c.status,
            audit.c.generation,
            audit.c.highest_generation,
            audit.c.owner,
            audit.c.upstream,
            audit.c.method,
            audit.c.path,
            audit.c.idempotency_key,
        )
        .where(audit.c.job_id == job_id)
        .order_by(audit.c.at.desc(), audit.c.id.desc())
        .limit(limit + 1)
    )


def _job(job_id: str) -> sa.Select[Any]:
    return sa.select(
        jobs.c.job_id,
        jobs.c.queue,
        jobs.c.state,
        jobs.c.generation,
        jobs.c.owner,
        jobs.c.lease_expires_at,
        jobs.c.attempts,
        jobs.c.max_attempts,
    ).where(jobs.c.job_id == job_id)


Event = tuple[float, int, int, dict[str, Any]]


def _grant_events(grants: Sequence[sa.RowMapping]) -> list[Event]:
    """A grant's event, newest first as read (``seq`` keeps that order within an
    instant)."""
    return [
        _event(
            g["granted_at"],
            "grant",
            -seq,
            generation=g["generation"],
            owner=g["owner"],
            expires_at=rfc3339(g["expires_at"]),
        )
        for seq, g in enumerate(grants)
    ]


def _write_events(writes: Sequence[sa.RowMapping]) -> list[Event]:
    """A forwarded write's event, with how it ended once it did."""
    return [
        _event(
            w["created_at"],
            "forward",
            -seq,
            generation=w["generation"],
            upstream=w["upstream"],
            method=w["method"],
            path=w["path"],
            idempotency_key=None if fence.is_anonymous(w["key"]) else w["key"],
            state=w["state"],
            status=w["status"],
            note=w["note"],
            settled_at=rfc3339(w["settled_at"] or w["updated_at"])
            if w["state"] != "in_flight"
            else None,
        )
        for seq, w in enumerate(writes)
    ]


def _answer_events(answers: Sequence[sa.RowMapping]) -> list[Event]:
    """The gateway's own answer's event: a refusal, a replay or a resolution."""
    return [
        _event(
            a["at"],
            _answer_kind(a["reason"]),
            a["id"],
            reason=a["reason"],
            status=a["status"],
            generation=a["generation"],
            highest_generation=a["highest_generation"],
            owner=a["owner"],
            upstream=a["upstream"],
            method=a["method"],
            path=a["path"],
            idempotency_key=a["idempotency_key"],
        )
        for a in answers
    ]


def _answer_kind(reason: str) -> str:
    """The kind the timeline shows an audit entry as: the entries that are not refusals
    are replays and the gateway's own resolutions."""
    if reason == fence.Reason.IDEMPOTENT_REPLAY:
        return "replay"
    if reason == fence.Reason.AUTO_RESOLVED:
        return "resolution"
    return "refusal"


def _event(at: float, kind: str, seq: int, **fields: Any) -> Event:
    return (at, _KIND_ORDER[kind], seq, {"at": rfc3339(at), "kind": kind, **fields})
