"""A forwarded write's final answer is stored behind the answer
(``gateway.settle_before_answer = false``, the default): the client does not wait for
the database, and a duplicate that the same replica admits before the record is written
waits for it and gets the replay. With ``settle_before_answer = true`` the answer's last
byte waits for the record.

The record's write is held back for real: while the upstream answers, another
connection locks the key's row (PostgreSQL) or the database (SQLite), and lets go when
the test says so."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import asyncpg
import pytest
from aiohttp import web

from tests.gateway_helpers import ok, replayed
from tests.support import Upstream, upstream_config


class Locker:
    """Holds the key's record (or the whole SQLite database) from another connection,
    taken while the upstream answers."""

    def __init__(self, database_url: str) -> None:
        self.url = database_url
        self.pg: list[Any] = []  # a connection holding each key's row
        self.sqlite: sqlite3.Connection | None = None

    async def take(self, key: str) -> None:
        if self.url.startswith("sqlite"):
            self.sqlite = sqlite3.connect(self.url.split("///", 1)[1], isolation_level=None)
            self.sqlite.execute("BEGIN IMMEDIATE")
            return
        conn = await asyncpg.connect(self.url.replace("postgresql+asyncpg", "postgresql"))
        self.pg.append(conn)
        await conn.execute("BEGIN")
        await conn.execute("SELECT 1 FROM idempotency_records WHERE key = $1 FOR UPDATE", key)

    async def let_go(self) -> None:
        if self.sqlite is not None:
            self.sqlite.execute("ROLLBACK")
            self.sqlite.close()
            self.sqlite = None
        while self.pg:
            conn = self.pg.pop()
            await conn.execute("ROLLBACK")
            await conn.close()


@pytest.fixture
async def locking(aiohttp_server: Any, database_url: str) -> Any:
    """An upstream that, before it answers, has the key's record locked."""
    up = Upstream()
    locker = Locker(database_url)

    async def handler(request: web.Request) -> web.StreamResponse:
        await locker.take(request.headers["Idempotency-Key"])
        return await up.handler(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    server = await aiohttp_server(app)
    up.url = str(server.make_url("")).rstrip("/")
    yield up, locker
    await locker.let_go()


async def test_the_answer_does_not_wait_for_its_record(make_stack: Any, locking: Any) -> None:
    upstream, locker = locking
    stack = await make_stack(upstreams=[upstream_config(upstream)], use_clock=False)
    lease = await stack.lease("job-1")
    # The record cannot be written, yet the client has the whole answer.
    first = await asyncio.wait_for(stack.write("/pay/charges", lease, key="charge-1"), 10)
    body = await asyncio.wait_for(ok(first), 2)
    # A duplicate on this replica waits for the record instead of request-in-progress ...
    duplicate = asyncio.ensure_future(stack.write("/pay/charges", lease, key="charge-1"))
    await asyncio.sleep(0.3)
    assert not duplicate.done()
    await locker.let_go()
    # ... and gets the stored answer once it is written.
    again = await asyncio.wait_for(duplicate, 10)
    assert await replayed(again) == body
    assert "Preference-Applied" not in again.headers  # it did not ask to wait
    assert len(upstream.received) == 1


async def test_settle_before_answer_holds_the_answer_for_its_record(
    make_stack: Any, locking: Any
) -> None:
    upstream, locker = locking
    stack = await make_stack(
        upstreams=[upstream_config(upstream)],
        use_clock=False,
        gateway={"settle_before_answer": True},
    )
    lease = await stack.lease("job-1")
    # Nothing of the answer goes out before its record (a one-piece answer leaves
    # whole, head and body in one write; a streamed one holds back its last piece).
    writing = asyncio.ensure_future(stack.write("/pay/charges", lease, key="charge-1"))
    await asyncio.sleep(0.3)
    assert not writing.done()
    await locker.let_go()
    first = await asyncio.wait_for(writing, 10)
    body = await asyncio.wait_for(first.read(), 10)
    assert first.status == 201 and body
    await replayed(await stack.write("/pay/charges", lease, key="charge-1"))
    assert len(upstream.received) == 1


@pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_past_its_limit_an_answer_waits_for_its_record(make_stack: Any, locking: Any) -> None:
    """At most ``max_concurrent_requests`` records are written behind their answers:
    past that the database is not keeping up, and an answer waits for its own record,
    so the writes waiting cannot grow without bound. (PostgreSQL: each key's row is
    locked alone, so the second write gets as far as its answer.)"""
    upstream, locker = locking
    stack = await make_stack(
        upstreams=[upstream_config(upstream)],
        use_clock=False,
        gateway={"max_concurrent_requests": 1},
    )
    lease = await stack.lease("job-1")
    first = await asyncio.wait_for(stack.write("/pay/charges", lease, key="charge-1"), 10)
    await asyncio.wait_for(ok(first), 2)  # its record behind it: the one allowed
    writing = asyncio.ensure_future(stack.write("/pay/charges", lease, key="charge-2"))
    await asyncio.sleep(0.3)
    assert not writing.done()  # this one waits for its record
    await locker.let_go()
    second = await asyncio.wait_for(writing, 10)
    assert await asyncio.wait_for(second.read(), 10)
    assert second.status == 201
    await replayed(await stack.write("/pay/charges", lease, key="charge-2"))
