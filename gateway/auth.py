"""Bearer-token auth of the control listener: worker tokens for ``/v1/``, metrics tokens
for ``/metrics`` (a scrape credential that can read nothing else), admin tokens for
everything; ``/healthz`` and ``/readyz`` are open."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from lease_core import exceptions as exc

from .config import AuthSettings

# Open without a token: health, and the dashboard's static files, which hold no data
# (every call the page makes for data needs the admin token, which the user types in).
OPEN_PATHS = frozenset(
    {"/healthz", "/readyz", "/admin/ui", "/admin/ui/app.js", "/admin/ui/style.css"}
)
METRICS_PATH = "/metrics"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _matches(presented: bytes, tokens: list[bytes]) -> bool:
    # Compare against every token so the time taken says nothing about which matched.
    found = False
    for token in tokens:
        found |= hmac.compare_digest(presented, token)
    return found


def auth_middleware(settings: AuthSettings) -> Middleware:
    admin = [t.get_secret_value().encode() for t in settings.admin_tokens]
    worker = [t.get_secret_value().encode() for t in settings.worker_tokens]
    scrape = [t.get_secret_value().encode() for t in settings.metrics_tokens]

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS or not settings.enabled:
            return await handler(request)
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise exc.Unauthorized("send Authorization: Bearer <token>")
        token = presented.strip().encode("utf-8", "surrogateescape")
        if _matches(token, admin):
            return await handler(request)
        if _matches(token, scrape):
            if request.path != METRICS_PATH:
                raise exc.Forbidden("metrics tokens may only read /metrics")
            return await handler(request)
        if not _matches(token, worker):
            raise exc.Unauthorized("unknown bearer token")
        if not request.path.startswith("/v1/"):
            raise exc.Forbidden("worker tokens may only use /v1/; this path needs an admin token")
        return await handler(request)

    return middleware
