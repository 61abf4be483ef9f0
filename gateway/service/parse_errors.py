"""Requests that aiohttp's parser refuses, answered in the gateway's own words.

aiohttp answers bytes its HTTP parser cannot read (a bad request line, a header line
without a colon, a control character in a value) with a text page that repeats the
offending line, and logs it as an error with a traceback. That line can hold a
credential (``Authorization: Bearer ...``, ``Fencing-Token``, ``?api_key=``), which then
travels back through every proxy and log on the client's side. Both listeners answer
instead with a problem document (``invalid-request``, or ``http-error`` for another
status) naming only the kind of error, close the connection as aiohttp does, and log
one warning line without the bytes.

aiohttp has no public switch for this answer: ``ProblemRunner`` builds its server as
``AppRunner`` does and has it use ``ProblemRequestHandler``, whose ``handle_error`` is
aiohttp's documented hook for errors outside a handler.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError

from fencegate_client.reasons import REASONS
from gateway.fencing.decision import http_error
from lease_core.problems import problem_response

log = logging.getLogger("fencegate.http")

# The first line of llhttp's message names the error ("Invalid header value char");
# later lines quote the bytes. Only words, digits and a few signs are kept of it.
_KIND = re.compile(r"[A-Za-z][A-Za-z0-9 ,.()-]{0,80}")


def kind_of(error: BaseException | None) -> str:
    """What was wrong with the request, without any of its bytes."""
    if isinstance(error, HttpProcessingError):
        first = str(error.message).strip().splitlines()[0] if error.message else ""
        found = _KIND.fullmatch(first.rstrip(":").strip())
        if found:
            return found.group(0)
    return type(error).__name__ if error is not None else "malformed request"


class ProblemRequestHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler, with the gateway's answer to a request its parser
    refused (errors inside a handler never reach here: the apps' middlewares answer
    them)."""

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500 or not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        kind = kind_of(exc)
        log.warning("refused a malformed request from %s: %s", request.remote, kind)
        if request.writer.output_size > 0:  # an answer has begun: the connection is broken
            raise ConnectionError("an answer was already being sent")
        reason = http_error(status)
        title = REASONS[reason].title if reason in REASONS else HTTPStatus(status).phrase
        response = problem_response(
            status=status,
            reason=reason,
            title=title,
            detail=f"The request could not be parsed as HTTP/1.1: {kind}.",
        )
        response.force_close()  # nothing after it on the connection is read as a request
        return response


class ProblemServer(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return ProblemRequestHandler(self, loop=self._loop, **self._kwargs)


class ProblemRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are handled by ``ProblemRequestHandler``."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = ProblemServer  # the same object, the handler factory ours
        return server
