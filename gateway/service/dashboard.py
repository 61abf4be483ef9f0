"""The dashboard at ``/admin/ui`` (admin token). Served by the gateway itself.

One static page, three scripts (the page's, its chart's, its auto-refresh) and one
stylesheet from ``gateway/ui/`` (no build step, no third-party code), and two JSON reads
of their own under ``/admin/ui/api/``; the page also uses the admin API
(``/admin/rejections``, ``/admin/unknown-outcomes``).

Everything lives under ``/admin/``, so the auth middleware asks for an admin token on
every request, the page included. The page holds no data; its script sends the token
the operator typed (kept in ``sessionStorage``, never in a URL) or, when the field is
empty, no header of its own, so whatever put the header on the page request (a proxy
in front, a header-setting browser extension, a test's browser) authenticates its
calls too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

from aiohttp import web

from gateway.proxy.gateway import Gateway
from gateway.records import dashboard_queries as queries
from gateway.records.audit import parse_time
from lease_core import exceptions as exc
from lease_core import rules
from lease_core.api import path_id

DASHBOARD_GATEWAY = web.AppKey("dashboard_gateway", Gateway)

UI = Path(str(resources.files("gateway") / "ui"))
# Only these files are served; a request names one of them, never a path on disk.
ASSETS = {
    "app.js": "text/javascript",
    "chart.js": "text/javascript",
    "refresh.js": "text/javascript",
    "style.css": "text/css",
}
# The latest time RFC 3339 can write with four year digits.
MAX_TIME = 253402300799.0
TIMELINE_DEFAULT_LIMIT = 500

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


async def page(request: web.Request) -> web.StreamResponse:
    """``GET /admin/ui``: the page itself (no data in it)."""
    return web.FileResponse(
        UI / "index.html",
        headers={**SECURITY_HEADERS, "Content-Type": "text/html; charset=utf-8"},
    )


async def page_slash(request: web.Request) -> web.StreamResponse:
    raise web.HTTPPermanentRedirect("/admin/ui")


async def asset(request: web.Request) -> web.StreamResponse:
    """``GET /admin/ui/{name}``: the script and the stylesheet."""
    name = request.match_info["name"]
    content_type = ASSETS.get(name)
    if content_type is None:
        raise exc.NotFound()
    return web.FileResponse(
        UI / name,
        headers={**SECURITY_HEADERS, "Content-Type": f"{content_type}; charset=utf-8"},
    )


async def refusals_over_time(request: web.Request) -> web.Response:
    """``GET /admin/ui/api/refusals-over-time?since=&until=&window_seconds=&bucket_seconds=
    &upstream=&job_id=``: refusals per bucket and reason, replays counted apart, and per
    upstream the writes forwarded, replayed and refused. ``until`` defaults to the
    database's now, ``since`` to ``window_seconds`` (default a day) before it."""
    backend = request.app[DASHBOARD_GATEWAY].audit.backend
    q = request.query
    since, until = _time(q, "since"), _time(q, "until")
    seconds = _window_seconds(q, since)
    bucket = _whole(q.get("bucket_seconds"), "bucket_seconds", 1, queries.MAX_BUCKET_SECONDS, 0)
    upstream = q.get("upstream") or None
    if upstream is not None:
        gateway = request.app[DASHBOARD_GATEWAY]
        await gateway.audit.check_upstream(upstream, gateway.upstreams)
    job_id = _optional_id(q, "job_id")
    now = await backend.database_now()
    if until is None:
        until = now
    window = _window(since, until, seconds, bucket)
    gateway = request.app[DASHBOARD_GATEWAY]
    await gateway.audit.flush()  # this replica's entries are in
    # Admissions since then are all still in the idempotency records (forwarded counts).
    retention = gateway.settings.gateway.idempotency_retention_seconds
    doc = await queries.refusals_over_time(
        backend,
        window,
        upstream=upstream,
        job_id=job_id,
        configured=list(gateway.upstreams),
        records_since=now - retention,
    )
    return web.json_response(doc)


async def job_timeline(request: web.Request) -> web.Response:
    """``GET /admin/ui/api/jobs/{job_id}/timeline?limit=``: grants, forwarded writes and
    the gateway's own answers for one job, oldest first."""
    job_id = path_id(request, "job_id")
    limit = _whole(
        request.query.get("limit"), "limit", 1, queries.MAX_TIMELINE, TIMELINE_DEFAULT_LIMIT
    )
    audit = request.app[DASHBOARD_GATEWAY].audit
    await audit.flush()  # this replica's entries are in
    return web.json_response(await queries.job_timeline(audit.backend, job_id, limit))


# -- parsing query parameters -------------------------------------------------------------


def _time(query: Mapping[str, str], field: str) -> float | None:
    raw = query.get(field)
    if raw is None or raw == "":
        return None
    value = parse_time(raw, field)
    if not math.isfinite(value) or not 0 <= value <= MAX_TIME:
        raise exc.InvalidRequest(f"{field}: out of range.", field=field)
    return value


def _whole(raw: str | None, field: str, low: int, high: int, default: int) -> int:
    if raw is None or raw == "":
        return default
    if not raw.isascii() or not raw.isdigit() or not low <= int(raw) <= high:
        raise exc.InvalidRequest(
            f"{field}: must be a whole number from {low} to {high}.", field=field
        )
    return int(raw)


def _window_seconds(query: Mapping[str, str], since: float | None) -> int:
    if since is not None and "window_seconds" in query:
        raise exc.InvalidRequest(
            "window_seconds: give either since or window_seconds.", field="window_seconds"
        )
    default = int(queries.DEFAULT_WINDOW_SECONDS)
    return _whole(
        query.get("window_seconds"), "window_seconds", 1, queries.MAX_WINDOW_SECONDS, default
    )


def _window(since: float | None, until: float, seconds: int, bucket: int) -> queries.Window:
    """``since`` (or ``seconds`` before ``until``) to ``until`` in buckets of ``bucket``
    seconds (0: a size that gives a readable chart)."""
    if since is None:
        since = max(0.0, until - seconds)
    if since >= until:
        raise exc.InvalidRequest("since: must be before until.", field="since")
    window = queries.Window(since, until, bucket or queries.default_bucket(until - since))
    if window.bucket_count > queries.MAX_BUCKETS:
        raise exc.InvalidRequest(
            f"bucket_seconds: the window would have {window.bucket_count} buckets, at most "
            f"{queries.MAX_BUCKETS}: choose larger buckets or a shorter window.",
            field="bucket_seconds",
        )
    return window


def _optional_id(query: Mapping[str, str], field: str) -> str | None:
    value = query.get(field) or None
    if value is not None and not rules.is_valid_id(value):
        raise exc.InvalidRequest(f"{field}: not a valid job id.", field=field)
    return value


def add_routes(app: web.Application, gateway: Gateway) -> None:
    """The page, its two files and its JSON reads; all under ``/admin/`` (admin token)."""
    app[DASHBOARD_GATEWAY] = gateway
    app.router.add_get("/admin/ui", page)
    app.router.add_get("/admin/ui/", page_slash)
    app.router.add_get("/admin/ui/api/refusals-over-time", refusals_over_time)
    app.router.add_get("/admin/ui/api/jobs/{job_id}/timeline", job_timeline)
    app.router.add_get("/admin/ui/{name:[a-z]+\\.(?:js|css)}", asset)
