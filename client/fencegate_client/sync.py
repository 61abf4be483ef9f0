"""The synchronous worker client: leases that renew themselves in a thread, writes
fenced through the gateway (httpx). The asyncio client (``aio``) without
``async``/``await``: both only drive the operations of ``core``, where they are written
once.

.. code-block:: python

    from fencegate_client.sync import LeaseClient

    with LeaseClient("http://127.0.0.1:8081", gateway_url="http://127.0.0.1:8080",
                     token="worker-token...") as client:
        with client.claim("payments", owner="worker-1", ttl=30) as lease:
            if lease is None:
                return  # nothing to do
            answer = lease.http.post("/payments/charges", step="charge",
                                     json={"amount": 500})
            lease.complete({"charge": answer.json()})

``client.claim(...)`` and ``client.acquire(...)`` are lazy: ``with`` takes the lease,
renews it in a background thread at a third of its TTL, and ends it on the way out
(released, or failed with the error when the block raised); ``.take()`` only takes it.
When the lease is lost (taken over after expiry, or refused on renew) ``lease.lost``
(a ``threading.Event``) is set and the next write raises the matching ``LeaseLost``
error instead of being sent. httpx is in fencegate-client's base install.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Unpack

from ._needs import needs

try:
    import httpx
except ModuleNotFoundError as error:
    needs(error, __name__, "httpx", install="'fencegate-client[httpx]'")
    raise

from . import core
from . import errors as exc
from . import protocol as p
from .core import T
from .protocol import FencedResponse


@dataclass(eq=False, kw_only=True)
class Lease(core.LeaseBase):
    """A lease this worker holds. Use it as a context manager to keep it renewed (and to
    make it the current lease of the block, the one the transports fence with when they
    are given none)."""

    client: LeaseClient
    lost: threading.Event = field(default_factory=threading.Event)
    _renewer: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def http(self) -> FencedSession:
        """Writes through the gateway, fenced by this lease."""
        return FencedSession(self)

    def renew(self, ttl: float | None = None) -> None:
        self.client._drive(self._renewal(ttl))

    def complete(self, result: Any = None) -> dict[str, Any]:
        return self._end(p.complete_call(self.token, result))

    def fail(self, error: str | None = None, retry_in: float = 0) -> dict[str, Any]:
        return self._end(p.fail_call(self.token, error, retry_in))

    def release(self) -> dict[str, Any]:
        return self._end(p.release_call(self.token))

    def _end(self, call: p.Call) -> dict[str, Any]:
        doc = self.client._drive(self._ending(call))
        self.stop_renewing()
        return doc

    # -- renewal in a thread --------------------------------------------------------------

    def _renew_forever(self) -> None:
        while self.held:
            if self._stop.wait(p.renew_interval(self.ttl_seconds)):
                return  # stopped: the lease is ended or its block left
            if not self.held:
                break  # lapsed while we waited (a stalled process): say so below
            try:
                self.renew()
            except exc.LeaseLost:
                return
            except (httpx.HTTPError, exc.LeaseError) as error:
                self._renewal_failed(error)
        if self.lapsed:
            self._lapse()

    def start_renewing(self) -> None:
        if self._renewer is None:
            self._stop.clear()
            self._renewer = threading.Thread(
                target=self._renew_forever, name=f"fencegate:renew:{self.job_id}", daemon=True
            )
            self._renewer.start()

    def stop_renewing(self) -> None:
        """Stop the renewing thread; waits for a renewal under way (at most the client's
        timeout)."""
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            self._stop.set()
            if renewer is not threading.current_thread():
                renewer.join()

    def __enter__(self) -> Lease:
        self.start_renewing()
        self._enter_block()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave_block()
        self.stop_renewing()
        call = self._exit_call(error, interrupt=(KeyboardInterrupt, SystemExit))
        if call is not None:
            with contextlib.suppress(exc.LeaseLost, httpx.HTTPError):
                self._end(call)


class FencedSession:
    """HTTP through the gateway with this lease's ``Fencing-Token`` and a key: ``step``,
    ``key``, ``json``, ``data``, ``headers``, ``timeout`` as ``core.write`` says."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease

    def request(
        self, method: str, path: str, **options: Unpack[core.WriteOptions]
    ) -> FencedResponse:
        """Send ``method path`` (``/{upstream}/...``) through the gateway (``core.write``)."""
        return self.lease.client._drive(core.write(self.lease, method, path, **options))

    def post(self, path: str, **options: Unpack[core.WriteOptions]) -> FencedResponse:
        return self.request("POST", path, **options)

    def put(self, path: str, **options: Unpack[core.WriteOptions]) -> FencedResponse:
        return self.request("PUT", path, **options)

    def patch(self, path: str, **options: Unpack[core.WriteOptions]) -> FencedResponse:
        return self.request("PATCH", path, **options)

    def delete(self, path: str, **options: Unpack[core.WriteOptions]) -> FencedResponse:
        return self.request("DELETE", path, **options)


class _Grant(core.GrantBase[Lease]):
    """``with client.claim(...) as lease`` takes the lease (or None), keeps it renewed
    and ends it on the way out; ``client.claim(...).take()`` only takes it."""

    _client: LeaseClient

    def take(self) -> Lease | None:
        """The lease (None when claim finds nothing), not renewed: the sync spelling of
        the asyncio client's ``await client.claim(...)``."""
        return self._client._drive(self._granting())

    def __enter__(self) -> Lease | None:
        self._lease = self.take()
        if self._lease is not None:
            self._lease.__enter__()
        return self._lease

    def __exit__(self, *exc_info: Any) -> None:
        if self._lease is not None:
            self._lease.__exit__(*exc_info)


class LeaseClient(core.ClientBase[_Grant]):
    """The lease API (control listener) and, with ``gateway_url``, fenced writes.

    ``http`` is the ``httpx.Client`` both go through (its own unless given; it must be
    safe to share with the renewing threads, which an ``httpx.Client`` is);
    ``gateway_url``, ``token``, ``timeout``, ``retry_wait`` as ``core.ClientBase`` says."""

    def __init__(
        self,
        control_url: str,
        *,
        http: httpx.Client | None = None,
        **options: Unpack[core.ClientOptions],
    ) -> None:
        super().__init__(control_url, **options)
        self._own_http = http is None
        self.http = http if http is not None else httpx.Client()

    def close(self) -> None:
        if self._own_http:
            self.http.close()

    def __enter__(self) -> LeaseClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _drive(self, flow: core.Flow[T]) -> T:
        """Run an operation of ``core``, its requests sent with ``http``."""
        run = core.Run(flow)
        while (request := run.request) is not None:
            run.answer(self._exchange(request))
        return run.result

    def _exchange(self, request: core.Request) -> core.Answer:
        resp = self.http.request(
            request.method,
            request.url,
            json=request.json,
            content=request.data,
            headers=request.headers,
            timeout=request.timeout,
        )
        return core.Answer(resp.status_code, resp.headers, resp.content)

    def _grant(self, call: p.Call) -> _Grant:
        return _Grant(self, call, Lease)

    # -- the lease API -----------------------------------------------------------------

    def enqueue(self, **job: Unpack[core.NewJob]) -> dict[str, Any]:
        """A new job (``queue``, ``job_id``, ``payload``, ``max_attempts``, all optional)."""
        return self._drive(self._document(p.enqueue_call(**job)))

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._drive(self._document(p.get_job_call(job_id)))
