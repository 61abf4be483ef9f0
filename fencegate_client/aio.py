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
import logging
import time
from collections.abc import Generator, Mapping
from contextvars import Token
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ._needs import needs

try:
    import aiohttp
    from multidict import CIMultiDict, CIMultiDictProxy
except ModuleNotFoundError as error:  # a dependency of fencegate; not of a client-only install
    needs(error, __name__, "aiohttp", install="aiohttp")
    raise

from . import errors as exc
from . import protocol as p
from .protocol import FencedResponse, LeaseState
from .waits import DEFAULT_RETRY_WAIT, InProgressRetries

log = logging.getLogger("fencegate.client")


@dataclass(eq=False, kw_only=True)
class Lease(LeaseState):
    """A lease this worker holds. Use it as an async context manager to keep it renewed
    (and to make it the current lease of the block, the one ``fencegate_client.httpx``
    fences with when it is given none)."""

    client: LeaseClient
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    _renewer: asyncio.Task[None] | None = None
    _entered: Token[LeaseState | None] | None = None

    @property
    def http(self) -> FencedSession:
        """Writes through the gateway, fenced by this lease."""
        return FencedSession(self)

    # -- renewal ----------------------------------------------------------------------

    async def renew(self, ttl: float | None = None) -> None:
        self.check()
        started = time.monotonic()
        try:
            doc = await self.client._call(p.renew_call(self.token, ttl))
        except exc.LeaseLost as error:
            self._lose(error)
            raise
        self._renewed(doc, started)

    async def _renew_forever(self) -> None:
        while self.held:
            await asyncio.sleep(p.renew_interval(self.ttl_seconds))
            if not self.held:
                break  # lapsed while we waited (a stalled loop): say so below
            try:
                await self.renew()
            except exc.LeaseLost:
                return
            except (aiohttp.ClientError, TimeoutError, exc.LeaseError) as error:
                log.warning("renewing lease on job %s failed (%s); retrying", self.job_id, error)
        if self.lapsed:
            self._lapse()

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
        self._entered = p._CURRENT.set(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._entered is not None:
            p._CURRENT.reset(self._entered)
            self._entered = None
        await self.stop_renewing()
        if self.ended or self.lost.is_set():
            return
        with contextlib.suppress(exc.LeaseLost, aiohttp.ClientError, TimeoutError):
            if error is not None and not isinstance(error, asyncio.CancelledError):
                await self.fail(error=p.exit_error_text(error))
            else:
                await self.release()

    # -- ending ------------------------------------------------------------------------

    async def _end(self, call: p.Call) -> dict[str, Any]:
        self.check()
        try:
            doc: dict[str, Any] = await self.client._call(call)
        except exc.LeaseLost as error:
            self._lose(error)
            raise
        self.ended = True
        if asyncio.current_task() is not self._renewer:
            await self.stop_renewing()
        return doc

    async def complete(self, result: Any = None) -> dict[str, Any]:
        return await self._end(p.complete_call(self.token, result))

    async def fail(self, error: str | None = None, retry_in: float = 0) -> dict[str, Any]:
        return await self._end(p.fail_call(self.token, error, retry_in))

    async def release(self) -> dict[str, Any]:
        return await self._end(p.release_call(self.token))


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

        The key is ``key``, else derived from ``step`` (see ``step_key``), else the
        current ``lease.step(...)`` block's, else none (for upstreams that do not require
        one). Raises the lease's ``LeaseLost`` error instead of sending when the lease is
        gone, and marks it lost when the gateway says so.

        Answered ``request-in-progress`` (the key's first attempt is still in flight), it
        is sent again with ``Prefer: wait=N``, so that the gateway answers with the first
        attempt's answer once it has settled (``fencegate_client.waits``; the client's
        ``retry_wait``).
        """
        retries = InProgressRetries(self.lease.client.retry_wait, timeout)
        answer = await self._send(method, path, step, key, json, data, headers, timeout)
        while (again := retries.headers(answer, headers)) is not None:
            answer = await self._send(method, path, step, key, json, data, again, timeout)
        return answer

    async def _send(
        self,
        method: str,
        path: str,
        step: str | None,
        key: str | None,
        json: Any,
        data: bytes | str | None,
        headers: Mapping[str, str] | None,
        timeout: float,
    ) -> FencedResponse:
        lease = self.lease
        send = lease.fence_headers(headers, step=step, key=key)
        url = lease.gateway_path_url(path)
        async with lease.client.session.request(
            method,
            url,
            json=json,
            data=data,
            headers=send,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            body = await resp.read()
            # names stay case-insensitive
            return lease.answer(resp.status, CIMultiDictProxy(CIMultiDict(resp.headers)), body)

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

    def __init__(self, client: LeaseClient, call: p.Call) -> None:
        self._client, self._call = client, call
        self._lease: Lease | None = None

    async def _grant(self) -> Lease | None:
        asked = time.monotonic()
        doc = await self._client._call(self._call)
        if doc is None:
            return None
        lease = Lease(
            client=self._client, gateway_url=self._client.gateway_url, **Lease.grant_fields(doc)
        )
        lease._granted_at(asked)
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
    """The lease API (control listener) and, with ``gateway_url``, fenced writes.

    ``retry_wait``: a write answered ``request-in-progress`` is sent again with
    ``Prefer: wait=N`` for up to this many seconds in all (None or 0: not sent again)."""

    def __init__(
        self,
        control_url: str,
        *,
        gateway_url: str | None = None,
        token: str | None = None,
        session: aiohttp.ClientSession | None = None,
        timeout: float = 10.0,
        retry_wait: float | None = DEFAULT_RETRY_WAIT,
    ) -> None:
        self.control_url = control_url.rstrip("/")
        self.gateway_url = gateway_url.rstrip("/") if gateway_url else None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._own_session = session is None
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self.retry_wait = retry_wait

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

    async def _call(self, call: p.Call) -> Any:
        async with self.session.request(
            call.method,
            self.control_url + call.path,
            json=call.body,
            headers=self._headers,
            timeout=self._timeout,
        ) as resp:
            return p.control_answer(call, resp.status, await resp.read())

    # -- the lease API -----------------------------------------------------------------

    async def enqueue(
        self,
        *,
        queue: str | None = None,
        job_id: str | None = None,
        payload: Any = None,
        max_attempts: int | None = None,
    ) -> dict[str, Any]:
        call = p.enqueue_call(
            queue=queue, job_id=job_id, payload=payload, max_attempts=max_attempts
        )
        doc: dict[str, Any] = await self._call(call)
        return doc

    def claim(self, queue: str, *, owner: str, ttl: float | None = None) -> _Grant:
        """The next claimable job of ``queue`` (None when there is none)."""
        return _Grant(self, p.claim_call(queue, owner=owner, ttl=ttl))

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
        return _Grant(
            self, p.acquire_call(job_id, owner=owner, ttl=ttl, queue=queue, payload=payload)
        )

    async def get_job(self, job_id: str) -> dict[str, Any]:
        doc: dict[str, Any] = await self._call(p.get_job_call(job_id))
        return doc
