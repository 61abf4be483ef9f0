"""One connection to an upstream: an ``asyncio.Protocol`` whose answers httptools parses.

It carries one exchange at a time (``begin``, ``send``, ``head``, ``read_chunk``,
``end``), driven by the pool (``pool.py``); what it reads is the answer's head, up to the
client's limit, and its body as a stream, held back from a slow reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import struct
from collections import deque
from typing import Protocol, cast

import httptools

from gateway.upstream.errors import (
    CutShort,
    HeadTooLarge,
    NoAnswer,
    NoAnswerInTime,
    NotSent,
    UpstreamError,
)


class Owner(Protocol):
    """What a connection tells the pool that holds it (``pool.HostPool``)."""

    def lost(self, conn: Connection) -> None:
        """The connection closed: it is no longer the pool's."""


# A body above LARGE_BODY is written in pieces of PIECE bytes, each waiting for the
# socket to take the ones before (the transport's flow control): no second copy of it
# piles up in memory. A smaller one goes with the head in one write.
LARGE_BODY = 1024 * 1024
PIECE = 256 * 1024
# An answer's body buffered and not yet read: above HIGH the socket is not read until
# the reader has taken it below LOW (a slow worker slows the upstream, not our memory).
HIGH = 512 * 1024
LOW = 128 * 1024

# A request's bytes must not reach the upstream after the gateway let go of it: the
# claim on its key ends, and another replica may send the job's next generation. Closing
# a socket does not take back what the kernel still holds to send: it is retransmitted
# for minutes (a partition that heals later delivers it), and so are a killed process's.
# So while an exchange is in progress its socket closes with a reset (SO_LINGER on, 0 s:
# the unsent bytes are discarded, however the socket is closed: by us, or by the kernel
# when the process ends), and the kernel is told to drop the connection rather than keep
# its bytes unacknowledged past the exchange's deadline (TCP_USER_TIMEOUT, Linux), which
# holds while the process is frozen too. A connection whose exchange finished cleanly
# closes gracefully (idle, it holds nothing unsent): an upstream does not log a reset
# for every idle connection the pool closes. The reset is set once, when the connection
# is made, and the graceful close only right before such a close: no system call per
# exchange for it. TCP_USER_TIMEOUT is set again only when the exchange's deadline is
# shorter than the value the socket has, or longer by an eighth (USER_TIMEOUT_SLACK):
# the bound never exceeds an exchange's deadline.
RESET_ON_CLOSE = struct.pack("ii", 1, 0)
SHUT_ON_CLOSE = struct.pack("ii", 0, 0)
USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", None)
USER_TIMEOUT_SLACK = 8


class Connection(asyncio.Protocol):
    """One connection to an upstream: the socket's events, the parser's callbacks and
    the state of the one exchange it carries at a time."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, pool: Owner, *, max_head_bytes: int
    ) -> None:
        self._loop = loop
        self._pool = pool
        self._max_head_bytes = max_head_bytes
        self.transport: asyncio.Transport | None = None
        self._sock: socket.socket | None = None  # a TCP socket's, for its options
        self._user_timeout: int | None = None  # milliseconds, as last set on the socket
        self._clean = True  # no exchange yet, or the last one finished cleanly
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
        # Bytes the answer's head may still take: every byte read before its end (a 1xx
        # answer's head too) is counted against ``max_head_bytes``.
        self._head_room = max_head_bytes
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
        self._clean = False
        self._head_only = head_only
        self._error = None
        self._informational = self._framed = self.head_done = self.done = False
        self._head_room = self._max_head_bytes
        self.keep_alive = False
        self.status = 0
        self.reason = bytearray()
        self.headers = []
        self._timer = self._loop.call_at(deadline, self._expired)
        self._guard(deadline)

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
        self._clean = self.finished_cleanly()
        self._active = False
        self._cancel_timer()

    def close(self) -> None:
        self.gone = True
        self._cancel_timer()
        if self.transport is not None:
            if self._clean and not self._active:
                self._set_linger(SHUT_ON_CLOSE)  # idle: nothing of a request unsent
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

    def _guard(self, deadline: float) -> None:
        """Until the exchange finishes cleanly, closing the socket discards what it has
        not sent (``SO_LINGER``, set when the connection was made), and the kernel drops
        the connection if its bytes stay unacknowledged past ``deadline`` (this loop's
        time), whatever this process is doing then."""
        sock = self._sock
        if sock is None or USER_TIMEOUT is None:
            return
        milliseconds = max(1, int((deadline - self._loop.time()) * 1000))
        last = self._user_timeout
        if last is not None and last <= milliseconds <= last + last // USER_TIMEOUT_SLACK:
            return  # the socket's bound is already within the deadline, and near it
        try:
            sock.setsockopt(socket.IPPROTO_TCP, USER_TIMEOUT, milliseconds)
        except OSError:
            self._user_timeout = None
        else:
            self._user_timeout = milliseconds

    def _set_linger(self, linger: bytes) -> None:
        sock = self._sock
        if sock is None:
            return
        with contextlib.suppress(OSError, ValueError):  # closed already
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)

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
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family != socket.AF_UNIX:
            self._sock = sock
            self._set_linger(RESET_ON_CLOSE)

    def data_received(self, data: bytes) -> None:
        if not self._active or self.done:
            # Bytes nobody asked for (on an idle connection, or after an answer): the
            # connection's framing can no longer be trusted.
            self.close()
            return
        try:
            if self.head_done:
                self._parser.feed_data(data)
            else:
                self._read_head(data)
        except httptools.HttpParserUpgrade:
            self._fail(self._ended_early("the upstream switched protocols (101)"))
        except httptools.HttpParserError as error:
            self._fail(self._ended_early(f"the upstream's answer could not be parsed: {error}"))

    def _read_head(self, data: bytes) -> None:
        """Feed the parser no more bytes than the head may still take; the rest only once
        the head is complete. So a head over the limit is refused as soon as the limit is
        reached, and httptools never holds more of it (a single 2 MB header included)."""
        room = self._head_room
        if len(data) < room:
            self._head_room = room - len(data)
            self._parser.feed_data(data)
            return
        self._head_room = 0
        view = memoryview(data)  # slices without copying: httptools reads the buffer
        self._parser.feed_data(view[:room])
        if self.head_done:
            if len(data) > room:
                self._parser.feed_data(view[room:])
        elif self._error is None:
            self._fail(
                HeadTooLarge(
                    f"the upstream's answer head is over {self._max_head_bytes} bytes "
                    "(gateway.max_upstream_head_bytes): not read, the outcome is unknown"
                )
            )

    def eof_received(self) -> bool:
        if self._clean and not self._active:
            self._set_linger(SHUT_ON_CLOSE)  # the upstream closed an idle connection
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
        if self.head_done:
            # A chunked answer's trailers, parsed after its body: read, never taken as
            # the answer's headers (those went on, or were stored, with the head).
            return
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
