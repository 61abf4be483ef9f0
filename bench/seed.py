"""The rows a run starts from: idempotency records and audit rows within retention,
finished and leased jobs in the claim queue, settled records of the jobs the writes will
lease, and pending jobs for each claim run; bulk-inserted (``Database.insert``)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

from bench.pgadmin import Database

CLAIM_QUEUE = "bench"
UPSTREAM_NAME = "bench"
WRITE_PATH = "/bench/charge"

RECORD_COLUMNS = (
    "job_id",
    "key",
    "fingerprint",
    "state",
    "generation",
    "attempt",
    "upstream",
    "method",
    "path",
    "deadline",
    "status",
    "headers",
    "body",
    "created_at",
    "updated_at",
)
AUDIT_COLUMNS = (
    "at",
    "reason",
    "status",
    "job_id",
    "generation",
    "highest_generation",
    "owner",
    "upstream",
    "method",
    "path",
    "idempotency_key",
    "client",
    "fingerprint",
)
JOB_COLUMNS = (
    "job_id",
    "queue",
    "state",
    "generation",
    "owner",
    "lease_token_hash",
    "lease_ttl_seconds",
    "lease_expires_at",
    "claimable_at",
    "attempts",
    "max_attempts",
    "payload",
    "result",
    "created_at",
    "updated_at",
)
LEASE_COLUMNS = ("token_hash", "job_id", "generation", "owner", "granted_at", "expires_at")
SEED_JOBS_SPREAD = 10_000  # seeded records belong to this many (made-up) jobs


def seed_records(db: Database, target: int) -> dict[str, int]:
    """Top idempotency_records and audit_log up to ``target`` rows each (settled records
    and rejections within retention, as a busy gateway accumulates them)."""
    now = time.time()
    tag = secrets.token_hex(3)
    added = {}
    have = db.count("idempotency_records")
    missing = max(0, target - have)
    headers = json.dumps([["Content-Type", "application/json"]])
    body = b'{"id":"ch_seed","status":"succeeded"}'
    added["idempotency_records"] = db.insert(
        "idempotency_records",
        RECORD_COLUMNS,
        (
            (
                f"seed-{i % SEED_JOBS_SPREAD:05d}",
                f"seed-{tag}-{i}",
                f"{i:064x}",
                "completed",
                1,
                f"{i:032x}",
                UPSTREAM_NAME,
                "POST",
                "charge",
                now - 3600 + 30,
                201,
                headers,
                body,
                now - 3600 * (i / max(missing, 1)),
                now - 3600 * (i / max(missing, 1)),
            )
            for i in range(missing)
        ),
    )
    have = db.count("audit_log")
    missing = max(0, target - have)
    added["audit_log"] = db.insert(
        "audit_log",
        AUDIT_COLUMNS,
        (
            (
                now - 86400 * (i / max(missing, 1)),
                "stale-generation",
                409,
                f"seed-{i % SEED_JOBS_SPREAD:05d}",
                1,
                2,
                "worker-seed",
                UPSTREAM_NAME,
                "POST",
                WRITE_PATH,
                f"seed-{tag}-{i}",
                "127.0.0.1",
                f"{i:064x}",
            )
            for i in range(missing)
        ),
    )
    return added


def seed_job_records(db: Database, tag: str, jobs: int, per_job: int) -> int:
    """``per_job`` settled records for each job the writes run with ``tag`` will lease
    (the driver's job ids: ``{tag}-w{i}``), as a job that has written that often has."""
    now = time.time()
    headers = json.dumps([["Content-Type", "application/json"]])
    body = b'{"id":"ch_seed","status":"succeeded"}'
    return db.insert(
        "idempotency_records",
        RECORD_COLUMNS,
        (
            (
                f"{tag}-w{i % jobs}",
                f"seed-{i}",
                f"{i:064x}",
                "completed",
                1,
                f"{i:032x}",
                UPSTREAM_NAME,
                "POST",
                "charge",
                now - 3600 + 30,
                201,
                headers,
                body,
                now - 3600,
                now - 3600,
            )
            for i in range(jobs * per_job)
        ),
    )


def seed_jobs(db: Database, count: int) -> None:
    """Jobs in the claim queue that must not slow a claim down: half completed, half
    leased far into the future (each with its grant in ``leases``)."""
    now = time.time()
    tag = secrets.token_hex(3)
    payload = json.dumps({"order": 1})

    def jobs() -> Iterator[tuple[Any, ...]]:
        for i in range(count):
            done = bool(i % 2)
            yield (
                f"seed-{'done' if done else 'held'}-{tag}-{i}",
                CLAIM_QUEUE,
                "completed" if done else "leased",
                1,
                "worker-seed",
                None if done else _seed_hash(tag, i),
                86400.0,
                None if done else now + 86400,
                None if done else now + 86400,
                1,
                3,
                payload,
                json.dumps({"ok": True}) if done else None,
                now - 7200,
                now - 3600 if done else now,
            )

    def grants() -> Iterator[tuple[Any, ...]]:
        for i in range(count):
            done = bool(i % 2)
            yield (
                _seed_hash(tag, i),
                f"seed-{'done' if done else 'held'}-{tag}-{i}",
                1,
                "worker-seed",
                now - 7000,
                now - 6000 if done else now + 86400,
            )

    db.insert("jobs", JOB_COLUMNS, jobs())
    db.insert("leases", LEASE_COLUMNS, grants())


def _seed_hash(tag: str, i: int) -> str:
    return f"{tag}{i:058x}"


def add_pending(db: Database, count: int) -> None:
    """``count`` pending jobs, due now, in the claim queue."""
    now = time.time()
    tag = secrets.token_hex(3)
    payload = json.dumps({"order": 1})
    db.insert(
        "jobs",
        JOB_COLUMNS,
        (
            (
                f"pending-{tag}-{i}",
                CLAIM_QUEUE,
                "pending",
                0,
                None,
                None,
                None,
                None,
                now - 600 + i * 1e-4,
                0,
                3,
                payload,
                None,
                now - 600,
                now - 600,
            )
            for i in range(count)
        ),
    )
