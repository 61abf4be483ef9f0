"""The worker client's old address, kept so that existing imports keep working.

The client is the package ``fencegate_client`` now, apart from the lease service
(``from fencegate_client import LeaseClient``); the names below are the very same
objects.
"""

from __future__ import annotations

from fencegate_client.aio import FencedSession, Lease, LeaseClient
from fencegate_client.errors import RemoteError, error_from_problem
from fencegate_client.protocol import FencedResponse, step_key

__all__ = [
    "FencedResponse",
    "FencedSession",
    "Lease",
    "LeaseClient",
    "RemoteError",
    "error_from_problem",
    "step_key",
]
