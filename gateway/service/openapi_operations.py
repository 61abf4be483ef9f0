"""The control listener's operations for the OpenAPI document (``openapi.py``), keyed by
the (method, path) of their routes: who may call, the request body's model (the one the
handler validates with), the query, the answers, and the errors the handler raises
(``lease_core.exceptions`` classes, whose reasons give the statuses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from fencegate_client.reasons import GATEWAY_REASONS
from gateway.service.admin import ResolveBody
from lease_core import api
from lease_core import exceptions as exc
from lease_core.rules import ID_PATTERN, State

PATH = "/openapi.json"
REF = "#/components/schemas/{model}"
# Who may call: the security requirements of an operation.
SECURITY: dict[str, list[dict[str, list[str]]]] = {
    "open": [],
    "lease": [{"workerToken": []}, {"adminToken": []}],
    "admin": [{"adminToken": []}],
    "metrics": [{"adminToken": []}, {"metricsToken": []}],
}
# The refusals of the control listener's token check (``auth.py``), by who may call.
AUTH_REFUSALS = {
    "open": (),
    "lease": (exc.Unauthorized, exc.Forbidden),
    "admin": (exc.Unauthorized, exc.Forbidden),
    "metrics": (exc.Unauthorized, exc.Forbidden),
}


@dataclass(frozen=True)
class Operation:
    tag: str
    summary: str
    who: str
    answers: dict[int, tuple[str, dict[str, Any] | None]]  # status: what, its content
    refusals: tuple[type[exc.LeaseError], ...] = ()  # what its handler raises
    body: type[BaseModel] | None = None
    query: tuple[dict[str, Any], ...] = ()
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def json_of(model: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": REF.format(model=model)}}}


def param(name: str, where: str = "query", **schema: Any) -> dict[str, Any]:
    description = schema.pop("description", None)
    out: dict[str, Any] = {"name": name, "in": where, "schema": schema or {"type": "string"}}
    if where == "path":
        out["required"] = True
    if description:
        out["description"] = description
    return out


ID = {"type": "string", "pattern": f"^{ID_PATTERN.pattern}$"}
TIME = {
    "type": "string",
    "description": "RFC 3339 (2026-12-02T10:00:00Z) or seconds since the epoch.",
}


def limit(high: int, default: int) -> dict[str, Any]:
    return param("limit", type="integer", minimum=1, maximum=high, default=default)


CURSOR = param("cursor", description="next_cursor of the previous page.")
LOST = (exc.InvalidLeaseToken, exc.StaleGeneration, exc.LeaseEnded, exc.LeaseExpired)
STORE = (exc.StoreUnavailable,)

OPERATIONS: dict[tuple[str, str], Operation] = {
    # -- the lease API ----------------------------------------------------------------------
    ("POST", "/v1/jobs"): Operation(
        "lease",
        "Enqueue a job",
        "lease",
        {201: ("The job.", json_of("Job"))},
        (exc.InvalidRequest, exc.JobExists, *STORE),
        api.EnqueueBody,
    ),
    ("GET", "/v1/jobs"): Operation(
        "lease",
        "List jobs, oldest first",
        "lease",
        {200: ("A page of jobs.", json_of("JobPage"))},
        (exc.InvalidRequest, *STORE),
        query=(
            param("queue", **ID),
            param("state", type="string", enum=[s.value for s in State]),
            limit(api.MAX_LIST_LIMIT, 50),
            CURSOR,
        ),
    ),
    ("GET", "/v1/jobs/{job_id}"): Operation(
        "lease",
        "Read a job",
        "lease",
        {200: ("The job.", json_of("Job"))},
        (exc.InvalidRequest, exc.JobNotFound, *STORE),
    ),
    ("PUT", "/v1/jobs/{job_id}/lease"): Operation(
        "lease",
        "Acquire a named job's lease (the job is created if absent)",
        "lease",
        {201: ("The lease, with its token.", json_of("LeaseGrant"))},
        (exc.InvalidRequest, exc.LeaseHeld, exc.JobFinished, *STORE),
        api.AcquireBody,
        description="An owner acquiring a job it already holds gets a new grant with a "
        "higher generation: its earlier token turns stale.",
    ),
    ("POST", "/v1/queues/{queue}/claim"): Operation(
        "lease",
        "Claim the next claimable job of a queue",
        "lease",
        {
            200: ("The lease, with its token.", json_of("LeaseGrant")),
            204: ("Nothing to claim.", None),
        },
        (exc.InvalidRequest, *STORE),
        api.ClaimBody,
    ),
    ("POST", "/v1/leases/renew"): Operation(
        "lease",
        "Renew a lease",
        "lease",
        {200: ("The lease, without its token.", json_of("Lease"))},
        (exc.InvalidRequest, *LOST, *STORE),
        api.RenewBody,
    ),
    ("POST", "/v1/leases/complete"): Operation(
        "lease",
        "Complete a job",
        "lease",
        {200: ("The job.", json_of("Job"))},
        (exc.InvalidRequest, *LOST, *STORE),
        api.CompleteBody,
    ),
    ("POST", "/v1/leases/fail"): Operation(
        "lease",
        "Fail an attempt (retried until max_attempts)",
        "lease",
        {200: ("The job.", json_of("Job"))},
        (exc.InvalidRequest, *LOST, *STORE),
        api.FailBody,
    ),
    ("POST", "/v1/leases/release"): Operation(
        "lease",
        "Release a lease (the job is claimable again)",
        "lease",
        {200: ("The job.", json_of("Job"))},
        (exc.InvalidRequest, *LOST, *STORE),
        api.ReleaseBody,
    ),
    # -- the admin API ----------------------------------------------------------------------
    ("DELETE", "/admin/jobs/{job_id}"): Operation(
        "admin",
        "Purge a job that no current lease holds",
        "admin",
        {204: ("Purged.", None)},
        (exc.InvalidRequest, exc.JobNotFound, exc.LeaseHeld, *STORE),
    ),
    ("GET", "/admin/rejections"): Operation(
        "audit",
        "The audit: every answer the gateway gave itself, newest first",
        "admin",
        {200: ("A page of entries.", json_of("AuditPage"))},
        (exc.InvalidRequest, *STORE),
        query=(
            param("job_id"),
            param("reason", type="string", enum=[r.value for r in GATEWAY_REASONS]),
            param("upstream"),
            param("source", description='"fencegate" or a [[lease_sources]] name.'),
            param("replica", description="The replica that answered (gateway.replica_name)."),
            param("since", **TIME),
            param("until", **TIME),
            limit(api.MAX_LIST_LIMIT, 100),
            CURSOR,
        ),
    ),
    ("GET", "/admin/unknown-outcomes"): Operation(
        "outcomes",
        "Keys whose forward has an unknown outcome",
        "admin",
        {200: ("The keys.", json_of("UnknownOutcomes"))},
        (exc.InvalidRequest, *STORE),
        query=(limit(api.MAX_LIST_LIMIT, 100),),
    ),
    ("POST", "/admin/unknown-outcomes/resolve"): Operation(
        "outcomes",
        "Resolve a held key: applied (with the answer duplicates get) or not applied",
        "admin",
        {200: ("Resolved.", json_of("Resolved"))},
        (exc.InvalidRequest, exc.NotFound, *STORE),
        ResolveBody,
    ),
    ("GET", "/admin/upstreams"): Operation(
        "admin",
        "The configured upstreams",
        "admin",
        {200: ("The upstreams.", json_of("Upstreams"))},
    ),
    # -- the dashboard ----------------------------------------------------------------------
    ("GET", "/admin/ui"): Operation(
        "dashboard",
        "The dashboard page (holds no data)",
        "open",
        {200: ("The page.", {"text/html": {"schema": {"type": "string"}}})},
    ),
    ("GET", "/admin/ui/"): Operation(
        "dashboard",
        "Redirect to /admin/ui",
        "admin",
        {308: ("To /admin/ui.", None)},
    ),
    ("GET", "/admin/ui/{name}"): Operation(
        "dashboard",
        "The page's script and stylesheet",
        "open",
        {
            200: (
                "The file.",
                {t: {"schema": {"type": "string"}} for t in ("text/javascript", "text/css")},
            )
        },
        (exc.NotFound,),
        extra={"x-path-pattern": "[a-z]+\\.(?:js|css)"},
    ),
    ("GET", "/admin/ui/api/refusals-over-time"): Operation(
        "dashboard",
        "Refusals per time bucket and reason (the dashboard's chart)",
        "admin",
        {200: ("The buckets.", json_of("RefusalsOverTime"))},
        (exc.InvalidRequest, *STORE),
        query=(
            param("since", **TIME),
            param("until", **TIME),
            param("window_seconds", type="integer", minimum=1),
            param("bucket_seconds", type="integer", minimum=1),
            param("upstream"),
            param("job_id", **ID),
        ),
    ),
    ("GET", "/admin/ui/api/jobs/{job_id}/timeline"): Operation(
        "dashboard",
        "One job's grants, forwards and refusals, oldest first",
        "admin",
        {200: ("The timeline.", json_of("JobTimeline"))},
        (exc.InvalidRequest, *STORE),
        query=(param("limit", type="integer", minimum=1),),
    ),
    # -- health, metrics, this document -----------------------------------------------------
    ("GET", "/healthz"): Operation(
        "health", "The process answers", "open", {200: ("Alive.", json_of("Health"))}
    ),
    ("GET", "/readyz"): Operation(
        "health",
        "The database answers at a compatible schema (on PostgreSQL: the primary)",
        "open",
        {200: ("Ready.", json_of("Ready"))},
        STORE,
    ),
    ("GET", "/metrics"): Operation(
        "health",
        "Prometheus text, every series prefixed fencegate_",
        "metrics",
        {200: ("The metrics.", {"text/plain": {"schema": {"type": "string"}}})},
    ),
    ("GET", PATH): Operation(
        "health",
        "This document",
        "open",
        {200: ("OpenAPI 3.1.", {"application/json": {"schema": {"type": "object"}}})},
    ),
}

PATH_PARAMS = {
    "job_id": ID,
    "queue": ID,
    "name": {"type": "string", "pattern": "^[a-z]+\\.(js|css)$"},
}
