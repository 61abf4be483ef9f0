"""The fencing decision as pure functions: what the gateway knows about a request, the
lease behind its token and the key's record in, a verdict out. No I/O here.

The order of checks is the spec's table: the first row that applies is the answer.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from lease_core import rules, tokens
from lease_core.rules import RecordState as RecordState  # re-exported: the gateway names it


class Reason(StrEnum):
    UNKNOWN_UPSTREAM = "unknown-upstream"
    INVALID_REQUEST = "invalid-request"
    MISSING_FENCING_TOKEN = "missing-fencing-token"
    INVALID_FENCING_TOKEN = "invalid-fencing-token"
    MISSING_IDEMPOTENCY_KEY = "missing-idempotency-key"
    STALE_GENERATION = "stale-generation"
    LEASE_ENDED = "lease-ended"
    LEASE_EXPIRED = "lease-expired"
    BODY_TOO_LARGE = "body-too-large"
    BODY_TIMEOUT = "body-timeout"
    IDEMPOTENCY_KEY_REUSED = "idempotency-key-reused"
    REQUEST_IN_PROGRESS = "request-in-progress"
    OUTCOME_UNKNOWN = "outcome-unknown"
    ORDERING_TIMEOUT = "ordering-timeout"
    UPSTREAM_UNAVAILABLE = "upstream-unavailable"
    UPSTREAM_TIMEOUT = "upstream-timeout"
    STORE_UNAVAILABLE = "store-unavailable"
    OVERLOADED = "gateway-overloaded"
    REPLAY_UNAVAILABLE = "replay-unavailable"
    IDEMPOTENT_REPLAY = "idempotent-replay"


@dataclass(frozen=True, slots=True)
class ReasonInfo:
    status: int
    title: str
    detail: str
    retry_after: bool = False  # answered with ``Retry-After: 1``: the same request may pass soon


REASONS: dict[Reason, ReasonInfo] = {
    Reason.UNKNOWN_UPSTREAM: ReasonInfo(404, "Unknown upstream", "No upstream of that name."),
    Reason.INVALID_REQUEST: ReasonInfo(
        400, "Invalid request", "The request is malformed or not allowed through the gateway."
    ),
    Reason.MISSING_FENCING_TOKEN: ReasonInfo(
        428, "Fencing token required", "This method is fenced: send Fencing-Token."
    ),
    Reason.INVALID_FENCING_TOKEN: ReasonInfo(
        403, "Invalid fencing token", "The fencing token is malformed or unknown."
    ),
    Reason.MISSING_IDEMPOTENCY_KEY: ReasonInfo(
        400,
        "Idempotency key required",
        "This upstream requires an Idempotency-Key: a quoted string or a token, 1 to 255 "
        "characters.",
    ),
    Reason.STALE_GENERATION: ReasonInfo(
        409, "Stale generation", "A newer generation of this job exists or has already written."
    ),
    Reason.LEASE_ENDED: ReasonInfo(
        409, "Lease ended", "The lease was completed, failed or released."
    ),
    Reason.LEASE_EXPIRED: ReasonInfo(409, "Lease expired", "The lease behind this token expired."),
    Reason.BODY_TOO_LARGE: ReasonInfo(
        413, "Body too large", "The body is over this upstream's limit."
    ),
    Reason.BODY_TIMEOUT: ReasonInfo(
        408,
        "Body timeout",
        "The request body did not arrive in time (body_timeout_seconds, "
        "body_idle_timeout_seconds); the connection is closed.",
    ),
    Reason.IDEMPOTENCY_KEY_REUSED: ReasonInfo(
        422,
        "Idempotency key reused",
        "This key was used for this job with a different request.",
    ),
    Reason.REQUEST_IN_PROGRESS: ReasonInfo(
        409,
        "Request in progress",
        "A request with this key is being forwarded right now.",
        retry_after=True,
    ),
    Reason.OUTCOME_UNKNOWN: ReasonInfo(
        409,
        "Outcome unknown",
        "An earlier forward with this key has an unknown outcome; an operator must resolve it.",
    ),
    Reason.REPLAY_UNAVAILABLE: ReasonInfo(
        409,
        "Replay unavailable",
        "This key's request was applied, but its answer was larger than "
        "max_replay_body_bytes and was not stored; its status is in stored_status.",
    ),
    Reason.ORDERING_TIMEOUT: ReasonInfo(
        503,
        "Ordering timeout",
        "A write of an older generation of this job did not settle in time.",
        retry_after=True,
    ),
    Reason.UPSTREAM_UNAVAILABLE: ReasonInfo(
        502, "Upstream unavailable", "The upstream refused the connection or failed to answer."
    ),
    Reason.UPSTREAM_TIMEOUT: ReasonInfo(
        504, "Upstream timeout", "The upstream did not answer in time."
    ),
    Reason.OVERLOADED: ReasonInfo(
        503,
        "Gateway overloaded",
        "The gateway is at max_concurrent_requests; try again shortly.",
        retry_after=True,
    ),
    Reason.STORE_UNAVAILABLE: ReasonInfo(
        503,
        "Store unavailable",
        "The gateway's database is not reachable; try again shortly.",
        retry_after=True,
    ),
}

# -- idempotency keys ---------------------------------------------------------------

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_SF_STRING = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
ANONYMOUS_PREFIX = "\u2205"  # never the first character of a key that parse_key accepts


def parse_key(header: str, max_length: int = 255) -> str | None:
    """The key of an ``Idempotency-Key`` header, or None when malformed.

    A structured-field string (``"abc"``) or a bare run of RFC 9110 token characters;
    ``"abc"`` and ``abc`` name the same key.
    """
    header = header.strip(" \t")
    match = _SF_STRING.fullmatch(header)
    if match is not None:
        key = re.sub(r"\\(.)", r"\1", match.group(1))
    elif _TOKEN.fullmatch(header):
        key = header
    else:
        return None
    return key if 1 <= len(key) <= max_length else None


def canonical_key(key: str) -> str:
    """The one form of a key that upstreams get, however the worker quoted it: bare where
    it is made of token characters (``"step-1"`` and ``step-1`` both go as ``step-1``),
    else a structured-field string."""
    if _TOKEN.fullmatch(key):
        return key
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def anonymous_key() -> str:
    """A key for a write that carries none: tracked while in flight, never replayed."""
    return ANONYMOUS_PREFIX + tokens.new_serial_id()


def is_anonymous(key: str) -> bool:
    return key.startswith(ANONYMOUS_PREFIX)


Hasher = Any  # a hashlib object (``hashlib._Hash`` is not public)


def fingerprint_hasher(method: str, upstream: str, path: str, query: str) -> Hasher:
    """The fingerprint of a request whose body is still to come: ``update`` it with the
    body's pieces as they arrive, then ``hexdigest()``."""
    digest = hashlib.sha256()
    for part in (method.upper(), upstream, path, query):
        encoded = part.encode("utf-8", "surrogateescape")
        digest.update(len(encoded).to_bytes(8, "big"))
        digest.update(encoded)
    return digest


def fingerprint(method: str, upstream: str, path: str, query: str, body: bytes) -> str:
    """What makes two requests 'the same request' for an idempotency key."""
    digest = fingerprint_hasher(method, upstream, path, query)
    digest.update(body)
    return str(digest.hexdigest())


# -- records and verdicts -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """The stored state of one (job, key)."""

    fingerprint: str
    state: RecordState
    generation: int
    attempt: str
    deadline: float
    status: int | None = None
    headers: list[tuple[str, str]] | None = None
    body: bytes | None = None


@dataclass(frozen=True, slots=True)
class Presented:
    """The lease behind the presented token (as granted) and the job as it is now."""

    job_id: str
    generation: int
    owner: str
    job: rules.Job | None


class Action(StrEnum):
    FORWARD = "forward"
    REPLAY = "replay"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    reason: Reason | None = None

    @classmethod
    def reject(cls, reason: Reason) -> Verdict:
        return cls(Action.REJECT, reason)


FORWARD = Verdict(Action.FORWARD)
REPLAY = Verdict(Action.REPLAY, Reason.IDEMPOTENT_REPLAY)


def lease_reason(presented: Presented | None, now: float) -> Reason | None:
    """None when the presented lease may write now; else why not."""
    if presented is None:
        return Reason.INVALID_FENCING_TOKEN
    lease = rules.Lease(presented.job_id, presented.generation, presented.owner, 0.0)
    job = presented.job
    if job is not None and rules.is_current(lease, job, now):
        return None
    return Reason(rules.refusal_reason(presented.generation, job, now))


def effective_state(record: Record, now: float) -> RecordState:
    """An in-flight record whose deadline passed (its replica crashed or hung) is unknown."""
    if record.state is RecordState.IN_FLIGHT and record.deadline <= now:
        return RecordState.UNKNOWN
    return record.state


def record_verdict(record: Record, fingerprint: str, now: float, policy: str) -> Verdict:
    """What a request whose key already has a record gets."""
    if record.fingerprint != fingerprint:
        return Verdict.reject(Reason.IDEMPOTENCY_KEY_REUSED)
    state = effective_state(record, now)
    if state is RecordState.COMPLETED:
        return REPLAY
    if state is RecordState.IN_FLIGHT:
        return Verdict.reject(Reason.REQUEST_IN_PROGRESS)
    if policy == "retry":
        return FORWARD
    return Verdict.reject(Reason.OUTCOME_UNKNOWN)


def send_verdict(generation: int, fence: int | None, seconds_left: float) -> Reason | None:
    """Judged once more right before a claimed write's first byte goes out, after its
    admission's commit is known: None when it may still be sent. A newer generation was
    admitted meanwhile (the job's fence moved past ours): ``stale-generation``. The claim
    is gone, or so near its deadline that other replicas may stop waiting for it
    (``seconds_left``, the lesser of this process's clock and the database's): not sent,
    ``ordering-timeout``."""
    if fence is not None and fence > generation:
        return Reason.STALE_GENERATION
    if seconds_left <= 0:
        return Reason.ORDERING_TIMEOUT
    return None


def problem_extra(presented: Presented | None, highest: int | None = None) -> dict[str, Any]:
    """The extension members of a problem document, where known."""
    if presented is None:
        return {}
    job_generation = presented.job.generation if presented.job is not None else None
    candidates = [g for g in (highest, job_generation) if g is not None]
    return {
        "job_id": presented.job_id,
        "generation": presented.generation,
        "highest_generation": max(candidates) if candidates else None,
    }
