"""Upstreams that write literal bytes: an answer's head over the limit
(``gateway.max_upstream_head_bytes``) and chunked trailers, checked on the upstream
client itself and end to end through a gateway.

- A head (the status line and headers, with those of any 1xx answer before it) larger
  than the limit is ``HeadTooLarge``: the request was sent, so, like any other answer
  that cannot be read, it is no answer and its outcome is unknown (502
  ``upstream-connection-lost``; a retry with the same key is not replayed as a success).
- Trailers of a chunked answer are never the answer's headers: not when it is first
  forwarded, not in the stored answer a replay gives back.
- How the gateway frames an answer for the worker: a body that arrives in one piece
  leaves whole, head and body in one write, with its ``Content-Length``; one in several
  pieces is streamed back chunked, its last piece held until the answer has ended; one
  cut short is never whole for the worker. A replay gives back the same body, and the
  answer carries the upstream's headers only (docs/operations.md, "Request ids").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from gateway.upstream import HeadTooLarge, NoAnswer, NoAnswerInTime, UpstreamClient
from tests.gateway_helpers import ok, problem, replayed

TIMEOUTS = {"timeout": 5.0, "connect_timeout": 2.0}
LIMIT = 64 * 1024  # the default of gateway.max_upstream_head_bytes

# An answer whose many headers add up to more than the limit (none is large alone),
# and one whose single header is 2 MB (the size issue 31 found accepted).
MANY_HEADERS = (
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
    + b"".join(b"X-Filler-%03d: %s\r\n" % (i, b"v" * 700) for i in range(100))
    + b"\r\nok"
)
ONE_HUGE_HEADER = (
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Huge: " + b"h" * (2 * 1024 * 1024) + b"\r\n\r\nok"
)
# A 103 Early Hints head and the answer's own: each under the limit, together over it.
EARLY_HINTS = (
    b"HTTP/1.1 103 Early Hints\r\n"
    + b"".join(b"Link: </s/%03d.css>; rel=preload%s\r\n" % (i, b" " * 600) for i in range(60))
    + b"\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
    + b"".join(b"X-Filler-%03d: %s\r\n" % (i, b"v" * 600) for i in range(50))
    + b"\r\nok"
)
TRAILERS = (
    b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\nTrailer: X-Checksum, X-Charge-State\r\n\r\n"
    b'c\r\n{"charged": \r\n5\r\ntrue}\r\n0\r\n'
    b"X-Checksum: sha256=abc\r\nX-Charge-State: settled\r\n\r\n"
)
TRAILER_NAMES = {"x-checksum", "x-charge-state"}


class RawUpstream:
    """An upstream that reads each request (head and ``Content-Length`` body) on a
    keep-alive connection and writes ``answer``, byte for byte, in one write or in the
    pieces ``answer`` lists, ``pause`` seconds after each piece (so that the reader gets
    each on its own); with ``close``, it closes the connection after one answer. It
    keeps every request it read."""

    def __init__(
        self, answer: bytes | list[bytes], *, pause: float = 0.0, close: bool = False
    ) -> None:
        self.answer = answer
        self.pause = pause
        self.close_after = close
        self.requests: list[bytes] = []
        self.connections = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _on(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
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
                    if self.pause:
                        await asyncio.sleep(self.pause)
                if self.close_after:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()


@pytest.fixture
async def raw_upstream() -> AsyncIterator[Callable[..., Awaitable[RawUpstream]]]:
    made: list[RawUpstream] = []

    async def make(answer: bytes | list[bytes], **options: Any) -> RawUpstream:
        up = RawUpstream(answer, **options)
        await up.start()
        made.append(up)
        return up

    yield make
    for up in made:
        await up.close()


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    made = UpstreamClient(connections_per_host=8, keepalive_seconds=30)
    yield made
    await made.close()


async def unknown_outcomes(stack: Any) -> list[dict[str, Any]]:
    resp = await stack.control.get("/admin/unknown-outcomes")
    assert resp.status == 200, await resp.text()
    items: list[dict[str, Any]] = (await resp.json())["items"]
    return items


def padded_head(size: int) -> bytes:
    """A 200 answer's head of exactly ``size`` bytes (its blank line included)."""
    start = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Pad: "
    end = b"\r\n\r\n"
    return start + b"p" * (size - len(start) - len(end)) + end


# -- the client ------------------------------------------------------------------------------


@pytest.mark.parametrize("answer", [MANY_HEADERS, ONE_HUGE_HEADER], ids=["many", "one-huge"])
async def test_a_head_over_the_limit_is_no_answer(
    client: UpstreamClient,
    raw_upstream: Callable[[bytes | list[bytes]], Awaitable[RawUpstream]],
    answer: bytes,
) -> None:
    up = await raw_upstream(answer)
    with pytest.raises(HeadTooLarge) as raised:
        await client.request("PUT", up.url + "/charges", [], b"{}", **TIMEOUTS)
    # Sent, then no answer that can be read: an unknown outcome, not a timeout.
    assert isinstance(raised.value, NoAnswer)
    assert not isinstance(raised.value, NoAnswerInTime)
    assert str(LIMIT) in str(raised.value)
    assert len(up.requests) == 1
    # The connection is not reused: the next request opens another, and gets the same.
    with pytest.raises(HeadTooLarge):
        await client.request("PUT", up.url + "/charges", [], b"{}", **TIMEOUTS)
    assert up.connections == 2 and len(up.requests) == 2


async def test_the_heads_of_1xx_answers_count_towards_the_limit(
    client: UpstreamClient, raw_upstream: Callable[[bytes | list[bytes]], Awaitable[RawUpstream]]
) -> None:
    up = await raw_upstream(EARLY_HINTS)
    with pytest.raises(HeadTooLarge):
        await client.request("POST", up.url, [], b"{}", **TIMEOUTS)


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "in-pieces"])
async def test_a_head_of_exactly_the_limit_passes_and_one_byte_more_does_not(
    raw_upstream: Callable[[bytes | list[bytes]], Awaitable[RawUpstream]], split: bool
) -> None:
    """The limit counts the head's bytes, blank line included, and not the body's that
    arrive with it (in the same read, or after a head that came in pieces)."""
    limit = 4096
    client = UpstreamClient(connections_per_host=8, keepalive_seconds=30, max_head_bytes=limit)
    try:
        for size, fits in ((limit, True), (limit + 1, False)):
            head = padded_head(size)
            answer: bytes | list[bytes] = (
                [head[:1000], head[1000:3000], head[3000:] + b"ok"] if split else head + b"ok"
            )
            up = await raw_upstream(answer)
            if fits:
                async with await client.request("GET", up.url, [], **TIMEOUTS) as got:
                    assert got.status == 200 and await got.read() == b"ok"
            else:
                with pytest.raises(HeadTooLarge):
                    await client.request("GET", up.url, [], **TIMEOUTS)
    finally:
        await client.close()


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "in-pieces"])
async def test_trailers_are_not_the_answers_headers(
    client: UpstreamClient,
    raw_upstream: Callable[[bytes | list[bytes]], Awaitable[RawUpstream]],
    split: bool,
) -> None:
    cut = TRAILERS.index(b"0\r\n")
    up = await raw_upstream([TRAILERS[:cut], TRAILERS[cut:]] if split else TRAILERS)
    for _ in range(2):
        async with await client.request("POST", up.url, [], b"{}", **TIMEOUTS) as answer:
            assert answer.status == 201
            assert ("Trailer", "X-Checksum, X-Charge-State") in answer.headers
            assert await answer.read() == b'{"charged": true}'
            names = {name.lower() for name, _ in answer.headers}
            assert not names & TRAILER_NAMES, answer.headers
    # The trailers end the answer cleanly: its connection is reused.
    assert up.connections == 1 and len(up.requests) == 2


# -- through the gateway ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "gateway"),
    [
        (MANY_HEADERS, {}),
        (ONE_HUGE_HEADER, {}),
        (padded_head(5000) + b"ok", {"max_upstream_head_bytes": 4096}),
    ],
    ids=["many", "one-huge", "configured"],
)
async def test_a_head_over_the_limit_is_an_unknown_outcome_never_replayed(
    make_stack: Any,
    raw_upstream: Callable[[bytes | list[bytes]], Awaitable[RawUpstream]],
    answer: bytes,
    gateway: dict[str, Any],
) -> None:
    up = await raw_upstream(answer)
    stack = await make_stack(upstreams=[{"name": "pay", "url": up.url}], gateway=gateway)
    lease = await stack.lease("job-1")
    doc = await problem(
        await stack.write("/pay/charges", lease, key="pay-1"), 502, "upstream-connection-lost"
    )
    assert doc["job_id"] == "job-1" and doc["sent"] == "maybe"
    [held] = await unknown_outcomes(stack)
    assert (held["key"], held["state"], held["status"]) == ("pay-1", "unknown", None)
    assert held["note"].startswith("no answer: ") and "head" in held["note"]
    # The retry is neither replayed as a success nor sent again.
    await problem(await stack.write("/pay/charges", lease, key="pay-1"), 409, "outcome-unknown")
    assert len(up.requests) == 1


async def test_a_head_of_the_configured_size_is_forwarded(
    make_stack: Any, raw_upstream: Callable[[bytes | list[bytes]], Awaitable[RawUpstream]]
) -> None:
    up = await raw_upstream(padded_head(5000) + b"ok")
    stack = await make_stack(
        upstreams=[{"name": "pay", "url": up.url}], gateway={"max_upstream_head_bytes": 5000}
    )
    lease = await stack.lease("job-1")
    assert await ok(await stack.write("/pay/charges", lease, key="pay-1"), 200) == b"ok"


async def test_trailers_are_neither_forwarded_nor_replayed_as_headers(
    make_stack: Any, raw_upstream: Callable[[bytes | list[bytes]], Awaitable[RawUpstream]]
) -> None:
    up = await raw_upstream(TRAILERS)
    stack = await make_stack(upstreams=[{"name": "pay", "url": up.url}])
    lease = await stack.lease("job-1")
    first = await stack.write("/pay/charges", lease, key="pay-1")
    assert await ok(first, 201) == b'{"charged": true}'
    assert not {name.lower() for name in first.headers} & TRAILER_NAMES, first.headers
    again = await stack.write("/pay/charges", lease, key="pay-1")
    assert await replayed(again, 201) == b'{"charged": true}'
    assert again.headers["Content-Type"] == "application/json"
    assert not {name.lower() for name in again.headers} & TRAILER_NAMES, again.headers
    assert len(up.requests) == 1


# -- how an answer is framed for the worker ----------------------------------------------

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


async def test_a_one_piece_answer_leaves_whole_with_its_length(
    make_stack: Any, raw_upstream: Callable[..., Awaitable[RawUpstream]]
) -> None:
    up = await raw_upstream(ONE_PIECE, pause=0.05)
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
    make_stack: Any, raw_upstream: Callable[..., Awaitable[RawUpstream]]
) -> None:
    up = await raw_upstream(PIECES, pause=0.05)
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
    make_stack: Any, raw_upstream: Callable[..., Awaitable[RawUpstream]]
) -> None:
    up = await raw_upstream(CUT, close=True)
    stack = await make_stack(upstreams=[{"name": "pay", "url": up.url}])
    lease = await stack.lease("job-1")
    with pytest.raises(aiohttp.ClientPayloadError):
        first = await stack.write("/pay/charges", lease, key="pay-1")
        await first.read()
