"""Where a request to an upstream goes and the bytes of its head; no I/O."""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from gateway.upstream.errors import NotSent

# Methods that carry no body unless given one: aiohttp's GET_METHODS. Any other method
# without a body is sent with ``Content-Length: 0``, as aiohttp sent it.
BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
DEFAULT_PORTS = {"http": 80, "https": 443}


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
