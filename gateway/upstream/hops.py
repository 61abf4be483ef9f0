"""Hop-by-hop headers (RFC 9110, section 7.6.1): they describe one connection, never the
message, so neither the request the gateway forwards nor the answer it relays carries
them on. The intake drops them from the client's request; forwarding from the answer."""

from __future__ import annotations

from collections.abc import Iterable

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Proxy-Connection",
    )
)


def connection_named(headers: Iterable[tuple[str, str]]) -> set[str]:
    """The header names the ``Connection`` headers among ``headers`` (name, value pairs:
    a request's ``.items()``, an upstream answer's list) list: hop-by-hop for this
    message."""
    return {
        h.strip().lower() for k, v in headers if k.lower() == "connection" for h in v.split(",")
    }
