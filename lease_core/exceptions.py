"""Errors of the lease service.

Every error carries the HTTP ``status`` and the stable ``reason`` that the problem
middleware (``lease_core.problems``) puts into an RFC 9457 document. A class's
docstring is its default message.

The classes are defined once, in ``fencegate_client.errors``: the worker client raises
the same ones from the problems it receives, so ``except lease_core.exceptions.LeaseLost``
and ``except fencegate_client.LeaseLost`` catch the same errors, and the client needs
nothing of the service to have them.
"""

from __future__ import annotations

from fencegate_client.errors import (
    LOST_BY_REASON,
    Forbidden,
    InvalidLeaseToken,
    InvalidRequest,
    JobExists,
    JobFinished,
    JobNotFound,
    LeaseEnded,
    LeaseError,
    LeaseExpired,
    LeaseHeld,
    LeaseLost,
    MethodNotAllowed,
    NotFound,
    StaleGeneration,
    StoreUnavailable,
    Unauthorized,
)

__all__ = [
    "LOST_BY_REASON",
    "Forbidden",
    "InvalidLeaseToken",
    "InvalidRequest",
    "JobExists",
    "JobFinished",
    "JobNotFound",
    "LeaseEnded",
    "LeaseError",
    "LeaseExpired",
    "LeaseHeld",
    "LeaseLost",
    "MethodNotAllowed",
    "NotFound",
    "StaleGeneration",
    "StoreUnavailable",
    "Unauthorized",
]
