"""The gateway's HTTP/1.1 client (``gateway.upstream``) against real servers:
aiohttp test servers for well-behaved upstreams, raw asyncio servers for byte-level
misbehaviour (answers cut short, connections closed without an answer, 1xx answers).

What matters most is checked by what the server saw: a request is never sent twice,
a connection is reused only when that is safe, and nothing leaves when connecting
fails."""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop
from aiohttp import web

from gateway.upstream import (
    ConnectTimeout,
    CutShort,
    NoAnswer,
    NoAnswerInTime,
    NotSent,
    UpstreamClient,
    UpstreamResponse,
)
from tests.certs import Pki
from tests.support import Upstream

TIMEOUTS = {"timeout": 5.0, "connect_timeout": 2.0}


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    made = UpstreamClient(connections_per_host=8, keepalive_seconds=30)
    yield made
    await made.close()


class RawServer:
    """An upstream that speaks bytes: ``handle(server, reader, writer)`` per connection.
    It counts connections and keeps every request it read (head and body)."""

    def __init__(self, handle: Handler) -> None:
        self.handle = handle
        self.connections = 0
        self.requests: list[bytes] = []
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def _on(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handle(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        size = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                size = int(line.split(b":")[1])
        request = head + (await reader.readexactly(size) if size else b"")
        self.requests.append(request)
        return request

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def send(
        self,
        client: UpstreamClient,
        method: str = "GET",
        body: bytes | io.BytesIO = b"",
        *,
        path: str = "/",
        headers: list[tuple[str, str]] | None = None,
        **timeouts: float,
    ) -> UpstreamResponse:
        """``client``'s request to this server (``TIMEOUTS`` unless given); its answer
        once the head is in."""
        return await client.request(
            method, self.url + path, headers or [], body, **{**TIMEOUTS, **timeouts}
        )

    async def fetch(self, client: UpstreamClient, method: str = "GET", body: bytes = b"") -> bytes:
        """One whole exchange: send, read the answer to its end, close it; its body."""
        async with await self.send(client, method, body) as answer:
            return await answer.read()


Handler = Callable[[RawServer, Any, Any], Awaitable[None]]


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[..., Awaitable[RawServer]]]:
    made: list[RawServer] = []

    async def make(handle: Handler) -> RawServer:
        server = RawServer(handle)
        await server.start()
        made.append(server)
        return server

    yield make
    for server in made:
        await server.close()


def answering(*answers: bytes, close: bool = False) -> Handler:
    """A handler that reads one request per answer on the same connection and writes
    the answer's bytes (``b""``: no answer at all); then closes the connection
    (``close``) or keeps it open until the client closes it."""

    async def handle(server: RawServer, reader: Any, writer: Any) -> None:
        for answer in answers:
            await server.read_request(reader)
            if answer:
                writer.write(answer)
                await writer.drain()
        if not close:
            await reader.read()

    return handle


async def echo_app(aiohttp_server: Callable[..., Any]) -> tuple[str, list[str]]:
    """An aiohttp upstream: ``/echo`` answers the body it got, ``/big/<n>`` n bytes in
    pieces, ``/chunked`` a chunked answer; the list records each request's peer."""
    peers: list[str] = []

    async def echo(request: web.Request) -> web.StreamResponse:
        peers.append(str(request.transport.get_extra_info("peername")))  # type: ignore[union-attr]
        body = await request.read()
        return web.Response(body=body, headers={"X-Method": request.method})

    async def big(request: web.Request) -> web.StreamResponse:
        peers.append(str(request.transport.get_extra_info("peername")))  # type: ignore[union-attr]
        size = int(request.match_info["size"])
        out = web.StreamResponse(headers={"Content-Length": str(size)})
        await out.prepare(request)
        piece = b"x" * 65536
        left = size
        while left:
            await out.write(piece[: min(left, len(piece))])
            left -= min(left, len(piece))
        await out.write_eof()
        return out

    async def chunked(request: web.Request) -> web.StreamResponse:
        peers.append(str(request.transport.get_extra_info("peername")))  # type: ignore[union-attr]
        out = web.StreamResponse()
        out.enable_chunked_encoding()
        await out.prepare(request)
        for part in (b"one,", b"two,", b"three"):
            await out.write(part)
        await out.write_eof()
        return out

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/echo", echo)
    app.router.add_get("/big/{size}", big)
    app.router.add_get("/chunked", chunked)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/"), peers


async def test_content_length_and_chunked_answers_on_one_connection(
    client: UpstreamClient, aiohttp_server: Callable[..., Any]
) -> None:
    url, peers = await echo_app(aiohttp_server)
    async with await client.request(
        "POST", url + "/echo", [("X-A", "1")], b"hello", **TIMEOUTS
    ) as answer:
        assert (answer.status, answer.reason) == (200, "OK")
        assert ("X-Method", "POST") in answer.headers
        assert await answer.read() == b"hello"
    async with await client.request("GET", url + "/chunked", [], **TIMEOUTS) as answer:
        assert ("Transfer-Encoding", "chunked") in answer.headers
        assert await answer.read() == b"one,two,three"
    written = io.BytesIO()
    written.write(b"abc")  # a buffer's body: its first tell() bytes, as the proxy reads it
    async with await client.request("PUT", url + "/echo", [], written, **TIMEOUTS) as a:
        assert await a.read() == b"abc"
    assert len(peers) == 3 and len(set(peers)) == 1  # one keep-alive connection


async def test_large_bodies_stream_both_ways(
    client: UpstreamClient, aiohttp_server: Callable[..., Any]
) -> None:
    url, _ = await echo_app(aiohttp_server)
    size = 8 * 1024 * 1024
    async with await client.request("GET", f"{url}/big/{size}", [], **TIMEOUTS) as answer:
        got = 0
        parts = 0
        async for chunk in answer:
            got += len(chunk)
            parts += 1
            await asyncio.sleep(0)  # a slow reader: the client must not buffer it all
        assert got == size and parts > 1
    body = io.BytesIO()
    body.write(bytes(range(256)) * (3 * 4096 + 7))  # > 1 MiB: sent in pieces
    async with await client.request("POST", url + "/echo", [], body, **TIMEOUTS) as answer:
        assert await answer.read() == body.getvalue()


async def test_read_until_close(
    client: UpstreamClient, raw_server: Callable[..., Awaitable[RawServer]]
) -> None:
    server = await raw_server(answering(b"HTTP/1.1 200 OK\r\nX-A: 1\r\n\r\nall of it", close=True))
    assert await server.fetch(client) == b"all of it"
    assert await server.fetch(client) == b"all of it"
    assert server.connections == 2


async def test_the_request_as_framed(
    client: UpstreamClient, raw_server: Callable[..., Awaitable[RawServer]]
) -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    server = await raw_server(answering(ok, ok, ok, ok))
    path = "/a%2Fb/c%20d?x=%2F&y=%zz"
    twice = [("X-Dup", "1"), ("x-dup", "2")]
    for method in ("GET", "POST", "DELETE"):
        (await server.send(client, method, path=path, headers=twice)).close()
    (await server.send(client, "PUT", b"xyz", path="/p", headers=[("Host", "example.com")])).close()
    port = server.url.rsplit(":", 1)[1]
    get, post, delete, put = server.requests
    assert (
        get
        == (
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Dup: 1\r\nx-dup: 2\r\n\r\n"
        ).encode()
    )
    # As aiohttp sent them: Content-Length: 0 for a method that is not GET, HEAD,
    # OPTIONS or TRACE; no User-Agent, Accept-Encoding or Content-Type of its own.
    assert b"Content-Length: 0\r\n" in post and b"Content-Length: 0\r\n" in delete
    assert put == b"PUT /p HTTP/1.1\r\nHost: example.com\r\nContent-Length: 3\r\n\r\nxyz"
    assert server.connections == 1


@pytest.mark.parametrize("bad", ["a\r\nX-Injected: 1", "a\nb", "a\0b"])
async def test_a_header_that_could_end_its_line_is_not_sent(
    client: UpstreamClient, raw_server: Callable[..., Awaitable[RawServer]], bad: str
) -> None:
    server = await raw_server(answering())
    with pytest.raises(NotSent):
        await server.send(client, "POST", headers=[("X-A", bad)])
    with pytest.raises(NotSent):
        await server.send(client, "POST", headers=[(bad, "v")])
    await asyncio.sleep(0.05)
    assert server.connections == 0


async def test_no_reuse_after_connection_close_head_or_a_cut_body(
    client: UpstreamClient, raw_server: Callable[..., Awaitable[RawServer]]
) -> None:
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
    server = await raw_server(answering(closing))
    for _ in range(2):
        assert await server.fetch(client) == b"ok"
    assert server.connections == 2

    # HEAD: the Content-Length announces a body that never comes; the answer ends at
    # its head and the connection is not used again.
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n"
    server = await raw_server(answering(head, head))
    for _ in range(2):
        async with await server.send(client, "HEAD") as answer:
            assert answer.status == 200
            assert ("Content-Length", "10") in answer.headers
            assert await answer.read() == b""
    assert server.connections == 2

    # An answer not read to its end is not followed by another on its connection.
    partial = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234"
    server = await raw_server(answering(partial, partial))
    for _ in range(2):
        async with await server.send(client) as answer:
            assert await answer.read_chunk() == b"01234"
    assert server.connections == 2


async def test_informational_answers_are_skipped_and_bodiless_answers_end_at_their_head(
    client: UpstreamClient, raw_server: Callable[..., Awaitable[RawServer]]
) -> None:
    early = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\nmade"
    )
    no_content = b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n"
    not_modified = b'HTTP/1.1 304 Not Modified\r\nETag: "1"\r\nContent-Length: 9\r\n\r\n'
    last = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nend"
    server = await raw_server(answering(early, no_content, not_modified, last))
    async with await server.send(client, "POST", b"x") as answer:
        assert (answer.status, answer.reason) == (201, "Created")
        assert answer.headers == [("Content-Length", "4")]
        assert await answer.read() == b"made"
    for status in (204, 304):
        async with await server.send(client) as answer:
            assert answer.status == status
            assert await answer.read() == b""
    assert await server.fetch(client) == b"end"
    assert server.connections == 1  # all four on one connection


async def test_headers_kept_in_order_with_duplicates(
    client: UpstreamClient, raw_server: Callable[..., Awaitable[RawServer]]
) -> None:
    answer_bytes = (
        b"HTTP/1.1 200 Fine Thanks\r\nSet-Cookie: a=1\r\nX-B: 2\r\nset-cookie: b=2\r\n"
        b"X-Latin: caf\xe9\r\nX-Utf8: caf\xc3\xa9\r\nContent-Length: 0\r\n\r\n"
    )
    server = await raw_server(answering(answer_bytes))
    async with await server.send(client) as answer:
        assert answer.reason == "Fine Thanks"
        assert answer.headers == [
            ("Set-Cookie", "a=1"),
            ("X-B", "2"),
            ("set-cookie", "b=2"),
            # Decoded as aiohttp's parser decodes (and its server encodes again): UTF-8,
            # other bytes kept as surrogates.
            ("X-Latin", "caf\udce9"),
            ("X-Utf8", "café"),
            ("Content-Length", "0"),
        ]


async def test_an_upgrade_is_an_error(
    client: UpstreamClient, raw_server: Callable[..., Awaitable[RawServer]]
) -> None:
    upgrade = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    server = await raw_server(answering(upgrade))
    with pytest.raises(NoAnswer):
        await server.send(client)


async def test_connect_refused_is_not_sent(client: UpstreamClient) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(NotSent) as raised:
        await client.request("PUT", f"http://127.0.0.1:{port}/", [], b"x", **TIMEOUTS)
    assert not isinstance(raised.value, ConnectTimeout)


async def test_connect_timeout_is_not_sent() -> None:
    """A listening socket whose backlog is full and never accepts: SYNs go unanswered."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    loop = asyncio.get_running_loop()
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    client = UpstreamClient(connections_per_host=8, keepalive_seconds=30)
    try:
        started = loop.time()
        with pytest.raises(ConnectTimeout):
            await client.request(
                "PUT", f"http://127.0.0.1:{port}/", [], b"x", timeout=5, connect_timeout=0.3
            )
        assert loop.time() - started < 2
    finally:
        await client.close()
        for filler in fillers:
            filler.close()
        listener.close()


async def test_closed_without_an_answer_is_no_answer_and_sent_once(
    client: UpstreamClient, raw_server: Callable[..., Awaitable[RawServer]]
) -> None:
    server = await raw_server(answering(b"", close=True))  # reads the request, closes
    for method in ("PUT", "DELETE", "POST"):
        with pytest.raises(NoAnswer) as raised:
            await server.send(client, method, b"x")
        assert not isinstance(raised.value, NoAnswerInTime)
    await asyncio.sleep(0.05)
    assert len(server.requests) == 3 and server.connections == 3  # never re-sent


async def test_an_answer_cut_short(
    client: UpstreamClient, raw_server: Callable[..., Awaitable[RawServer]]
) -> None:
    short = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart"
    server = await raw_server(answering(short, close=True))
    async with await server.send(client) as answer:
        assert answer.status == 200
        with pytest.raises(CutShort):
            await answer.read()

    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\npart\r\n"
    server = await raw_server(answering(chunked, close=True))
    async with await server.send(client) as answer:  # the head is whole
        with pytest.raises(CutShort):
            await answer.read()

    garbage = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    server = await raw_server(answering(garbage))  # and keeps the connection open
    async with await server.send(client) as answer:  # the head is whole
        with pytest.raises(CutShort):
            await answer.read()


async def test_the_deadline_covers_the_whole_exchange(
    client: UpstreamClient, raw_server: Callable[..., Awaitable[RawServer]]
) -> None:
    server = await raw_server(answering(b""))  # reads the request, never answers
    with pytest.raises(NoAnswerInTime):
        await server.send(client, "PUT", b"x", timeout=0.3, connect_timeout=1)
    assert len(server.requests) == 1

    async def slow(server: RawServer, reader: Any, writer: Any) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
        for _ in range(20):  # a byte every 0.1 s: never idle long, yet too slow in all
            await asyncio.sleep(0.1)
            writer.write(b"x")
            await writer.drain()
        await reader.read()

    server = await raw_server(slow)
    loop = asyncio.get_running_loop()
    started = loop.time()
    answer = await server.send(client, timeout=0.5, connect_timeout=1)
    async with answer:
        with pytest.raises(CutShort):
            await answer.read()
    assert 0.4 < loop.time() - started < 1.5


async def test_the_per_host_limit_makes_the_next_request_wait(
    aiohttp_server: Callable[..., Any],
) -> None:
    url, peers = await echo_app(aiohttp_server)
    client = UpstreamClient(connections_per_host=2, keepalive_seconds=30)
    try:
        first = await client.request("GET", url + "/echo", [], **TIMEOUTS)
        second = await client.request("GET", url + "/echo", [], **TIMEOUTS)
        third = asyncio.ensure_future(client.request("GET", url + "/echo", [], **TIMEOUTS))
        await asyncio.sleep(0.2)
        assert not third.done() and len(peers) == 2
        await first.read()
        first.close()  # back to the pool: the waiting request takes it
        taken = await third
        await taken.read()
        assert peers[2] == peers[0]
        # At the limit until its deadline: not sent, timed out.
        with pytest.raises(ConnectTimeout):
            await client.request("GET", url + "/echo", [], timeout=0.2, connect_timeout=1)
        taken.close()
        second.close()  # not read whole: closed, which frees its place too
        async with await client.request("GET", url + "/echo", [], **TIMEOUTS) as answer:
            await answer.read()
        assert len(peers) == 4
    finally:
        await client.close()


async def test_a_connection_the_upstream_closed_is_never_used_to_send(
    client: UpstreamClient, raw_server: Callable[..., Awaitable[RawServer]]
) -> None:
    # Answers, and closes while the client keeps the connection for reuse.
    server = await raw_server(
        answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", close=True)
    )
    for _ in range(2):
        assert await server.fetch(client, "PUT", b"x") == b"ok"
        await asyncio.sleep(0.05)  # the upstream's FIN arrives
    assert server.connections == 2
    assert len(server.requests) == 2  # each request seen once


async def test_idle_connections_expire(
    raw_server: Callable[..., Awaitable[RawServer]],
) -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    server = await raw_server(answering(ok, ok))
    client = UpstreamClient(connections_per_host=8, keepalive_seconds=0.2)
    try:
        (await server.send(client)).close()
        (await server.send(client)).close()
        assert server.connections == 1
        await asyncio.sleep(0.5)
        (await server.send(client)).close()
        assert server.connections == 2
    finally:
        await client.close()


async def test_https_upstream(aiohttp_server: Callable[..., Any], tmp_path: Path) -> None:
    pki = Pki(tmp_path / "pki")
    issued = pki.issue("upstream", server=True)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(issued.cert, issued.key)
    peers: list[str] = []

    async def hello(request: web.Request) -> web.Response:
        peers.append(str(request.transport.get_extra_info("peername")))  # type: ignore[union-attr]
        return web.Response(text=f"hello {request.host}")

    app = web.Application()
    app.router.add_get("/", hello)
    server = await aiohttp_server(app, ssl=server_context)
    url = f"https://localhost:{server.port}/"

    client = UpstreamClient(
        connections_per_host=8, keepalive_seconds=30, ssl_context=pki.client_context()
    )
    try:
        for _ in range(2):
            async with await client.request("GET", url, [], **TIMEOUTS) as answer:
                assert await answer.read() == f"hello localhost:{server.port}".encode()
        assert len(set(peers)) == 1
    finally:
        await client.close()
    # The system's trust store (the default) does not know the test CA: not sent.
    untrusting = UpstreamClient(connections_per_host=8, keepalive_seconds=30)
    try:
        with pytest.raises(NotSent):
            await untrusting.request("GET", url, [], **TIMEOUTS)
    finally:
        await untrusting.close()


def test_on_uvloop() -> None:
    """The gateway runs on uvloop, whose transports are not asyncio's: the paths that
    touch the transport (flow control both ways, EOF, reuse) once more on it."""

    async def scenario() -> None:
        big = 3 * 1024 * 1024

        async def handle(server: RawServer, reader: Any, writer: Any) -> None:
            while True:
                request = await server.read_request(reader)
                if request.startswith(b"GET /cut"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\npart")
                    await writer.drain()
                    return
                if request.startswith(b"GET /none"):
                    return
                size = len(request) - request.index(b"\r\n\r\n") - 4
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % big)
                writer.write(b"y" * big)
                writer.write(b"")
                await writer.drain()
                assert size in (0, big)

        server = RawServer(handle)
        await server.start()
        client = UpstreamClient(connections_per_host=2, keepalive_seconds=30)
        try:
            body = io.BytesIO()
            body.write(b"z" * big)
            for sent in (body, b""):
                async with await server.send(client, "POST", sent) as answer:
                    got = 0
                    async for chunk in answer:
                        got += len(chunk)
                        await asyncio.sleep(0)
                    assert got == big
            assert server.connections == 1
            async with await server.send(client, path="/cut") as answer:
                with pytest.raises(CutShort):
                    await answer.read()
            with pytest.raises(NoAnswer):
                await server.send(client, path="/none")
            await asyncio.sleep(0.05)
            assert server.connections == 2  # /cut on the kept one, /none on a new one
            assert len(server.requests) == 4
        finally:
            await client.close()
            await server.close()

    uvloop.run(scenario())


async def test_a_fenced_write_to_an_https_upstream(
    make_stack: Any,
    aiohttp_server: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the gateway: an https upstream whose certificate the system's trust store
    (here: ``SSL_CERT_FILE``, read by OpenSSL) vouches for gets the write; one it does
    not gets nothing, and the key stays free (not sent)."""
    pki = Pki(tmp_path / "pki")
    issued = pki.issue("upstream", server=True)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(issued.cert, issued.key)
    up = Upstream()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", up.handler)
    server = await aiohttp_server(app, ssl=server_context)
    config = {"name": "pay", "url": f"https://localhost:{server.port}"}

    untrusting = await make_stack(upstreams=[config])
    lease = await untrusting.lease("job-tls", owner="a", ttl=60)
    resp = await untrusting.write("/pay/charges", lease, key="step-1")
    doc = await resp.json()
    assert resp.status == 502 and doc["reason"] == "upstream-unavailable"
    assert "TLS handshake failed" in doc["detail"] and "safe to retry" in doc["detail"]
    assert resp.headers["Retry-After"] == "1"
    assert up.received == []

    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca))  # read when a context is made
    trusting = await make_stack(upstreams=[config])
    resp = await trusting.write("/pay/charges", lease, key="step-1")  # free again
    assert resp.status == 201, await resp.text()
    resp = await trusting.write("/pay/charges", lease, key="step-2")
    assert resp.status == 201
    assert len(up.received) == 2
    assert up.received[0]["headers"]["Host"] == f"localhost:{server.port}"
