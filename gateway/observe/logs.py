"""Structured logs: one JSON object per line with the request id; never a whole token."""

from __future__ import annotations

import json
import logging
import random
import re
import sys
import time
import traceback
from collections.abc import Iterable
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="-")
_SAFE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
ACCESS_LOG = logging.getLogger("fencegate.access")


_TOKEN = re.compile(r"fgl_[A-Za-z0-9_-]{4}[A-Za-z0-9_-]*")
# A credential-carrying header as any text quotes it (an HTTP head, a parser error's
# ``b'Authorization: …'``, a dict's repr): the value goes, up to the end of the line.
_HEADER = re.compile(
    r"(?i)\b(authorization|proxy-authorization|fencing-token|cookie|set-cookie|x-api-key)"
    r"(['\"]?\s*[:=]\s*)[^\r\n]+"
)
_BEARER = re.compile(r"(?i)\b(bearer|basic)(\s+)[^\s'\",;]+")
# ``scheme://user:password@host``: the password goes, the user stays.
_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]*):[^/\s@]*@")
REDACTED = "[redacted]"
_SECRETS: set[str] = set()
_MIN_SECRET = 6


def redact(text: str) -> str:
    """Credentials never reach a log line: lease tokens keep only their first
    characters (even when aiohttp quotes a refused request's head in its own error
    message); bearer and basic credentials, credential headers' values, passwords in
    URLs and every secret of the configuration (``protect``) are replaced."""
    text = _TOKEN.sub(lambda m: m.group(0)[:8] + "…", text)
    text = _HEADER.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)
    text = _BEARER.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)
    text = _URL_PASSWORD.sub(lambda m: m.group(1) + ":***@", text)
    for secret in _SECRETS:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def protect(secrets: Iterable[str]) -> None:
    """Remember secret values (control tokens, upstream header values) so that no log
    line carries them whatever the context; and make sure every record is redacted."""
    for secret in secrets:
        for value in (secret, secret.rsplit(None, 1)[-1] if secret.strip() else ""):
            if len(value) >= _MIN_SECRET:
                _SECRETS.add(value)
    install()


_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
_installed = False


def install() -> None:
    """Redact every log record as it is made, whoever logs it and wherever it goes
    (our handlers, a test's capture, an embedding application's): its message, its
    arguments, its traceback and its extra fields. Idempotent.

    aiosqlite quotes each statement's parameters at DEBUG (``executing
    functools.partial(…, params)``): bodies and tokens' hashes. Its logger stays at INFO
    whatever the root level. SQLAlchemy's engines hide parameters (``hide_parameters``
    in ``lease_core.db``) and its echo of fetched rows is replaced here."""
    global _installed
    logging.getLogger("aiosqlite").setLevel(logging.INFO)
    if _installed:
        return
    _installed = True
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        _scrub(record)
        return record

    logging.setLogRecordFactory(factory)


def _scrub(record: logging.LogRecord) -> None:
    if record.name.startswith("sqlalchemy.engine") and record.msg == "Row %r":
        # SQLAlchemy's DEBUG echo of fetched rows: stored answers, audited bodies.
        record.msg, record.args = "Row [hidden]", None
        return
    try:
        message = record.getMessage()
    except Exception:  # a malformed call: keep what it said, redacted
        message = f"{record.msg} {record.args!r}"
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[1] is not None:
        text = "".join(traceback.format_exception(*record.exc_info))
        clean = redact(text).rstrip("\n")
        if clean != text.rstrip("\n"):
            record.exc_text, record.exc_info = clean, None
    if record.stack_info:
        record.stack_info = redact(record.stack_info)
    for key, value in list(record.__dict__.items()):
        if key not in _STANDARD:
            record.__dict__[key] = _scrub_value(value)


def _scrub_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _scrub_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_scrub_value(v) for v in value)
    return value


class TextFormatter(logging.Formatter):
    """Plain lines; the record was redacted when it was made (``install``)."""


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", "request_id", ...fields}`` per line (and
    ``pid`` with ``pid=True``: ``serve --workers``, whose processes share one stream).
    Its records were redacted as they were made (``install``, which ``configure``
    runs)."""

    def __init__(self, *, pid: bool = False) -> None:
        super().__init__()
        self.pid = pid

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": REQUEST_ID.get(),
        }
        if self.pid:
            doc["pid"] = record.process
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            doc.update(fields)
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["error"] = record.exc_text
        return json.dumps(doc, default=str)  # redacted when the record was made


def configure(
    level: str = "INFO", fmt: str = "auto", *, access_log: bool = False, pid: bool = False
) -> None:
    """``fmt``: json, text, or auto (text on a terminal, JSON otherwise). Access lines
    (one per request) only with ``access_log``. ``pid``: every line names its process
    (``serve --workers``: the parent and its workers write to one stream)."""
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(pid=pid))
    else:
        name = "%(name)s[%(process)d]" if pid else "%(name)s"
        handler.setFormatter(TextFormatter(f"%(asctime)s %(levelname)s {name}: %(message)s"))
    install()
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
