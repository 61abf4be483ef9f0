"""The gateway's HTTP/1.1 client to its upstreams: lean, and never re-sending.

aiohttp's client was a large part of the gateway's CPU on a forwarded write, and the
part it could replace without changing what workers talk to
(docs/performance-history.md, "A leaner forward path"). This one
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
- an answer's head is read up to ``max_head_bytes`` (``gateway.max_upstream_head_bytes``,
  64 KiB by default; the heads of 1xx answers before it count too): a larger one is
  ``HeadTooLarge``, a ``NoAnswer``, since the request was sent; nothing of it is kept;
- the headers are the head's: a chunked answer's trailers are read and dropped, never
  added to them;
- one deadline per exchange (``timeout``) covers connecting, sending, the head and the
  body; connecting alone is also held to ``connect_timeout``.

The modules, by responsibility (httpcore's split): ``origin`` (where a request goes and
its head, without I/O), ``connection`` (one connection: the socket's events and the
parser's callbacks), ``pool`` (the keep-alive pools per host, the client and its
answers), ``errors`` (how an exchange failed).
"""

from __future__ import annotations

from gateway.upstream.errors import (
    ConnectTimeout,
    CutShort,
    HeadTooLarge,
    NoAnswer,
    NoAnswerInTime,
    NotSent,
    UpstreamError,
)
from gateway.upstream.pool import DEFAULT_MAX_HEAD_BYTES, UpstreamClient, UpstreamResponse

__all__ = [
    "DEFAULT_MAX_HEAD_BYTES",
    "ConnectTimeout",
    "CutShort",
    "HeadTooLarge",
    "NoAnswer",
    "NoAnswerInTime",
    "NotSent",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamResponse",
]
