"""The keep-alive pools of connections per upstream host, the client that sends through
them, and its answers."""

from __future__ import annotations

import asyncio
import io
import ssl
from collections import deque
from collections.abc import Callable, Iterable
from types import TracebackType

from gateway.upstream.connection import Connection
from gateway.upstream.errors import ConnectTimeout, CutShort, NotSent
from gateway.upstream.origin import Origin, request_head, split_url

# The largest answer head read (status line and headers, with those of 1xx answers before
# it): ``gateway.max_upstream_head_bytes``'s default. aiohttp's parser takes 8 KiB per
# field, h11 16 KiB per head; some upstreams' heads (cookies, links) are larger.
DEFAULT_MAX_HEAD_BYTES = 64 * 1024


class UpstreamResponse:
    """An answer whose head has arrived; its body is read as a stream (``read_chunk``,
    ``async for``, ``read``). Closing it gives its connection back to the pool when the
    answer was read whole and may be followed by another, and closes it otherwise."""

    __slots__ = ("_conn", "_pool", "headers", "reason", "status")

    def __init__(self, conn: Connection, pool: HostPool) -> None:
        self._conn: Connection | None = conn
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


class HostPool:
    """The connections to one (scheme, host, port): idle ones kept for reuse, at most
    ``limit`` open at a time, and the requests waiting for one."""

    def __init__(self, client: UpstreamClient, origin: Origin) -> None:
        self._client = client
        self.scheme, self.host, self.port = origin.scheme, origin.host, origin.port
        self.idle: deque[Connection] = deque()
        self.open: set[Connection] = set()
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self, deadline: float, connect_timeout: float) -> Connection:
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
    ) -> Connection:
        conn = Connection(loop, self, max_head_bytes=self._client.max_head_bytes)
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

    def release(self, conn: Connection) -> None:
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

    def _discard(self, conn: Connection) -> None:
        conn.close()
        self.lost(conn)

    def lost(self, conn: Connection) -> None:
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
        kept: deque[Connection] = deque()
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
        max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
    ) -> None:
        self.connections_per_host = connections_per_host
        self.keepalive_seconds = keepalive_seconds
        self.max_head_bytes = max_head_bytes
        self._ssl_context = ssl_context
        self._pools: dict[tuple[str, str, int], HostPool] = {}
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
        sending: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send one request; its answer once the head has arrived. ``body``: bytes, or a
        buffer whose first ``tell()`` bytes are the body. ``timeout`` covers the whole
        exchange, reading the body included; close the answer when done with it.
        ``sending`` is called once a connection is in hand, right before the first byte
        is written: until then, whatever ends the request (a cancellation too), nothing
        of it has left."""
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
            pool = self._pools[key] = HostPool(self, origin)
        conn = await pool.acquire(deadline, connect_timeout)
        if sending is not None:
            sending()
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
