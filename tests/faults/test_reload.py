"""(g) SIGHUP reloads the upstreams of a running ``fencegate serve`` (on SQLite: this
one needs no PostgreSQL).

Proves: after the config gains a second upstream and the process gets SIGHUP, a request
to the new upstream is forwarded, while a keep-alive connection opened before the reload
keeps working (the same connection serves requests before and after); a broken config on
SIGHUP is refused with a logged reason, the process keeps running and the upstreams it
had keep working.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from .harness import (
    PAY,
    ProcessGroup,
    UpstreamSpec,
    acquire,
    http,
    raw_write,
    start_replica,
    start_upstream,
    write_config,
)

SECOND = UpstreamSpec("second", path="second")


async def upstream_names(session: aiohttp.ClientSession, control: str) -> list[str]:
    answer = await http(session, "GET", control + "/admin/upstreams")
    assert answer.status == 200, answer
    return [u["name"] for u in json.loads(answer.body)["items"]]


@pytest.mark.timeout(60)
async def test_sighup_adds_an_upstream_and_refuses_a_broken_config(group: ProcessGroup) -> None:
    upstream = await start_upstream(group)
    database_url = f"sqlite+aiosqlite:///{group.folder / 'reload.db'}"
    config = write_config(group.folder, database_url, upstream.url, [PAY])
    replica = await start_replica(group, config, "replica-a")

    created, reused = [], []

    async def on_create(*args: Any) -> None:
        created.append(args)

    async def on_reuse(*args: Any) -> None:
        reused.append(args)

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(on_create)
    trace.on_connection_reuseconn.append(on_reuse)
    connector = aiohttp.TCPConnector(limit=1)
    async with (
        aiohttp.ClientSession() as control,
        aiohttp.ClientSession(connector=connector, trace_configs=[trace]) as kept,
    ):
        lease = await acquire(control, replica, "reload", "worker-1", ttl=300)

        async def write(name: str, step: str) -> SimpleNamespace:
            attempt = await raw_write(kept, "worker-1", lease, replica, name, step)
            return SimpleNamespace(status=attempt.status, reason=attempt.reason)

        assert (await write("pay", "s0")).status == 201
        assert (await write("second", "s1")).reason == "unknown-upstream"

        write_config(group.folder, database_url, upstream.url, [PAY, SECOND])
        replica.signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "second" not in await upstream_names(control, replica.control):
            assert time.monotonic() < deadline, replica.proc.output()
            await asyncio.sleep(0.05)
        assert (await write("second", "s1")).status == 201
        assert (await write("pay", "s2")).status == 201
        assert upstream.events()[-2]["path"] == "/second/charges"

        # A broken config: refused, the running one stays.
        config.write_text(config.read_text() + "\n[gateway]\nno_such_setting = 1\n")
        replica.signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reload refused" not in replica.proc.output():
            assert time.monotonic() < deadline, replica.proc.output()
            await asyncio.sleep(0.05)
        assert replica.proc.alive()
        assert await upstream_names(control, replica.control) == ["pay", "second"]
        assert (await write("pay", "s3")).status == 201
        assert (await write("second", "s4")).status == 201

    # One connection served every request, before and after both reloads.
    assert (len(created), len(reused)) == (1, 5)  # six writes
    assert [e["path"] for e in upstream.events()] == [
        "/hold/charges",
        "/second/charges",
        "/hold/charges",
        "/hold/charges",
        "/second/charges",
    ]
