"""An upstream that fails answers what happened (issue 46): not sent (nothing of the
request left: the connection refused) is "safe to retry" with ``Retry-After`` and the
key back as it was; sent but unanswered is an unknown outcome, said so, without
``Retry-After``. Each is logged at WARNING with the upstream's address and the cause.
A real upstream port that refuses, a real server that reads the request and hangs up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.gateway_helpers import ok, problem
from tests.support import Upstream, free_port, upstream_config


@pytest.fixture
async def hangs_up() -> AsyncIterator[tuple[int, list[bytes]]]:
    """A server that reads a request's head and closes the connection unanswered."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1], heads
    server.close()
    await server.wait_closed()


async def test_not_sent_is_safe_to_retry_and_says_so(
    make_stack: Any, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()  # nothing listens there
    down = await make_stack(
        upstreams=[{"name": "pay", "url": f"http://127.0.0.1:{port}", "timeout_seconds": 2}]
    )
    lease = await down.lease("job-down", owner="a", ttl=60)
    with caplog.at_level(logging.WARNING, logger="fencegate.proxy"):
        resp = await down.write("/pay/charges", lease, key="step-1")
    doc = await problem(resp, 502, "upstream-unavailable")
    assert resp.headers["Retry-After"] == "1"
    assert "Nothing of the request was sent" in doc["detail"]
    assert "safe to retry" in doc["detail"] and "back as it was" in doc["detail"]
    [line] = [r for r in caplog.records if "not sent" in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert f"127.0.0.1:{port}" in line.getMessage() and "pay" in line.getMessage()
    # The key is free: the same write through a replica whose upstream answers goes out.
    up = await make_stack(upstreams=[upstream_config(upstream)])
    await ok(await up.write("/pay/charges", lease, key="step-1"))
    assert len(upstream.received) == 1


async def test_sent_but_unanswered_is_an_unknown_outcome_and_says_so(
    make_stack: Any, hangs_up: tuple[int, list[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    port, heads = hangs_up
    stack = await make_stack(
        upstreams=[{"name": "pay", "url": f"http://127.0.0.1:{port}", "timeout_seconds": 2}]
    )
    lease = await stack.lease("job-hangs", owner="a", ttl=60)
    with caplog.at_level(logging.WARNING, logger="fencegate.proxy"):
        resp = await stack.write("/pay/charges", lease, key="step-1")
    doc = await problem(resp, 502, "upstream-connection-lost")
    assert "Retry-After" not in resp.headers and doc["sent"] == "maybe"
    assert "whether the upstream applied it is unknown" in doc["detail"]
    assert "held as unknown" in doc["detail"]
    assert len(heads) == 1  # it was sent
    [line] = [r for r in caplog.records if "no answer" in r.getMessage()]
    assert line.levelno == logging.WARNING and f"127.0.0.1:{port}" in line.getMessage()
    # The key's outcome is unknown: a retry with it is not sent again (hold).
    await problem(await stack.write("/pay/charges", lease, key="step-1"), 409, "outcome-unknown")
    assert len(heads) == 1


async def test_an_unfenced_request_not_sent_says_so_without_a_key(
    make_stack: Any,
) -> None:
    stack = await make_stack(upstreams=[{"name": "pay", "url": f"http://127.0.0.1:{free_port()}"}])
    resp = await stack.proxy.get("/pay/charges")
    doc = await problem(resp, 502, "upstream-unavailable")
    assert resp.headers["Retry-After"] == "1"
    assert "Nothing of the request was sent: safe to retry." in doc["detail"]
