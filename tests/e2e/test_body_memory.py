"""A request body costs its size once: the gateway hashes it as it arrives and keeps one
copy, so the documented bound (``max_concurrent_requests`` times ``max_body_bytes``)
holds. Measured on a real ``fencegate serve`` process by its peak resident set."""

from __future__ import annotations

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
