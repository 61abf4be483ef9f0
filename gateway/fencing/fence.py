"""The rules behind the decision's facts, as pure functions: the lease behind a token,
a key's record, a lease source's finding and the last judgement before the send each
turned into the ``Reason`` that the decision table's row answers (None: nothing stops
the write). With keys, fingerprints and the records' shapes. No I/O here.

One of the decision modules (with ``decision`` and ``after_forward``): a ``Reason`` is
chosen here or there and nowhere else in the gateway
(``tests/unit/test_decision_is_the_only_chooser.py``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from fencegate_client.reasons import GATEWAY_REASONS as GATEWAY_REASONS
from fencegate_client.reasons import REASONS as ALL_REASONS
from fencegate_client.reasons import Layer
from fencegate_client.reasons import Reason as Reason
from fencegate_client.reasons import ReasonInfo as ReasonInfo
from lease_core import rules, tokens
from lease_core.rules import RecordState as RecordState  # re-exported: the gateway names it

PROBLEMS: dict[Reason, ReasonInfo] = {
    reason: info for reason, info in ALL_REASONS.items() if Layer.GATEWAY in info.layers
}
"""The gateway's problem documents: status, title, default detail, ``Retry-After``. The
reasons and their facts are written in ``fencegate_client.reasons``."""

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


def source_of(job_id: str) -> str:
    """The lease source a job id belongs to: ``fencegate`` (the gateway's own leases,
    whose ids never hold a ``/``) or the name before the ``/`` (``gateway.sources``)."""
    source, slash, _ = job_id.partition("/")
    return source if slash else "fencegate"


# -- records and the rules of the facts -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """The stored state of one (job, key)."""

    fingerprint: str
    state: RecordState
    generation: int
    attempt: str
    deadline: float
    # Its deadline has passed, by the database's clock (the SQL's ``past_deadline``).
    overdue: bool = False
    status: int | None = None
    headers: list[tuple[str, str]] | None = None
    body: bytes | None = None


@dataclass(frozen=True, slots=True)
class Presented:
    """The lease behind the presented token (as granted) and the job as it is now.

    A lease of another source (``gateway.sources``) has no ``job`` row: ``source`` names
    it, and ``refused`` is the verdict that the source and the job's fence gave (None:
    current). Its generation is None when the source no longer knows it (an etcd lock
    key that is gone)."""

    job_id: str
    generation: int | None
    owner: str
    job: rules.Job | None
    source: str | None = None
    refused: Reason | None = None
    detail: str | None = None  # the source's explanation of the refusal, if it has one


@dataclass(frozen=True, slots=True)
class Admission:
    """Everything the admit transaction (or a read of the lease) learned; ``lease`` is
    its verdict on the lease, as the SQL gave it (its ``refusal`` column)."""

    now: float
    presented: Presented | None
    lease: Reason | None  # None: the lease may write now; else why not
    highest: int | None = None
    claimed: bool = False
    attempt: str | None = None
    record: Record | None = None
    older_in_flight: bool = False
    # The key's record was taken over (retry policy): ``attempt`` is ours now, and
    # ``back_to`` is the record as it was, to return to if our attempt is never sent.
    back_to: Record | None = None


@dataclass(frozen=True, slots=True)
class ClaimState:
    """A claimed write, as the database sees it right before it is sent."""

    now: float
    fence: int | None  # the job's fence: the highest generation admitted
    deadline: float | None  # None: the claim is no longer ours (released, taken over)
    older_in_flight: bool  # an older generation's write to the job is in flight now


class Lost(StrEnum):
    """What a lease source (``gateway.sources``) found out about a lease that may no
    longer write: a fact, which ``external_reason`` turns into the refusal's reason."""

    NEWER_HOLDER = "newer-holder"  # somebody newer holds the lock now
    RELEASED = "released"  # released (or its session ended), nobody newer holds it
    EXPIRED = "expired"  # its lease ran out, nobody newer holds it
    # The source's generation does not fit the database's integer (``GENERATION_MAX``):
    # it can never be fenced.
    OUT_OF_RANGE = "out-of-range"


_LOST: dict[Lost, Reason] = {
    Lost.NEWER_HOLDER: Reason.STALE_GENERATION,
    Lost.RELEASED: Reason.LEASE_ENDED,
    Lost.EXPIRED: Reason.LEASE_EXPIRED,
    Lost.OUT_OF_RANGE: Reason.INVALID_FENCING_TOKEN,
}

GENERATION_MAX: Final = 2**63 - 1
"""The largest generation the database stores (a signed 64-bit integer, ``bigint``)."""


UNKNOWN_TOKEN: Final = Reason.INVALID_FENCING_TOKEN
"""The lease of a token that no lease (nor its source) knows."""


def sql_verdict(refusal: str | None) -> Reason | None:
    """The verdict an operation of the catalogue gave on a lease (its ``refusal``
    column: a reason's value, or NULL when the lease may write), named. The SQL decided;
    nothing is judged again here."""
    return None if refusal is None else Reason(refusal)


def superseded(generation: int, fence: int | None) -> bool:
    """A newer generation than ``generation`` has been admitted: the job's fence (the
    highest generation admitted; None: none yet) is above it. Every judgement of a write
    against its job's fence in Python is this one (the SQL's is ``external_stale`` and
    the admission's own statement)."""
    return fence is not None and fence > generation


def lease_after_wait(lease: Reason | None, highest: int | None, generation: int) -> Reason | None:
    """The lease judged again after the wait for older writes: a newer generation
    admitted meanwhile makes a current lease stale."""
    if lease is None and superseded(generation, highest):
        return Reason.STALE_GENERATION
    return lease


def effective_state(record: Record) -> RecordState:
    """An in-flight record whose deadline passed (its replica crashed or hung: ``overdue``,
    as the SQL read it) is unknown."""
    if record.state is RecordState.IN_FLIGHT and record.overdue:
        return RecordState.UNKNOWN
    return record.state


class UnknownOutcome(StrEnum):
    """What becomes of a sent write whose outcome is unknown: an upstream's
    ``unknown_outcome`` (docs/profiles.md)."""

    HOLD = "hold"  # its key answers outcome-unknown until it is resolved
    RETRY = "retry"  # a retry under its key is forwarded again
    RESOLVE = "resolve"  # the gateway re-sends it itself (an upstream that deduplicates)


def record_reason(record: Record | None, fingerprint: str, policy: UnknownOutcome) -> Reason:
    """What a request whose key has a record that the admission did not give it gets:
    ``idempotent-replay`` (the stored answer), ``replay-unavailable`` (applied, but the
    answer was too large to keep), ``idempotency-key-reused``, ``outcome-unknown``, or
    ``request-in-progress``: in flight under another request, or to be forwarded again
    (retry) but taken over by another request first, or vanished between our claim and
    our read."""
    if record is None:
        return Reason.REQUEST_IN_PROGRESS
    if record.fingerprint != fingerprint:
        return Reason.IDEMPOTENCY_KEY_REUSED
    state = effective_state(record)
    if state is RecordState.COMPLETED:
        return Reason.IDEMPOTENT_REPLAY if record.body is not None else Reason.REPLAY_UNAVAILABLE
    if state is RecordState.IN_FLIGHT or policy == UnknownOutcome.RETRY:
        return Reason.REQUEST_IN_PROGRESS
    return Reason.OUTCOME_UNKNOWN


def in_progress(record: Reason | None) -> bool:
    """The key is in flight under another request (a duplicate may wait for it)."""
    return record is Reason.REQUEST_IN_PROGRESS


def external_reason(refused: Lost | None) -> Reason | None:
    """The reason a lease source's own finding names (None: it found nothing against the
    lease). The job's fence and the lease's expiry are the database's to judge: the
    operations ``external_lease`` and ``admit_external`` (``lease_core/sql/common.sql``)
    put this finding in the spec's order among their own: a generation below the fence
    is stale whatever the source says; then this finding; then the fence's generation
    bound to another holder (``generation-reissued``); then the expiry a signed token
    carries, by the database's clock."""
    return None if refused is None else _LOST[refused]


def source_detail(
    lost: Lost | None,
    refused: Reason | None,
    *,
    reissued: str | None,
    counter_lost: str | None,
    own: str | None,
) -> str | None:
    """A lease source's explanation of a refusal (None: the reason's default): its
    generation bound to another holder (``reissued``); current for the source, yet below
    the fence (``counter_lost``: the source's counter went backwards); else the source's
    own finding's (``own``)."""
    if refused is Reason.GENERATION_REISSUED:
        return reissued
    if lost is None and refused is Reason.STALE_GENERATION:
        return counter_lost
    return own


def send_verdict(generation: int, fence: int | None, seconds_left: float) -> Reason | None:
    """Judged once more right before a claimed write's first byte goes out, after its
    admission's commit is known: None when it may still be sent. A newer generation was
    admitted meanwhile (the job's fence moved past ours): ``stale-generation``. The claim
    is gone, or so near its deadline that other replicas may stop waiting for it
    (``seconds_left``, the lesser of this process's clock and the database's): not sent,
    ``ordering-timeout``."""
    if superseded(generation, fence):
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
