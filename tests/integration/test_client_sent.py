"""A real gateway's failure answers, as the worker clients read them: each says what became
of the write (``sent``), and the client's answer and error carry it. An upstream port
that refuses is ``upstream-unavailable``, sent never (the write may go again, under any
key); a server that reads the request and hangs up is ``upstream-connection-lost``, and
one that answers too late ``upstream-timeout``: sent maybe (never under a new key). Real
SQLite (and PostgreSQL), a real gateway, real upstream sockets."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fencegate_client import errors as exc
from fencegate_client.aio import LeaseClient as AsyncLeaseClient
from fencegate_client.protocol import FencedResponse
from fencegate_client.reasons import Sent
from fencegate_client.sync import LeaseClient
from tests.support import Stack, Upstream, free_port


def base_url(client: Any) -> str:
    return str(client.make_url("")).rstrip("/")


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


async def write_once(stack: Stack, step: str = "charge") -> FencedResponse:
    """One fenced write of a fresh job's step through the asyncio client."""
    gateway = base_url(stack.proxy)
    async with AsyncLeaseClient(base_url(stack.control), gateway_url=gateway) as client:
        lease = await client.acquire(f"sent-{uuid.uuid4().hex[:10]}", owner="w", ttl=60)
        assert lease is not None
        answer = await lease.http.post("/pay/charges", step=step, json={"amount": 1})
        await lease.release()
        return answer


def raised(answer: FencedResponse) -> exc.LeaseError:
    with pytest.raises(exc.LeaseError) as error:
        answer.raise_for_problem()
    return error.value


async def test_an_upstream_that_refuses_was_never_sent(make_stack: Any) -> None:
    stack = await make_stack(
        upstreams=[{"name": "pay", "url": f"http://127.0.0.1:{free_port()}"}], use_clock=False
    )
    answer = await write_once(stack)
    assert answer.status == 502 and answer.problem is not None
    assert answer.problem["reason"] == "upstream-unavailable"
    assert answer.problem["sent"] == "never"
    assert answer.sent is Sent.NEVER and answer.new_key_safe
    error = raised(answer)
    assert isinstance(error, exc.RemoteError) and error.remote_reason == "upstream-unavailable"
    assert error.sent is Sent.NEVER and error.new_key_safe


async def test_the_sync_client_reads_the_same_fact(make_stack: Any) -> None:
    stack = await make_stack(
        upstreams=[{"name": "pay", "url": f"http://127.0.0.1:{free_port()}"}], use_clock=False
    )

    def run() -> FencedResponse:
        gateway = base_url(stack.proxy)
        with LeaseClient(base_url(stack.control), gateway_url=gateway) as client:
            lease = client.acquire(f"sent-{uuid.uuid4().hex[:10]}", owner="w", ttl=60).take()
            assert lease is not None
            answer = lease.http.post("/pay/charges", step="charge", json={"amount": 1})
            lease.release()
            return answer

    answer = await asyncio.to_thread(run)
    assert answer.problem is not None and answer.problem["reason"] == "upstream-unavailable"
    assert answer.sent is Sent.NEVER and raised(answer).new_key_safe


async def test_a_connection_cut_after_the_request_may_have_applied_it(
    make_stack: Any, hangs_up: tuple[int, list[bytes]]
) -> None:
    port, heads = hangs_up
    stack = await make_stack(
        upstreams=[{"name": "pay", "url": f"http://127.0.0.1:{port}", "timeout_seconds": 5}],
        use_clock=False,
    )
    answer = await write_once(stack)
    assert len(heads) == 1  # it reached the upstream
    assert answer.status == 502 and answer.problem is not None
    assert answer.problem["reason"] == "upstream-connection-lost"
    assert answer.problem["sent"] == "maybe"
    assert answer.sent is Sent.MAYBE and not answer.new_key_safe
    error = raised(answer)
    assert error.sent is Sent.MAYBE and not error.new_key_safe


async def test_an_upstream_that_answers_too_late_may_have_applied_it(
    make_stack: Any, upstream: Upstream
) -> None:
    upstream.delay = 3.0
    stack = await make_stack(
        upstreams=[{"name": "pay", "url": upstream.url, "timeout_seconds": 0.5}], use_clock=False
    )
    answer = await write_once(stack)
    assert answer.status == 504 and answer.problem is not None
    assert answer.problem["reason"] == "upstream-timeout"
    assert answer.problem["sent"] == "maybe"
    assert "Retry-After" not in answer.headers
    assert answer.sent is Sent.MAYBE and not answer.new_key_safe
    error = raised(answer)
    assert error.sent is Sent.MAYBE and not error.new_key_safe
