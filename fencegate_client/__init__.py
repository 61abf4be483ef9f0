"""Fencegate's worker client: take a lease on a job, keep it renewed, and send the job's
writes through the gateway fenced by it.

.. code-block:: python

    from fencegate_client import LeaseClient, LeaseLost

It is apart from the lease service (``lease_core``) and the gateway: nothing here imports
them, so a worker needs only this package and aiohttp. ``aio`` is the asyncio client;
``protocol`` (header names, step keys, the gateway's answer), ``reasons`` (every problem
reason, with its status and title) and ``errors`` (one class per lease-API reason) do no
I/O and are shared by every client.
"""

from __future__ import annotations

from .aio import FencedSession, Lease, LeaseClient
from .errors import (
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
    RemoteError,
    StaleGeneration,
    StoreUnavailable,
    Unauthorized,
    error_from_problem,
)
from .protocol import FencedResponse, step_key

__all__ = [
    "FencedResponse",
    "FencedSession",
    "Forbidden",
    "InvalidLeaseToken",
    "InvalidRequest",
    "JobExists",
    "JobFinished",
    "JobNotFound",
    "Lease",
    "LeaseClient",
    "LeaseEnded",
    "LeaseError",
    "LeaseExpired",
    "LeaseHeld",
    "LeaseLost",
    "RemoteError",
    "StaleGeneration",
    "StoreUnavailable",
    "Unauthorized",
    "error_from_problem",
    "step_key",
]
