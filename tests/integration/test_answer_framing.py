"""How the gateway frames an upstream's answer for the worker.

- An answer whose body arrives in one piece leaves whole, head and body in one write,
  framed by its ``Content-Length`` (one segment on the wire instead of three).
- An answer that arrives in several pieces is streamed back chunked, its last piece
  held until the answer has ended.
- An answer cut short is never taken as whole by the worker, whichever way it was
  going to be framed.
- A replay gives back the same body either way.
- Either way the answer carries the upstream's headers only (docs/operations.md,
  "Request ids").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from tests.gateway_helpers import ok, replayed
from tests.integration.test_upstream_raw import RawUpstream

BODY = b'{"charged": true, "amount": 1250}'
ONE_PIECE = (
    b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nX-Charge: ch_1\r\n\r\n%s" % (len(BODY), BODY)
)
PIECES = [
    b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\nX-Charge: ch_1\r\n\r\n",
    b"d\r\n" + BODY[:13] + b"\r\n",
    b"%x\r\n" % (len(BODY) - 13) + BODY[13:] + b"\r\n",
    b"0\r\n\r\n",
]
CUT = b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(BODY),
    BODY[:10],
)


class SlowRawUpstream(RawUpstream):
    """``RawUpstream`` that pauses between its pieces, so the gateway reads each one on
    its own, and closes the connection after ``answer`` when ``close`` is set."""

    def __init__(self, answer: bytes | list[bytes], *, close: bool = False) -> None:
        super().__init__(answer)
        self.close_after = close

    async def _on(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            size = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    size = int(line.split(b":")[1])
            self.requests.append(head + await reader.readexactly(size))
            pieces = self.answer if isinstance(self.answer, list) else [self.answer]
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.05)
            if not self.close_after:
                await reader.read()  # keep the connection until the gateway drops it
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def upstream_of() -> AsyncIterator[Callable[..., Awaitable[SlowRawUpstream]]]:
    made: list[SlowRawUpstream] = []

    async def make(answer: bytes | list[bytes], *, close: bool = False) -> SlowRawUpstream:
        up = SlowRawUpstream(answer, close=close)
        await up.start()
        made.append(up)
        return up

    yield make
    for up in made:
        await up.close()


async def test_a_one_piece_answer_leaves_whole_with_its_length(
    make_stack: Any, upstream_of: Callable[..., Awaitable[SlowRawUpstream]]
) -> None:
    up = await upstream_of(ONE_PIECE)
    stack = await make_stack(upstreams=[{"name": "pay", "url": up.url}])
    lease = await stack.lease("job-1")
    first = await stack.write("/pay/charges", lease, key="pay-1")
    assert first.headers.get("Content-Length") == str(len(BODY))
    assert "Transfer-Encoding" not in first.headers
    assert first.headers.get("X-Charge") == "ch_1"
    assert first.headers.get("Content-Type") == "application/json"
    assert "X-Request-Id" not in first.headers  # the upstream's headers only
    assert await ok(first, 201) == BODY
    again = await stack.write("/pay/charges", lease, key="pay-1")
    await replayed(again)
    assert await again.read() == BODY
    assert len(up.requests) == 1


async def test_an_answer_in_pieces_is_streamed_back_chunked(
    make_stack: Any, upstream_of: Callable[..., Awaitable[SlowRawUpstream]]
) -> None:
    up = await upstream_of(PIECES)
    stack = await make_stack(upstreams=[{"name": "pay", "url": up.url}])
    lease = await stack.lease("job-1")
    first = await stack.write("/pay/charges", lease, key="pay-1")
    assert first.headers.get("Transfer-Encoding") == "chunked"
    assert "Content-Length" not in first.headers
    assert first.headers.get("X-Charge") == "ch_1"
    assert "X-Request-Id" not in first.headers
    assert await ok(first, 201) == BODY
    again = await stack.write("/pay/charges", lease, key="pay-1")
    await replayed(again)
    assert await again.read() == BODY


async def test_an_answer_cut_short_is_never_whole_for_the_worker(
    make_stack: Any, upstream_of: Callable[..., Awaitable[SlowRawUpstream]]
) -> None:
    up = await upstream_of(CUT, close=True)
    stack = await make_stack(upstreams=[{"name": "pay", "url": up.url}])
    lease = await stack.lease("job-1")
    with pytest.raises(aiohttp.ClientPayloadError):
        first = await stack.write("/pay/charges", lease, key="pay-1")
        await first.read()
