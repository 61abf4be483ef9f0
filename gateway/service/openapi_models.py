"""The shapes of the control listener's answers, for the OpenAPI document only.

The request bodies' models are the ones the handlers validate with (``lease_core.api``,
``gateway.service.admin``); the answers are dictionaries built by the store, the audit
and the admin API, so their shapes are written here once, as pydantic models, and held
to the code by tests: Schemathesis checks every answer of a real ``fencegate serve``
against them (``tests/e2e/test_openapi_fuzz.py``), and the typed client of
``tests/e2e/test_openapi_client.py`` reads its answers through them. Every model forbids
members it does not name, so an answer that gains one fails those tests until its field
is written here.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from fencegate_client.reasons import GATEWAY_REASONS, REASONS, Sent
from gateway.fencing.decision import http_error
from lease_core.rules import State


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


def one_of(values: Iterable[str]) -> Any:
    """A string that is one of ``values`` (an ``enum`` in the schema)."""
    return WithJsonSchema({"type": "string", "enum": list(values)})


JobState = Annotated[str, one_of(s.value for s in State)]
AuditReason = Annotated[str, one_of(r.value for r in GATEWAY_REASONS)]
# Every reason a server sends in a problem document: the fixed ones and aiohttp's own.
ProblemReason = Annotated[str, one_of(r.value for r in (*REASONS, http_error(500)))]


class Job(Answer):
    """A job (``pending``, ``leased``, ``completed`` or ``failed``)."""

    job_id: str
    queue: str
    state: JobState
    generation: int = Field(ge=0, description="The job's fencing token: the last grant's.")
    owner: str | None
    lease_expires_at: datetime | None
    attempts: int = Field(ge=0)
    max_attempts: int = Field(ge=1)
    payload: Any
    result: Any
    error: str | None
    created_at: datetime | None


class Lease(Answer):
    """A lease as renew answers it: without its token."""

    job_id: str
    generation: int = Field(ge=1)
    owner: str
    expires_at: datetime
    ttl_seconds: float = Field(gt=0)
    payload: Any


class LeaseGrant(Lease):
    """A granted lease (claim, acquire): the only answer that carries its token."""

    lease_token: str = Field(
        description="A secret: send it as Fencing-Token on the proxy listener and in the "
        "lease calls. The store keeps only its hash."
    )


class JobPage(Answer):
    items: list[Job]
    next_cursor: str | None


class AuditEntry(Answer):
    """One answer the gateway gave itself (a refusal or a replay); entries of one kind
    written close together are grouped (``count``, ``last_at``)."""

    id: int
    at: datetime
    reason: AuditReason
    status: int
    job_id: str | None
    source: str | None = Field(
        description='"fencegate" (the gateway\'s own leases) or a [[lease_sources]] name'
    )
    generation: int | None
    highest_generation: int | None
    owner: str | None
    upstream: str | None
    method: str
    path: str
    idempotency_key: str | None
    client: str | None
    fingerprint: str | None
    replica: str | None = Field(
        description="The replica that answered (gateway.replica_name); null for entries "
        "written by a version before it was kept."
    )
    count: int = Field(ge=1)
    last_at: datetime
    body: str | None = Field(
        default=None, description="The request body, base64 (only when audit_bodies is on)."
    )


class AuditPage(Answer):
    items: list[AuditEntry]
    next_cursor: str | None


class UnknownOutcome(Answer):
    """A key whose forward has an unknown outcome, or that the gateway re-sends now."""

    job_id: str
    key: str
    state: Literal["unknown", "resolving"]
    generation: int
    upstream: str
    method: str
    path: str
    status: int | None
    note: str | None
    resolve_attempts: int
    resolvable: bool
    updated_at: datetime


class UnknownOutcomes(Answer):
    items: list[UnknownOutcome]


class Resolved(Answer):
    job_id: str
    key: str
    resolved: Literal["applied", "not-applied"]


class Upstream(Answer):
    """What operators may see of an upstream: header names, never their values."""

    name: str
    url: str
    fenced_methods: list[str]
    require_idempotency_key: bool
    timeout_seconds: float
    max_body_bytes: int
    unknown_outcome: Literal["hold", "retry", "resolve"]
    profile: str
    dedup: dict[str, Any] | None
    signing: dict[str, Any] | None
    not_processed_statuses: list[int]
    audit_query_params: bool | list[str]
    set_headers: list[str]


class Upstreams(Answer):
    items: list[Upstream]


class Health(Answer):
    status: Literal["ok"]


class Ready(Answer):
    status: Literal["ready"]
    schema_: str | None = Field(alias="schema", description="The database's alembic revision.")
    database: dict[str, Any] | None = Field(
        default=None, description="PostgreSQL: the server, whether it is the primary, its standbys."
    )


class Dashboard(BaseModel):
    """The dashboard page's own reads: their members serve the page and may grow."""

    model_config = ConfigDict(extra="allow")


class RefusalsOverTime(Dashboard):
    since: datetime
    until: datetime
    bucket_seconds: int
    buckets: list[dict[str, Any]]


class JobTimeline(Dashboard):
    job_id: str
    job: dict[str, Any] | None
    events: list[dict[str, Any]]
    truncated: bool


class ProblemField(BaseModel):
    field: str
    message: str


class Problem(BaseModel):
    """An RFC 9457 problem document; ``reason`` is the stable, machine-readable member.
    Extension members beside those named here may be added."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(description="https://fencegate.dev/problems/<reason>")
    title: str
    status: int = Field(ge=400, le=599)
    detail: str
    reason: ProblemReason
    field: str | None = Field(default=None, description="invalid-request: the first bad field.")
    errors: list[ProblemField] | None = Field(
        default=None, description="invalid-request: every bad field."
    )
    job_id: str | None = None
    generation: int | None = None
    highest_generation: int | None = None
    sent: Annotated[str, one_of(s.value for s in Sent)] | None = Field(
        default=None,
        description="The gateway's answers to a write: whether any byte of it reached "
        "the upstream. never: nothing was sent; send it again, under the same key or a "
        "new one (after Retry-After when given). maybe: it may have been sent and "
        "whether it was applied is unknown; never send it under a new key: retry the "
        "same key or have the outcome resolved (POST /admin/unknown-outcomes/resolve). "
        "yes: sent and answered; this answer is the outcome. Decide from this member "
        "alone, not from the detail or the headers. Absent on the control listener's "
        "problems, which answer no write.",
    )


ANSWERS: tuple[type[BaseModel], ...] = (
    Job,
    JobPage,
    Lease,
    LeaseGrant,
    AuditPage,
    UnknownOutcomes,
    Resolved,
    Upstreams,
    Health,
    Ready,
    RefusalsOverTime,
    JobTimeline,
    Problem,
)
