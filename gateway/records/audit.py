"""The audit of every request the gateway answered itself (rejections and replays)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import logging
import math
import re
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote_plus

import sqlalchemy as sa

from gateway.config import REPLICA_NAME, SOURCE_NAME, GatewaySettings
from gateway.fencing.fence import GATEWAY_REASONS, source_of
from gateway.observe.metrics import AUDIT, GatewayMetrics
from gateway.records.schema import audit
from lease_core import exceptions as lease_exc
from lease_core.backend import PURGE_BATCH
from lease_core.statement import MAX_BATCH
from lease_core.store import LeaseStore, rfc3339

FENCEGATE_SOURCE = "fencegate"  # the gateway's own leases (``source_of``)

log = logging.getLogger("fencegate.audit")

MAX_PAGE = 500
MAX_NAMED_REPLICAS = 20  # replicas a refused replica filter names at most
REASON_VALUES = tuple(sorted(r.value for r in GATEWAY_REASONS))  # the filter takes these
MAX_PATH = 2000  # characters of an entry's path
MAX_GROUP_PATH = 200  # characters of a grouped entry's path: the group's path prefix
OVERFLOW = "*"  # method and path of a bucket's overflow row
# Entries being written behind their answers at most; past it a new one is dropped (and
# logged): a database that answers slowly must not make the gateway's memory grow.
MAX_PENDING = 10_000
# How long the writer waits for more entries before it writes what it has (unless a whole
# batch is waiting): entries given within it share one statement, so a replay's or a
# refusal's entry costs a share of a round trip, not one of its own, even when they come
# one at a time. The entry's time is the database's clock when it is written.
GATHER_SECONDS = 0.01


@dataclass(frozen=True, slots=True)
class AuditEntry:
    reason: str
    status: int
    method: str
    path: str
    job_id: str | None = None
    generation: int | None = None
    highest_generation: int | None = None
    owner: str | None = None
    upstream: str | None = None
    idempotency_key: str | None = None
    client: str | None = None
    fingerprint: str | None = None
    body: bytes | None = None


@dataclass(frozen=True, slots=True)
class AuditQuery:
    job_id: str | None = None
    reason: str | None = None
    upstream: str | None = None
    # "fencegate" (the gateway's own leases) or a [[lease_sources]] name
    source: str | None = None
    # the replica that answered (``gateway.replica_name``)
    replica: str | None = None
    since: float | None = None
    until: float | None = None
    limit: int = 100
    cursor: str | None = None


class Audit:
    """Writes and reads the audit.

    An entry with a job behind it (a real lease's refusal or replay) is one row. An entry
    without (no token, a made-up one, an unknown upstream: anything anyone can send) is
    counted in a grouped row instead, one per (reason, status, upstream, method, path
    prefix, client, replica) and time bucket, so what unauthenticated traffic makes the
    database hold is bounded: per bucket and replica at most
    ``audit_unauthenticated_groups`` rows, and then one overflow row per reason and
    status, kept for ``audit_unauthenticated_retention_days``. The row keeps the first
    request's details.

    Every entry names the replica that answered (``gateway.replica_name``). The replica
    is part of a grouped row's group: a row counts only its own replica's requests, so
    the ``replica`` filter is exact, at the price of one row per group and replica (the
    bound above was per replica already).
    """

    def __init__(self, lease_store: LeaseStore, settings: GatewaySettings | None = None) -> None:
        self.backend = lease_store.backend  # the database handle the lease store uses
        self.settings = settings or GatewaySettings()
        self.replica = self.settings.replica  # resolved once: the hostname may change
        self._bucket: int | None = None
        self._groups: set[str] = set()  # this bucket's group keys, as many as allowed
        # What the previous purge removed everything older than (``purge``).
        self._purged_before = -math.inf
        self._grouped_purged_before = -math.inf
        # Entries given, not yet being written, each with the injected clock's reading
        # when it was given (None: the database's clock, when it is written).
        self._queue: list[tuple[AuditEntry, float | None]] = []
        self._writer: asyncio.Future[None] | None = None
        # Each entry's write, timed (``fencegate_write_phase_seconds{phase="audit"}``).
        self._timed = GatewayMetrics.of(self.backend.metrics.registry).phase[AUDIT]

    def record(self, entry: AuditEntry) -> None:
        """Write one entry behind the answer: the answer does not wait for it. Entries
        are written in the order given, those given within ``GATHER_SECONDS`` of each
        other together (on PostgreSQL one statement for a run of them: the catalogue's
        ``audit`` has a shared form).
        Reads of the audit (``query``, the dashboard) and ``close`` wait for the entries
        given so far (``flush``). A database outage loses the entry, logged, never
        raised: the client has its answer already."""
        if len(self._queue) >= MAX_PENDING:
            log.warning(
                "audit entry lost (%d entries waiting to be written): %s %s",
                len(self._queue),
                entry.reason,
                entry.method,
            )
            return
        self._queue.append((entry, self.backend.injected_now()))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write_queued())

    async def flush(self) -> None:
        """Until every entry given so far is written (or lost)."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)

    async def close(self) -> None:
        """At shutdown: the entries still waiting, written."""
        await self.flush()

    async def _write_queued(self) -> None:
        """The entries in the order given, until none wait: a run of entries with a lease
        behind them at once (one statement on PostgreSQL, in order), the grouped ones
        (upserts of their group's row) one after another."""
        while self._queue:
            if len(self._queue) < MAX_BATCH:
                await asyncio.sleep(GATHER_SECONDS)
            entries, self._queue = self._queue, []
            for grouped, run in itertools.groupby(entries, key=lambda e: e[0].job_id is None):
                if grouped:
                    for entry, at in run:
                        await self._write(entry, at)
                else:
                    given = list(run)
                    for first in range(0, len(given), MAX_BATCH):  # one batch at a time
                        batch = given[first : first + MAX_BATCH]
                        await asyncio.gather(*(self._write(entry, at) for entry, at in batch))

    async def _write(self, entry: AuditEntry, at: float | None) -> None:
        values = asdict(entry)
        values["now"] = at
        values["path"] = values["path"][:MAX_PATH]
        values["replica"] = self.replica
        operation = "audit"
        if entry.job_id is None:
            operation = "audit_grouped"
            values["body"] = None
            values["group_key"] = self._group(values)
        began = time.perf_counter()
        try:
            await self.backend.run(operation, **values)
            self._timed.observe(time.perf_counter() - began)
        except lease_exc.StoreUnavailable:
            log.warning(
                "audit entry lost (database unavailable): %s %s %s",
                entry.reason,
                entry.method,
                values["path"],
            )
        except Exception:
            log.exception("audit entry lost: %s %s %s", entry.reason, entry.method, values["path"])

    def _group(self, values: dict[str, Any]) -> str:
        """The key of the row this entry is counted in (``values`` becomes that row's).
        Past this bucket's allowance of groups, the reason's overflow row."""
        now = values["now"]  # the injected clock's reading when the entry was given
        bucket = int(
            (time.time() if now is None else now)
            // self.settings.audit_unauthenticated_bucket_seconds
        )
        if bucket != self._bucket:
            self._bucket, self._groups = bucket, set()
        values["path"] = values["path"][:MAX_GROUP_PATH]
        fields = ("reason", "status", "upstream", "method", "path", "client", "replica")
        key = _digest(bucket, *(values[f] for f in fields))
        if key in self._groups:
            return key
        if len(self._groups) < self.settings.audit_unauthenticated_groups:
            self._groups.add(key)
            return key
        values.update(
            method=OVERFLOW,
            path=OVERFLOW,
            upstream=None,
            client=None,
            idempotency_key=None,
            fingerprint=None,
        )
        return _digest(bucket, values["reason"], values["status"], values["replica"], OVERFLOW)

    async def query(
        self,
        q: AuditQuery,
        *,
        upstreams: Collection[str] | None = None,
        sources: Collection[str] | None = None,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """Newest first; ``next_cursor`` continues after the last item. A filter that
        can never match is refused (``InvalidRequest`` naming the valid values): a reason
        that is not one, an upstream neither in ``upstreams`` (the configured ones) nor
        in the audit (one removed since), a source neither ``fencegate``, nor in
        ``sources`` (the configured lease sources), nor in the audit, a replica that no
        entry names."""
        check_reason(q.reason)
        check_replica(q.replica)
        await self.flush()  # this process's entries given so far are in
        if q.upstream is not None and upstreams is not None:
            await self.check_upstream(q.upstream, upstreams)
        if q.source is not None:
            await self.check_source(q.source, sources)
        if q.replica is not None:
            await self.check_replica_audited(q.replica)
        stmt = sa.select(audit).order_by(audit.c.id.desc()).limit(q.limit + 1)
        for column, value in (
            (audit.c.job_id, q.job_id),
            (audit.c.reason, q.reason),
            (audit.c.upstream, q.upstream),
            (audit.c.replica, q.replica),
        ):
            if value is not None:
                stmt = stmt.where(column == value)
        if q.source is not None:
            stmt = stmt.where(source_is(q.source))
        if q.since is not None:
            stmt = stmt.where(audit.c.at >= q.since)
        if q.until is not None:
            stmt = stmt.where(audit.c.at < q.until)
        if q.cursor is not None:
            stmt = stmt.where(audit.c.id < decode_cursor(q.cursor))
        async with self.backend.transaction() as conn:
            rows = (await conn.execute(stmt)).mappings().all()
        items = [entry_json(row) for row in rows[: q.limit]]
        next_cursor = encode_cursor(rows[q.limit - 1]["id"]) if len(rows) > q.limit else None
        return items, next_cursor

    async def check_upstream(self, name: str, configured: Collection[str]) -> None:
        if name in configured:
            return
        await self.flush()
        stmt = sa.select(audit.c.id).where(audit.c.upstream == name).limit(1)
        async with self.backend.transaction() as conn:
            if (await conn.execute(stmt)).first() is not None:
                return
        raise lease_exc.InvalidRequest(
            f"upstream: {name[:100]!r} is not a configured upstream and is not in the audit; "
            f"configured: {', '.join(sorted(configured)) or 'none'}.",
            field="upstream",
        )

    async def check_replica_audited(self, name: str) -> None:
        """A replica filter that can never match is refused, naming the replicas the
        audit holds: replicas are configured nowhere, so one that no entry names is a
        typo or has answered nothing (yet). Like ``check_upstream``'s, the look-up is the
        filtered query's own read (no index on the column: every entry would pay for
        it), and the list of names is read only to answer a mistake."""
        stmt = sa.select(audit.c.id).where(audit.c.replica == name).limit(1)
        async with self.backend.transaction() as conn:
            if (await conn.execute(stmt)).first() is not None:
                return
            names_q = (
                sa.select(audit.c.replica)
                .where(audit.c.replica.is_not(None))
                .distinct()
                .order_by(audit.c.replica)
                .limit(MAX_NAMED_REPLICAS + 1)
            )
            names = list((await conn.execute(names_q)).scalars())
        more = ", …" if len(names) > MAX_NAMED_REPLICAS else ""
        raise lease_exc.InvalidRequest(
            f"replica: {name[:100]!r} answered nothing in the audit; replicas in the audit: "
            f"{', '.join(names[:MAX_NAMED_REPLICAS]) or 'none'}{more}.",
            field="replica",
        )

    async def check_source(self, name: str, configured: Collection[str] | None) -> None:
        if name == FENCEGATE_SOURCE or (
            re.fullmatch(SOURCE_NAME, name) is not None
            and (configured is None or name in configured)
        ):
            return
        if re.fullmatch(SOURCE_NAME, name) is not None:
            await self.flush()
            stmt = sa.select(audit.c.id).where(source_is(name)).limit(1)
            async with self.backend.transaction() as conn:
                if (await conn.execute(stmt)).first() is not None:
                    return
        known = sorted({FENCEGATE_SOURCE, *(configured or ())})
        raise lease_exc.InvalidRequest(
            f"source: {name[:100]!r} is not a configured lease source and is not in the "
            f"audit; configured: {', '.join(known)}.",
            field="source",
        )

    async def purge(
        self,
        older_than_seconds: float,
        grouped_older_than_seconds: float | None = None,
        *,
        batch: int = PURGE_BATCH,
    ) -> int:
        """Entries older than ``older_than_seconds``, grouped ones (requests without a
        lease) older than ``grouped_older_than_seconds``, ``batch`` per transaction; how
        many rows went.

        A call looks only at the entries that crossed those ages since the previous
        call's cutoffs (an entry's ``at`` never changes, a grouped row's ``last_at`` only
        grows): the first call of a process looks at all of them."""
        await self.flush()  # this process's entries given so far are in, to be judged too
        purged, row = await self.backend.run_in_batches(
            "purge_audit",
            batch=batch,
            older_than=float(older_than_seconds),
            grouped_older_than=(
                None if grouped_older_than_seconds is None else float(grouped_older_than_seconds)
            ),
            since=self._purged_before,
            grouped_since=self._grouped_purged_before,
        )
        self._purged_before = float(row["cutoff"])
        if row["grouped_cutoff"] is not None:
            self._grouped_purged_before = float(row["grouped_cutoff"])
        return purged


def audit_path(raw_path: str, allowed: Collection[str] = ()) -> str:
    """The request target as the audit keeps it: the path, and of the query only the
    parameters named in ``allowed`` (as sent, in the order sent). A query can carry
    credentials, so nothing else of it is kept."""
    path, sep, query = raw_path.partition("?")
    if not sep or not allowed:
        return path
    kept = [p for p in query.split("&") if unquote_plus(p.partition("=")[0]) in allowed]
    return f"{path}?{'&'.join(kept)}" if kept else path


def source_is(name: str) -> sa.ColumnElement[bool]:
    """The entries of one lease source, by their job ids (``source_of``): the gateway's
    own have no ``/``; a source's start with ``<name>/`` (LIKE, its ``_`` escaped; not a
    range of the index: a locale collation may skip the ``/``)."""
    if name == FENCEGATE_SOURCE:
        return sa.and_(audit.c.job_id.is_not(None), ~audit.c.job_id.contains("/"))
    return audit.c.job_id.startswith(f"{name}/", autoescape=True)


def check_reason(value: str | None) -> None:
    if value is not None and value not in REASON_VALUES:
        raise lease_exc.InvalidRequest(
            f"reason: {value[:100]!r} is not a reason; one of: {', '.join(REASON_VALUES)}.",
            field="reason",
        )


def check_replica(value: str | None) -> None:
    """A replica filter must be a name a replica can have (before the database is read;
    ``Audit.check_replica_audited`` then asks the audit)."""
    if value is not None and re.fullmatch(REPLICA_NAME, value) is None:
        raise lease_exc.InvalidRequest(
            f"replica: {value[:100]!r} is not a replica name (1 to 100 letters, digits and "
            "._:-, starting with a letter or a digit).",
            field="replica",
        )


def entry_json(row: Any) -> dict[str, Any]:
    body = row["body"]
    return {
        "id": row["id"],
        "at": rfc3339(row["at"]),
        "reason": row["reason"],
        "status": row["status"],
        "job_id": row["job_id"],
        # The lease source: "fencegate" (the gateway's own leases) or a [[lease_sources]]
        # name, the prefix of its namespaced job ids; None without a lease behind it.
        "source": None if row["job_id"] is None else source_of(row["job_id"]),
        "generation": row["generation"],
        "highest_generation": row["highest_generation"],
        "owner": row["owner"],
        "upstream": row["upstream"],
        "method": row["method"],
        "path": row["path"],
        "idempotency_key": row["idempotency_key"],
        "client": row["client"],
        # The replica that answered (``gateway.replica_name``); None before migration 0011.
        "replica": row["replica"],
        "fingerprint": row["fingerprint"],
        "count": row["count"],
        "last_at": rfc3339(row["last_at"] if row["last_at"] is not None else row["at"]),
        **({"body": base64.b64encode(body).decode()} if body is not None else {}),
    }


def _digest(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def encode_cursor(entry_id: int) -> str:
    return base64.urlsafe_b64encode(f"a{entry_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        if not raw.startswith("a") or not raw[1:].isdigit():
            raise ValueError(cursor)
        return int(raw[1:])
    except (ValueError, UnicodeDecodeError) as error:
        raise lease_exc.InvalidRequest(
            "cursor: not a cursor this server gave out.", field="cursor"
        ) from error


def parse_time(value: str, field: str) -> float:
    """RFC 3339 (``2026-12-02T10:00:00Z``) or seconds since the epoch."""
    try:
        if value.replace(".", "", 1).isdigit():
            return float(value)
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return moment.timestamp()
    except ValueError as error:
        raise lease_exc.InvalidRequest(
            f"{field}: must be an RFC 3339 time or seconds since the epoch.", field=field
        ) from error
