"""A request body costs its size once: the gateway hashes it as it arrives and keeps one
copy, so the documented bound (``max_concurrent_requests`` times ``max_body_bytes``)
holds. Measured on a real ``fencegate serve`` process by its peak resident set."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.e2e.test_serve_processes import call, serve, write_config

MiB = 1024 * 1024
BODY = 200 * MiB


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def _upload() -> AsyncIterator[bytes]:
    chunk = b"x" * MiB
    for _ in range(BODY // MiB):
        yield chunk


@pytest.mark.timeout(120)
async def test_a_large_body_is_held_once(tmp_path: Path) -> None:
    received = 0

    async def sink(request: web.Request) -> web.Response:
        nonlocal received
        async for chunk in request.content.iter_any():
            received += len(chunk)
        return web.Response(status=201, text="stored")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", sink)
    async with TestServer(app, host="127.0.0.1") as upstream:
        config = write_config(
            tmp_path,
            f"sqlite+aiosqlite:///{tmp_path / 'fg.db'}",
            "[[upstreams]]\n"
            'name = "files"\n'
            f'url = "http://127.0.0.1:{upstream.port}"\n'
            "timeout_seconds = 60\n"
            f"max_body_bytes = {BODY + MiB}\n",
        )
        async with serve(config, cwd=tmp_path) as server, aiohttp.ClientSession() as session:
            lease = await call(
                session, "PUT", server.control + "/v1/jobs/big/lease", 201, {"owner": "w"}
            )
            before = peak_rss(server.process.pid)
            async with session.put(
                server.proxy + "/files/objects/big",
                data=_upload(),
                headers={"Fencing-Token": lease["lease_token"], "Idempotency-Key": "put-big"},
            ) as resp:
                assert resp.status == 201, await resp.text()
            grown = peak_rss(server.process.pid) - before
    assert received == BODY
    # One copy of the body, plus buffers; two copies would be 400 MiB.
    assert grown < 1.4 * BODY, f"peak grew by {grown / MiB:.0f} MiB for a {BODY // MiB} MiB body"


WAITER_BODY = 4 * MiB
WAITERS = 48
SLOTS = 3


async def _waiting(session: aiohttp.ClientSession, control: str) -> float:
    """``fencegate_gateway_waiting_requests{wait="first"}`` as the server reports it."""
    async with session.get(control + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith('fencegate_gateway_waiting_requests{wait="first"}'):
                return float(line.split()[-1])
    return 0.0


@pytest.mark.timeout(180)
async def test_waiting_duplicates_hold_no_body(tmp_path: Path) -> None:
    """Issue 52, items 3 and 4: 48 duplicates with 4 MiB bodies wait (``Prefer: wait``)
    behind a first attempt, with 3 slots. Each gives its slot and its body back when its
    wait begins, so the peak resident set grows by less than the documented bound
    (slots x max_body_bytes = 12 MiB, plus buffers), where holding the bodies grew it by
    192 MiB; and when the first attempt settles, every waiter gets the stored answer
    (none is gateway-overloaded: an answer from the store needs no slot)."""
    release = asyncio.Event()
    received = 0

    async def slow(request: web.Request) -> web.Response:
        nonlocal received
        await request.read()
        received += 1
        await release.wait()
        return web.Response(status=201, text="stored")

    app = web.Application(client_max_size=2 * WAITER_BODY)
    app.router.add_route("*", "/{tail:.*}", slow)
    body = b"y" * WAITER_BODY
    async with TestServer(app, host="127.0.0.1") as upstream:
        config = write_config(
            tmp_path,
            f"sqlite+aiosqlite:///{tmp_path / 'fg.db'}",
            "[gateway]\n"
            f"max_concurrent_requests = {SLOTS}\n"
            "max_prefer_wait_seconds = 120\n"
            "[[upstreams]]\n"
            'name = "files"\n'
            f'url = "http://127.0.0.1:{upstream.port}"\n'
            "timeout_seconds = 120\n"
            f"max_body_bytes = {WAITER_BODY + MiB}\n",
        )
        async with serve(config, cwd=tmp_path) as server, aiohttp.ClientSession() as session:
            lease = await call(
                session, "PUT", server.control + "/v1/jobs/big/lease", 201, {"owner": "w"}
            )
            headers = {"Fencing-Token": lease["lease_token"], "Idempotency-Key": "put-1"}
            url = server.proxy + "/files/objects/one"
            first = asyncio.ensure_future(session.put(url, data=io.BytesIO(body), headers=headers))
            while received < 1:
                await asyncio.sleep(0.01)
            before = peak_rss(server.process.pid)
            waiters = []
            for count in range(1, WAITERS + 1):
                waiters.append(
                    asyncio.ensure_future(
                        session.put(
                            url, data=io.BytesIO(body), headers={**headers, "Prefer": "wait=120"}
                        )
                    )
                )
                while await _waiting(session, server.control) < count:
                    assert not waiters[-1].done(), await (await waiters[-1]).text()
                    await asyncio.sleep(0.01)
            grown = peak_rss(server.process.pid) - before
            release.set()
            async with await first as resp:
                assert resp.status == 201, await resp.text()
            for waiter in waiters:
                async with await waiter as resp:
                    assert resp.status == 201, await resp.text()
                    assert resp.headers["Idempotent-Replayed"] == "true"
    assert received == 1
    bound = SLOTS * WAITER_BODY
    assert grown < bound + 24 * MiB, (
        f"peak grew by {grown / MiB:.0f} MiB with {WAITERS} waiters of "
        f"{WAITER_BODY // MiB} MiB (bound {bound // MiB} MiB)"
    )
