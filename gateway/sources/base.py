"""What every lease source shares: the facts it gives (``ExternalLease``), the protocol it
follows (``Source``) and the job ids it makes (``namespaced``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from gateway.fencing.fence import Lost

log = logging.getLogger("fencegate.sources")

JOB_ID_MAX = 200  # the database's column
MAX_TOKEN = 8192


@dataclass(frozen=True, slots=True)
class ExternalLease:
    """What a source says of the lease behind a token."""

    source: str
    job_id: str  # namespaced: "<source>/<job>"
    generation: int | None  # None: not known (an etcd key that is gone)
    owner: str
    # None: the lease may write, as far as the source can tell; else what it found out
    # (a newer holder, released, expired), a fact the decision turns into a reason
    # (``fence.external_reason``).
    refused: Lost | None = None
    # Judged by the admission with the database's clock (signed tokens); None: the source
    # judged the expiry itself.
    expires_at: float | None = None
    newer: int | None = None  # a newer holder's generation that the source saw
    # The detail of a refusal when the source says the lease is current but the job's
    # fence is above its generation: the source's counter went backwards (redis, dynamodb).
    behind_fence: str | None = None


class Source(Protocol):
    name: str

    def well_formed(self, token: str) -> bool:
        """The token's shape (no I/O): a malformed one is refused before any lookup."""
        ...

    async def check(self, token: str) -> ExternalLease | None:
        """The lease behind a well-formed token; None: not a token of this source
        (forged, of another issuer, malformed inside)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


def namespaced(source: str, job: str) -> str | None:
    job_id = f"{source}/{job}"
    if not job or len(job_id) > JOB_ID_MAX or any(ord(c) < 0x20 or c == "\x7f" for c in job):
        return None
    return job_id
