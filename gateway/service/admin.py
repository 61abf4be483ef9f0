"""The admin API (control listener, admin tokens): the audit, unknown outcomes, upstreams."""

from __future__ import annotations

import base64
from typing import Annotated

from aiohttp import web
from pydantic import Field

from gateway.proxy.gateway import Gateway
from gateway.records.audit import MAX_PAGE, AuditQuery, parse_time
from lease_core import exceptions as exc
from lease_core.api import Body, Id, query_limit, read_body
from lease_core.store import rfc3339

GATEWAY_STATE = web.AppKey("gateway_state", Gateway)


async def rejections(request: web.Request) -> web.Response:
    """``GET /admin/rejections?job_id=&reason=&upstream=&source=&replica=&since=&until=&limit=
    &cursor=``"""
    q = request.query
    since = parse_time(q["since"], "since") if "since" in q else None
    until = parse_time(q["until"], "until") if "until" in q else None
    gateway = request.app[GATEWAY_STATE]
    items, next_cursor = await gateway.audit.query(
        AuditQuery(
            job_id=q.get("job_id"),
            reason=q.get("reason"),
            upstream=q.get("upstream"),
            source=q.get("source"),
            replica=q.get("replica") or None,
            since=since,
            until=until,
            limit=min(query_limit(q.get("limit"), default=100), MAX_PAGE),
            cursor=q.get("cursor"),
        ),
        upstreams=gateway.upstreams,
        sources=gateway.sources,
    )
    return web.json_response({"items": items, "next_cursor": next_cursor})


async def unknown_outcomes(request: web.Request) -> web.Response:
    rows = await request.app[GATEWAY_STATE].store.list_unknown(
        query_limit(request.query.get("limit"), default=100)
    )
    items = [{**row, "updated_at": rfc3339(row["updated_at"])} for row in rows]
    return web.json_response({"items": items})


class ResolveBody(Body):
    job_id: Id
    key: Annotated[str, Field(min_length=1, max_length=255)]
    applied: bool
    status: Annotated[int, Field(ge=100, le=599)] | None = None
    headers: dict[str, str] | None = None
    body_base64: str | None = None
    body: str | None = None


async def resolve(request: web.Request) -> web.Response:
    """``POST /admin/unknown-outcomes/resolve``: mark a held key applied (with the answer
    later duplicates get) or not applied (the next request with it is forwarded)."""
    body = await read_body(request, ResolveBody)
    raw: bytes | None = None
    if body.body_base64 is not None:
        try:
            raw = base64.b64decode(body.body_base64, validate=True)
        except ValueError as error:  # binascii.Error, or a character that is not ASCII
            raise exc.InvalidRequest("body_base64: not base64.", field="body_base64") from error
    elif body.body is not None:
        raw = body.body.encode()
    if body.applied and body.status is None:
        raise exc.InvalidRequest(
            "status: required when applied is true (the status duplicates will get).",
            field="status",
        )
    done = await request.app[GATEWAY_STATE].store.resolve(
        body.job_id,
        body.key,
        applied=body.applied,
        status=body.status,
        headers=list((body.headers or {}).items()),
        body=raw,
    )
    if not done:
        raise exc.NotFound(f"No unknown outcome for key {body.key!r} of job {body.job_id!r}.")
    return web.json_response(
        {
            "job_id": body.job_id,
            "key": body.key,
            "resolved": "applied" if body.applied else "not-applied",
        }
    )


async def upstreams(request: web.Request) -> web.Response:
    items = [u.summary() for u in request.app[GATEWAY_STATE].upstreams.values()]
    return web.json_response({"items": items})


def add_routes(app: web.Application, gateway: Gateway) -> None:
    app[GATEWAY_STATE] = gateway
    app.router.add_get("/admin/rejections", rejections)
    app.router.add_get("/admin/unknown-outcomes", unknown_outcomes)
    app.router.add_post("/admin/unknown-outcomes/resolve", resolve)
    app.router.add_get("/admin/upstreams", upstreams)
