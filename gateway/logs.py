"""Structured logs: one JSON object per line with the request id; never a whole token."""

from __future__ import annotations

import json
import logging
import random
import re
import sys
import time
from contextvars import ContextVar
from datetime import UTC, datetime

from aiohttp import web
from aiohttp.typedefs import Handler

REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="-")
_SAFE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
ACCESS_LOG = logging.getLogger("fencegate.access")


_TOKEN = re.compile(r"fgl_[A-Za-z0-9_-]{4}[A-Za-z0-9_-]*")


def redact(text: str) -> str:
    """Lease tokens are credentials: only their first characters ever reach a log (even
    when aiohttp quotes a refused request's head in its own error message)."""
    return _TOKEN.sub(lambda m: m.group(0)[:8] + "…", text)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", "request_id", ...fields}`` per line."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": REQUEST_ID.get(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            doc.update(fields)
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return redact(json.dumps(doc, default=str))


def configure(level: str = "INFO", fmt: str = "auto", *, access_log: bool = False) -> None:
    """``fmt``: json, text, or auto (text on a terminal, JSON otherwise). Access lines
    (one per request) only with ``access_log``."""
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # alembic's own INFO lines are noise at start.
    logging.getLogger("alembic").setLevel(max(logging.WARNING, root.level))
    ACCESS_LOG.setLevel(logging.INFO if access_log else logging.WARNING)


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Take a sane ``X-Request-Id`` or make one; echo it; log one access line."""
    presented = request.headers.get("X-Request-Id", "")
    # Not a secret, only unique enough to find a request's lines: a fast generator, and
    # no counter a client could read the process's traffic from.
    request_id = presented if _SAFE_ID.fullmatch(presented) else f"{random.getrandbits(64):016x}"
    token = REQUEST_ID.set(request_id)
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        if not response.prepared:
            response.headers["X-Request-Id"] = request_id
        return response
    except web.HTTPException as error:
        status = error.status
        raise
    finally:
        if ACCESS_LOG.isEnabledFor(logging.INFO):
            ACCESS_LOG.info(
                "%s %s %d",
                request.method,
                request.path[:200],
                status,
                extra={
                    "fields": {
                        "method": request.method,
                        "path": request.path[:200],
                        "status": status,
                        "duration_ms": round((time.perf_counter() - started) * 1000, 2),
                        "remote": request.remote,
                    }
                },
            )
        REQUEST_ID.reset(token)
