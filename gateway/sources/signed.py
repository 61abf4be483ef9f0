"""``jwt``: a compact JWS (RFC 7515/7519) whose claims carry the job (``sub``), the
generation (``gen``), ``exp`` and ``iss``; verified with PyJWT against the configured
public keys, algorithms and issuer."""

from __future__ import annotations

import re
from typing import Any

import jwt
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from gateway.config import JwtSourceSettings
from gateway.sources.base import MAX_TOKEN, ExternalLease, log, namespaced

REISSUED = (
    "The issuer signed this generation for two grants (another jti was admitted under "
    "it): a generation must grow with every grant of a job, and each grant carries its "
    "own jti (the same jti when one grant's token is signed again)."
)

_JWS = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")


class JwtSource:
    def __init__(self, settings: JwtSourceSettings) -> None:
        self.name = settings.name
        self.settings = settings
        self.keys = [load_pem_public_key(k.encode("utf-8")) for k in settings.public_keys]

    def well_formed(self, token: str) -> bool:
        return len(token) <= MAX_TOKEN and _JWS.fullmatch(token) is not None

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def check(self, token: str) -> ExternalLease | None:
        claims = self.verify(token)
        if claims is None:
            return None
        job_id = namespaced(self.name, claims["sub"])
        if job_id is None:
            return None
        owner, grant = claims.get("owner"), claims.get("jti")
        return ExternalLease(
            source=self.name,
            job_id=job_id,
            generation=claims["gen"],
            owner=owner[:200] if isinstance(owner, str) else "",
            expires_at=float(claims["exp"]) + self.settings.leeway_seconds,
            # The grant (``jti``): two grants of one generation are two holders. A token
            # without one is told apart from no other.
            holder=grant if isinstance(grant, str) else "",
            reissued=REISSUED,
        )

    def verify(self, token: str) -> dict[str, Any] | None:
        """The claims of a token signed by one of the keys with an allowed algorithm,
        from the issuer, with ``sub``, ``gen`` and ``exp``; None otherwise. The expiry
        is not judged here (the admission judges it with the database's clock)."""
        options: Any = {
            "require": ["exp", "iss", "sub", "gen"],
            # Times are the database clock's to judge (exp, in the admission); "iat" and
            # "nbf" against this process's clock would only add a second clock.
            "verify_exp": False,
            "verify_iat": False,
            "verify_nbf": False,
            "verify_aud": self.settings.audience is not None,
        }
        for key in self.keys:
            try:
                claims: dict[str, Any] = jwt.decode(
                    token,
                    key,  # type: ignore[arg-type]
                    algorithms=list(self.settings.algorithms),
                    issuer=self.settings.issuer,
                    audience=self.settings.audience,
                    options=options,
                )
            except jwt.InvalidSignatureError:
                continue  # maybe another key's (a rotation)
            except (jwt.PyJWTError, ValueError, TypeError) as error:
                log.debug("%s: token refused: %s", self.name, error)
                return None
            gen, exp, sub = claims.get("gen"), claims.get("exp"), claims.get("sub")
            if type(gen) is not int or gen < 0:  # above the database's range: ``bounded``
                return None
            if isinstance(exp, bool) or not isinstance(exp, int | float):
                return None
            if not isinstance(sub, str):
                return None
            return claims
        return None
