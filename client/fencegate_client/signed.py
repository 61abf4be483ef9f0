"""Mint signed fencing tokens for a ``kind = "jwt"`` lease source (no server needed).

The service that grants a lease (a queue handing out a message under a visibility
timeout, a scheduler starting an attempt) signs one token per grant::

    from fencegate_client.signed import mint_token

    token = mint_token(
        private_key_pem,             # the key whose public half the gateway holds
        source="queue",              # the [[lease_sources]] name: "queue:<JWS>"
        issuer="billing-queue",
        job="order-42",
        generation=receive_count,    # grows with every grant of this job
        ttl_seconds=30,
    )
    headers = {"Fencing-Token": token, "Idempotency-Key": "charge"}

The claims are ``iss``, ``sub`` (the job), ``gen`` (an integer that grows with every grant
of that job), ``iat``, ``exp``, and ``jti`` when ``grant_id`` names the grant; any JOSE
library of another language can mint the same (docs/lease-sources.md). The gateway
fences by the highest ``gen`` that has written for the job: a token of a lower
generation is refused ``stale-generation``, and a token of another grant (another
``jti``) under a generation that has written, ``generation-reissued``. Name each grant
(a message id, an attempt id) with ``grant_id``, the same in every token of that grant.
"""

from __future__ import annotations

import time
from typing import Any

from ._needs import needs

try:
    import jwt
except ModuleNotFoundError as error:  # a dependency of fencegate; not of a client-only install
    needs(error, __name__, "jwt", install="'pyjwt[crypto]'")
    raise

ALGORITHMS = (
    "EdDSA",
    "ES256",
    "ES384",
    "ES512",
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
)


def claims(
    *,
    issuer: str,
    job: str,
    generation: int,
    ttl_seconds: float,
    now: float | None = None,
    owner: str | None = None,
    audience: str | None = None,
    grant_id: str | None = None,
) -> dict[str, Any]:
    """The claims of one grant (``owner``: shown in the gateway's audit; ``grant_id``:
    its ``jti``, which tells the gateway two grants of one generation apart)."""
    if type(generation) is not int or generation < 0:
        raise ValueError("generation must be a non-negative integer")
    if not job:
        raise ValueError("job must not be empty")
    if not ttl_seconds > 0:
        raise ValueError("ttl_seconds must be above zero")
    issued = time.time() if now is None else now
    body: dict[str, Any] = {
        "iss": issuer,
        "sub": job,
        "gen": generation,
        "iat": int(issued),
        "exp": int(issued + ttl_seconds),
    }
    if grant_id is not None:
        body["jti"] = grant_id
    if owner is not None:
        body["owner"] = owner
    if audience is not None:
        body["aud"] = audience
    return body


def mint_token(
    private_key: str | bytes,
    *,
    issuer: str,
    job: str,
    generation: int,
    ttl_seconds: float,
    source: str | None = None,
    algorithm: str = "EdDSA",
    owner: str | None = None,
    audience: str | None = None,
    key_id: str | None = None,
    now: float | None = None,
    grant_id: str | None = None,
) -> str:
    """A compact JWS for one grant, signed with ``private_key`` (PEM); prefixed
    ``<source>:`` when ``source`` is given, ready for the ``Fencing-Token`` header."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}")
    body = claims(
        issuer=issuer,
        job=job,
        generation=generation,
        ttl_seconds=ttl_seconds,
        now=now,
        owner=owner,
        audience=audience,
        grant_id=grant_id,
    )
    headers = {"kid": key_id} if key_id is not None else None
    token = jwt.encode(body, private_key, algorithm=algorithm, headers=headers)
    return f"{source}:{token}" if source else token
