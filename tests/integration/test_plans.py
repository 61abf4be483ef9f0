"""Every hot statement reads a bounded number of pages, and every statement of the
upkeep what it removes, whatever PostgreSQL's statistics say: none (tables never
analyzed), stale (analyzed while empty) or wrong (``job_id`` declared unique while one
job has 20,000 records). The machine's PostgreSQL runs with autovacuum off, so nothing
refreshes them in production either.

Measured with ``EXPLAIN (ANALYZE, BUFFERS)`` on the real statements of the catalogue, in
a transaction rolled back, with the plan PostgreSQL would choose for a one-off call and
the generic plan a prepared statement settles on."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest
import sqlalchemy as sa

from gateway.records import migrate
from lease_core import catalogue, tokens
from lease_core.db import create_engine
from lease_core.statement import Statement
from lease_core.store import LeaseStore
from tests.support import pg_admin, pg_url_of, postgres_unavailable

RECORDS = 20_000  # of the one job the writes go to
OTHER_JOBS = 5_000  # finished jobs in the claim queue, one record each
PAGES_PER_WRITE = 40  # a full read of the job's records is over 1,000
RECORDS_PAST_RETENTION = 20  # of those, settled a day and more ago
AUDIT_ENTRIES = 60_000  # within retention: about 660 pages of table
AUDIT_GROUPS = 2_000  # grouped rows within theirs
AUDIT_PAST_RETENTION = 20  # half of them grouped
SCENARIOS = ("none", "stale", "job_id-unique")
PLAN_MODES = ("auto", "force_generic_plan")
SQL = catalogue.load("postgresql")


def driver_url(url: str) -> str:
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture(params=SCENARIOS)
async def seeded(request: pytest.FixtureRequest) -> AsyncIterator[dict[str, Any]]:
    scenario = request.param
    name = f"fencegate_plans_{uuid.uuid4().hex[:8]}"
    try:
        await asyncio.wait_for(pg_admin(f'CREATE DATABASE "{name}"'), 10)
    except Exception as error:
        postgres_unavailable(f"{type(error).__name__}: {error}")
    url = pg_url_of(name)
    try:
        await asyncio.to_thread(migrate.upgrade, url)
        conn = await asyncpg.connect(driver_url(url))
        engine = create_engine(url)
        try:
            if scenario == "stale":
                await conn.execute("ANALYZE")
            store = LeaseStore(engine)
            lease = await store.acquire(job_id="hot", owner="w", ttl=600, queue="q")
            assert lease.lease_token is not None
            await conn.execute(
                """
INSERT INTO idempotency_records
SELECT 'hot', 'k' || g, repeat('f', 64), 'completed', 1, 'a' || g, 'u', 'POST', '/p', 0,
       201, '[]', decode(repeat('ab', 200), 'hex'), NULL, 0,
       CASE WHEN g <= $2 THEN 0 ELSE extract(epoch FROM now()) - 3600 END
FROM generate_series(1, $1) AS g""",
                RECORDS,
                RECORDS_PAST_RETENTION,
            )
            await conn.execute(
                """
INSERT INTO jobs (job_id, queue, state, generation, attempts, max_attempts, payload,
                  result, created_at, updated_at)
SELECT 'done' || g, 'q', 'completed', 1, 1, 3, 'null', 'null', 0, 0
FROM generate_series(1, $1) AS g""",
                OTHER_JOBS,
            )
            await conn.execute(
                """
INSERT INTO idempotency_records
SELECT 'done' || g, 'k', repeat('f', 64), 'completed', 1, 'a' || g, 'u', 'POST', '/p', 0,
       201, '[]', NULL, NULL, 0, extract(epoch FROM now()) - 3600
FROM generate_series(1, $1) AS g""",
                OTHER_JOBS,
            )
            # The audit: 30 days of entries as the upkeep finds them, nearly all within
            # retention, and grouped rows (requests without a lease) of the last day.
            await conn.execute(
                """
INSERT INTO audit_log (at, reason, status, job_id, method, path, count)
SELECT extract(epoch FROM now()) - 29 * 86400 + g * (29 * 86400.0 / $1),
       'forwarded', 201, 'hot', 'POST', '/p', 1
FROM generate_series(1, $1) AS g""",
                AUDIT_ENTRIES,
            )
            await conn.execute(
                """
INSERT INTO audit_log (at, last_at, group_key, reason, status, method, path, count)
SELECT extract(epoch FROM now()) - 3600, extract(epoch FROM now()) - 60, 'g' || g,
       'no-fencing-token', 401, 'POST', '/p', 1
FROM generate_series(1, $1) AS g""",
                AUDIT_GROUPS,
            )
            await conn.execute(
                """
INSERT INTO audit_log (at, last_at, group_key, reason, status, job_id, method, path, count)
SELECT extract(epoch FROM now()) - 40 * 86400,
       CASE WHEN g % 2 = 0 THEN extract(epoch FROM now()) - 2 * 86400 END,
       CASE WHEN g % 2 = 0 THEN 'old' || g END,
       'forwarded', 201, CASE WHEN g % 2 = 1 THEN 'hot' END, 'POST', '/p', 1
FROM generate_series(1, $1) AS g""",
                AUDIT_PAST_RETENTION,
            )
            if scenario == "job_id-unique":
                for table in ("idempotency_records", "fences", "jobs", "leases"):
                    await conn.execute(
                        f"ALTER TABLE {table} ALTER COLUMN job_id SET (n_distinct = -1)"
                    )
                await conn.execute("ANALYZE")
            yield {
                "url": driver_url(url),
                "token_hash": tokens.hash_token(lease.lease_token),
                "token": lease.lease_token,
            }
        finally:
            await conn.close()
            await engine.dispose()
    finally:
        await pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def cases(token_hash: str) -> dict[str, tuple[Statement | None, dict[str, Any], int]]:
    """Each hot statement with its parameters and how many writes it serves."""
    write = {
        "fingerprint": "f" * 64,
        "upstream": "u",
        "method": "POST",
        "path": "/p",
        "deadline_in": 30.0,
    }

    def admit(keys: list[str], retry: bool) -> dict[str, Any]:
        n = len(keys)
        return {
            "token_hash": [token_hash] * n,
            "key": keys,
            "attempt": [f"new-{k}" for k in keys],
            "retry": [retry] * n,
            **{name: [value] * n for name, value in write.items()},
        }

    def admit_one(key: str, retry: bool) -> dict[str, Any]:
        return {name: values[0] for name, values in admit([key], retry).items()}

    settle = {
        "job_id": ["hot"] * 4,
        "key": ["k1", "k2", "k3", "k4"],
        "attempt": ["a1", "a2", "a3", "a4"],
        "state": ["completed"] * 4,
        "status": [201] * 4,
        "headers": ["[]"] * 4,
        "body": [b"x"] * 4,
        "note": [None] * 4,
    }
    return {
        "admit a new key": (SQL["admit"].many, admit(["new"], False), 1),
        "admit a known key": (SQL["admit"].many, admit(["k5"], True), 1),
        "admit a new key, one caller": (SQL["admit"].statements[0], admit_one("new", False), 1),
        "admit a known key, one caller": (SQL["admit"].statements[0], admit_one("k5", True), 1),
        "admit 8 keys of one job": (SQL["admit"].many, admit([f"n{i}" for i in range(8)], True), 8),
        "settle 4": (SQL["settle"].many, settle, 4),
        "send-time read": (
            SQL["claim_state"].many,
            {"job_id": ["hot"], "key": ["k9"], "attempt": ["a9"]},
            1,
        ),
        "lease of a token": (SQL["lease_of_token"].statements[0], {"token_hash": token_hash}, 1),
        "lowest in flight": (SQL["lowest_in_flight"].statements[0], {"job_id": "hot"}, 1),
        "renew": (SQL["renew"].statements[0], {"token_hash": token_hash, "ttl": 600.0}, 1),
        "claim": (
            SQL["claim"].many,
            {"queue": ["q"], "owner": ["w2"], "token_hash": ["t" * 64], "ttl": [60.0]},
            1,
        ),
        # Not a write's own statement, but every resolve round runs it (every 2 s by
        # default) while the writes go on: it must not read every record either.
        "a resolver's claim": (
            SQL["claim_resolution"].statements[0],
            {
                "upstream": "u",
                "window": 86400.0,
                "max_attempts": 5,
                "pause": 1.0,
                "deadline_in": 30.0,
                "attempt": "resolve-1",
            },
            1,
        ),
    }


async def pages_read(url: str, statement: Statement, params: dict[str, Any], mode: str) -> int:
    text, names = statement.postgres(False)
    conn = await asyncpg.connect(url)
    try:
        transaction = conn.transaction()
        await transaction.start()
        try:
            await conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
            rows = await conn.fetch(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + text, *[params[n] for n in names]
            )
        finally:
            await transaction.rollback()
    finally:
        await conn.close()
    plan = json.loads(rows[0][0])[0]["Plan"]
    return int(plan.get("Shared Hit Blocks", 0)) + int(plan.get("Shared Read Blocks", 0))


async def test_hot_statements_read_a_bounded_number_of_pages(seeded: dict[str, Any]) -> None:
    read = {}
    for mode in PLAN_MODES:
        for label, (statement, params, writes) in cases(seeded["token_hash"]).items():
            assert statement is not None
            pages = await pages_read(seeded["url"], statement, params, mode)
            read[f"{label} ({mode})"] = pages / writes
    too_many = {label: pages for label, pages in read.items() if pages > PAGES_PER_WRITE}
    assert too_many == {}, f"pages read per write, over {PAGES_PER_WRITE}: {read}"


async def test_the_upkeep_reads_what_it_removes(seeded: dict[str, Any]) -> None:
    """The upkeep's statements (once a minute) find what is due through their indexes:
    with no statistics the audit's purge once read the whole audit, every minute. The
    first step of a process looks from the beginning (``since`` -Infinity), the next
    ones from the previous step's cutoffs."""
    day = 86400.0
    conn = await asyncpg.connect(seeded["url"])
    try:
        now = float(await conn.fetchval("SELECT extract(epoch FROM now())"))
    finally:
        await conn.close()
    audit = {
        "older_than": 30 * day,
        "grouped_older_than": day,
        "limit": None,
        "since": float("-inf"),
        "grouped_since": float("-inf"),
    }
    # Each with the rows it removes: a few pages each (its lock, its primary-key probe)
    # beside a few for the index it finds them in.
    steps: dict[str, tuple[str, dict[str, Any], int]] = {
        "audit, the first step": ("purge_audit", audit, AUDIT_PAST_RETENTION),
        "audit, a later step": (
            "purge_audit",
            {**audit, "since": now - 30 * day - 60, "grouped_since": now - day - 60},
            0,
        ),
        "records": ("purge_records", {"older_than": day, "limit": None}, RECORDS_PAST_RETENTION),
        "expired last attempts": ("fail_exhausted", {}, 0),
        "grants, the sweep": (
            "purge_grants",
            {"older_than": 30 * day, "since": float("-inf"), "until": float("inf")},
            0,
        ),
    }
    read = {}
    for mode in PLAN_MODES:
        for label, (name, params, _) in steps.items():
            pages = await pages_read(seeded["url"], SQL[name].statements[0], params, mode)
            read[f"{label} ({mode})"] = pages
    bound = {f"{label} ({mode})": 20 + 8 * removed
             for label, (_, _, removed) in steps.items() for mode in PLAN_MODES}  # fmt: skip
    too_many = {label: pages for label, pages in read.items() if pages > bound[label]}
    assert too_many == {}, f"pages read, over {bound}: {read}"
    # And each finds what is due, none of the rest.
    conn = await asyncpg.connect(seeded["url"])
    try:
        for label, (name, params, removed) in steps.items():
            text, names = SQL[name].statements[0].postgres(False)
            transaction = conn.transaction()
            await transaction.start()
            try:
                row = await conn.fetchrow(text, *[params[n] for n in names])
                assert row["changed"] == removed, label
            finally:
                await transaction.rollback()
    finally:
        await conn.close()


async def explained_pages(url: str, text: str, args: list[Any], mode: str) -> int:
    """Pages one statement reads (``EXPLAIN (ANALYZE, BUFFERS)``, rolled back)."""
    conn = await asyncpg.connect(url)
    try:
        transaction = conn.transaction()
        await transaction.start()
        try:
            await conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
            rows = await conn.fetch("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + text, *args)
        finally:
            await transaction.rollback()
    finally:
        await conn.close()
    plan = json.loads(rows[0][0])[0]["Plan"]
    return int(plan.get("Shared Hit Blocks", 0)) + int(plan.get("Shared Read Blocks", 0))


async def test_the_operators_reads_go_through_their_indexes(seeded: dict[str, Any]) -> None:
    """The list of unknown outcomes (none here) and the dashboard's count of the writes
    forwarded in the last half hour (none: every record changed hands an hour ago and
    more) read a few pages, not the records: "unknown_at IS NOT NULL" and "updated_at
    since" alone are most of the table to a planner without statistics, and the records'
    fillfactor makes the table twice the pages it would be packed."""
    from sqlalchemy.dialects.postgresql import asyncpg as pg_asyncpg

    from gateway.records.dashboard_queries import _forwarded

    conn = await asyncpg.connect(seeded["url"])
    try:
        now = float(await conn.fetchval("SELECT extract(epoch FROM now())"))
    finally:
        await conn.close()
    compiled = _forwarded(now - 1800, now, upstream=None, job_id=None).compile(
        dialect=pg_asyncpg.dialect()
    )
    assert compiled.positiontup is not None
    forwarded = (str(compiled), [compiled.params[k] for k in compiled.positiontup])
    text, names = SQL["list_unknown"].statements[0].postgres(False)
    listed = (text, [{"limit": 50}[n] for n in names])
    read = {}
    for mode in PLAN_MODES:
        for label, (statement, args) in {"unknown": listed, "forwarded": forwarded}.items():
            read[f"{label} ({mode})"] = await explained_pages(seeded["url"], statement, args, mode)
    assert all(pages <= PAGES_PER_WRITE for pages in read.values()), read


WRITING_JOBS = 5_000  # other jobs with a write in flight: about 50 pages of the table
IN_FLIGHT_SCENARIOS = ("none", "stale", "job_id-unique")


@pytest.fixture(params=IN_FLIGHT_SCENARIOS)
async def writing(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """A database whose writes_in_flight holds one write of each of ``WRITING_JOBS``
    other jobs and five of the job "hot" (generations 3 to 7; the one of 3 past its
    deadline), with no statistics, statistics of the empty table, or ``job_id`` declared
    unique."""
    scenario = request.param
    name = f"fencegate_writing_{uuid.uuid4().hex[:8]}"
    try:
        await asyncio.wait_for(pg_admin(f'CREATE DATABASE "{name}"'), 10)
    except Exception as error:
        postgres_unavailable(f"{type(error).__name__}: {error}")
    url = pg_url_of(name)
    try:
        await asyncio.to_thread(migrate.upgrade, url)
        conn = await asyncpg.connect(driver_url(url))
        try:
            if scenario == "stale":
                await conn.execute("ANALYZE writes_in_flight")
            await conn.execute(
                """
INSERT INTO writes_in_flight (job_id, key, generation, attempt, deadline)
SELECT 'other' || g, 'k', 1, 'a' || g, extract(epoch FROM now()) + 600
FROM generate_series(1, $1) AS g
UNION ALL
SELECT 'hot', 'k' || g, g, 'h' || g,
       extract(epoch FROM now()) + CASE WHEN g = 3 THEN -1 ELSE 600 END
FROM generate_series(3, 7) AS g""",
                WRITING_JOBS,
            )
            if scenario == "job_id-unique":
                await conn.execute(
                    "ALTER TABLE writes_in_flight ALTER COLUMN job_id SET (n_distinct = -1)"
                )
                await conn.execute("ANALYZE writes_in_flight")
        finally:
            await conn.close()
        yield driver_url(url)
    finally:
        await pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def test_the_ordering_look_reads_its_jobs_writes_only(writing: str) -> None:
    """The waiters' look (the job's lowest generation in flight, every ``POLL_MAX`` at
    most per waiting job and replica) finds the job's writes by the primary key's
    ``job_id``, not by a scan of every write in flight, and skips the one past its
    deadline."""
    text, names = SQL["lowest_in_flight"].statements[0].postgres(False)
    args = [{"job_id": "hot", "now": None}[n] for n in names]
    read = {}
    for mode in PLAN_MODES:
        conn = await asyncpg.connect(writing)
        try:
            transaction = conn.transaction()
            await transaction.start()
            try:
                await conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
                [row] = await conn.fetch("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + text, *args)
                assert await conn.fetchval(text, *args) == 4
            finally:
                await transaction.rollback()
        finally:
            await conn.close()
        plan = json.loads(row[0])[0]["Plan"]
        assert "Seq Scan" not in json.dumps(plan), (mode, plan)
        read[mode] = int(plan.get("Shared Hit Blocks", 0)) + int(plan.get("Shared Read Blocks", 0))
    assert max(read.values()) <= 8, f"pages read: {read}"
