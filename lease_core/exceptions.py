"""Errors of the lease service.

Every error carries the HTTP ``status`` and the stable ``reason`` that the problem
middleware (``lease_core.problems``) puts into an RFC 9457 document. A class's
docstring is its default message.
"""

from __future__ import annotations

from typing import Any, ClassVar


class LeaseError(Exception):
    """The lease service refused the request."""

    status: ClassVar[int] = 500
    reason: ClassVar[str] = "internal-error"
    title: ClassVar[str] = "Internal error"
    headers: ClassVar[dict[str, str]] = {}

    def __init__(self, detail: str | None = None, **extra: Any) -> None:
        self.detail = detail or (self.__doc__ or "").strip()
        self.extra = {k: v for k, v in extra.items() if v is not None}
        super().__init__(self.detail)


class InvalidRequest(LeaseError):
    """The request is not valid."""

    status = 400
    reason = "invalid-request"
    title = "Invalid request"


class Unauthorized(LeaseError):
    """A valid bearer token is required."""

    status = 401
    reason = "unauthorized"
    title = "Unauthorized"
    headers = {"WWW-Authenticate": 'Bearer realm="fencegate"'}  # noqa: RUF012


class Forbidden(LeaseError):
    """This token may not use this path."""

    status = 403
    reason = "forbidden"
    title = "Forbidden"


class InvalidLeaseToken(LeaseError):
    """The lease token is malformed or unknown."""

    status = 403
    reason = "invalid-lease-token"
    title = "Invalid lease token"


class JobNotFound(LeaseError):
    """No job with this id."""

    status = 404
    reason = "job-not-found"
    title = "Job not found"


class NotFound(LeaseError):
    """Nothing lives at this path."""

    status = 404
    reason = "not-found"
    title = "Not found"


class MethodNotAllowed(LeaseError):
    """This method is not allowed on this path."""

    status = 405
    reason = "method-not-allowed"
    title = "Method not allowed"


class JobExists(LeaseError):
    """A job with this id exists already."""

    status = 409
    reason = "job-exists"
    title = "Job exists"


class LeaseHeld(LeaseError):
    """The job is held by another current lease."""

    status = 409
    reason = "lease-held"
    title = "Lease held"


class JobFinished(LeaseError):
    """The job has completed or failed; it cannot be leased again."""

    status = 409
    reason = "job-finished"
    title = "Job finished"


class LeaseLost(LeaseError):
    """The lease is no longer current."""

    status = 409
    title = "Lease lost"


class LeaseExpired(LeaseLost):
    """The lease has expired."""

    reason = "lease-expired"
    title = "Lease expired"


class StaleGeneration(LeaseLost):
    """A newer generation of this job exists."""

    reason = "stale-generation"
    title = "Stale generation"


class LeaseEnded(LeaseLost):
    """The lease was completed, failed or released."""

    reason = "lease-ended"
    title = "Lease ended"


class StoreUnavailable(LeaseError):
    """The database is not reachable; try again shortly."""

    status = 503
    reason = "store-unavailable"
    title = "Store unavailable"


LOST_BY_REASON: dict[str, type[LeaseLost]] = {
    cls.reason: cls for cls in (LeaseExpired, StaleGeneration, LeaseEnded)
}
