"""How the upstream client's connections end, seen from a real upstream's socket.

- A connection whose exchange finished cleanly closes gracefully (a FIN): an upstream
  does not log a reset for each idle connection the pool closes.
- A connection let go of mid-exchange (its answer did not come in time) is reset: the
  kernel must not keep retransmitting a request the gateway gave up on.
- ``TCP_USER_TIMEOUT`` never exceeds the exchange's deadline, though it is set again
  only when the deadline moved (``connection.USER_TIMEOUT_SLACK``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest

from gateway.upstream import NoAnswerInTime, UpstreamClient
from gateway.upstream.connection import USER_TIMEOUT

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Upstream:
    """Reads each request (a one-byte body); answers it, or with ``silent`` never does. How each
    connection ended: ``fin`` (read to its end) or ``reset``."""

    def __init__(self) -> None:
        self.silent = False
        self.ends: list[str] = []
        self.ended = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _on(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        end = "fin"
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(1)  # the body, b"x"
                if not self.silent:
                    writer.write(ANSWER)
                    await writer.drain()
        except asyncio.IncompleteReadError as error:
            end = "fin" if not error.partial else "cut"
        except ConnectionResetError:
            end = "reset"
        finally:
            self.ends.append(end)
            self.ended.set()
            writer.close()

    async def wait_end(self) -> str:
        await asyncio.wait_for(self.ended.wait(), 5)
        self.ended.clear()
        return self.ends[-1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    await up.start()
    yield up
    await up.close()


async def send(client: UpstreamClient, port: int, timeout: float) -> bytes:
    answer = await client.request(
        "POST", f"http://127.0.0.1:{port}/w", [], b"x", timeout=timeout, connect_timeout=2
    )
    async with answer:
        return await answer.read()


async def test_an_idle_connection_closes_gracefully(upstream: Upstream) -> None:
    client = UpstreamClient(connections_per_host=4, keepalive_seconds=30)
    for _ in range(3):
        assert await send(client, upstream.port, 5) == b"ok"
    await client.close()
    assert await upstream.wait_end() == "fin"


async def test_a_connection_let_go_mid_exchange_is_reset(upstream: Upstream) -> None:
    client = UpstreamClient(connections_per_host=4, keepalive_seconds=30)
    try:
        assert await send(client, upstream.port, 5) == b"ok"  # a clean exchange first
        upstream.silent = True
        with pytest.raises(NoAnswerInTime):
            await send(client, upstream.port, 0.3)
        assert await upstream.wait_end() == "reset"
    finally:
        await client.close()


@pytest.mark.skipif(USER_TIMEOUT is None, reason="TCP_USER_TIMEOUT is Linux's")
async def test_the_user_timeout_never_exceeds_the_exchanges_deadline(upstream: Upstream) -> None:
    assert USER_TIMEOUT is not None
    client = UpstreamClient(connections_per_host=1, keepalive_seconds=30)

    def user_timeout() -> int:
        (conn,) = next(iter(client._pools.values())).idle
        sock = conn.transport.get_extra_info("socket") if conn.transport else None
        assert sock is not None
        value: int = sock.getsockopt(socket.IPPROTO_TCP, USER_TIMEOUT)
        return value

    try:
        for timeout, most in [(5, 5000), (5, 5000), (2, 2000), (4, 4000), (30, 30000)]:
            assert await send(client, upstream.port, timeout) == b"ok"
            value = user_timeout()
            assert 0 < value <= most
            # near the deadline, not a leftover of a much shorter one
            assert value > most * 0.8
    finally:
        with contextlib.suppress(Exception):
            await client.close()
