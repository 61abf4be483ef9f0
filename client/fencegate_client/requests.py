"""Fencing for ``requests``: a transport adapter, mounted on the gateway's URL, that
fences every request sent through it.

.. code-block:: python

    import requests
    from fencegate_client.requests import fence_session

    http = fence_session(requests.Session(), gateway_url="http://127.0.0.1:8080")
    with client.claim("payments", owner="worker-1") as lease:   # fencegate_client.sync
        with lease.step("charge"):
            http.post("http://127.0.0.1:8080/payments/charges", json={"amount": 500})

The adapter is mounted for the gateway's URL only, so requests elsewhere never carry the
token (a credential); it checks the URL again before adding it. A request gets the
lease's ``Fencing-Token`` and an ``Idempotency-Key``: the request's own if it has one,
else the key of the current ``lease.step(name)`` block. The lease is the adapter's own
(``lease=``), else the current one: the lease whose ``with`` block is running. A refusal
of the gateway that says the lease is gone (``stale-generation``, ``lease-expired``,
``lease-ended``) marks the lease lost and raises its ``LeaseLost`` error; so does a write
on a lease already known to be gone, without sending it. Needs the ``requests`` extra.
"""

from __future__ import annotations

from typing import Any

from ._needs import needs

try:
    import requests
    from requests.adapters import HTTPAdapter
except ModuleNotFoundError as error:
    needs(error, __name__, "requests", install="'fencegate-client[requests]'")
    raise

from .protocol import IDEMPOTENCY_KEY, LeaseState, fence_for, may_report_loss, to_gateway


class FencedAdapter(HTTPAdapter):
    """An ``HTTPAdapter`` that fences what it sends to the gateway (see the module)."""

    def __init__(
        self, *, gateway_url: str | None = None, lease: LeaseState | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.gateway_url = gateway_url.rstrip("/") if gateway_url else None
        self.lease = lease

    def send(
        self, request: requests.PreparedRequest, *args: Any, **kwargs: Any
    ) -> requests.Response:
        lease = fence_for(self.lease)
        gateway_url = self.gateway_url or (lease.gateway_url if lease is not None else None)
        if lease is None or request.url is None:
            return super().send(request, *args, **kwargs)
        if gateway_url is None:
            raise ValueError("FencedAdapter(gateway_url=...) is needed: the lease has none")
        if not to_gateway(request.url, gateway_url):
            return super().send(request, *args, **kwargs)
        request.headers.update(lease.fencing_headers(has_key=IDEMPOTENCY_KEY in request.headers))
        response = super().send(request, *args, **kwargs)
        content_type = response.headers.get("Content-Type", "")
        if may_report_loss(response.status_code, content_type):
            try:
                lease.settle(response.status_code, content_type, response.content)
            except BaseException:
                response.close()
                raise
        return response


def fence_session(
    session: requests.Session,
    *,
    gateway_url: str,
    lease: LeaseState | None = None,
    **adapter_args: Any,
) -> requests.Session:
    """Mount a ``FencedAdapter`` on ``session`` for ``gateway_url``; the session."""
    base = gateway_url.rstrip("/") + "/"
    session.mount(base, FencedAdapter(gateway_url=gateway_url, lease=lease, **adapter_args))
    return session
