"""What every lease source shares: the facts it gives (``ExternalLease``), the protocol it
follows (``Source``) and the job ids it makes (``namespaced``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Protocol

from gateway.fencing.fence import GENERATION_MAX, Lost

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
    # Who holds the lock under this generation, as the source tells holders apart (a
    # Redis lock's value, a DynamoDB item's record version, an etcd lock key, a
    # ZooKeeper lock node and its session, a signed token's ``jti``). The admission binds
    # the generation to the first holder it admits and refuses any other
    # (``generation-reissued``).
    holder: str = ""
    # The detail of a refusal when the source says the lease is current but the job's
    # fence is above its generation: the source's counter went backwards, and what to
    # configure (the sources with a counter: redis, dynamodb, etcd).
    counter_lost: str | None = None
    # The detail of ``generation-reissued``: the source handed this generation to
    # another holder too, and what to configure.
    reissued: str | None = None
    # The detail of a refusal the source's own finding explains (``Lost.OUT_OF_RANGE``).
    detail: str | None = None


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


def bounded(lease: ExternalLease | None) -> ExternalLease | None:
    """The lease, refused at intake when its generation does not fit the database's
    integer (a counter raised by hand past 2^63 - 1): a clear refusal, never a write the
    database cannot store."""
    if lease is None:
        return None
    if lease.newer is not None and not 0 <= lease.newer <= GENERATION_MAX:
        lease = replace(lease, newer=None)  # a newer holder's, shown and audited: unknown
    if lease.generation is None or 0 <= lease.generation <= GENERATION_MAX:
        return lease
    return replace(
        lease,
        generation=None,
        refused=Lost.OUT_OF_RANGE,
        detail=(
            f"The lease source {lease.source!r} gave generation {lease.generation}, outside "
            f"0 to {GENERATION_MAX}, the range of the database's generation column (a "
            "signed 64-bit integer): no fence can hold it, and nothing was forwarded. The "
            "lock's counter was raised by hand: take a new lock name for this job."
        ),
    )


def namespaced(source: str, job: str) -> str | None:
    job_id = f"{source}/{job}"
    if not job or len(job_id) > JOB_ID_MAX or any(ord(c) < 0x20 or c == "\x7f" for c in job):
        return None
    return job_id
