"""The OpenAPI 3.1 document of the control listener and of the proxy's fenced writes.

One source of truth, built from the code's own definitions: the control app's routes
(``document`` walks its router: a route with no operation in ``openapi_operations``, or
an operation there with no route, is refused), the request bodies' pydantic models that the handlers
validate with, the answers' models (``openapi_models``) and every problem ``reason``
with its status and title (``fencegate_client.reasons.REASONS``). ``GET /openapi.json``
serves it (open, like ``/healthz``: it describes the protocol, not this deployment); the
copy in the repository, ``docs/openapi.json``, is written by
``python -m gateway.service.openapi`` and ``tests/unit/test_openapi.py`` fails when it
differs from what the code generates.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from fencegate_client.reasons import REASONS, Layer, Reason
from gateway.service import openapi_models as models
from gateway.service.admin import ResolveBody
from gateway.service.openapi_operations import (
    AUTH_REFUSALS,
    OPERATIONS,
    PATH,
    PATH_PARAMS,
    REF,
    SECURITY,
    Operation,
    json_of,
    param,
)
from gateway.service.openapi_proxy import proxy_paths, proxy_webhooks
from lease_core import __version__, api
from lease_core.problems import CONTENT_TYPE, PROBLEM_TYPE_BASE

DOCUMENT = web.AppKey("openapi_document", dict[str, bytes])  # rendered once, on demand
COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def problem_schemas() -> dict[str, Any]:
    """One schema per reason with a fixed status: ``Problem`` narrowed to its reason."""
    out: dict[str, Any] = {}
    for reason, info in REASONS.items():
        layers = [n for n, layer in (("proxy", Layer.GATEWAY), ("control", Layer.LEASE_API))
                  if layer in info.layers]  # fmt: skip
        schema: dict[str, Any] = {
            "allOf": [{"$ref": REF.format(model="Problem")}],
            "properties": {
                "type": {"const": PROBLEM_TYPE_BASE + reason.value},
                "title": {"const": info.title},
                "status": {"const": info.status},
                "reason": {"const": reason.value},
            },
            "x-listeners": layers,
        }
        if info.detail:
            schema["description"] = info.detail
        if info.retry_after:
            schema["x-retry-after"] = True
        if info.sent is not None:  # the gateway's: what became of the write
            schema["properties"]["sent"] = {"const": info.sent.value}
            schema["x-sent"] = info.sent.value
        out[problem_name(reason)] = schema
    return out


def problem_name(reason: Reason) -> str:
    return f"Problem-{reason.value}"


def problem_answers(reasons: Iterable[Reason]) -> dict[str, Any]:
    """Responses by status: each a problem document of one of its reasons."""
    by_status: dict[int, list[Reason]] = {}
    for reason in reasons:
        by_status.setdefault(REASONS[reason].status, []).append(reason)
    out: dict[str, Any] = {}
    for status, group in sorted(by_status.items()):
        refs = [{"$ref": REF.format(model=problem_name(r))} for r in group]
        response: dict[str, Any] = {
            "description": ", ".join(r.value for r in group),
            "content": {CONTENT_TYPE: {"schema": refs[0] if len(refs) == 1 else {"oneOf": refs}}},
        }
        if any(REASONS[r].retry_after for r in group):
            response["headers"] = {"Retry-After": {"$ref": "#/components/headers/Retry-After"}}
        out[str(status)] = response
    return out


DEFAULT_PROBLEM = {
    "description": "Any other error (internal-error, http-error, ...): a problem document.",
    "content": {CONTENT_TYPE: {"schema": {"$ref": REF.format(model="Problem")}}},
}


def operation(method: str, path: str, op: Operation) -> dict[str, Any]:
    out: dict[str, Any] = {
        "operationId": operation_id(method, path),
        "tags": [op.tag],
        "summary": op.summary,
    }
    if op.description:
        out["description"] = op.description
    out["security"] = SECURITY[op.who]
    params = [param(name, "path", **PATH_PARAMS[name]) for name in path_names(path)]
    params.extend(op.query)
    if params:
        out["parameters"] = params
    if op.body is not None:
        out["requestBody"] = {"required": False, "content": json_of(op.body.__name__)}
    responses: dict[str, Any] = {}
    for status, (what, content) in op.answers.items():
        responses[str(status)] = {"description": what}
        if content is not None:
            responses[str(status)]["content"] = content
        if status == 308:
            responses[str(status)]["headers"] = {
                "Location": {"schema": {"type": "string"}, "description": "/admin/ui"}
            }
    refusals = (*op.refusals, *AUTH_REFUSALS[op.who])
    responses |= problem_answers(e.reason for e in refusals)
    for error in refusals:  # the headers an error class answers with (WWW-Authenticate)
        for name, value in error.headers.items():
            responses[str(error.status)].setdefault("headers", {})[name] = {
                "schema": {"type": "string"},
                "description": value,
            }
    responses["default"] = DEFAULT_PROBLEM
    out["responses"] = responses
    out |= op.extra
    return out


def path_names(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]


def operation_id(method: str, path: str) -> str:
    words = [p.strip("{}") for p in path.replace(".", "/").replace("-", "_").split("/") if p]
    if path.endswith("/"):
        words.append("slash")
    return "_".join([method.lower(), *words]) or method.lower()


REQUESTS: tuple[type[BaseModel], ...] = (
    api.EnqueueBody, api.ClaimBody, api.AcquireBody, api.RenewBody,
    api.CompleteBody, api.FailBody, api.ReleaseBody, ResolveBody,
)  # fmt: skip


def request_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A request body's schema, its optional fields optional to generators' defaults.

    pydantic writes ``"default": null`` (or the default) on every optional field, and
    openapi-typescript, by default (``defaultNonNullable``), types a property with a
    ``default`` as always present: ``POST /v1/jobs`` would need every field. A request's
    default is the server's business, so it is said in the field's description instead;
    the field stays out of ``required``.
    """
    schema = model.model_json_schema(ref_template=REF, mode="validation")
    for prop in schema.get("properties", {}).values():
        if "default" in prop:
            default = prop.pop("default")
            if default is not None:
                said = f"Default: {json.dumps(default)}."
                prop["description"] = " ".join(filter(None, (prop.get("description"), said)))
    return schema


def schemas() -> dict[str, Any]:
    """Every model's JSON Schema (2020-12, as OpenAPI 3.1 takes it), under one roof."""
    out: dict[str, Any] = {}
    for model in REQUESTS:
        schema = request_schema(model)
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    for model in models.ANSWERS:
        schema = model.model_json_schema(ref_template=REF, mode="serialization")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out | problem_schemas()


def routes(router: web.UrlDispatcher) -> list[tuple[str, str]]:
    """The app's (method, path) pairs; the HEAD aiohttp adds beside every GET is the GET's."""
    found = [(r.method, r.resource.canonical) for r in router.routes() if r.resource is not None]
    gets = {path for method, path in found if method == "GET"}
    return [(m, p) for m, p in found if not (m == "HEAD" and p in gets)]


def document(router: web.UrlDispatcher) -> dict[str, Any]:
    """The document of the control app whose router this is, and of the proxy."""
    found = routes(router)
    undocumented = sorted(set(found) - set(OPERATIONS))
    gone = sorted(set(OPERATIONS) - set(found))
    if undocumented or gone:
        raise ValueError(
            f"OpenAPI: routes with no operation {undocumented}; operations with no route {gone}"
        )
    paths: dict[str, Any] = {}
    for method, path in found:
        paths.setdefault(path, {})[method.lower()] = operation(
            method, path, OPERATIONS[method, path]
        )
    paths |= proxy_paths()
    return {
        "openapi": "3.1.0",
        "info": INFO,
        "servers": [
            {
                "url": "http://{control}",
                "description": "The control listener (control_listen).",
                "variables": {"control": {"default": "127.0.0.1:8081"}},
            }
        ],
        "tags": TAGS,
        "paths": paths,
        "webhooks": proxy_webhooks(),
        "components": {
            "schemas": schemas(),
            "securitySchemes": SECURITY_SCHEMES,
            "headers": {
                "Retry-After": {
                    "description": "Seconds after which the same request may pass.",
                    "schema": {"type": "integer", "minimum": 0},
                }
            },
        },
    }


INFO = {
    "title": "Fencegate",
    "version": __version__,
    "summary": "Expiring leases with fencing tokens, and a gateway that fences writes.",
    "description": "The control listener's lease, admin, audit, outcome, dashboard and "
    "health calls, and (tag proxy, its own server) the proxy listener's fenced writes. "
    "Every error is an RFC 9457 problem document (application/problem+json) with a "
    "stable `reason`; `components.schemas.Problem-<reason>` gives each reason's status "
    "and title. Every problem the gateway answers a write with says what became of the "
    "write in its member `sent` (never, maybe, yes; the schema's `x-sent` gives each "
    "reason's): a client decides from it alone whether to send the write again under a "
    "new key (never), only under the same key (maybe), or not at all (yes: the answer is "
    "the outcome). docs/protocol.md is the prose; docs/openapi.md says how this document "
    "is generated and checked.",
    "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
}
TAGS = [
    {"name": "lease", "description": "The lease API (worker or admin token)."},
    {"name": "admin", "description": "Jobs and upstreams (admin token)."},
    {"name": "audit", "description": "What the gateway answered itself (admin token)."},
    {"name": "outcomes", "description": "Unknown outcomes and their resolution (admin token)."},
    {"name": "dashboard", "description": "The page at /admin/ui and its reads."},
    {"name": "health", "description": "Liveness, readiness, metrics, this document."},
    {"name": "proxy", "description": "Fenced writes, on the proxy listener (proxy_listen)."},
]
SECURITY_SCHEMES = {
    name: {"type": "http", "scheme": "bearer", "description": description}
    for name, description in (
        ("workerToken", "auth.worker_tokens: /v1/ only."),
        ("adminToken", "auth.admin_tokens: everything."),
        ("metricsToken", "auth.metrics_tokens: /metrics only."),
    )
}


def render(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()


async def serve_document(request: web.Request) -> web.Response:
    """``GET /openapi.json``: the document, the same bytes as docs/openapi.json."""
    cache = request.app[DOCUMENT]
    if "doc" not in cache:
        cache["doc"] = render(document(request.app.router))
    return web.Response(body=cache["doc"], content_type="application/json")


def add_routes(app: web.Application) -> None:
    app[DOCUMENT] = {}
    app.router.add_get(PATH, serve_document)


def generate() -> bytes:
    """The document of a control app built with the default settings (no database opened)."""
    import asyncio

    from gateway.config import Settings
    from gateway.service.server import create_control_app
    from lease_core.db import create_engine
    from lease_core.store import LeaseStore

    async def build() -> bytes:
        engine = create_engine("sqlite+aiosqlite:////nonexistent/never-opened.db")
        try:
            app = create_control_app(Settings(), LeaseStore(engine))
            return render(document(app.router))
        finally:
            await engine.dispose()

    return asyncio.run(build())


def main(argv: list[str] | None = None) -> int:
    """``python -m gateway.service.openapi [--check]``: write docs/openapi.json, or say
    whether it is current (exit 1 if not)."""
    args = sys.argv[1:] if argv is None else argv
    fresh = generate()
    if "--check" in args:
        if COMMITTED.read_bytes() != fresh:
            print(f"{COMMITTED} is out of date: python -m gateway.service.openapi", file=sys.stderr)
            return 1
        return 0
    COMMITTED.write_bytes(fresh)
    print(f"wrote {COMMITTED}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
