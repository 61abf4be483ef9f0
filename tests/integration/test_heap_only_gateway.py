"""Through the real gateway on PostgreSQL, the updates of a fenced write's hot tables are
heap-only (HOT): fenced writes of several jobs, concurrent ones among them (the shared
forms of the admission and the settle), new generations (the fence raised), replays
(the audit) and writes without a key (forgotten); then PostgreSQL's own counters of each
table (``pg_stat_user_tables``: ``n_tup_upd``, ``n_tup_hot_upd``), read once every
backend that wrote has reported them.

A database of its own, migrated to ``FENCEGATE_HOT_REVISION`` (default head: set it to
``0011`` to see the schema before migration ``0012`` fail), so no other test's updates
count. The answers are 530 bytes, so a settled record is four times its size in flight
(the fillfactor leaves room for answers up to about 550 bytes; docs/performance.md,
"Heap-only settles")."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from gateway.config import Settings
from gateway.proxy.gateway import Gateway, create_proxy_app
from gateway.records import migrate
from gateway.service.server import create_control_app
from lease_core.db import create_engine
from lease_core.store import LeaseStore
from tests.support import Stack, Upstream, pg_admin, pg_url_of, upstream_config

pytestmark = pytest.mark.postgres

JOBS = 8
ROUNDS = 40  # each round: one keyed write per job, at once
# A 530-byte answer: its record settled is four times its size in flight.
ANSWER = json.dumps({"id": "ch_1", "pad": "x" * 500}).encode()
# The tables a fenced write updates; jobs is the lease API's (its renewals and grants
# change indexed columns by design) and is not one of them.
HOT_TABLES = ("idempotency_records", "fences", "writes_in_flight", "audit_log")
COUNTERS = """
    SELECT relname, n_tup_upd AS updates, n_tup_hot_upd AS hot
    FROM pg_stat_user_tables WHERE relname = ANY($1::text[])
"""


@pytest.fixture
async def own_database(pg_database_url: str) -> AsyncIterator[str]:
    """A database of this test's own, migrated to the revision under test."""
    name = f"fencegate_hot_{uuid.uuid4().hex[:8]}"
    await pg_admin(f'CREATE DATABASE "{name}"')
    url = pg_url_of(name)
    revision = os.environ.get("FENCEGATE_HOT_REVISION", "head")
    await asyncio.to_thread(migrate.upgrade, url, revision)
    yield url
    await pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def counters(url: str) -> dict[str, tuple[int, int]]:
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        rows = await conn.fetch(COUNTERS, [*HOT_TABLES, "jobs"])
    finally:
        await conn.close()
    return {r["relname"]: (r["updates"], r["hot"]) for r in rows}


async def reported(url: str, settles: int) -> dict[str, tuple[int, int]]:
    """The counters once the gateway's backends (closed: they report as they exit) have
    reported every settle."""
    deadline = time.monotonic() + 30
    while True:
        seen = await counters(url)
        if seen["idempotency_records"][0] >= settles or time.monotonic() > deadline:
            return seen
        await asyncio.sleep(0.2)


async def fenced_writes(stack: Stack) -> tuple[int, int]:
    """The writes; how many settles and fence raises they made."""
    leases = {j: await stack.lease(f"job-{j}") for j in range(JOBS)}
    settles = raises = 0
    for round_ in range(ROUNDS):
        if round_ and round_ % 10 == 0:  # a new generation of every job: its fence rises
            leases = {j: await stack.lease(f"job-{j}") for j in leases}
            raises += JOBS
        answers = await asyncio.gather(
            *(stack.write("/pay/c", leases[j], key=f"k-{round_}-{j}") for j in leases)
        )
        assert all(a.status == 201 for a in answers), [a.status for a in answers]
        settles += len(answers)
        replay = await stack.write("/pay/c", leases[0], key=f"k-{round_}-0")
        assert replay.status == 201 and replay.headers.get("Idempotent-Replayed") == "true"
        unkeyed = await stack.write("/pay/c", leases[1], key=None)
        assert unkeyed.status == 201
    await stack.written()
    return settles, raises


async def test_a_fenced_writes_updates_are_heap_only(
    own_database: str,
    upstream: Upstream,
    aiohttp_client: Callable[..., Any],
) -> None:
    upstream.body = ANSWER
    upstream.status = 201
    engine = create_engine(own_database)
    store = LeaseStore(engine)
    settings = Settings(
        database_url=own_database,
        upstreams=[upstream_config(upstream, require_idempotency_key=False)],
    )
    gateway = Gateway(settings, store)
    control = await aiohttp_client(create_control_app(settings, store, gateway))
    proxy = await aiohttp_client(create_proxy_app(gateway))
    before = await counters(own_database)
    try:
        settles, raises = await fenced_writes(Stack(control, proxy))
    finally:
        await control.close()
        await proxy.close()
        await engine.dispose()
    after = await reported(own_database, settles)
    change = {t: (after[t][0] - before[t][0], after[t][1] - before[t][1]) for t in after}
    shares = {t: f"{hot} of {updates} HOT" for t, (updates, hot) in change.items()}
    print(f"HOT updates over {settles} settles and {raises} fence raises: {shares}")
    records, fences = change["idempotency_records"], change["fences"]
    assert records[0] >= settles, shares
    assert fences[0] >= raises, shares
    for table in HOT_TABLES:
        updates, hot = change[table]
        assert hot >= 0.9 * updates, shares
