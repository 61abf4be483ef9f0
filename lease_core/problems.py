"""RFC 9457 problem documents: the one place HTTP errors are built."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from fencegate_client.reasons import Reason

from . import exceptions as exc

log = logging.getLogger("fencegate.problems")

PROBLEM_TYPE_BASE = "https://fencegate.dev/problems/"
CONTENT_TYPE = "application/problem+json"


def sentence(text: str) -> str:
    """``text`` as a problem's detail is written, in the gateway's voice too: a sentence
    with its full stop. Details built from parts (a field's name and a library's
    message) go through here; the fixed ones are written so."""
    text = text.strip()
    return text if text.endswith((".", "?", "!")) else f"{text}."


def problem_response(
    *,
    status: int,
    reason: str,
    title: str,
    detail: str,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> web.Response:
    doc: dict[str, Any] = {
        "type": PROBLEM_TYPE_BASE + reason,
        "title": title,
        "status": status,
        "detail": detail,
        "reason": reason,
    }
    doc.update({k: v for k, v in extra.items() if v is not None})
    return web.Response(
        status=status,
        body=json.dumps(doc, separators=(",", ":")).encode(),
        content_type=CONTENT_TYPE,
        headers=headers,
    )


def from_error(error: exc.LeaseError) -> web.Response:
    return problem_response(
        status=error.status,
        reason=error.reason,
        title=error.title,
        detail=error.detail,
        headers=error.headers or None,
        **error.extra,
    )


_HTTP_REASONS: dict[int, type[exc.LeaseError]] = {
    404: exc.NotFound,
    405: exc.MethodNotAllowed,
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A listener's check of a request before its handler: None to go on, a response to answer
# with instead; it refuses by raising a ``LeaseError``.
Check = Callable[[web.Request], Awaitable[web.StreamResponse | None]]


def problem_middleware(*checks: Check, not_found: str | None = None) -> Middleware:
    """Domain errors and aiohttp's own HTTP errors become problem documents. ``checks``
    run first, in order, inside it: their refusals are answered the same way, and one
    that answers itself ends the request before the handler. One middleware, not one
    per check: every layer costs each request a coroutine and a hop on each resume.
    ``not_found``: the detail of a path that no route serves (the listener's own hint)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            for name, value in request.query.items():
                if "\x00" in name or "\x00" in value:
                    raise exc.InvalidRequest(
                        f"{name}: must not contain NUL characters.", field=name
                    )
            for check in checks:
                answer = await check(request)
                if answer is not None:
                    return answer
            return await handler(request)
        except exc.LeaseError as error:
            return from_error(error)
        except web.HTTPException as http_error:
            if http_error.status < 400:
                raise
            cls = _HTTP_REASONS.get(http_error.status)
            if cls is not None:
                return from_error(cls(not_found if cls is exc.NotFound else None))
            text = http_error.text or ""
            if text.startswith(f"{http_error.status}: "):  # aiohttp's default: status, phrase
                text = ""
            return problem_response(
                status=http_error.status,
                reason=Reason.HTTP_ERROR,
                title=http_error.reason,
                detail=sentence(text or http_error.reason),
            )
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return from_error(exc.LeaseError("An unexpected error occurred; see the server log."))

    return middleware
