"""Every problem ``reason`` of Fencegate, spelled once, with the facts of each.

A reason is the stable, machine-readable ``reason`` member of an RFC 9457 problem
document: the gateway's answers on the proxy listener, the lease and admin API's on the
control listener. Both layers and the worker client name them through ``Reason``; no
other module spells their values (``tests/unit/test_reasons.py`` checks). This module
imports nothing but the standard library: the worker client is the lowest layer, and the
lease service and the gateway build on it.

To add a reason: a member of ``Reason`` and its row in ``REASONS`` (status, title, the
layers that answer it, and for the gateway its default detail). Then, for the gateway, a
row in ``gateway.fencing.decision.ROWS``; for the lease API, its class in
``fencegate_client.errors`` (``reason = Reason.X``: the class takes status and title from
the row).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Flag, StrEnum, auto
from types import MappingProxyType


class Reason(StrEnum):
    # The gateway's, in the order of the spec's table (the dashboard lists them so).
    UNKNOWN_UPSTREAM = "unknown-upstream"
    INVALID_REQUEST = "invalid-request"
    MISSING_FENCING_TOKEN = "missing-fencing-token"
    INVALID_FENCING_TOKEN = "invalid-fencing-token"
    MISSING_IDEMPOTENCY_KEY = "missing-idempotency-key"
    STALE_GENERATION = "stale-generation"
    LEASE_ENDED = "lease-ended"
    LEASE_EXPIRED = "lease-expired"
    # A lease source handed a generation that another holder of its lock was admitted
    # under: the lock service lost its fence counter (gateway.sources).
    GENERATION_REISSUED = "generation-reissued"
    BODY_TOO_LARGE = "body-too-large"
    BODY_TIMEOUT = "body-timeout"
    IDEMPOTENCY_KEY_REUSED = "idempotency-key-reused"
    REQUEST_IN_PROGRESS = "request-in-progress"
    OUTCOME_UNKNOWN = "outcome-unknown"
    ORDERING_TIMEOUT = "ordering-timeout"
    UPSTREAM_UNAVAILABLE = "upstream-unavailable"
    UPSTREAM_TIMEOUT = "upstream-timeout"
    # Sent, and the connection failed before the upstream's answer arrived.
    UPSTREAM_CONNECTION_LOST = "upstream-connection-lost"
    # An S3 upstream refused the write's own precondition (If-None-Match: *, If-Match).
    PRECONDITION_FAILED = "precondition-failed"
    STORE_UNAVAILABLE = "store-unavailable"
    OVERLOADED = "gateway-overloaded"
    REPLAY_UNAVAILABLE = "replay-unavailable"
    IDEMPOTENT_REPLAY = "idempotent-replay"  # not a problem: audited with the stored status
    # Not a problem either: an unknown outcome that the gateway settled itself by
    # re-sending the write (``unknown_outcome = "resolve"``), audited with the answer's
    # status, which is stored as the key's answer.
    AUTO_RESOLVED = "auto-resolved"
    # The control listener's only (the lease and admin API).
    INTERNAL_ERROR = "internal-error"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    INVALID_LEASE_TOKEN = "invalid-lease-token"
    JOB_NOT_FOUND = "job-not-found"
    NOT_FOUND = "not-found"
    METHOD_NOT_ALLOWED = "method-not-allowed"
    JOB_EXISTS = "job-exists"
    LEASE_HELD = "lease-held"
    JOB_FINISHED = "job-finished"
    HTTP_ERROR = "http-error"  # any other aiohttp error: its status, its reason phrase
    # The worker client's own, for a ``RemoteError``: never sent by a server.
    INVALID_RESPONSE = "invalid-response"


class Sent(StrEnum):
    """What a gateway's answer says of the write it answers: whether any byte of it
    reached the upstream. A worker decides what to do from this fact alone:

    - ``never``: nothing was sent. The upstream never saw it: send it again (the same key
      is free, or back as it was), now or after ``Retry-After``; a new key is safe too.
    - ``maybe``: sent, or maybe sent, and whether it was applied is unknown. Never send it
      under a new key: retry with the same key (the upstream's ``unknown_outcome`` says
      what that gets) or have it resolved (``fencegate outcomes resolve``).
    - ``yes``: sent and answered; the answer is the outcome (a replay is the earlier
      write's answer). Sending it again under the same key gets the same answer.
    """

    NEVER = "never"
    MAYBE = "maybe"
    YES = "yes"

    @property
    def new_key_safe(self) -> bool:
        """Whether the write may be sent again under a new key: only when it was never
        sent. (The same key is always safe: the gateway answers a duplicate itself.)"""
        return self is Sent.NEVER


class Layer(Flag):
    """Who answers with a reason."""

    GATEWAY = auto()  # the gateway, on the proxy listener
    LEASE_API = auto()  # the control listener: lease API, admin API (``errors`` classes)


@dataclass(frozen=True, slots=True)
class ReasonInfo:
    status: int
    title: str
    layers: Layer
    detail: str = ""  # the gateway's default; a lease-API error's is its class's docstring
    retry_after: bool = False  # answered with ``Retry-After: 1``: the same request may pass soon
    # Of the gateway's answers: whether the write reached the upstream (``Sent``); None
    # for the control listener's only, which answer no write.
    sent: Sent | None = None


_GW = Layer.GATEWAY
_API = Layer.LEASE_API
_BOTH = _GW | _API

REASONS: Mapping[Reason, ReasonInfo] = MappingProxyType(
    {
        # -- the gateway's -----------------------------------------------------------------
        Reason.UNKNOWN_UPSTREAM: ReasonInfo(
            404,
            "Unknown upstream",
            _GW,
            "No upstream of that name.",
            sent=Sent.NEVER,
        ),
        Reason.INVALID_REQUEST: ReasonInfo(
            400,
            "Invalid request",
            _BOTH,
            "The request is malformed or not allowed through the gateway.",
            sent=Sent.NEVER,
        ),
        Reason.MISSING_FENCING_TOKEN: ReasonInfo(
            428,
            "Fencing token required",
            _GW,
            "This method is fenced: send Fencing-Token.",
            sent=Sent.NEVER,
        ),
        Reason.INVALID_FENCING_TOKEN: ReasonInfo(
            403,
            "Invalid fencing token",
            _GW,
            "The fencing token is malformed or unknown.",
            sent=Sent.NEVER,
        ),
        Reason.MISSING_IDEMPOTENCY_KEY: ReasonInfo(
            400,
            "Idempotency key required",
            _GW,
            "This upstream requires an Idempotency-Key: a quoted string or a token, 1 to 255 "
            "characters.",
            sent=Sent.NEVER,
        ),
        Reason.STALE_GENERATION: ReasonInfo(
            409,
            "Stale generation",
            _BOTH,
            "A newer generation of this job exists or has already written.",
            sent=Sent.NEVER,
        ),
        Reason.LEASE_ENDED: ReasonInfo(
            409,
            "Lease ended",
            _BOTH,
            "The lease was completed, failed or released.",
            sent=Sent.NEVER,
        ),
        Reason.LEASE_EXPIRED: ReasonInfo(
            409,
            "Lease expired",
            _BOTH,
            "The lease behind this token expired.",
            sent=Sent.NEVER,
        ),
        Reason.GENERATION_REISSUED: ReasonInfo(
            409,
            "Generation reissued",
            _GW,
            "Another holder of this lock was admitted under this generation: the lock "
            "service issued it twice (it lost its fence counter). Nothing was forwarded; "
            "acquire the lock again once its counter is past highest_generation.",
            sent=Sent.NEVER,
        ),
        Reason.BODY_TOO_LARGE: ReasonInfo(
            413,
            "Body too large",
            _GW,
            "The body is over this upstream's limit.",
            sent=Sent.NEVER,
        ),
        Reason.BODY_TIMEOUT: ReasonInfo(
            408,
            "Body timeout",
            _GW,
            "The request body did not arrive in time (body_timeout_seconds, "
            "body_idle_timeout_seconds); the connection is closed.",
            sent=Sent.NEVER,
        ),
        Reason.IDEMPOTENCY_KEY_REUSED: ReasonInfo(
            422,
            "Idempotency key reused",
            _GW,
            "This key was used for this job with a different request.",
            sent=Sent.NEVER,
        ),
        Reason.REQUEST_IN_PROGRESS: ReasonInfo(
            409,
            "Request in progress",
            _GW,
            "A request with this key is being forwarded right now.",
            retry_after=True,
            sent=Sent.NEVER,
        ),
        Reason.OUTCOME_UNKNOWN: ReasonInfo(
            409,
            "Outcome unknown",
            _GW,
            "An earlier forward with this key has an unknown outcome: retry it with the same "
            "key once an operator has resolved it (fencegate outcomes resolve JOB KEY "
            "--applied or --not-applied, or POST /admin/unknown-outcomes/resolve).",
            sent=Sent.MAYBE,
        ),
        Reason.REPLAY_UNAVAILABLE: ReasonInfo(
            409,
            "Replay unavailable",
            _GW,
            "This key's request was applied, but its answer was larger than "
            "max_replay_body_bytes and was not stored; its status is in stored_status.",
            sent=Sent.YES,
        ),
        Reason.ORDERING_TIMEOUT: ReasonInfo(
            503,
            "Ordering timeout",
            _GW,
            "A write of an older generation of this job did not settle in time.",
            retry_after=True,
            sent=Sent.NEVER,
        ),
        Reason.UPSTREAM_UNAVAILABLE: ReasonInfo(
            502,
            "Upstream unavailable",
            _GW,
            "The upstream could not be reached: nothing of the request was sent; safe to retry.",
            retry_after=True,
            sent=Sent.NEVER,
        ),
        Reason.UPSTREAM_TIMEOUT: ReasonInfo(
            504,
            "Upstream timeout",
            _GW,
            "The request was sent and the upstream did not answer in time: whether it was "
            "applied is unknown.",
            sent=Sent.MAYBE,
        ),
        Reason.UPSTREAM_CONNECTION_LOST: ReasonInfo(
            502,
            "Upstream connection lost",
            _GW,
            "The request was sent and the connection to the upstream failed before its "
            "answer arrived: whether it was applied is unknown.",
            sent=Sent.MAYBE,
        ),
        Reason.PRECONDITION_FAILED: ReasonInfo(
            412,
            "Precondition failed",
            _GW,
            "The upstream refused this write's precondition (If-None-Match: * or "
            "If-Match): the object exists, or has changed. Nothing was written; the "
            "key stays free.",
            sent=Sent.YES,
        ),
        Reason.OVERLOADED: ReasonInfo(
            503,
            "Gateway overloaded",
            _GW,
            "The gateway is at max_concurrent_requests; try again shortly.",
            retry_after=True,
            sent=Sent.NEVER,
        ),
        Reason.STORE_UNAVAILABLE: ReasonInfo(
            503,
            "Store unavailable",
            _BOTH,
            "The gateway's database is not reachable; nothing of this request was sent: "
            "try again shortly.",
            retry_after=True,
            sent=Sent.NEVER,
        ),
        Reason.INTERNAL_ERROR: ReasonInfo(
            500,
            "Internal error",
            _BOTH,
            "The gateway failed unexpectedly: whether this request reached the upstream "
            "is unknown.",
            sent=Sent.MAYBE,
        ),
        # -- the control listener's only ---------------------------------------------------
        Reason.UNAUTHORIZED: ReasonInfo(401, "Unauthorized", _API),
        Reason.FORBIDDEN: ReasonInfo(403, "Forbidden", _API),
        Reason.INVALID_LEASE_TOKEN: ReasonInfo(403, "Invalid lease token", _API),
        Reason.JOB_NOT_FOUND: ReasonInfo(404, "Job not found", _API),
        Reason.NOT_FOUND: ReasonInfo(404, "Not found", _API),
        Reason.METHOD_NOT_ALLOWED: ReasonInfo(405, "Method not allowed", _API),
        Reason.JOB_EXISTS: ReasonInfo(409, "Job exists", _API),
        Reason.LEASE_HELD: ReasonInfo(409, "Lease held", _API),
        Reason.JOB_FINISHED: ReasonInfo(409, "Job finished", _API),
    }
)
"""Every reason whose status and title are fixed. Not here: ``idempotent-replay`` (the
stored answer's status), ``auto-resolved`` (the status of the answer it stored),
``http-error`` (aiohttp's status and reason phrase) and
``invalid-response`` (the client's own)."""

AUDIT_ONLY: frozenset[Reason] = frozenset({Reason.IDEMPOTENT_REPLAY, Reason.AUTO_RESOLVED})
"""The gateway's audit reasons that are no problem document: each is audited with the
status of a stored answer."""

GATEWAY_REASONS: tuple[Reason, ...] = tuple(
    r for r in Reason if r in AUDIT_ONLY or (r in REASONS and Layer.GATEWAY in REASONS[r].layers)
)
"""Every reason the gateway answers or audits, in ``Reason``'s order: what the audit can
be filtered by and the dashboard shows."""


def sent_of(problem: Mapping[str, object]) -> Sent | None:
    """What a gateway's problem document says of its write: its ``sent`` member, else
    (a gateway from before the member, or an answer built outside the gateway's reason
    table) its reason's row in ``REASONS``; None for an answer that says nothing of a
    write (the control listener's, or a reason this client does not know)."""
    member, reason = problem.get("sent"), problem.get("reason")
    if isinstance(member, str) and member in _SENT_VALUES:
        return Sent(member)
    if isinstance(reason, str) and reason in _REASON_VALUES:
        info = REASONS.get(Reason(reason))
        return info.sent if info is not None else None
    return None


_SENT_VALUES = frozenset(s.value for s in Sent)
_REASON_VALUES = frozenset(r.value for r in Reason)
