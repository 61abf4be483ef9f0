"""Fencing for ``httpx``: transports (sync and async) that wrap another transport and
fence every request that goes to the gateway.

.. code-block:: python

    import httpx
    from fencegate_client.httpx import FencedTransport

    http = httpx.Client(transport=FencedTransport(gateway_url="http://127.0.0.1:8080"))
    with client.claim("payments", owner="worker-1") as lease:   # sync or asyncio client
        with lease.step("charge"):
            http.post("http://127.0.0.1:8080/payments/charges", json={"amount": 500})

A request to the gateway (same scheme, host and port, a path under ``gateway_url``) gets
the lease's ``Fencing-Token`` and an ``Idempotency-Key``: the request's own if it has one,
else the key of the step named by ``extensions={"fencegate_step": name}``, else of the
current ``lease.step(name)`` block. Requests elsewhere pass through untouched (the token
is a credential). The lease is the transport's own (``lease=``), else the current one:
the lease whose ``with`` / ``async with`` block is running. A refusal of the gateway that
says the lease is gone (``stale-generation``, ``lease-expired``, ``lease-ended``) marks
the lease lost and raises its ``LeaseLost`` error; so does a write on a lease already
known to be gone, without sending it. Needs the ``httpx`` extra.
"""

from __future__ import annotations

from types import TracebackType

from ._needs import needs

try:
    import httpx
except ModuleNotFoundError as error:
    needs(error, __name__, "httpx", install="'fencegate-client[httpx]'")
    raise

from .errors import LeaseLost
from .protocol import IDEMPOTENCY_KEY, LeaseState, fence_for, may_report_loss, to_gateway

STEP_EXTENSION = "fencegate_step"
"""The request extension that names the request's step."""


class _Fence:
    def __init__(self, lease: LeaseState | None, gateway_url: str | None) -> None:
        self._lease = lease
        self._gateway_url = gateway_url.rstrip("/") if gateway_url else None

    def _fence(self, request: httpx.Request) -> LeaseState | None:
        """Add the fencing headers when the request goes to the gateway; the lease that
        fenced it (None: not fenced)."""
        lease = fence_for(self._lease)
        if lease is None:
            return None
        gateway_url = self._gateway_url or lease.gateway_url
        if gateway_url is None:
            raise ValueError("FencedTransport(gateway_url=...) is needed: the lease has none")
        if not to_gateway(str(request.url), gateway_url):
            return None
        step = request.extensions.get(STEP_EXTENSION)
        request.headers.update(
            lease.fencing_headers(
                has_key=IDEMPOTENCY_KEY in request.headers,
                step=str(step) if step is not None else None,
            )
        )
        return lease


def _content_type(response: httpx.Response) -> str:
    return str(response.headers.get("Content-Type", ""))


class FencedTransport(_Fence, httpx.BaseTransport):
    """A sync transport that fences requests to the gateway (see the module)."""

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        *,
        gateway_url: str | None = None,
        lease: LeaseState | None = None,
    ) -> None:
        super().__init__(lease, gateway_url)
        self._transport = transport if transport is not None else httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        lease = self._fence(request)
        response = self._transport.handle_request(request)
        if lease is not None and may_report_loss(response.status_code, _content_type(response)):
            try:
                lease.settle(response.status_code, _content_type(response), response.read())
            except LeaseLost:
                response.close()
                raise
        return response

    def close(self) -> None:
        self._transport.close()

    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        self._transport.__exit__(exc_type, exc_value, traceback)


class AsyncFencedTransport(_Fence, httpx.AsyncBaseTransport):
    """An async transport that fences requests to the gateway (see the module)."""

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        gateway_url: str | None = None,
        lease: LeaseState | None = None,
    ) -> None:
        super().__init__(lease, gateway_url)
        self._transport = transport if transport is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        lease = self._fence(request)
        response = await self._transport.handle_async_request(request)
        if lease is not None and may_report_loss(response.status_code, _content_type(response)):
            body = await response.aread()
            try:
                lease.settle(response.status_code, _content_type(response), body)
            except LeaseLost:
                await response.aclose()
                raise
        return response

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        await self._transport.__aexit__(exc_type, exc_value, traceback)
