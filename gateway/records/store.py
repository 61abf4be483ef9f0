"""The gateway's state changes: admit a write (lease check + fence + key claim in one
transaction), settle it, wait for older generations, resolve unknown outcomes. Each is
an operation of the catalogue (``lease_core/sql/<dialect>.sql``); this module names
their parameters and reads their answers.

Nothing authoritative lives in process memory: several replicas on one PostgreSQL
answer as one. The job row is locked (``FOR SHARE``) while a write is admitted, so a
reclaim cannot slip between the lease check and the fence update.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from gateway.fencing import fence
from gateway.fencing.fence import Admission, ClaimState, Presented, Reason, Record, RecordState
from gateway.records.schema import writing
from gateway.sources import ExternalLease
from lease_core import rules, tokens
from lease_core.backend import PURGE_BATCH
from lease_core.rules import State
from lease_core.store import LeaseStore


@dataclass(frozen=True, slots=True)
class WriteRequest:
    token_hash: str | None  # None: a lease of another source (``admit_external``)
    key: str
    fingerprint: str
    upstream: str
    method: str
    path: str
    deadline_in: float
    # The upstream's ``unknown_outcome`` is "retry": a record of this key whose outcome
    # is unknown is taken over in the admission itself, under the same lease check.
    retry: bool = False

    def params(self, attempt: str) -> dict[str, Any]:
        """The write's parameters of ``admit`` and ``admit_external``, for ``attempt``."""
        return {
            "key": self.key,
            "fingerprint": self.fingerprint,
            "attempt": attempt,
            "upstream": self.upstream,
            "method": self.method,
            "path": self.path,
            "deadline_in": self.deadline_in,
            "retry": self.retry,
        }


@dataclass(frozen=True, slots=True)
class KeptRequest:
    """A forwarded request as kept for a re-send: its query, its headers as forwarded
    without the upstream's configured ones (secrets, set again at the re-send), its body."""

    query: str
    headers: list[tuple[str, str]]
    body: bytes


@dataclass(frozen=True, slots=True)
class Resolution:
    """An unknown outcome claimed for a re-send by the gateway (``gateway.proxy.resolve``)."""

    job_id: str
    key: str
    attempt: str  # the claim's: the record is ours under it
    generation: int
    fingerprint: str
    method: str
    path: str
    request: KeptRequest
    attempts: int  # re-sends so far, this one included


class GatewayStore:
    """The gateway's operations of the catalogue (``lease_core/sql``), run by the lease
    store's backend; the listings read through SQLAlchemy."""

    def __init__(self, leases_store: LeaseStore) -> None:
        self.backend = leases_store.backend

    # -- reading the lease --------------------------------------------------------

    async def check_lease(self, token_hash: str) -> Admission:
        """Read-only: may this token write now? (For refusals before the body is read.)"""
        row = await self.backend.run("lease_of_token", token_hash=token_hash)
        assert row is not None
        presented, highest = _presented(row)
        return Admission(
            now=float(row["now"]), presented=presented, lease=_verdict(row), highest=highest
        )

    async def claim(self, job_id: str, key: str, attempt: str) -> ClaimState:
        """Read-only, right before a claimed write is sent: the job's fence, the claim's
        deadline while the record is still our attempt, in flight, and whether an older
        generation's write is in flight now."""
        row = await self.backend.run("claim_state", job_id=job_id, key=key, attempt=attempt)
        assert row is not None
        deadline = row["deadline"]
        return ClaimState(
            now=float(row["now"]),
            fence=row["fence_generation"],
            deadline=None if deadline is None else float(deadline),
            older_in_flight=bool(row["older_in_flight"]),
        )

    # -- admitting a write ----------------------------------------------------------

    async def admit(self, write: WriteRequest) -> Admission:
        """In one transaction (operation ``admit``): check the lease, raise the job's
        fence to this generation, claim the key (or read its record, and take it over
        when its outcome is unknown and the upstream's policy is retry), and see whether
        an older generation's write is still in flight. The SQL decides, and says why it
        refused (``refusal``); this reads its answer."""
        attempt = tokens.new_serial_id()
        row = await self.backend.run("admit", token_hash=write.token_hash, **write.params(attempt))
        assert row is not None
        now = float(row["now"])
        presented, highest = _presented(row)
        lease = _verdict(row)
        if lease is not None:  # why nothing was claimed
            return Admission(now=now, presented=presented, lease=lease, highest=highest)
        assert presented is not None
        return await self._claimed(row, presented, highest, attempt, write.key)

    async def _claimed(
        self, row: Any, presented: Presented, highest: int | None, attempt: str, key: str
    ) -> Admission:
        """An admission's answer when the lease was current: the key claimed, taken
        over, or its record (the same columns in ``admit`` and ``admit_external``)."""
        assert presented.generation is not None
        now = float(row["now"])
        claimed, taken = bool(row["claimed"]), bool(row["taken"])
        record = None  # the key's record as it was before this admission
        if row["r_attempt"] is not None:
            record = _record(
                {
                    **row,
                    "state": row["r_state"],
                    "generation": row["r_generation"],
                    "attempt": row["r_attempt"],
                }
            )
        elif not claimed:  # claimed concurrently, after this statement's snapshot was taken
            found = await self.backend.run("record", job_id=presented.job_id, key=key)
            record = None if found is None else _record(found)
        ours = claimed or taken
        return Admission(
            now=now,
            presented=presented,
            lease=None,
            highest=max(presented.generation, highest or 0),
            claimed=claimed,
            attempt=attempt if ours else None,
            record=record,
            older_in_flight=ours and bool(row["older_in_flight"]),
            back_to=record if taken else None,
        )

    # -- leases of other sources (gateway.sources) -----------------------------------

    async def check_external(self, lease: ExternalLease) -> Admission:
        """Read-only: may this lease of another source write now? The SQL's verdict
        (operation ``external_lease``) on its job's fence, the source's own finding
        (``fence.external_reason``) and the lease's expiry."""
        row = await self.backend.run(
            "external_lease",
            job_id=lease.job_id,
            generation=lease.generation,
            expires_at=lease.expires_at,
            lost=_value(fence.external_reason(lease.refused)),
        )
        assert row is not None
        refused, fenced = _verdict(row), row["fence_generation"]
        return Admission(
            now=float(row["now"]),
            presented=_external(lease, refused),
            lease=refused,
            highest=_highest(lease, fenced),
        )

    async def admit_external(self, lease: ExternalLease, write: WriteRequest) -> Admission:
        """Operation ``admit_external``: the job's fence raised to the lease's generation
        unless it is above it (or the token's expiry has passed, by the database's
        clock), then the key, as ``admit`` does. The SQL decides, and says why it
        refused (``refusal``); this reads its answer."""
        assert lease.refused is None and lease.generation is not None
        attempt = tokens.new_serial_id()
        holder = holder_digest(lease)
        row = await self.backend.run(
            "admit_external",
            job_id=lease.job_id,
            generation=lease.generation,
            holder=holder,
            expires_at=lease.expires_at,
            **write.params(attempt),
        )
        assert row is not None
        refused, fenced = _verdict(row), row["fence_generation"]
        if refused is not None:  # stale, bound to another holder, or past its expiry
            return Admission(
                now=float(row["now"]),
                presented=_external(lease, refused),
                lease=refused,
                highest=_highest(lease, fenced),
            )
        return await self._claimed(row, _external(lease, None), fenced, attempt, write.key)

    async def record(self, job_id: str, key: str) -> Record | None:
        """Read-only: the key's record as it is now (None: there is none). A duplicate
        that waits (``Prefer: wait``) looks here for its first attempt to settle; the
        admission, run again, decides what it gets."""
        row = await self.backend.run("record", job_id=job_id, key=key)
        return None if row is None else _record(row)

    async def lowest_in_flight(self, job_id: str) -> int | None:
        """Read-only: the lowest generation of the job's writes in flight (None: none).
        A write waiting for older generations' may go once it is not below its own: one
        read answers every generation waiting (``gateway.proxy.waits``)."""
        row = await self.backend.run("lowest_in_flight", job_id=job_id)
        return None if row is None or row["lowest"] is None else int(row["lowest"])

    # -- settling ---------------------------------------------------------------------

    async def settle(
        self,
        job_id: str,
        key: str,
        attempt: str,
        *,
        state: RecordState,
        status: int | None,
        headers: list[tuple[str, str]] | None,
        body: bytes | None,
        note: str | None = None,
    ) -> None:
        """Store the answer of our attempt (completed, or unknown outcome)."""
        if fence.is_anonymous(key) and state is RecordState.COMPLETED:
            await self.backend.run("forget", job_id=job_id, key=key, attempt=attempt)
            return
        await self.backend.run(
            "settle",
            job_id=job_id,
            key=key,
            attempt=attempt,
            state=state.value,
            status=status,
            headers=_headers_json(headers),
            body=body,
            note=note,
        )

    async def hold_for_resolution(
        self,
        job_id: str,
        key: str,
        attempt: str,
        *,
        status: int | None,
        headers: list[tuple[str, str]] | None,
        body: bytes | None,
        note: str | None,
        request: KeptRequest,
    ) -> None:
        """Our attempt's outcome is unknown, and the gateway may resolve it: settle it
        unknown with the request kept for the re-send (operation ``hold_for_resolution``)."""
        await self.backend.run(
            "hold_for_resolution",
            job_id=job_id,
            key=key,
            attempt=attempt,
            status=status,
            headers=_headers_json(headers),
            body=body,
            note=note,
            request_head=json.dumps(
                {"query": request.query, "headers": [list(h) for h in request.headers]}
            ),
            request_body=request.body,
        )

    async def claim_resolution(
        self,
        upstream: str,
        *,
        window: float,
        max_attempts: int,
        pause: float,
        deadline_in: float,
    ) -> Resolution | None:
        """Claim one of the upstream's unknown outcomes to re-send (operation
        ``claim_resolution``: one conditional statement, so replicas never claim one
        record twice); None: nothing to resolve now."""
        attempt = tokens.new_serial_id()
        row = await self.backend.run(
            "claim_resolution",
            upstream=upstream,
            attempt=attempt,
            window=float(window),
            max_attempts=max_attempts,
            pause=float(pause),
            deadline_in=float(deadline_in),
        )
        if row is None or row["job_id"] is None:
            return None
        head = row["request_head"]
        head = json.loads(head) if isinstance(head, str | bytes) else head
        return Resolution(
            job_id=row["job_id"],
            key=row["key"],
            attempt=attempt,
            generation=int(row["generation"]),
            fingerprint=row["fingerprint"],
            method=row["method"],
            path=row["path"],
            request=KeptRequest(
                query=str(head["query"]),
                headers=[(str(k), str(v)) for k, v in head["headers"]],
                body=bytes(row["request_body"]),
            ),
            attempts=int(row["resolve_attempts"]),
        )

    async def settle_resolution(
        self,
        resolution: Resolution,
        *,
        state: RecordState,
        status: int | None,
        headers: list[tuple[str, str]] | None,
        body: bytes | None,
        note: str,
        keep_request: bool,
    ) -> bool:
        """The end of a re-send: its answer, or unknown again (with the request kept
        for another re-send, or left to an operator). False: no longer ours."""
        row = await self.backend.run(
            "settle_resolution",
            job_id=resolution.job_id,
            key=resolution.key,
            attempt=resolution.attempt,
            state=state.value,
            status=status,
            headers=_headers_json(headers),
            body=body,
            note=note,
            keep_request=keep_request,
        )
        return row is not None

    async def release(self, job_id: str, key: str, attempt: str, back_to: Record | None) -> None:
        """Our attempt did not reach the upstream: undo the claim (or return the record to
        the state it had before we took it over)."""
        if back_to is None:
            await self.backend.run("release_claim", job_id=job_id, key=key, attempt=attempt)
        else:
            await self.backend.run(
                "return_claim",
                job_id=job_id,
                key=key,
                attempt=attempt,
                back_attempt=back_to.attempt,
                back_generation=back_to.generation,
            )

    # -- operators: unknown outcomes ---------------------------------------------------

    async def list_unknown(self, limit: int = 100) -> list[dict[str, Any]]:
        """Keys whose outcome is unknown (including in-flight ones past their deadline),
        and those the gateway is re-sending right now (``state`` "resolving").
        ``resolvable``: the request is kept, so the gateway may re-send it (inside the
        upstream's window, up to ``gateway.resolve_max_attempts`` times); else it waits
        for an operator."""
        row = await self.backend.run("list_unknown", limit=limit)
        assert row is not None
        return [{**dict(item), "resolvable": bool(item["resolvable"])} for item in row["rows"]]

    async def resolve(
        self,
        job_id: str,
        key: str,
        *,
        applied: bool,
        status: int | None = None,
        headers: list[tuple[str, str]] | None = None,
        body: bytes | None = None,
    ) -> bool:
        """An operator's verdict on an unknown outcome. Applied: later duplicates replay
        the given answer. Not applied: the record goes, and the next request with this
        key is forwarded. False when the key is not (or no longer) unknown."""
        if applied:
            row = await self.backend.run(
                "resolve_applied",
                job_id=job_id,
                key=key,
                status=status,
                headers=_headers_json(headers or []),
                body=body or b"",
            )
        else:
            row = await self.backend.run("resolve_not_applied", job_id=job_id, key=key)
        return row is not None

    # -- retention ---------------------------------------------------------------------

    async def vacuum_writing(self) -> None:
        """Vacuum writes_in_flight (PostgreSQL; ``Backend.vacuum``): a row inserted and
        deleted per write, its dead rows slow the ordering's probes and grow the table
        until a vacuum runs."""
        await self.backend.vacuum(writing.name)

    async def purge_records(self, older_than_seconds: float, *, batch: int = PURGE_BATCH) -> int:
        """Drop settled records past retention, ``batch`` per transaction; never an
        unknown one. How many."""
        purged, _ = await self.backend.run_in_batches(
            "purge_records", batch=batch, older_than=float(older_than_seconds)
        )
        return purged


def _headers_json(headers: list[tuple[str, str]] | None) -> str | None:
    return None if headers is None else json.dumps([list(h) for h in headers])


def _verdict(row: Any) -> Reason | None:
    """The SQL's verdict on the lease (its column ``refusal``), named: None, it may write."""
    return fence.sql_verdict(row["refusal"])


def _value(reason: Reason | None) -> str | None:
    return None if reason is None else reason.value


def _external(lease: ExternalLease, refused: Reason | None) -> Presented:
    detail = fence.source_detail(
        lease.refused,
        refused,
        reissued=lease.reissued,
        counter_lost=lease.counter_lost,
        own=lease.detail,
    )
    return Presented(
        lease.job_id,
        lease.generation,
        lease.owner,
        None,
        source=lease.source,
        refused=refused,
        detail=detail,
    )


def holder_digest(lease: ExternalLease) -> str:
    """The holder as ``fences.holder`` keeps it: a digest of fixed width (a holder may
    be a whole lock key, long and not for the database's eyes)."""
    return hashlib.sha256(lease.holder.encode("utf-8", "surrogatepass")).hexdigest()


def _highest(lease: ExternalLease, fenced: int | None) -> int | None:
    known = [g for g in (fenced, lease.generation, lease.newer) if g is not None]
    return max(known) if known else None


def _presented(row: Any) -> tuple[Presented | None, int | None]:
    """The lease a token presents and its job's fence, from a row of the operation
    ``lease_of_token`` or ``admit``."""
    if row["job_id"] is None:
        return None, None
    if row["state"] is None:  # the job has been purged
        return Presented(row["job_id"], row["lease_generation"], row["lease_owner"], None), None
    presented = Presented(row["job_id"], row["lease_generation"], row["lease_owner"], _job(row))
    return presented, row["fence_generation"]


def _job(row: Any) -> rules.Job:
    """The job's columns of an admission row, for the rules to judge."""
    return rules.Job(
        row["job_id"],
        State(row["state"]),
        row["generation"],
        owner=row["owner"],
        lease_expires_at=row["lease_expires_at"],
        attempts=row["attempts"],
        max_attempts=row["max_attempts"],
    )


def _record(row: Any) -> Record:
    """A record's row (the driver gives its JSON as text)."""
    headers = row["headers"]
    if headers is not None:
        headers = json.loads(headers)
    return Record(
        fingerprint=row["fingerprint"],
        state=RecordState(row["state"]),
        generation=row["generation"],
        attempt=row["attempt"],
        deadline=row["deadline"],
        overdue=bool(row["overdue"]),
        status=row["status"],
        headers=[(str(k), str(v)) for k, v in headers] if headers is not None else None,
        body=row["body"],
    )
