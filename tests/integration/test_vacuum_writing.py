"""writes_in_flight has a row inserted and deleted per write. On PostgreSQL the
gateway vacuums it itself (``GatewayStore.vacuum_writing``, every
``server.VACUUM_INTERVAL_SECONDS``), so it stays as small as the writes in flight with
autovacuum off as well as on; on SQLite, which reuses a deleted row's space by itself,
the call does nothing."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.records.store import GatewayStore
from lease_core.store import LeaseStore
from tests.support import Upstream, upstream_config

WRITES = 300


async def pages(engine: AsyncEngine, backend: str) -> int:
    query = (
        "SELECT pg_relation_size('writes_in_flight') / 8192"
        if backend == "postgres"
        else "SELECT count(*) FROM writes_in_flight"
    )
    async with engine.connect() as conn:
        return int((await conn.execute(sa.text(query))).scalar_one())


async def test_the_gateway_vacuums_writes_in_flight(
    make_stack: Any, upstream: Upstream, engine: AsyncEngine, backend: str
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    for i in range(WRITES):
        resp = await stack.write("/pay/charge", lease, key=f"k{i}")
        assert resp.status < 300, await resp.text()
    await stack.written()
    async with engine.connect() as conn:
        assert (await conn.execute(sa.text("SELECT count(*) FROM writes_in_flight"))).scalar() == 0
    before = await pages(engine, backend)
    await GatewayStore(LeaseStore(engine)).vacuum_writing()
    after = await pages(engine, backend)
    if backend == "postgres":
        # Every row was deleted: the vacuum removes them and gives the empty pages back.
        assert before > 0
        assert after == 0
    else:
        assert before == after == 0
