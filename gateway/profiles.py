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
from typing import Any, Final, Literal

Profile = Literal["generic", "stripe", "paypal", "checkout", "s3"]

# The defaults of each profile's ``[upstreams.dedup]`` table (None: no table).
PROFILES: Final[dict[str, dict[str, Any] | None]] = {
    "generic": None,
    # https://docs.stripe.com/api/idempotent_requests: ``Idempotency-Key``, up to 255
    # characters; keys are removed "after they're at least 24 hours old"; the same key
    # with other parameters is refused with an ``idempotency_error``.
    "stripe": {
        "header": "Idempotency-Key",
        "window_seconds": 86400.0,
        "mismatch_status": 400,
        "mismatch_contains": "idempotency_error",
    },
    # https://developer.paypal.com/api/rest/reference/idempotency/: ``PayPal-Request-Id``;
    # how long a request id is kept depends on the API (the shortest is used here).
    "paypal": {
        "header": "PayPal-Request-Id",
        "window_seconds": 6 * 3600.0,
        "mismatch_status": None,
        "mismatch_contains": None,
    },
    # https://www.checkout.com/docs/developer-resources/api/idempotency:
    # ``Cko-Idempotency-Key``, kept 24 hours; a key used with another request is refused
    # with 409.
    "checkout": {
        "header": "Cko-Idempotency-Key",
        "window_seconds": 86400.0,
        "mismatch_status": 409,
        "mismatch_contains": None,
    },
    # S3 deduplicates nothing by key: the key goes into the object's metadata, and an
    # unknown outcome is settled by reading it back (docs/profiles.md).
    "s3": {
        "header": None,
        "window_seconds": 86400.0,
        "mismatch_status": None,
        "mismatch_contains": None,
    },
}

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
