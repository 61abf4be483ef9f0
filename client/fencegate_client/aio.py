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
from collections.abc import Generator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Unpack

from ._needs import needs

try:
    import aiohttp
    from multidict import CIMultiDict, CIMultiDictProxy
except ModuleNotFoundError as error:  # a base dependency of fencegate-client
    needs(error, __name__, "aiohttp", install="fencegate-client")
    raise

from . import core
from . import errors as exc
from . import protocol as p
from .core import T
from .protocol import FencedResponse


@dataclass(eq=False, kw_only=True)
class Lease(core.LeaseBase):
    """A lease this worker holds. Use it as an async context manager to keep it renewed
    (and to make it the current lease of the block, the one ``fencegate_client.httpx``
    fences with when it is given none)."""

    client: LeaseClient
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    _renewer: asyncio.Task[None] | None = None

    @property
    def http(self) -> FencedSession:
        """Writes through the gateway, fenced by this lease."""
        return FencedSession(self)

    async def renew(self, ttl: float | None = None) -> None:
        await self.client._drive(self._renewal(ttl))

    async def complete(self, result: Any = None) -> dict[str, Any]:
        return await self._end(p.complete_call(self.token, result))

    async def fail(self, error: str | None = None, retry_in: float = 0) -> dict[str, Any]:
        return await self._end(p.fail_call(self.token, error, retry_in))

    async def release(self) -> dict[str, Any]:
        return await self._end(p.release_call(self.token))

    async def _end(self, call: p.Call) -> dict[str, Any]:
        doc = await self.client._drive(self._ending(call))
        if asyncio.current_task() is not self._renewer:
            await self.stop_renewing()
        return doc

    # -- renewal in a task ----------------------------------------------------------------

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
                self._renewal_failed(error)
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
        self._enter_block()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave_block()
        await self.stop_renewing()
        call = self._exit_call(error, interrupt=asyncio.CancelledError)
        if call is not None:
            with contextlib.suppress(exc.LeaseLost, aiohttp.ClientError, TimeoutError):
                await self._end(call)


class FencedSession:
    """HTTP through the gateway with this lease's ``Fencing-Token`` and a key: ``step``,
    ``key``, ``json``, ``data``, ``headers``, ``timeout`` as ``core.write`` says."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease

    async def request(
        self, method: str, path: str, **options: Unpack[core.WriteOptions]
    ) -> FencedResponse:
        """Send ``method path`` (``/{upstream}/...``) through the gateway (``core.write``)."""
        return await self.lease.client._drive(core.write(self.lease, method, path, **options))

    async def post(self, path: str, **options: Unpack[core.WriteOptions]) -> FencedResponse:
        return await self.request("POST", path, **options)

    async def put(self, path: str, **options: Unpack[core.WriteOptions]) -> FencedResponse:
        return await self.request("PUT", path, **options)

    async def patch(self, path: str, **options: Unpack[core.WriteOptions]) -> FencedResponse:
        return await self.request("PATCH", path, **options)

    async def delete(self, path: str, **options: Unpack[core.WriteOptions]) -> FencedResponse:
        return await self.request("DELETE", path, **options)


class _Grant(core.GrantBase[Lease]):
    """``await client.claim(...)`` gives the lease (or None); ``async with`` also keeps
    it renewed and ends it on the way out."""

    _client: LeaseClient

    def __await__(self) -> Generator[Any, None, Lease | None]:
        return self._client._drive(self._granting()).__await__()

    async def __aenter__(self) -> Lease | None:
        self._lease = await self
        if self._lease is not None:
            await self._lease.__aenter__()
        return self._lease

    async def __aexit__(self, *exc_info: Any) -> None:
        if self._lease is not None:
            await self._lease.__aexit__(*exc_info)


class LeaseClient(core.ClientBase[_Grant]):
    """The lease API (control listener) and, with ``gateway_url``, fenced writes.

    ``session`` is the ``aiohttp.ClientSession`` both go through (its own unless given);
    ``gateway_url``, ``token``, ``timeout``, ``retry_wait`` as ``core.ClientBase`` says."""

    def __init__(
        self,
        control_url: str,
        *,
        session: aiohttp.ClientSession | None = None,
        **options: Unpack[core.ClientOptions],
    ) -> None:
        super().__init__(control_url, **options)
        self._own_session = session is None
        self._session = session

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

    async def _drive(self, flow: core.Flow[T]) -> T:
        """Run an operation of ``core``, its requests sent with the session."""
        run = core.Run(flow)
        while (request := run.request) is not None:
            run.answer(await self._exchange(request))
        return run.result

    async def _exchange(self, request: core.Request) -> core.Answer:
        async with self.session.request(
            request.method,
            request.url,
            json=request.json,
            data=request.data,
            headers=request.headers,
            timeout=aiohttp.ClientTimeout(total=request.timeout),
        ) as resp:
            body = await resp.read()
            # names stay case-insensitive
            return core.Answer(resp.status, CIMultiDictProxy(CIMultiDict(resp.headers)), body)

    def _grant(self, call: p.Call) -> _Grant:
        return _Grant(self, call, Lease)

    # -- the lease API -----------------------------------------------------------------

    async def enqueue(self, **job: Unpack[core.NewJob]) -> dict[str, Any]:
        """A new job (``queue``, ``job_id``, ``payload``, ``max_attempts``, all optional)."""
        return await self._drive(self._document(p.enqueue_call(**job)))

    async def get_job(self, job_id: str) -> dict[str, Any]:
        return await self._drive(self._document(p.get_job_call(job_id)))
