"""The asyncio worker client: leases that renew themselves, writes fenced through the
gateway (an aiohttp session).

.. code-block:: python

    async with LeaseClient("http://127.0.0.1:8081", gateway_url="http://127.0.0.1:8080",
                           token="worker-token...") as client:
        async with client.claim("payments", owner="worker-1", ttl=30) as lease:
            if lease is None:
                return  # nothing to do
            answer = await lease.http.post("/payments/charges", step="charge",
                                           json={"amount": 500})
            await lease.complete({"charge": answer.json()})

The lease renews itself at a third of its TTL. When it is lost (taken over after
expiry, or refused on renew) ``lease.lost`` is set and the next write raises the
matching ``LeaseLost`` error (``StaleGeneration``, ``LeaseExpired``, ``LeaseEnded``)
instead of being sent. Leaving the ``async with`` block without completing releases the
job (or fails it, when the block raised).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

from . import errors as exc
from .errors import RemoteError, error_from_problem
from .protocol import FENCING_TOKEN, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, FencedResponse, step_key
from .reasons import Reason

log = logging.getLogger("fencegate.client")


@dataclass(eq=False)
class Lease:
    """A lease this worker holds. Use it as an async context manager to keep it renewed."""

    client: LeaseClient
    job_id: str
    generation: int
    owner: str
    token: str
    ttl_seconds: float
    payload: Any
    expires_at: str
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    lost_reason: exc.LeaseError | None = None
    ended: bool = False
    _valid_until: float = 0.0  # time.monotonic() after which we must assume it lapsed
    _renewer: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self._valid_until = time.monotonic() + self.ttl_seconds

    @property
    def held(self) -> bool:
        """Still ours, as far as this worker can tell (not lost, ended or lapsed)."""
        return not self.lost.is_set() and not self.ended and time.monotonic() < self._valid_until

    def check(self) -> None:
        """Raise the reason the lease is gone, if it is."""
        if self.lost_reason is not None:
            raise self.lost_reason
        if self.ended:
            raise exc.LeaseEnded("this worker already completed, failed or released the lease")
        if time.monotonic() >= self._valid_until:
            self._lose(exc.LeaseExpired("the lease lapsed before it could be renewed"))
            raise exc.LeaseExpired("the lease lapsed before it could be renewed")

    def _lose(self, error: exc.LeaseError) -> None:
        if self.lost_reason is None:
            self.lost_reason = error
            log.warning(
                "lease on job %s (generation %d) lost: %s",
                self.job_id,
                self.generation,
                error.reason,
            )
        self.lost.set()

    @property
    def http(self) -> FencedSession:
        """Writes through the gateway, fenced by this lease."""
        return FencedSession(self)

    # -- renewal ----------------------------------------------------------------------

    async def renew(self, ttl: float | None = None) -> None:
        self.check()
        started = time.monotonic()
        body: dict[str, Any] = {"lease_token": self.token}
        if ttl is not None:
            body["ttl_seconds"] = ttl
        try:
            doc = await self.client._call("POST", "/v1/leases/renew", body)
        except exc.LeaseLost as error:
            self._lose(error)
            raise
        self.ttl_seconds = float(doc["ttl_seconds"])
        self.expires_at = doc["expires_at"]
        # Judged from when we asked, not when the answer came: never later than the server.
        self._valid_until = started + self.ttl_seconds

    async def _renew_forever(self) -> None:
        while self.held:
            await asyncio.sleep(max(self.ttl_seconds / 3, 0.05))
            if not self.held:
                break  # lapsed while we waited (a stalled loop): say so below
            try:
                await self.renew()
            except exc.LeaseLost:
                return
            except (aiohttp.ClientError, TimeoutError, exc.LeaseError) as error:
                log.warning("renewing lease on job %s failed (%s); retrying", self.job_id, error)
        if not self.ended and not self.lost.is_set():
            self._lose(exc.LeaseExpired("the lease lapsed before it could be renewed"))

    def start_renewing(self) -> None:
        if self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(
                self._renew_forever(), name=f"fencegate:renew:{self.job_id}"
            )

    async def stop_renewing(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None

    async def __aenter__(self) -> Lease:
        self.start_renewing()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop_renewing()
        if self.ended or self.lost.is_set():
            return
        with contextlib.suppress(exc.LeaseLost, aiohttp.ClientError, TimeoutError):
            if error is not None and not isinstance(error, asyncio.CancelledError):
                await self.fail(error=f"{type(error).__name__}: {error}"[:10_000])
            else:
                await self.release()

    # -- ending ------------------------------------------------------------------------

    async def _end(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.check()
        try:
            doc: dict[str, Any] = await self.client._call(
                "POST", path, {"lease_token": self.token, **body}
            )
        except exc.LeaseLost as error:
            self._lose(error)
            raise
        self.ended = True
        if asyncio.current_task() is not self._renewer:
            await self.stop_renewing()
        return doc

    async def complete(self, result: Any = None) -> dict[str, Any]:
        return await self._end("/v1/leases/complete", {"result": result})

    async def fail(self, error: str | None = None, retry_in: float = 0) -> dict[str, Any]:
        return await self._end("/v1/leases/fail", {"error": error, "retry_in_seconds": retry_in})

    async def release(self) -> dict[str, Any]:
        return await self._end("/v1/leases/release", {})


class FencedSession:
    """HTTP through the gateway with this lease's ``Fencing-Token`` and a key."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease

    async def request(
        self,
        method: str,
        path: str,
        *,
        step: str | None = None,
        key: str | None = None,
        json: Any = None,
        data: bytes | str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> FencedResponse:
        """Send ``method path`` (``/{upstream}/...``) through the gateway.

        The key is ``key``, else derived from ``step`` (see ``step_key``), else none (for
        upstreams that do not require one). Raises the lease's ``LeaseLost`` error instead
        of sending when the lease is gone, and marks it lost when the gateway says so.
        """
        lease = self.lease
        lease.check()
        if lease.client.gateway_url is None:
            raise ValueError("LeaseClient(gateway_url=...) is needed to write through the gateway")
        send: dict[str, str] = dict(headers or {})
        send[FENCING_TOKEN] = lease.token
        idempotency_key = key or (step_key(lease.job_id, step) if step is not None else None)
        if idempotency_key is not None:
            send[IDEMPOTENCY_KEY] = idempotency_key
        session = lease.client.session
        async with session.request(
            method,
            lease.client.gateway_url + path,
            json=json,
            data=data,
            headers=send,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            body = await resp.read()
            answer = FencedResponse(
                resp.status,
                CIMultiDictProxy(CIMultiDict(resp.headers)),  # names stay case-insensitive
                body,
                resp.headers.get(IDEMPOTENT_REPLAYED) == "true",
            )
        error = answer.lease_lost()
        if error is not None:
            lease._lose(error)
            raise error
        return answer

    async def post(self, path: str, **kwargs: Any) -> FencedResponse:
        return await self.request("POST", path, **kwargs)

    async def put(self, path: str, **kwargs: Any) -> FencedResponse:
        return await self.request("PUT", path, **kwargs)

    async def patch(self, path: str, **kwargs: Any) -> FencedResponse:
        return await self.request("PATCH", path, **kwargs)

    async def delete(self, path: str, **kwargs: Any) -> FencedResponse:
        return await self.request("DELETE", path, **kwargs)


class _Grant:
    """``await client.claim(...)`` gives the lease (or None); ``async with`` also keeps
    it renewed and ends it on the way out."""

    def __init__(self, client: LeaseClient, method: str, path: str, body: dict[str, Any]) -> None:
        self._client, self._method, self._path, self._body = client, method, path, body
        self._lease: Lease | None = None

    async def _grant(self) -> Lease | None:
        asked = time.monotonic()
        doc = await self._client._call(self._method, self._path, self._body)
        if doc is None:
            return None
        lease = Lease(
            client=self._client,
            job_id=doc["job_id"],
            generation=doc["generation"],
            owner=doc["owner"],
            token=doc["lease_token"],
            ttl_seconds=float(doc["ttl_seconds"]),
            payload=doc.get("payload"),
            expires_at=doc["expires_at"],
        )
        # Judged from when we asked, as on renew: never later than the server's expiry.
        lease._valid_until = asked + lease.ttl_seconds
        return lease

    def __await__(self) -> Generator[Any, None, Lease | None]:
        return self._grant().__await__()

    async def __aenter__(self) -> Lease | None:
        self._lease = await self._grant()
        if self._lease is not None:
            await self._lease.__aenter__()
        return self._lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._lease is not None:
            await self._lease.__aexit__(exc_type, error, tb)


class LeaseClient:
    """The lease API (control listener) and, with ``gateway_url``, fenced writes."""

    def __init__(
        self,
        control_url: str,
        *,
        gateway_url: str | None = None,
        token: str | None = None,
        session: aiohttp.ClientSession | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.control_url = control_url.rstrip("/")
        self.gateway_url = gateway_url.rstrip("/") if gateway_url else None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._own_session = session is None
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> LeaseClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        async with self.session.request(
            method,
            self.control_url + path,
            json=body,
            headers=self._headers,
            timeout=self._timeout,
        ) as resp:
            if resp.status == 204:
                return None
            raw = await resp.read()
            try:
                doc = json.loads(raw) if raw else None
            except ValueError:
                doc = None
                if resp.status < 400:
                    raise RemoteError(
                        resp.status,
                        Reason.INVALID_RESPONSE,
                        f"not JSON from {path}: {raw[:200]!r}",
                        {},
                    ) from None
            if resp.status >= 400:
                if not isinstance(doc, dict):
                    doc = {"detail": f"HTTP {resp.status} from {path}: {raw[:200]!r}"}
                raise error_from_problem(resp.status, doc)
            return doc

    # -- the lease API -----------------------------------------------------------------

    async def enqueue(
        self,
        *,
        queue: str | None = None,
        job_id: str | None = None,
        payload: Any = None,
        max_attempts: int | None = None,
    ) -> dict[str, Any]:
        body = {
            k: v
            for k, v in {
                "queue": queue,
                "job_id": job_id,
                "payload": payload,
                "max_attempts": max_attempts,
            }.items()
            if v is not None
        }
        doc: dict[str, Any] = await self._call("POST", "/v1/jobs", body)
        return doc

    def claim(self, queue: str, *, owner: str, ttl: float | None = None) -> _Grant:
        """The next claimable job of ``queue`` (None when there is none)."""
        body: dict[str, Any] = {"owner": owner}
        if ttl is not None:
            body["ttl_seconds"] = ttl
        return _Grant(self, "POST", f"/v1/queues/{queue}/claim", body)

    def acquire(
        self,
        job_id: str,
        *,
        owner: str,
        ttl: float | None = None,
        queue: str | None = None,
        payload: Any = None,
    ) -> _Grant:
        """A named job's lease, creating the job if absent (raises ``LeaseHeld`` when
        another current lease holds it)."""
        body: dict[str, Any] = {"owner": owner}
        for name, value in (("ttl_seconds", ttl), ("queue", queue), ("payload", payload)):
            if value is not None:
                body[name] = value
        return _Grant(self, "PUT", f"/v1/jobs/{job_id}/lease", body)

    async def get_job(self, job_id: str) -> dict[str, Any]:
        doc: dict[str, Any] = await self._call("GET", f"/v1/jobs/{job_id}")
        return doc
