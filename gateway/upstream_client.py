"""The gateway's HTTP/1.1 client to its upstreams: lean, and never re-sending.

aiohttp's client spent more of the gateway's CPU on a forwarded write than the rest of
the write's path put together (docs/performance.md, "A leaner forward path"). This one
is an ``asyncio.Protocol`` per connection, a pool of idle keep-alive connections per
(scheme, host, port), and an answer whose body is read as a stream. Answers are parsed
by httptools (llhttp, the parser uvicorn and node use); nothing here parses HTTP by hand.

What it promises the forwarding (``forwarding.py``) and the resolver (``resolve.py``):

- nothing is ever sent twice: once a byte of a request went to a socket, a failure is
  ``NoAnswer`` (the outcome is unknown), never a retry; a connection is reused only
  after its answer was read to the end, the answer allowed keep-alive, and the upstream
  has not closed it since;
- ``NotSent`` means no byte of the request left (connecting failed or timed out, or the
  request could not be framed): the caller may treat the write as never made;
- ``CutShort``: the answer's head arrived, its body did not arrive whole;
- one deadline per exchange (``timeout``) covers connecting, sending, the head and the
  body; connecting alone is also held to ``connect_timeout``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import ssl
from collections import deque
from collections.abc import Iterable
from types import TracebackType
from typing import NamedTuple, cast
from urllib.parse import unquote, urlsplit

import httptools

# Methods that carry no body unless given one: aiohttp's GET_METHODS. Any other method
# without a body is sent with ``Content-Length: 0``, as aiohttp sent it.
BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
DEFAULT_PORTS = {"http": 80, "https": 443}
# A body above LARGE_BODY is written in pieces of PIECE bytes, each waiting for the
# socket to take the ones before (the transport's flow control): no second copy of it
# piles up in memory. A smaller one goes with the head in one write.
LARGE_BODY = 1024 * 1024
PIECE = 256 * 1024
# An answer's body buffered and not yet read: above HIGH the socket is not read until
# the reader has taken it below LOW (a slow worker slows the upstream, not our memory).
HIGH = 512 * 1024
LOW = 128 * 1024


class UpstreamError(Exception):
    """The exchange with the upstream failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.__doc__)


class NotSent(UpstreamError):
    """Nothing of the request was sent: the upstream could not be reached."""


class ConnectTimeout(NotSent):
    """Nothing of the request was sent: connecting to the upstream timed out."""


class NoAnswer(UpstreamError):
    """The request was sent (maybe in part), and no answer came: its outcome is unknown."""


class NoAnswerInTime(NoAnswer):
    """The request was sent, and its answer did not come in time: its outcome is unknown."""


class CutShort(UpstreamError):
    """The upstream's answer began and did not arrive whole."""


class Origin(NamedTuple):
    """Where a request goes (the pool's key) and how its Host header reads."""

    scheme: str
    host: str
    port: int
    host_header: str
    authorization: str | None  # Basic credentials written in the URL


# Origins parsed once each: the upstreams are few, their URLs many (every path).
_origins: dict[str, Origin] = {}


def split_url(url: str) -> tuple[Origin, str]:
    """The URL's origin and its path and query as given (already encoded: never
    re-quoted); a fragment is dropped, as aiohttp dropped it."""
    start = url.find("://")
    end = len(url)
    for stop in "/?#":
        at = url.find(stop, start + 3)
        if start >= 0 and 0 <= at < end:
            end = at
    origin = _origins.get(url[:end])
    if origin is None:
        origin = _parse_origin(url[:end])
        if len(_origins) < 1024:
            _origins[url[:end]] = origin
    path = url[end:].partition("#")[0]
    if not path.startswith("/"):
        path = "/" + path
    return origin, path


def _parse_origin(text: str) -> Origin:
    parts = urlsplit(text)
    scheme = parts.scheme
    host = parts.hostname
    if scheme not in DEFAULT_PORTS or not host:
        raise NotSent(f"not an http(s) URL: {text!r}")
    default = DEFAULT_PORTS[scheme]
    try:
        port = parts.port or default
    except ValueError as error:
        raise NotSent(f"not an http(s) URL: {text!r}") from error
    shown = f"[{host}]" if ":" in host else host
    authorization = None
    if parts.username is not None:
        # As aiohttp did: credentials in the upstream's URL become Basic authentication.
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(pair.encode("latin-1")).decode("ascii")
    host_header = shown if port == default else f"{shown}:{port}"
    return Origin(scheme, host, port, host_header, authorization)


def request_head(
    method: str, origin: Origin, path: str, headers: Iterable[tuple[str, str]], size: int
) -> bytes:
    """The request line and headers: ``Host`` first unless given, the headers as given,
    then ``Content-Length``. A name or value that could end the line early (CR, LF,
    NUL) is refused before anything is sent."""
    lines = [f"{method} {path} HTTP/1.1"]
    given = [f"{name}: {value}" for name, value in headers]
    names = {line[: line.index(":")].lower() for line in given}
    if "host" not in names:
        lines.append(f"Host: {origin.host_header}")
    if origin.authorization is not None:
        if "authorization" in names:
            raise NotSent("credentials both in the upstream's URL and in an Authorization header")
        lines.append(f"Authorization: {origin.authorization}")
    lines += given
    if "content-length" not in names and (size or method not in BODYLESS_METHODS):
        lines.append(f"Content-Length: {size}")
    lines.append("\r\n")
    text = "\r\n".join(lines)
    # Each line ends with the one CR LF put there: any other CR, LF or NUL came in a
    # name, a value or the path (three scans in C, not one per header).
    breaks = len(lines)
    if text.count("\n") != breaks or text.count("\r") != breaks or "\0" in text:
        raise NotSent("a header or the path holds a CR, LF or NUL character")
    # Encoded as aiohttp encodes them; surrogateescape gives back the bytes a worker sent.
    return text.encode("utf-8", "surrogateescape")


class UpstreamResponse:
    """An answer whose head has arrived; its body is read as a stream (``read_chunk``,
    ``async for``, ``read``). Closing it gives its connection back to the pool when the
    answer was read whole and may be followed by another, and closes it otherwise."""

    __slots__ = ("_conn", "_pool", "headers", "reason", "status")

    def __init__(self, conn: _Connection, pool: _HostPool) -> None:
        self._conn: _Connection | None = conn
        self._pool = pool
        self.status = conn.status
        self.reason = conn.reason.decode("utf-8", "surrogateescape")
        self.headers: list[tuple[str, str]] = conn.headers

    async def read_chunk(self) -> bytes:
        """The body's next part; ``b""`` at its end. ``CutShort`` when it ends early."""
        conn = self._conn
        if conn is None:
            raise CutShort("the answer was closed before it was read")
        return await conn.read_chunk()

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self.read_chunk()
        if not chunk:
            raise StopAsyncIteration
        return chunk

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self])

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(conn)

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _Connection(asyncio.Protocol):
    """One connection to an upstream: the socket's events, the parser's callbacks and
    the state of the one exchange it carries at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: _HostPool) -> None:
        self._loop = loop
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.gone = False  # closed, lost, or the upstream's end shut: never used again
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._writing_paused = False
        self._timer: asyncio.TimerHandle | None = None
        # The exchange in progress (``begin`` resets it).
        self._active = False
        self._head_only = False
        self._error: UpstreamError | None = None
        self._informational = False
        self._framed = False  # Content-Length or chunked: EOF before the end cuts it
        self.head_done = False
        self.done = False
        self.keep_alive = False
        self.status = 0
        self.reason = bytearray()
        self.headers: list[tuple[str, str]] = []
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._reading_paused = False

    # -- the exchange, as the client drives it

    def reusable(self) -> bool:
        transport = self.transport
        return not self.gone and transport is not None and not transport.is_closing()

    def begin(self, deadline: float, *, head_only: bool) -> None:
        self._active = True
        self._head_only = head_only
        self._error = None
        self._informational = self._framed = self.head_done = self.done = False
        self.keep_alive = False
        self.status = 0
        self.reason = bytearray()
        self.headers = []
        self._timer = self._loop.call_at(deadline, self._expired)

    async def send(self, head: bytes, body: bytes | io.BytesIO, size: int) -> None:
        """Write the request. Once its first write is taken, a failure is ``NoAnswer``:
        bytes may have left."""
        transport = self.transport
        assert transport is not None
        small = size <= LARGE_BODY
        first = head
        if small and size:
            first += body.getvalue()[:size] if isinstance(body, io.BytesIO) else body
        try:
            transport.write(first)
        except RuntimeError as error:  # uvloop: the transport closed under us
            raise NotSent(f"the connection closed before the request was sent: {error}") from None
        if small:
            return
        source = io.BytesIO(body) if isinstance(body, bytes) else body
        source.seek(0)
        left = size
        while left > 0:
            piece = source.read(min(PIECE, left))
            if not piece:
                break
            left -= len(piece)
            if self.gone:
                break
            transport.write(piece)
            if self._writing_paused:
                await self._wait()
            if self.done:
                break
        if self.done and left > 0:
            # The upstream answered before taking the whole body: never reuse this one.
            self.keep_alive = False
        elif self._error is not None:
            raise self._error
        elif self.gone and not self.done:
            raise NoAnswer("the upstream closed the connection while the request was sent")

    async def head(self) -> None:
        """Wait for the answer's head (1xx answers skipped)."""
        while not self.head_done:
            if self._error is not None:
                raise self._error
            if self.gone:
                raise NoAnswer("the connection ended without an answer")
            await self._wait()

    async def read_chunk(self) -> bytes:
        while True:
            chunks = self._chunks
            if chunks:
                chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                if self._reading_paused and self.transport is not None:
                    self._reading_paused = False
                    self.transport.resume_reading()
                return chunk
            if self._error is not None:
                raise self._error
            if self.done:
                return b""
            await self._wait()

    def finished_cleanly(self) -> bool:
        """The answer was read whole and another may follow on this connection."""
        return (
            self.done
            and self.keep_alive
            and not self._head_only
            and self._error is None
            and not self._chunks
            and self.reusable()
        )

    def end(self) -> None:
        """The exchange is over (released to the pool or about to be closed)."""
        self._active = False
        self._cancel_timer()

    def close(self) -> None:
        self.gone = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.head_done:
            self._fail(CutShort("the answer did not arrive whole in time"))
        else:
            self._fail(NoAnswerInTime())

    def _fail(self, error: UpstreamError) -> None:
        """The exchange is broken: remember why, drop the socket, wake the reader."""
        if self._error is None and not self.done:
            self._error = error
        self.gone = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def _ended_early(self, why: str) -> UpstreamError:
        return CutShort(why) if self.head_done else NoAnswer(why)

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self._active or self.done:
            # Bytes nobody asked for (on an idle connection, or after an answer): the
            # connection's framing can no longer be trusted.
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(self._ended_early("the upstream switched protocols (101)"))
        except httptools.HttpParserError as error:
            self._fail(self._ended_early(f"the upstream's answer could not be parsed: {error}"))

    def eof_received(self) -> bool:
        self._at_eof()
        return False  # close our end too

    def connection_lost(self, exc: Exception | None) -> None:
        self._at_eof()
        self.gone = True
        self._cancel_timer()
        self._writing_paused = False
        self._wake()
        self._pool.lost(self)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._wake()

    def _at_eof(self) -> None:
        self.gone = True
        if not self._active or self.done or self._error is not None:
            return
        if self.head_done and not self._framed:
            # Read until close (no Content-Length, not chunked): the end is the EOF.
            self.done = True
            self.keep_alive = False
            self._cancel_timer()
        elif self.head_done:
            self._error = CutShort("the upstream closed the connection before the answer's end")
        else:
            self._error = NoAnswer("the upstream closed the connection without answering")
        self._wake()

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self.reason = bytearray()
        self.headers = []
        self._framed = False

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        # As aiohttp's parser decodes them (and its server encodes them again): UTF-8
        # passes through unchanged.
        decoded = name.decode("utf-8", "surrogateescape")
        self.headers.append((decoded, value.decode("utf-8", "surrogateescape")))
        lower = decoded.lower()
        if lower == "content-length" or (
            lower == "transfer-encoding" and b"chunked" in value.lower()
        ):
            self._framed = True

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # 100 Continue, 103 Early Hints: not the answer. After a 101 the parser
            # raises HttpParserUpgrade: the connection is no longer HTTP, no answer.
            self._informational = True
            return
        self.status = status
        self.head_done = True
        if self._head_only:
            # httptools cannot be told the request was HEAD, so it would wait for the
            # body a Content-Length announces: the answer ends here, and so does the
            # connection (its parser's state is no longer the upstream's).
            self.done = True
            self.keep_alive = False
            self._cancel_timer()
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.done or self._informational:
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        if self.done:
            return
        self.done = True
        self.keep_alive = self._parser.should_keep_alive()
        self._cancel_timer()
        self._wake()


class _HostPool:
    """The connections to one (scheme, host, port): idle ones kept for reuse, at most
    ``limit`` open at a time, and the requests waiting for one."""

    def __init__(self, client: UpstreamClient, origin: Origin) -> None:
        self._client = client
        self.scheme, self.host, self.port = origin.scheme, origin.host, origin.port
        self.idle: deque[_Connection] = deque()
        self.open: set[_Connection] = set()
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self, deadline: float, connect_timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        keepalive = self._client.keepalive_seconds
        while True:
            while self.idle:
                conn = self.idle.pop()  # the most recently used: least likely timed out
                if conn.reusable() and loop.time() - conn.idle_since < keepalive:
                    return conn
                self._discard(conn)
            if len(self.open) < self._client.connections_per_host:
                return await self._connect(loop, deadline, connect_timeout)
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException as error:
                if not waiter.done():
                    waiter.cancel()
                    self._waiters.remove(waiter)
                elif not waiter.cancelled():
                    # Woken but leaving: the free place goes on to the next in line.
                    self._wake_one()
                if isinstance(error, TimeoutError):
                    raise ConnectTimeout(
                        "no connection to the upstream became free in time"
                    ) from None
                raise

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, deadline: float, connect_timeout: float
    ) -> _Connection:
        conn = _Connection(loop, self)
        self.open.add(conn)  # holds its place under the limit while connecting
        tls = self.scheme == "https"
        try:
            async with asyncio.timeout_at(min(deadline, loop.time() + connect_timeout)):
                await loop.create_connection(
                    lambda: conn,
                    self.host,
                    self.port,
                    ssl=self._client.ssl_context if tls else None,
                    server_hostname=self.host if tls else None,
                )
        except TimeoutError:
            self._discard(conn)
            raise ConnectTimeout(f"connecting to {self.host}:{self.port} timed out") from None
        except OSError as error:  # refused, unreachable, DNS, TLS verification
            self._discard(conn)
            raise NotSent(f"could not connect to {self.host}:{self.port}: {error}") from error
        except BaseException:
            self._discard(conn)
            raise
        return conn

    def release(self, conn: _Connection) -> None:
        """The answer is done with: keep the connection for the next request, or close it."""
        clean = conn.finished_cleanly() and not self._client.closed
        conn.end()
        if clean:
            conn.idle_since = asyncio.get_running_loop().time()
            self.idle.append(conn)
            self._client.schedule_sweep()
            self._wake_one()
        else:
            self._discard(conn)

    def _discard(self, conn: _Connection) -> None:
        conn.close()
        self.lost(conn)

    def lost(self, conn: _Connection) -> None:
        """A connection closed (by us or by the upstream): its place is free."""
        if conn in self.open:
            self.open.discard(conn)
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def sweep(self, now: float) -> float | None:
        """Close the idle connections kept too long; when the next one expires."""
        keepalive = self._client.keepalive_seconds
        kept: deque[_Connection] = deque()
        for conn in self.idle:
            if conn.reusable() and now - conn.idle_since < keepalive:
                kept.append(conn)
            else:
                self._discard(conn)
        self.idle = kept
        return min((c.idle_since + keepalive for c in kept), default=None)

    def close(self) -> None:
        for conn in list(self.open):
            self._discard(conn)
        self.idle.clear()


class UpstreamClient:
    """The pools of connections to every upstream, and the requests sent through them."""

    def __init__(
        self,
        *,
        connections_per_host: int,
        keepalive_seconds: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connections_per_host = connections_per_host
        self.keepalive_seconds = keepalive_seconds
        self._ssl_context = ssl_context
        self._pools: dict[tuple[str, str, int], _HostPool] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self.closed = False

    @property
    def ssl_context(self) -> ssl.SSLContext:
        # What aiohttp used by default: the system's trust store, hostnames checked.
        if self._ssl_context is None:
            self._ssl_context = ssl.create_default_context()
        return self._ssl_context

    async def request(
        self,
        method: str,
        url: str,
        headers: Iterable[tuple[str, str]],
        body: bytes | io.BytesIO = b"",
        *,
        timeout: float,
        connect_timeout: float,
    ) -> UpstreamResponse:
        """Send one request; its answer once the head has arrived. ``body``: bytes, or a
        buffer whose first ``tell()`` bytes are the body. ``timeout`` covers the whole
        exchange, reading the body included; close the answer when done with it."""
        if self.closed:
            raise NotSent("the upstream client is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        origin, path = split_url(url)
        size = body.tell() if isinstance(body, io.BytesIO) else len(body)
        head = request_head(method, origin, path, headers, size)
        key = (origin.scheme, origin.host, origin.port)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _HostPool(self, origin)
        conn = await pool.acquire(deadline, connect_timeout)
        try:
            conn.begin(deadline, head_only=method == "HEAD")
            await conn.send(head, body, size)
            await conn.head()
        except BaseException:
            conn.end()
            pool.release(conn)  # not finished cleanly: closed
            raise
        return UpstreamResponse(conn, pool)

    def schedule_sweep(self) -> None:
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(
                self.keepalive_seconds, self._sweep_idle
            )

    def _sweep_idle(self) -> None:
        self._sweep = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        next_at = [at for pool in self._pools.values() if (at := pool.sweep(now)) is not None]
        if next_at:
            self._sweep = loop.call_at(min(next_at), self._sweep_idle)

    async def close(self) -> None:
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for pool in self._pools.values():
            pool.close()
        # Let the transports run their connection_lost before the loop may stop.
        await asyncio.sleep(0)
