"""The idempotency key a forwarded write holds (``forwarding.ClaimedKey``): how the
exchange ended becomes the key's record in the store (settled, released, or held as an
unknown outcome with the request kept for the resolver's re-send), and duplicates that
wait on this replica are woken."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from gateway.fencing import fence
from gateway.fencing.fence import RecordState
from gateway.proxy.request import Incoming, Progress
from gateway.proxy.resolve import kept_request
from gateway.records.store import GatewayStore, KeptRequest
from gateway.upstream import s3


class HeldKey:
    """The key a forwarded write holds (``forwarding.ClaimedKey``), bound to the store:
    ids taken when the forward begins."""

    __slots__ = (
        "_attempt",
        "_incoming",
        "_job_id",
        "_key",
        "_max_replay_body_bytes",
        "_progress",
        "_release",
        "_settled",
        "_store",
    )

    def __init__(
        self,
        store: GatewayStore,
        incoming: Incoming,
        progress: Progress,
        *,
        release: Callable[[], Awaitable[None]],
        settled: Callable[[str, str], None],
        max_replay_body_bytes: int,
    ) -> None:
        presented = progress.admission.presented if progress.admission else None
        assert progress.claim is not None
        self._store, self._incoming, self._progress = store, incoming, progress
        self._release, self._settled = release, settled
        self._max_replay_body_bytes = max_replay_body_bytes
        self._job_id = presented.job_id if presented else ""
        self._key = incoming.key or ""
        self._attempt = progress.claim.attempt

    async def release(self) -> None:
        await self._release()

    async def settle(
        self,
        state: RecordState,
        *,
        status: int | None,
        headers: list[tuple[str, str]] | None,
        body: bytes | None,
        note: str | None,
    ) -> None:
        kept = self._kept() if state is RecordState.UNKNOWN else None
        if kept is not None:
            await self._store.hold_for_resolution(
                self._job_id,
                self._key,
                self._attempt,
                status=status,
                headers=headers,
                body=body,
                note=note,
                request=kept,
            )
        else:
            await self._store.settle(
                self._job_id,
                self._key,
                self._attempt,
                state=state,
                status=status,
                headers=headers,
                body=body,
                note=note,
            )
        self._settled(self._job_id, self._key)

    def _kept(self) -> KeptRequest | None:
        """The request to keep for a re-send by the gateway: only for an upstream that
        resolves unknown outcomes, a write with a key, and a body within
        ``gateway.max_replay_body_bytes`` (a larger one goes to the operator)."""
        incoming, progress = self._incoming, self._progress
        upstream = incoming.upstream
        if (
            upstream is None
            or upstream.unknown_outcome != "resolve"
            or fence.is_anonymous(self._key)
            or progress.forwarded is None
            or progress.body is None
        ):
            return None
        if upstream.signing is not None and not s3.is_object_write(
            incoming.request.method, incoming.rest, incoming.query
        ):
            return None  # S3: only an object write can be checked by its metadata
        with progress.body.getbuffer() as view:
            size = view.nbytes
        if size > self._max_replay_body_bytes:
            return None
        return kept_request(progress.forwarded, upstream, incoming.query, progress.body.getvalue())
