"""Fencegate's worker client: take a lease on a job, keep it renewed, and send the job's
writes through the gateway fenced by it.

.. code-block:: python

    from fencegate_client import LeaseClient, LeaseLost         # asyncio (aiohttp)
    from fencegate_client.sync import LeaseClient              # threads (httpx)

It is a distribution of its own (``fencegate-client``) and apart from the lease service
(``lease_core``) and the gateway: nothing here imports them, and installing it brings no
server dependency. ``aio`` is the asyncio client (aiohttp), ``sync`` the synchronous one
(httpx): both only drive the operations of ``core`` (flows without I/O, written once);
``httpx``, ``requests`` and ``boto3`` fence the HTTP clients a worker already uses;
``celery`` fences Celery tasks (``FencedTask``).
``protocol`` (header names, step keys, the lease API's calls, a lease's state, the
gateway's answer), ``reasons`` (every problem reason, with its status, title and ``Sent``) and
``errors`` (one class per lease-API reason) do no I/O and are shared by every client.

Names are loaded on first use (module ``__getattr__``): importing this package loads no
HTTP library, so a worker loads only the one its client uses (the extras
``fencegate-client[requests]``, ``[boto3]``, ``[celery]`` bring the integrations'; the
base install brings aiohttp and httpx for ``aio`` and ``sync``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .aio import FencedSession, Lease, LeaseClient
    from .errors import (
        Forbidden,
        GenerationReissued,
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
    from .protocol import FencedResponse, current_lease, step_key
    from .reasons import Sent, sent_of

_HOME = {
    "FencedSession": "aio",
    "Lease": "aio",
    "LeaseClient": "aio",
    "FencedResponse": "protocol",
    "current_lease": "protocol",
    "step_key": "protocol",
    "Sent": "reasons",
    "sent_of": "reasons",
    **dict.fromkeys(
        (
            "Forbidden",
            "GenerationReissued",
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
            "RemoteError",
            "StaleGeneration",
            "StoreUnavailable",
            "Unauthorized",
            "error_from_problem",
        ),
        "errors",
    ),
}

__all__ = [
    "FencedResponse",
    "FencedSession",
    "Forbidden",
    "GenerationReissued",
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
    "Sent",
    "StaleGeneration",
    "StoreUnavailable",
    "Unauthorized",
    "current_lease",
    "error_from_problem",
    "sent_of",
    "step_key",
]


def __getattr__(name: str) -> Any:
    """Load the module that defines ``name`` on first use (PEP 562)."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
