"""Bearer-token auth of the control listener: worker tokens for ``/v1/``, metrics tokens
for ``/metrics`` (a scrape credential that can read nothing else), admin tokens for
everything; ``/healthz`` and ``/readyz`` are open."""

from __future__ import annotations

import hmac

from aiohttp import web

from gateway.config import AuthSettings
from lease_core import exceptions as exc
from lease_core.problems import Check

# Open without a token: health, the dashboard's static files, which hold no data (every
# call the page makes for data needs the admin token, which the user types in), and the
# OpenAPI document, which describes the protocol (the same file as docs/openapi.json),
# nothing of this deployment: no upstream, token or setting.
OPEN_PATHS = frozenset(
    {
        "/healthz",
        "/readyz",
        "/openapi.json",
        "/admin/ui",
        "/admin/ui/app.js",
        "/admin/ui/chart.js",
        "/admin/ui/refresh.js",
        "/admin/ui/style.css",
    }
)
METRICS_PATH = "/metrics"


def _matches(presented: bytes, tokens: list[bytes]) -> bool:
    # Compare against every token so the time taken says nothing about which matched.
    found = False
    for token in tokens:
        found |= hmac.compare_digest(presented, token)
    return found


def auth_check(settings: AuthSettings) -> Check:
    """The control listener's check of a request's bearer token (run by its
    ``problem_middleware``, which answers the refusals)."""
    admin = [t.get_secret_value().encode() for t in settings.admin_tokens]
    worker = [t.get_secret_value().encode() for t in settings.worker_tokens]
    scrape = [t.get_secret_value().encode() for t in settings.metrics_tokens]

    async def check(request: web.Request) -> None:
        if request.path in OPEN_PATHS or not settings.enabled:
            return
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise exc.Unauthorized("Send Authorization: Bearer <token>.")
        token = presented.strip().encode("utf-8", "surrogateescape")
        if _matches(token, admin):
            return
        if _matches(token, scrape):
            if request.path != METRICS_PATH:
                raise exc.Forbidden("Metrics tokens may only read /metrics.")
            return
        if not _matches(token, worker):
            raise exc.Unauthorized("Unknown bearer token.")
        if not request.path.startswith("/v1/"):
            raise exc.Forbidden("Worker tokens may only use /v1/; this path needs an admin token.")

    return check
