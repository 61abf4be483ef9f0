"""The synchronous worker client: leases that renew themselves in a thread, writes
fenced through the gateway (httpx). The same shape as the asyncio client (``aio``),
without ``async``/``await``; both follow the rules of ``protocol``.

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
error instead of being sent. Needs the ``httpx`` extra (``pip install fencegate[httpx]``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from contextvars import Token
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ._needs import needs

try:
    import httpx
except ModuleNotFoundError as error:
    needs(error, __name__, "httpx", install="'fencegate[httpx]'")
    raise

from . import errors as exc
from . import protocol as p
from .protocol import FencedResponse, LeaseState
from .waits import DEFAULT_RETRY_WAIT, InProgressRetries

log = logging.getLogger("fencegate.client")


@dataclass(eq=False, kw_only=True)
class Lease(LeaseState):
    """A lease this worker holds. Use it as a context manager to keep it renewed (and to
    make it the current lease of the block, the one the transports fence with when they
    are given none)."""

    client: LeaseClient
    lost: threading.Event = field(default_factory=threading.Event)
    _renewer: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _entered: Token[LeaseState | None] | None = None

    @property
    def http(self) -> FencedSession:
        """Writes through the gateway, fenced by this lease."""
        return FencedSession(self)

    # -- renewal ----------------------------------------------------------------------

    def renew(self, ttl: float | None = None) -> None:
        self.check()
        started = time.monotonic()
        try:
            doc = self.client._call(p.renew_call(self.token, ttl))
        except exc.LeaseLost as error:
            self._lose(error)
            raise
        self._renewed(doc, started)

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
                log.warning("renewing lease on job %s failed (%s); retrying", self.job_id, error)
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
        self._entered = p._CURRENT.set(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._entered is not None:
            p._CURRENT.reset(self._entered)
            self._entered = None
        self.stop_renewing()
        if self.ended or self.lost.is_set():
            return
        with contextlib.suppress(exc.LeaseLost, httpx.HTTPError):
            if error is not None and not isinstance(error, KeyboardInterrupt | SystemExit):
                self.fail(error=p.exit_error_text(error))
            else:
                self.release()

    # -- ending ------------------------------------------------------------------------

    def _end(self, call: p.Call) -> dict[str, Any]:
        self.check()
        try:
            doc: dict[str, Any] = self.client._call(call)
        except exc.LeaseLost as error:
            self._lose(error)
            raise
        self.ended = True
        self.stop_renewing()
        return doc

    def complete(self, result: Any = None) -> dict[str, Any]:
        return self._end(p.complete_call(self.token, result))

    def fail(self, error: str | None = None, retry_in: float = 0) -> dict[str, Any]:
        return self._end(p.fail_call(self.token, error, retry_in))

    def release(self) -> dict[str, Any]:
        return self._end(p.release_call(self.token))


class FencedSession:
    """HTTP through the gateway with this lease's ``Fencing-Token`` and a key."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease

    def request(
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
        """Send ``method path`` (``/{upstream}/...``) through the gateway; the key, the
        lease's loss and the retry of ``request-in-progress`` as in
        ``fencegate_client.aio.FencedSession.request``."""
        retries = InProgressRetries(self.lease.client.retry_wait, timeout)
        answer = self._send(method, path, step, key, json, data, headers, timeout)
        while (again := retries.headers(answer, headers)) is not None:
            answer = self._send(method, path, step, key, json, data, again, timeout)
        return answer

    def _send(
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
        resp = lease.client.http.request(
            method, url, json=json, content=data, headers=send, timeout=timeout
        )
        return lease.answer(resp.status_code, resp.headers, resp.content)

    def post(self, path: str, **kwargs: Any) -> FencedResponse:
        return self.request("POST", path, **kwargs)

    def put(self, path: str, **kwargs: Any) -> FencedResponse:
        return self.request("PUT", path, **kwargs)

    def patch(self, path: str, **kwargs: Any) -> FencedResponse:
        return self.request("PATCH", path, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> FencedResponse:
        return self.request("DELETE", path, **kwargs)


class _Grant:
    """``with client.claim(...) as lease`` takes the lease (or None), keeps it renewed
    and ends it on the way out; ``client.claim(...).take()`` only takes it."""

    def __init__(self, client: LeaseClient, call: p.Call) -> None:
        self._client, self._call = client, call
        self._lease: Lease | None = None

    def take(self) -> Lease | None:
        """The lease (None when claim finds nothing), not renewed: the sync spelling of
        the asyncio client's ``await client.claim(...)``."""
        asked = time.monotonic()
        doc = self._client._call(self._call)
        if doc is None:
            return None
        lease = Lease(
            client=self._client, gateway_url=self._client.gateway_url, **Lease.grant_fields(doc)
        )
        lease._granted_at(asked)
        return lease

    def __enter__(self) -> Lease | None:
        self._lease = self.take()
        if self._lease is not None:
            self._lease.__enter__()
        return self._lease

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._lease is not None:
            self._lease.__exit__(exc_type, error, tb)


class LeaseClient:
    """The lease API (control listener) and, with ``gateway_url``, fenced writes.

    ``http`` is the ``httpx.Client`` both go through (its own unless given; it must be
    safe to share with the renewing threads, which an ``httpx.Client`` is).
    ``retry_wait``: a write answered ``request-in-progress`` is sent again with
    ``Prefer: wait=N`` for up to this many seconds in all (None or 0: not sent again)."""

    def __init__(
        self,
        control_url: str,
        *,
        gateway_url: str | None = None,
        token: str | None = None,
        http: httpx.Client | None = None,
        timeout: float = 10.0,
        retry_wait: float | None = DEFAULT_RETRY_WAIT,
    ) -> None:
        self.control_url = control_url.rstrip("/")
        self.gateway_url = gateway_url.rstrip("/") if gateway_url else None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._own_http = http is None
        self.http = http if http is not None else httpx.Client()
        self._timeout = timeout
        self.retry_wait = retry_wait

    def close(self) -> None:
        if self._own_http:
            self.http.close()

    def __enter__(self) -> LeaseClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(self, call: p.Call) -> Any:
        resp = self.http.request(
            call.method,
            self.control_url + call.path,
            json=call.body,
            headers=self._headers,
            timeout=self._timeout,
        )
        return p.control_answer(call, resp.status_code, resp.content)

    # -- the lease API -----------------------------------------------------------------

    def enqueue(
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
        doc: dict[str, Any] = self._call(call)
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

    def get_job(self, job_id: str) -> dict[str, Any]:
        doc: dict[str, Any] = self._call(p.get_job_call(job_id))
        return doc
