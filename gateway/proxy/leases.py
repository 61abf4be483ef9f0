"""The lease behind a request's token, read or admitted: the gateway's own lease (by its
token's hash) or another source's (asked of that source first, ``bounded``). I/O only:
what is found is judged by the request's state machine."""

from __future__ import annotations

from gateway.fencing.fence import Admission
from gateway.proxy.incoming import Incoming
from gateway.records.store import GatewayStore, WriteRequest
from gateway.sources import ExternalLease, bounded


async def lease_now(store: GatewayStore, incoming: Incoming) -> Admission | None:
    """Read-only: the lease behind the token as the database (and, for a lease of
    another source, that source) sees it now; None: no such token."""
    if incoming.source is not None:
        external = await source_says(incoming)
        return None if external is None else await store.check_external(external)
    if incoming.token_hash is None:
        return None
    return await store.check_lease(incoming.token_hash)


async def source_says(incoming: Incoming) -> ExternalLease | None:
    """What the token's source says of its lease now (no write), ``bounded``."""
    assert incoming.source is not None and incoming.source_token is not None
    return bounded(await incoming.source.check(incoming.source_token))


async def admit(store: GatewayStore, incoming: Incoming, write: WriteRequest) -> Admission | None:
    """The admission's one transaction (``GatewayStore.admit``, ``admit_external``). A
    lease of another source that its source refuses has nothing to admit: a read of its
    fence explains the refusal. None: no such token."""
    if incoming.source is None:
        return await store.admit(write)
    external = await source_says(incoming)
    if external is None:
        return None
    if external.refused is not None:
        return await store.check_external(external)
    return await store.admit_external(external, write)
