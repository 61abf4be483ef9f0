"""Upstream profiles: what a kind of destination guarantees by itself, as defaults.

A profile fills an upstream's ``[upstreams.dedup]`` table: the header in which the
upstream reads an idempotency key, how long it remembers one, and how it says that a key
was used before with other parameters. ``generic`` fills nothing (today's behaviour:
the worker's ``Idempotency-Key`` is forwarded in its canonical form). Each profile's
source is in docs/profiles.md. Pure data and pure functions: no I/O.

The key the gateway sends (``upstream_key``) is derived from the job and the worker's
key, so it is the same for every retry of one step, across generations and replicas, and
two jobs never share one.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from enum import StrEnum
from typing import Any, Final, Literal

Profile = Literal["generic", "stripe", "paypal", "checkout", "s3"]

# The defaults of each profile's ``[upstreams.dedup]`` table (None: no table).
PROFILES: Final[dict[str, dict[str, Any] | None]] = {
    "generic": None,
    # https://docs.stripe.com/idempotency: ``Idempotency-Key``, up to 255 characters;
    # keys are removed "after they're at least 24 hours old"; the same key with other
    # parameters is refused with an ``idempotency_error``. Stripe saves an answer "only
    # after the execution of an endpoint begins", 500s included; a request that failed
    # validation (400) or ran into a concurrent one with its key (409) is not saved.
    "stripe": {
        "header": "Idempotency-Key",
        "window_seconds": 86400.0,
        "mismatch_status": 400,
        "mismatch_contains": "idempotency_error",
        "final_statuses": ["2xx", 402, 424, 500],
    },
    # https://developer.paypal.com/api/rest/reference/idempotency/: ``PayPal-Request-Id``;
    # how long an id is kept depends on the API: the Orders API keeps it 6 hours (72 on
    # request), the shortest documented, used here. An id used for another request is
    # refused with 422 ``PAYPAL_REQUEST_ID_PREVIOUSLY_USED``.
    "paypal": {
        "header": "PayPal-Request-Id",
        "window_seconds": 6 * 3600.0,
        "mismatch_status": 422,
        "mismatch_contains": "PAYPAL_REQUEST_ID_PREVIOUSLY_USED",
        "final_statuses": ["2xx"],
    },
    # https://www.checkout.com/docs/developer-resources/api/idempotency:
    # ``Cko-Idempotency-Key``, kept 24 hours in production (120 seconds in the sandbox);
    # the answer is kept only when the request "was processed successfully" (not after a
    # validation error); a concurrent request with the key is answered 429. No answer
    # for "key used with another request" is documented.
    "checkout": {
        "header": "Cko-Idempotency-Key",
        "window_seconds": 86400.0,
        "mismatch_status": None,
        "mismatch_contains": None,
        "final_statuses": ["2xx"],
    },
    # S3 deduplicates nothing by key: the key goes into the object's metadata, and an
    # unknown outcome is settled by reading it back (docs/profiles.md).
    "s3": {
        "header": None,
        "window_seconds": 86400.0,
        "mismatch_status": None,
        "mismatch_contains": None,
        "final_statuses": None,
    },
}

# Upstream answers that do not tell whether the side effect happened (a proxy in front
# of the upstream gave up on it): unknown, whatever ``final_statuses`` say.
UNKNOWN_STATUSES: Final = frozenset({502, 504})
_STATUS_CLASS: Final = re.compile(r"[1-5][xX][xX]")


class Answer(StrEnum):
    """What an upstream's answer means for the write's key."""

    FINAL = "final"  # the key's answer: kept, and replayed to every retry
    NOT_PROCESSED = "not-processed"  # the upstream did not act: the key is free again
    UNKNOWN = "unknown"  # whether the upstream acted is not known
    # The request's own precondition was not met (RFC 9110 13.1): nothing was applied,
    # and the answer is not the key's (the gateway's answer to it is chosen in
    # ``after_forward``'s table).
    PRECONDITION_FAILED = "precondition-not-met"


def statuses(entries: Iterable[int | str]) -> frozenset[int]:
    """``[201, "2xx"]`` as the set of statuses it names; ValueError for anything else."""
    found: set[int] = set()
    for entry in entries:
        if isinstance(entry, int) and not isinstance(entry, bool) and 100 <= entry <= 599:
            found.add(entry)
        elif isinstance(entry, str) and _STATUS_CLASS.fullmatch(entry):
            base = int(entry[0]) * 100
            found.update(range(base, base + 100))
        else:
            raise ValueError(f'{entry!r} is not a status (100 to 599) or a class such as "2xx"')
    return frozenset(found)


def answer_of(
    status: int,
    *,
    whole: bool,
    not_processed: frozenset[int],
    final: frozenset[int] | None,
    precondition: bool = False,
) -> Answer:
    """The one rule for what an answer does to the key: a 412 to a request that carried
    a precondition the upstream is known to judge (``precondition``), precondition
    failed (decided on the head: ``whole`` does not matter); cut short or a proxy's
    502/504, unknown; one of ``not_processed_statuses``, or (where the upstream says
    which answers it keeps) not one of ``final_statuses``: not processed; else final."""
    if precondition and status == 412:
        return Answer.PRECONDITION_FAILED
    if not whole or status in UNKNOWN_STATUSES:
        return Answer.UNKNOWN
    if status in not_processed or (final is not None and status not in final):
        return Answer.NOT_PROCESSED
    return Answer.FINAL


UPSTREAM_KEY_PREFIX: Final = "fg-"
UPSTREAM_KEY_HEX: Final = 61  # 244 bits; with the prefix, 64 characters of [a-z0-9-]
_DOMAIN: Final = b"fencegate upstream key v1\x00"


def upstream_key(job_id: str, key: str) -> str:
    """The key the upstream gets for the worker's ``key`` of ``job_id``: a SHA-256 over
    a fixed domain string and both values, each prefixed with its length (so no two
    (job, key) pairs hash the same input), in hex. 64 characters of ``[a-z0-9-]``: within
    every profile's length limit and alphabet (PayPal's request ids allow 108, Stripe's
    keys 255), and the same whatever the generation, the attempt or the replica."""
    digest = hashlib.sha256(_DOMAIN)
    for part in (job_id, key):
        encoded = part.encode("utf-8", "surrogateescape")
        digest.update(len(encoded).to_bytes(8, "big"))
        digest.update(encoded)
    return UPSTREAM_KEY_PREFIX + digest.hexdigest()[:UPSTREAM_KEY_HEX]


def is_mismatch(
    status: int, body: bytes, mismatch_status: int | None, contains: str | None
) -> bool:
    """Whether an upstream's answer says that the key was used before with other
    parameters (so re-sending cannot settle the outcome)."""
    if mismatch_status is None or status != mismatch_status:
        return False
    return contains is None or contains.encode("utf-8") in body
