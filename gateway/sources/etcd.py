"""``etcd``: the key of a lock held through etcd's lock API (``<name>/<lease id>``); the
job is the lock's name, the generation the key's create revision. Read through etcd's JSON
gateway (``/v3/kv/range``, ``/v3/lease/timetolive``), a held lock briefly cached
(``cache_seconds``).

A secured etcd: ``https://`` endpoints verified with ``ca_file`` (and the gateway's
client certificate, ``cert_file`` and ``key_file``); with ``username`` and ``password``,
a token from ``/v3/auth/authenticate`` goes in every call's ``Authorization`` header, and
is asked for again when etcd says it is invalid (simple tokens expire unused)."""

from __future__ import annotations

import asyncio
import base64
import re
import ssl
import time
from collections import OrderedDict
from typing import Any

import aiohttp

from gateway.config import EtcdSourceSettings
from gateway.fencing.fence import Lost
from gateway.sources.base import ExternalLease, log, namespaced
from gateway.sources.secured import SourceRefused, client_context, tls_advice
from lease_core import exceptions as lease_exc

COUNTER_LOST = (
    "etcd says this key holds the lock under this revision, but a higher generation of "
    "this job has already written, or another lock key already wrote under this "
    "revision: etcd's revisions went backwards (its data directory was lost or restored "
    "from an older snapshot). Restore etcd from its newest snapshot, or move the job to "
    "a new lock name."
)

# etcd's gRPC codes, as its JSON gateway answers them: a token it does not know (expired
# unused, or issued before a restart), and an authenticate with a bad name or password.
INVALID_TOKEN = "invalid auth token"
AUTH_FAILED = "authentication failed"


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
        # etcd's auth token (``username``): asked for at start and when etcd says it is
        # invalid; one request asks for it at a time.
        self._token: str | None = None
        self._authenticating = asyncio.Lock()

    def well_formed(self, token: str) -> bool:
        name, slash, lease = token.rpartition("/")
        return (
            bool(name and slash)
            and len(token) <= 1024
            and re.fullmatch(r"[0-9a-f]{1,16}", lease) is not None
            and token.isprintable()
        )

    async def start(self) -> None:
        """The session (its TLS context from the settings); then, when etcd answers, its
        verdict on the certificate and the credentials: a refusal stops ``serve``
        (``SourceRefused``), an etcd that does not answer yet does not."""
        settings = self.settings
        timeout = aiohttp.ClientTimeout(total=settings.timeout_seconds)
        context: ssl.SSLContext | bool = True
        if any(e.startswith("https://") for e in settings.endpoints):
            context = client_context(settings.ca_file, settings.cert_file, settings.key_file)
        self.session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(ssl=context)
        )
        try:
            if settings.username is not None:
                await self._authenticate()
            else:
                await self._post("/v3/maintenance/status", {}, None)
        except _Refused as error:  # etcd answered, and refused the gateway's settings
            await self.close()
            raise SourceRefused(error.message) from None
        except lease_exc.StoreUnavailable:
            pass  # said in the log; checks answer 503 until etcd does
        except SourceRefused:
            await self.close()
            raise

    async def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            await session.close()

    async def check(self, token: str) -> ExternalLease | None:
        name, _, lease_hex = token.rpartition("/")
        job_id = namespaced(self.name, name)
        if job_id is None:
            return None
        cached = self._held.get(token)
        if cached is not None and cached[0] > time.monotonic():
            return self._current(job_id, cached[1], token, lease_hex)
        prefix = (name + "/").encode("utf-8")
        holder = await self._range(prefix, _prefix_end(prefix), first_created=True)
        if holder is not None and holder[0] == token:
            revision = holder[1]
            if self.settings.cache_seconds > 0:
                self._remember(token, revision)
            return self._current(job_id, revision, token, lease_hex)
        self._held.pop(token, None)
        mine = await self._range(token.encode("utf-8"), None, first_created=False)
        if mine is not None:
            # The key is there but is not the lowest: it waits for the lock, never held it.
            return None
        if holder is not None:  # released or expired, and somebody newer holds it now
            return ExternalLease(
                self.name, job_id, None, lease_hex, Lost.NEWER_HOLDER, newer=holder[1]
            )
        alive = await self._lease_alive(int(lease_hex, 16))
        refused = Lost.RELEASED if alive else Lost.EXPIRED
        return ExternalLease(self.name, job_id, None, lease_hex, refused)

    def _current(self, job_id: str, revision: int, token: str, lease_hex: str) -> ExternalLease:
        """The lock held by this key: its holder is the key (the lock's name and the
        holder's etcd lease)."""
        return ExternalLease(
            self.name,
            job_id,
            revision,
            lease_hex,
            holder=token,
            counter_lost=COUNTER_LOST,
            reissued=COUNTER_LOST,
        )

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
        (503, as for the database: nothing is forwarded on a lease nobody can confirm).
        A token etcd calls invalid is renewed once and the call made again. A refusal
        (a certificate, the credentials) after the start is a 503 too, and logged."""
        try:
            return await self._call_authenticated(path, body)
        except SourceRefused as error:
            log.warning("%s", error)
            raise lease_exc.StoreUnavailable(
                f"lease source {self.name}: etcd refused the gateway's settings"
            ) from error

    async def _call_authenticated(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        token = self._token
        try:
            return await self._post(path, body, token)
        except _InvalidToken:
            if self.settings.username is None:
                raise lease_exc.StoreUnavailable(
                    f"lease source {self.name}: etcd asks for a token: set username and password"
                ) from None
        async with self._authenticating:
            if self._token == token:  # nobody renewed it meanwhile
                log.info("%s: etcd's auth token is no longer valid; authenticating", self.name)
                await self._authenticate()
        try:
            return await self._post(path, body, self._token)
        except _InvalidToken:
            log.warning("%s: etcd refused a token it had just issued", self.name)
            raise lease_exc.StoreUnavailable(
                f"lease source {self.name}: etcd refused its token"
            ) from None

    async def _authenticate(self) -> None:
        """A new token for ``username``; a bad name or password: ``SourceRefused``."""
        settings = self.settings
        assert settings.username is not None and settings.password is not None
        body = {"name": settings.username, "password": settings.password.get_secret_value()}
        try:
            answer = await self._post("/v3/auth/authenticate", body, None)
        except _Refused as error:
            if AUTH_FAILED in error.message:
                raise SourceRefused(
                    f"lease source {self.name}: etcd refused username {settings.username!r} "
                    "with this password (authentication failed, invalid user ID or password)"
                ) from None
            if "authentication is not enabled" in error.message:
                raise SourceRefused(
                    f"lease source {self.name}: etcd's authentication is not enabled; "
                    "remove username and password, or run etcdctl auth enable"
                ) from None
            raise
        token = answer.get("token")
        if not isinstance(token, str) or not token:
            raise lease_exc.StoreUnavailable(f"lease source {self.name}: etcd gave no token")
        self._token = token

    async def _post(self, path: str, body: dict[str, Any], token: str | None) -> dict[str, Any]:
        if self.session is None:
            raise lease_exc.StoreUnavailable(f"lease source {self.name}: not started")
        headers = {"Authorization": token} if token else None
        last: Exception | None = None
        for endpoint in self.settings.endpoints:
            try:
                async with self.session.post(
                    endpoint + path, json=body, headers=headers
                ) as response:
                    if response.status == 200:
                        answer: dict[str, Any] = await response.json(content_type=None)
                        return answer
                    message = (await response.text())[:500]
                    if response.status == 401 and INVALID_TOKEN in message:
                        raise _InvalidToken
                    if response.status in (400, 401, 403):
                        refusal = self._refusal(path, response.status, message)
                        log.warning("%s", refusal)
                        raise _Refused(refusal)
                    raise aiohttp.ClientResponseError(
                        response.request_info, (), status=response.status
                    )
            except aiohttp.ClientConnectorCertificateError as error:
                raise SourceRefused(tls_advice(self.name, error.certificate_error)) from error
            except aiohttp.ClientConnectorSSLError as error:
                raise SourceRefused(tls_advice(self.name, error)) from error
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                if "SSL" in str(error) or "certificate" in str(error):
                    # refused in the handshake's last flight (TLS 1.3: after the client
                    # thinks it done), such as etcd's request for a client certificate
                    raise SourceRefused(tls_advice(self.name, error)) from error
                last = error
                continue
        log.warning("%s: no etcd endpoint answered: %s", self.name, last)
        raise lease_exc.StoreUnavailable(f"lease source {self.name}: etcd did not answer")

    def _refusal(self, path: str, status: int, message: str) -> str:
        if "CommonName of client" in message:
            return (
                f"lease source {self.name}: etcd's JSON gateway refuses a client certificate "
                "with a CommonName while its authentication is on; give the gateway a "
                "certificate without one (its name in subjectAltName), or none"
            )
        if "user name is empty" in message:
            return (
                f"lease source {self.name}: etcd refused {path}: its authentication is on "
                "(user name is empty); set username and password"
            )
        if "permission denied" in message:
            who = self.settings.username
            advice = (
                f"user {who!r} needs read permission on the locks' keys"
                if who
                else "its authentication is on: set username and password"
            )
            return f"lease source {self.name}: etcd denied {path} ({advice})"
        return f"lease source {self.name}: etcd refused {path} ({status}: {message})"


class _InvalidToken(Exception):
    """etcd's answer to a token it does not know (expired, or issued before a restart)."""


class _Refused(lease_exc.StoreUnavailable):
    """etcd answered and refused: permission, credentials, a certificate's name."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
