"""The audit of every request the gateway answered itself (rejections and replays)."""

from __future__ import annotations

import base64
import logging
from collections.abc import Collection
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote_plus

import sqlalchemy as sa

from lease_core import exceptions as lease_exc
from lease_core.store import LeaseStore, rfc3339

from .schema import audit

log = logging.getLogger("fencegate.audit")

MAX_PAGE = 500


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
    since: float | None = None
    until: float | None = None
    limit: int = 100
    cursor: str | None = None


class Audit:
    def __init__(self, lease_store: LeaseStore) -> None:
        self.lease_store = lease_store

    async def record(self, entry: AuditEntry) -> None:
        """Write one entry. A database outage is logged, never raised: the client still
        gets its answer."""
        values = asdict(entry)
        values["path"] = values["path"][:2000]
        try:
            async with self.lease_store.transaction() as conn:
                await conn.execute(
                    sa.insert(audit).values(at=self.lease_store.dialect.now(), **values)
                )
        except lease_exc.StoreUnavailable:
            log.warning(
                "audit entry lost (database unavailable): %s %s %s",
                entry.reason,
                entry.method,
                entry.path,
            )

    async def query(self, q: AuditQuery) -> tuple[list[dict[str, Any]], str | None]:
        """Newest first; ``next_cursor`` continues after the last item."""
        stmt = sa.select(audit).order_by(audit.c.id.desc()).limit(q.limit + 1)
        for column, value in (
            (audit.c.job_id, q.job_id),
            (audit.c.reason, q.reason),
            (audit.c.upstream, q.upstream),
        ):
            if value is not None:
                stmt = stmt.where(column == value)
        if q.since is not None:
            stmt = stmt.where(audit.c.at >= q.since)
        if q.until is not None:
            stmt = stmt.where(audit.c.at < q.until)
        if q.cursor is not None:
            stmt = stmt.where(audit.c.id < decode_cursor(q.cursor))
        async with self.lease_store.transaction() as conn:
            rows = (await conn.execute(stmt)).mappings().all()
        items = [entry_json(row) for row in rows[: q.limit]]
        next_cursor = encode_cursor(rows[q.limit - 1]["id"]) if len(rows) > q.limit else None
        return items, next_cursor

    async def purge(self, older_than_seconds: float) -> int:
        now = self.lease_store.dialect.now()
        async with self.lease_store.transaction() as conn:
            result = await conn.execute(
                sa.delete(audit).where(audit.c.at < now - older_than_seconds)
            )
            return result.rowcount


def audit_path(raw_path: str, allowed: Collection[str] = ()) -> str:
    """The request target as the audit keeps it: the path, and of the query only the
    parameters named in ``allowed`` (as sent, in the order sent). A query can carry
    credentials, so nothing else of it is kept."""
    path, sep, query = raw_path.partition("?")
    if not sep or not allowed:
        return path
    kept = [p for p in query.split("&") if unquote_plus(p.partition("=")[0]) in allowed]
    return f"{path}?{'&'.join(kept)}" if kept else path


def entry_json(row: Any) -> dict[str, Any]:
    body = row["body"]
    return {
        "id": row["id"],
        "at": rfc3339(row["at"]),
        "reason": row["reason"],
        "status": row["status"],
        "job_id": row["job_id"],
        "generation": row["generation"],
        "highest_generation": row["highest_generation"],
        "owner": row["owner"],
        "upstream": row["upstream"],
        "method": row["method"],
        "path": row["path"],
        "idempotency_key": row["idempotency_key"],
        "client": row["client"],
        "fingerprint": row["fingerprint"],
        **({"body": base64.b64encode(body).decode()} if body is not None else {}),
    }


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
            "cursor: not a cursor this server gave out", field="cursor"
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
            f"{field}: must be an RFC 3339 time or seconds since the epoch", field=field
        ) from error
