"""The lease API: thin aiohttp handlers. Parse, call the store, answer."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, TypeVar

from aiohttp import web
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from . import exceptions as exc
from . import rules
from .config import LeaseSettings
from .problems import sentence
from .rules import State
from .store import LeaseStore, seconds

STORE = web.AppKey("lease_store", LeaseStore)
SETTINGS = web.AppKey("lease_settings", LeaseSettings)

MAX_LIST_LIMIT = 500
ID_RULE = (
    "must be 1 to 200 characters of letters, digits and ._:@~+=-, starting with a letter or digit"
)


def _id(value: str) -> str:
    if not rules.is_valid_id(value):
        raise ValueError(ID_RULE)
    return value


def _owner(value: str) -> str:
    if not rules.is_valid_owner(value):
        raise ValueError(
            f"must be 1 to {rules.MAX_OWNER_LENGTH} printable characters (no control characters)"
        )
    return value


Id = Annotated[str, AfterValidator(_id)]
Owner = Annotated[str, AfterValidator(_owner)]
Seconds = Annotated[float, Field(allow_inf_nan=False)]
Token = Annotated[str, Field(min_length=1, max_length=200)]


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class EnqueueBody(Body):
    queue: Id | None = None
    job_id: Id | None = None
    payload: Any = None
    max_attempts: Annotated[int, Field(ge=1, le=1000)] | None = None


class ClaimBody(Body):
    owner: Owner
    ttl_seconds: Seconds | None = None


class AcquireBody(ClaimBody):
    queue: Id | None = None
    payload: Any = None
    max_attempts: Annotated[int, Field(ge=1, le=1000)] | None = None


class RenewBody(Body):
    lease_token: Token
    ttl_seconds: Seconds | None = None


class CompleteBody(Body):
    lease_token: Token
    result: Any = None


class FailBody(Body):
    lease_token: Token
    error: Annotated[str, Field(max_length=10_000)] | None = None
    retry_in_seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0


class ReleaseBody(Body):
    lease_token: Token


B = TypeVar("B", bound=Body)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# One decoder for every body: ``json.loads`` with these hooks builds a new one per call.
_DECODER = json.JSONDecoder(parse_float=_finite_float, parse_constant=_no_constants)


def parse_json(raw: bytes) -> Any:
    """Strict JSON: no NaN or Infinity, no numbers that overflow a double. The bytes are
    decoded as ``json.loads`` decodes them (UTF-8, -16 or -32, a UTF-8 BOM skipped)."""
    try:
        return _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except (ValueError, RecursionError) as error:
        raise exc.InvalidRequest(f"body: malformed JSON ({error}).", field="body") from error


async def read_body(request: web.Request, model: type[B]) -> B:
    raw = await request.read()
    data = parse_json(raw) if raw.strip() else {}
    if not isinstance(data, dict):
        raise exc.InvalidRequest("body: must be a JSON object.", field="body")
    where = _nul_at(data, "") if may_hold_nul(raw) else None
    if where is not None:
        field = where or "body"
        raise exc.InvalidRequest(f"{field}: must not contain NUL characters.", field=field)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise invalid(error) from error


def may_hold_nul(raw: bytes) -> bool:
    """Whether a JSON body could decode to a string holding a NUL character. JSON refuses
    control characters inside its strings, so in UTF-8 a NUL can only come from a
    ``\\u0000`` escape; a UTF-16 or UTF-32 body has zero bytes in it anyway. False spares
    every body without one the walk through all its values."""
    return b"\\u0000" in raw or b"\x00" in raw


def _nul_at(value: Any, path: str) -> str | None:
    """Where a NUL character hides in a JSON value (no database stores it in text)."""
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            if "\x00" in key:
                return path or "body"
            found = _nul_at(item, inner)
            if found is not None:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _nul_at(item, f"{path}.{index}" if path else str(index))
            if found is not None:
                return found
    return None


def invalid(error: ValidationError) -> exc.InvalidRequest:
    """A 400 that names the first bad field (and lists all of them)."""
    problems = [
        {
            "field": ".".join(str(p) for p in e["loc"]) or "body",
            # Our validators' ValueError: pydantic puts "Value error, " before it.
            "message": e["msg"].removeprefix("Value error, "),
        }
        for e in error.errors(include_url=False, include_input=False)
    ]
    first = problems[0]
    return exc.InvalidRequest(
        sentence(f"{first['field']}: {first['message']}"), field=first["field"], errors=problems
    )


def path_id(request: web.Request, name: str) -> str:
    value = request.match_info[name]
    if not rules.is_valid_id(value):
        raise exc.InvalidRequest(f"{name}: {ID_RULE}.", field=name)
    return value


def ttl(settings: LeaseSettings, value: float | None) -> float:
    if value is None:
        return settings.default_ttl_seconds
    why = rules.check_ttl(value, settings.max_ttl_seconds)
    if why is not None:
        raise exc.InvalidRequest(f"ttl_seconds: {why}.", field="ttl_seconds")
    return value


def renew_ttl(settings: LeaseSettings, value: float | None) -> float | None:
    return None if value is None else ttl(settings, value)


# -- handlers -------------------------------------------------------------------------


async def enqueue(request: web.Request) -> web.Response:
    body = await read_body(request, EnqueueBody)
    settings = request.app[SETTINGS]
    job = await request.app[STORE].enqueue(
        queue=body.queue or settings.default_queue,
        job_id=body.job_id,
        payload=body.payload,
        max_attempts=body.max_attempts or settings.default_max_attempts,
    )
    return web.json_response(job.to_json(), status=201)


async def claim(request: web.Request) -> web.Response:
    queue = path_id(request, "queue")
    body = await read_body(request, ClaimBody)
    lease = await request.app[STORE].claim(
        queue=queue, owner=body.owner, ttl=ttl(request.app[SETTINGS], body.ttl_seconds)
    )
    if lease is None:
        return web.Response(status=204)
    return web.json_response(lease.to_json())


async def acquire(request: web.Request) -> web.Response:
    job_id = path_id(request, "job_id")
    body = await read_body(request, AcquireBody)
    settings = request.app[SETTINGS]
    lease = await request.app[STORE].acquire(
        job_id=job_id,
        owner=body.owner,
        ttl=ttl(settings, body.ttl_seconds),
        queue=body.queue or settings.default_queue,
        payload=body.payload,
        max_attempts=body.max_attempts or settings.default_max_attempts,
    )
    return web.json_response(lease.to_json(), status=201)


async def renew(request: web.Request) -> web.Response:
    body = await read_body(request, RenewBody)
    lease = await request.app[STORE].renew(
        body.lease_token, renew_ttl(request.app[SETTINGS], body.ttl_seconds)
    )
    return web.json_response(lease.to_json())


async def complete(request: web.Request) -> web.Response:
    body = await read_body(request, CompleteBody)
    job = await request.app[STORE].complete(body.lease_token, body.result)
    return web.json_response(job.to_json())


async def fail(request: web.Request) -> web.Response:
    body = await read_body(request, FailBody)
    settings = request.app[SETTINGS]
    if body.retry_in_seconds > settings.max_retry_in_seconds:
        raise exc.InvalidRequest(
            f"retry_in_seconds: must not exceed {seconds(settings.max_retry_in_seconds)} "
            "(max_retry_in_seconds).",
            field="retry_in_seconds",
        )
    job = await request.app[STORE].fail(body.lease_token, body.error, body.retry_in_seconds)
    return web.json_response(job.to_json())


async def release(request: web.Request) -> web.Response:
    body = await read_body(request, ReleaseBody)
    job = await request.app[STORE].release(body.lease_token)
    return web.json_response(job.to_json())


async def get_job(request: web.Request) -> web.Response:
    job = await request.app[STORE].get_job(path_id(request, "job_id"))
    return web.json_response(job.to_json())


async def list_jobs(request: web.Request) -> web.Response:
    query = request.query
    queue = query.get("queue")
    if queue is not None and not rules.is_valid_id(queue):
        raise exc.InvalidRequest(f"queue: {ID_RULE}.", field="queue")
    state = query.get("state")
    if state is not None and state not in State.__members__.values():
        raise exc.InvalidRequest(
            f"state: must be one of {', '.join(s.value for s in State)}.", field="state"
        )
    limit = query_limit(query.get("limit"), default=50)
    page = await request.app[STORE].list_jobs(
        queue=queue, state=state, limit=limit, cursor=query.get("cursor")
    )
    return web.json_response(
        {"items": [job.to_json() for job in page.items], "next_cursor": page.next_cursor}
    )


def query_limit(raw: str | None, *, default: int) -> int:
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise exc.InvalidRequest(
            f"limit: must be a whole number from 1 to {MAX_LIST_LIMIT}.", field="limit"
        )
    return int(raw)


async def purge_job(request: web.Request) -> web.Response:
    await request.app[STORE].purge_job(path_id(request, "job_id"))
    return web.Response(status=204)


def add_routes(app: web.Application) -> None:
    """The lease API under ``/v1/`` and its admin call under ``/admin/``."""
    app.router.add_post("/v1/jobs", enqueue)
    app.router.add_get("/v1/jobs", list_jobs)
    app.router.add_get("/v1/jobs/{job_id}", get_job)
    app.router.add_put("/v1/jobs/{job_id}/lease", acquire)
    app.router.add_post("/v1/queues/{queue}/claim", claim)
    app.router.add_post("/v1/leases/renew", renew)
    app.router.add_post("/v1/leases/complete", complete)
    app.router.add_post("/v1/leases/fail", fail)
    app.router.add_post("/v1/leases/release", release)
    app.router.add_delete("/admin/jobs/{job_id}", purge_job)
