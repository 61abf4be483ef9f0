"""On PostgreSQL the settle of an answer is heap-only (HOT): it changes no column that an
index of the records names, and the records' fillfactor leaves room on the page for the
settled version. So it writes no index entry and leaves no dead row that only a vacuum
could remove (docs/performance.md). And writes_in_flight holds a row for each record in
flight, no other: what the ordering reads.

Measured with PostgreSQL's own counters of the transaction (``pg_stat_get_xact_*``),
on the catalogue's real statements, one transaction per statement as the gateway sends
them."""

from __future__ import annotations

import json
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from lease_core import catalogue, tokens
from lease_core.db import create_engine
from lease_core.store import LeaseStore
from tests.support import truncate_all

pytestmark = pytest.mark.postgres

SQL = catalogue.load("postgresql")
WRITES = 200
ANSWER = json.dumps({"id": "ch_1", "pad": "x" * 1000}).encode()  # a 1 KB answer


def driver_url(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


async def run(conn: Any, name: str, params: dict[str, Any]) -> Any:
    text, names = SQL[name].statements[0].postgres(False)
    return await conn.fetch(text, *[params[n] for n in names])


async def settle_counted(conn: Any, params: dict[str, Any]) -> tuple[int, int]:
    """The settle in its own transaction: rows it updated, and how many heap-only."""
    counters = (
        "SELECT pg_stat_get_xact_tuples_updated(c.oid) AS updated,"
        " pg_stat_get_xact_tuples_hot_updated(c.oid) AS hot"
        " FROM pg_class AS c WHERE c.relname = 'idempotency_records'"
    )
    async with conn.transaction():
        # What the backend has not reported yet, earlier transactions' too: the
        # difference is the settle's.
        before = await conn.fetchrow(counters)
        await run(conn, "settle", params)
        after = await conn.fetchrow(counters)
    return after["updated"] - before["updated"], after["hot"] - before["hot"]


async def leased(url: str, job_id: str) -> str:
    """An empty database, and the hash of a lease's token of ``job_id``."""
    await truncate_all(url)
    engine = create_engine(url)
    try:
        lease = await LeaseStore(engine).acquire(job_id=job_id, owner="w", ttl=600, queue="q")
    finally:
        await engine.dispose()
    assert lease.lease_token is not None
    return tokens.hash_token(lease.lease_token)


async def test_a_settle_with_an_answer_is_heap_only(pg_database_url: str) -> None:
    token_hash = await leased(pg_database_url, "hot")
    conn = await asyncpg.connect(driver_url(pg_database_url))
    try:
        updated = hot = 0
        for i in range(WRITES):
            admitted = await run(
                conn,
                "admit",
                {
                    "token_hash": token_hash,
                    "key": f"key-{i}",
                    "fingerprint": "f" * 64,
                    "attempt": f"attempt-{i}",
                    "upstream": "pay",
                    "method": "POST",
                    "path": "/charges",
                    "deadline_in": 30.0,
                    "retry": False,
                },
            )
            assert admitted[0]["claimed"]
            in_flight = await conn.fetch("SELECT key, attempt FROM writes_in_flight")
            assert [(r["key"], r["attempt"]) for r in in_flight] == [(f"key-{i}", f"attempt-{i}")]
            counted = await settle_counted(
                conn,
                {
                    "job_id": "hot",
                    "key": f"key-{i}",
                    "attempt": f"attempt-{i}",
                    "state": "completed",
                    "status": 201,
                    "headers": json.dumps([["Content-Type", "application/json"]]),
                    "body": ANSWER,
                    "note": None,
                },
            )
            updated += counted[0]
            hot += counted[1]
            assert await conn.fetchval("SELECT count(*) FROM writes_in_flight") == 0
        assert updated == WRITES
        # Every settle, or nearly: a page full of settled rows sends the next insert to a
        # new page, and the settle of the row that filled it finds no room.
        assert hot >= 0.9 * WRITES, f"{hot} of {updated} settles heap-only"
        stored = await conn.fetchrow(
            "SELECT state, settled_at, unknown_at, updated_at, created_at"
            " FROM idempotency_records WHERE key = 'key-0'"
        )
        assert stored["state"] == "completed"
        assert stored["unknown_at"] is None
        assert stored["settled_at"] >= stored["updated_at"] == stored["created_at"]
    finally:
        await conn.close()


async def test_an_unknown_outcome_leaves_writes_in_flight_and_is_indexed(
    pg_database_url: str,
) -> None:
    write = {
        "token_hash": await leased(pg_database_url, "j"),
        "key": "k",
        "fingerprint": "f" * 64,
        "upstream": "pay",
        "method": "POST",
        "path": "/charges",
        "deadline_in": 30.0,
    }
    conn = await asyncpg.connect(driver_url(pg_database_url))
    try:
        await run(conn, "admit", {**write, "attempt": "a1", "retry": True})
        await run(
            conn,
            "settle",
            {"job_id": "j", "key": "k", "attempt": "a1", "state": "unknown", "status": None,
             "headers": None, "body": None, "note": "timed out"},
        )  # fmt: skip
        assert await conn.fetchval("SELECT count(*) FROM writes_in_flight") == 0
        assert await conn.fetchval("SELECT unknown_at FROM idempotency_records") is not None
        # A retry takes it over: in flight again, marked again, no longer unknown.
        taken = await run(conn, "admit", {**write, "attempt": "a2", "retry": True})
        assert taken[0]["taken"]
        marked = await conn.fetch("SELECT key, attempt FROM writes_in_flight")
        assert [(r["key"], r["attempt"]) for r in marked] == [("k", "a2")]
        assert await conn.fetchval("SELECT unknown_at FROM idempotency_records") is None
        # The first attempt's late settle changes neither the record nor the marker.
        await run(
            conn,
            "settle",
            {"job_id": "j", "key": "k", "attempt": "a1", "state": "completed", "status": 201,
             "headers": "[]", "body": b"late", "note": None},
        )  # fmt: skip
        assert await conn.fetchval("SELECT state FROM idempotency_records") == "in_flight"
        assert await conn.fetchval("SELECT attempt FROM writes_in_flight") == "a2"
    finally:
        await conn.close()
