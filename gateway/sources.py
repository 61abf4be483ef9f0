"""Lease sources: fencing tokens of leases that other services hand out.

A token names its source with a prefix, ``<source>:<the source's token>``; the gateway's
own ``fgl_`` tokens have none. A source's adapter turns its token into facts for the
decision table, and writes nothing: the lease is current, ended or expired, or the token
is not one (``None``); with the job (namespaced ``<source>/<job>``, so no two sources,
nor ``lease_core``, whose ids never hold ``/``, can share a job) and the generation.
The fence is still the database's: the admission (``admit_external`` in the catalogue)
raises the job's fence only to a generation that is not below it.

- ``jwt``: a compact JWS (RFC 7515/7519) whose claims carry the job (``sub``), the
  generation (``gen``), ``exp`` and ``iss``; verified with PyJWT against the configured
  public keys, algorithms and issuer. The expiry is handed to the admission, which
  judges it with the database's clock (the clock that judges the gateway's own leases).
- ``etcd``: the key of a lock held through etcd's lock API (``<name>/<lease id>``); the
  job is the lock's name, the generation the key's create revision. Read through etcd's
  JSON gateway (``/v3/kv/range``, ``/v3/lease/timetolive``), a held lock briefly
  cached (``cache_seconds``).
"""

from __future__ import annotations

import base64
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import jwt
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from lease_core import exceptions as lease_exc

from .config import EtcdSourceSettings, JwtSourceSettings
from .fence import Reason

log = logging.getLogger("fencegate.sources")

JOB_ID_MAX = 200  # the database's column
_JWS = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
MAX_TOKEN = 8192


@dataclass(frozen=True, slots=True)
class ExternalLease:
    """What a source says of the lease behind a token."""

    source: str
    job_id: str  # namespaced: "<source>/<job>"
    generation: int | None  # None: not known (an etcd key that is gone)
    owner: str
    # None: the lease may write, as far as the source can tell; else why not
    # (stale-generation, lease-ended, lease-expired).
    refused: Reason | None = None
    # Judged by the admission with the database's clock (signed tokens); None: the source
    # judged the expiry itself.
    expires_at: float | None = None
    newer: int | None = None  # a newer holder's generation that the source saw


class Source(Protocol):
    name: str

    def well_formed(self, token: str) -> bool:
        """The token's shape (no I/O): a malformed one is refused before any lookup."""
        ...

    async def check(self, token: str) -> ExternalLease | None:
        """The lease behind a well-formed token; None: not a token of this source
        (forged, of another issuer, malformed inside)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


def namespaced(source: str, job: str) -> str | None:
    job_id = f"{source}/{job}"
    if not job or len(job_id) > JOB_ID_MAX or any(ord(c) < 0x20 or c == "\x7f" for c in job):
        return None
    return job_id


# -- signed tokens ------------------------------------------------------------------------


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
        owner = claims.get("owner")
        return ExternalLease(
            source=self.name,
            job_id=job_id,
            generation=claims["gen"],
            owner=owner[:200] if isinstance(owner, str) else "",
            expires_at=float(claims["exp"]) + self.settings.leeway_seconds,
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
            if type(gen) is not int or gen < 0 or gen >= 2**63:
                return None
            if isinstance(exp, bool) or not isinstance(exp, int | float):
                return None
            if not isinstance(sub, str):
                return None
            return claims
        return None


# -- etcd -----------------------------------------------------------------------------------


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def _prefix_end(prefix: bytes) -> bytes:
    """etcd's range end for every key that starts with ``prefix``."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


class EtcdSource:
    """Locks of etcd's lock API. The lock key is ``<name>/<lease id in hex>``; the lock
    is held by the key under ``<name>/`` with the lowest create revision."""

    CACHE_SIZE = 10_000

    def __init__(self, settings: EtcdSourceSettings) -> None:
        self.name = settings.name
        self.settings = settings
        self.session: aiohttp.ClientSession | None = None
        # key -> (believed until, monotonic; create revision): locks read as held.
        self._held: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def well_formed(self, token: str) -> bool:
        name, slash, lease = token.rpartition("/")
        return (
            bool(name and slash)
            and len(token) <= 1024
            and re.fullmatch(r"[0-9a-f]{1,16}", lease) is not None
            and token.isprintable()
        )

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_seconds)
        self.session = aiohttp.ClientSession(timeout=timeout)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def check(self, token: str) -> ExternalLease | None:
        name, _, lease_hex = token.rpartition("/")
        job_id = namespaced(self.name, name)
        if job_id is None:
            return None
        cached = self._held.get(token)
        if cached is not None and cached[0] > time.monotonic():
            return ExternalLease(self.name, job_id, cached[1], lease_hex)
        prefix = (name + "/").encode("utf-8")
        holder = await self._range(prefix, _prefix_end(prefix), first_created=True)
        if holder is not None and holder[0] == token:
            revision = holder[1]
            if self.settings.cache_seconds > 0:
                self._remember(token, revision)
            return ExternalLease(self.name, job_id, revision, lease_hex)
        self._held.pop(token, None)
        mine = await self._range(token.encode("utf-8"), None, first_created=False)
        if mine is not None:
            # The key is there but is not the lowest: it waits for the lock, never held it.
            return None
        if holder is not None:  # released or expired, and somebody newer holds it now
            return ExternalLease(
                self.name, job_id, None, lease_hex, Reason.STALE_GENERATION, newer=holder[1]
            )
        alive = await self._lease_alive(int(lease_hex, 16))
        refused = Reason.LEASE_ENDED if alive else Reason.LEASE_EXPIRED
        return ExternalLease(self.name, job_id, None, lease_hex, refused)

    def _remember(self, token: str, revision: int) -> None:
        self._held[token] = (time.monotonic() + self.settings.cache_seconds, revision)
        self._held.move_to_end(token)
        while len(self._held) > self.CACHE_SIZE:
            self._held.popitem(last=False)

    async def _range(
        self, key: bytes, range_end: bytes | None, *, first_created: bool
    ) -> tuple[str, int] | None:
        """(key, create revision) of the key, or of the oldest key in the range."""
        body: dict[str, Any] = {"key": _b64(key), "keys_only": True}
        if range_end is not None:
            body["range_end"] = _b64(range_end)
        if first_created:
            body.update(limit=1, sort_order="ASCEND", sort_target="CREATE")
        answer = await self._call("/v3/kv/range", body)
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        return base64.b64decode(kv["key"]).decode("utf-8", "replace"), int(kv["create_revision"])

    async def _lease_alive(self, lease_id: int) -> bool:
        answer = await self._call("/v3/lease/timetolive", {"ID": str(lease_id)})
        return int(answer.get("TTL", -1)) > 0

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call to the first endpoint that answers; none: the store is unavailable
        (503, as for the database: nothing is forwarded on a lease nobody can confirm)."""
        assert self.session is not None, "the source was not started"
        last: Exception | None = None
        for endpoint in self.settings.endpoints:
            try:
                async with self.session.post(endpoint + path, json=body) as response:
                    if response.status != 200:
                        raise aiohttp.ClientResponseError(
                            response.request_info, (), status=response.status
                        )
                    answer: dict[str, Any] = await response.json(content_type=None)
                    return answer
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                last = error
                continue
        log.warning("%s: no etcd endpoint answered: %s", self.name, last)
        raise lease_exc.StoreUnavailable(f"lease source {self.name}: etcd did not answer")


def build(settings: list[JwtSourceSettings | EtcdSourceSettings]) -> dict[str, Source]:
    sources: dict[str, Source] = {}
    for source in settings:
        sources[source.name] = (
            JwtSource(source) if isinstance(source, JwtSourceSettings) else EtcdSource(source)
        )
    return sources


def split_token(token: str, sources: Mapping[str, Source]) -> tuple[Source, str] | None:
    """The source a token names and its own token, when it names one."""
    name, colon, rest = token.partition(":")
    if not colon:
        return None
    source = sources.get(name)
    return None if source is None else (source, rest)
