"""The admission's SQL gives its verdict in a column (``refusal``), on both databases:
the reason a lease may not write, or NULL, decided by the statement that claims (or
does not) from the rows it decided on. ``GatewayStore`` only names it.

The gateway's own leases (``lease_of_token``, ``admit``: the fragment ``lease_refusal``)
are held row by row to the model, ``lease_core.rules`` (``is_current``,
``refusal_reason``); the leases of other sources (``external_lease``,
``admit_external``) to the spec's order: a generation below the fence is stale whatever
the source says, then the source's own finding, then the generation bound to another
holder (admission only), then the expiry by the database's clock. The listing of
unknown outcomes (``list_unknown``) is a catalogue operation with the same fragments.
"""

from __future__ import annotations

import itertools

import pytest
import sqlalchemy as sa

from gateway.fencing import fence
from gateway.fencing.fence import Lost, Reason, RecordState
from gateway.records.schema import fences, requests
from gateway.records.store import GatewayStore, WriteRequest, holder_digest
from gateway.sources import ExternalLease
from lease_core import tokens
from lease_core.rules import State
from lease_core.schema import jobs, leases
from lease_core.store import LeaseStore
from tests import lease_model as rules
from tests.support import FakeClock

LEASE_GENERATION = 4


@pytest.fixture
def gstore(store: LeaseStore) -> GatewayStore:
    return GatewayStore(store)


def write(token_hash: str | None, key: str = "k") -> WriteRequest:
    return WriteRequest(
        token_hash=token_hash,
        key=key,
        fingerprint="fp",
        upstream="pay",
        method="POST",
        path="/charges",
        deadline_in=300.0,
    )


async def granted(
    store: LeaseStore,
    job_id: str,
    *,
    state: State,
    generation: int,
    owner: str,
    expires_in: float,
    lease_generation: int = LEASE_GENERATION,
) -> tuple[str, rules.Lease, rules.Job]:
    """A grant of ``job_id`` to worker-1 at ``lease_generation``, its job row then set as
    given (a state, generation and owner the lease API would reach by its own ways):
    the token's hash, and the grant and job as the model sees them."""
    token = await store.acquire(job_id=job_id, owner="worker-1", ttl=30.0, queue="q")
    assert token.lease_token is not None
    token_hash = tokens.hash_token(token.lease_token)
    now = store.backend.injected_now()
    assert now is not None
    expires = now + expires_in
    async with store.backend.transaction() as conn:
        await conn.execute(
            sa.update(leases)
            .where(leases.c.token_hash == token_hash)
            .values(generation=lease_generation)
        )
        await conn.execute(
            sa.update(jobs)
            .where(jobs.c.job_id == job_id)
            .values(state=state.value, generation=generation, owner=owner, lease_expires_at=expires)
        )
    lease = rules.Lease(job_id, lease_generation, "worker-1", expires)
    job = rules.Job(job_id, state, generation, owner=owner, lease_expires_at=expires)
    return token_hash, lease, job


def model(lease: rules.Lease, job: rules.Job | None, now: float) -> Reason | None:
    """The verdict ``lease_core.rules`` gives."""
    if job is not None and rules.is_current(lease, job, now):
        return None
    return rules.refusal_reason(lease.generation, job, now)


# (case, state, job generation, owner, expires in, lease generation, reason). A leased
# job always has an expiry in the database, so the model's "no expiry recorded" is not a
# row here.
LEASES = [
    ("the current lease", State.LEASED, 4, "worker-1", 30.0, 4, None),
    ("expires a moment from now", State.LEASED, 4, "worker-1", 0.001, 4, None),
    ("a newer generation holds it", State.LEASED, 5, "worker-1", 30.0, 4, "stale"),
    ("a newer generation, and expired", State.LEASED, 5, "worker-1", -1.0, 4, "stale"),
    ("a newer generation, and ended", State.COMPLETED, 5, "worker-1", 30.0, 4, "stale"),
    ("completed", State.COMPLETED, 4, "worker-1", 30.0, 4, "ended"),
    ("failed", State.FAILED, 4, "worker-1", 30.0, 4, "ended"),
    ("released (pending)", State.PENDING, 4, "worker-1", 30.0, 4, "ended"),
    ("expired", State.LEASED, 4, "worker-1", -1.0, 4, "expired"),
    ("expires exactly now", State.LEASED, 4, "worker-1", 0.0, 4, "expired"),
    ("same generation, another owner", State.LEASED, 4, "worker-2", 30.0, 4, "stale"),
    ("a generation the job never had", State.LEASED, 4, "worker-1", 30.0, 9, "stale"),
]
NAMED = {
    "stale": Reason.STALE_GENERATION,
    "ended": Reason.LEASE_ENDED,
    "expired": Reason.LEASE_EXPIRED,
    None: None,
}


@pytest.mark.parametrize(
    ("case", "state", "generation", "owner", "expires_in", "lease_generation", "reason"),
    LEASES,
    ids=[row[0] for row in LEASES],
)
async def test_the_lease_verdict_is_the_sqls_and_the_models(
    store: LeaseStore,
    gstore: GatewayStore,
    clock: FakeClock,
    case: str,
    state: State,
    generation: int,
    owner: str,
    expires_in: float,
    lease_generation: int,
    reason: str | None,
) -> None:
    token_hash, lease, job = await granted(
        store,
        "job-1",
        state=state,
        generation=generation,
        owner=owner,
        expires_in=expires_in,
        lease_generation=lease_generation,
    )
    expected = NAMED[reason]
    assert model(lease, job, clock.now) is expected, case
    checked = await gstore.check_lease(token_hash)
    admitted = await gstore.admit(write(token_hash))
    assert (checked.lease, admitted.lease) == (expected, expected), case
    # Claimed exactly when admitted; a refusal raises no fence.
    assert admitted.claimed is (expected is None)
    assert (await fence_of(store, "job-1")) == (lease_generation if expected is None else None)


async def test_every_combination_is_judged_as_the_model_judges_it(
    store: LeaseStore, gstore: GatewayStore, clock: FakeClock
) -> None:
    grid = itertools.product(State, (3, 4, 5), ("worker-1", "worker-2"), (-1.0, 0.0, 1.0))
    for i, (state, generation, owner, expires_in) in enumerate(grid):
        token_hash, lease, job = await granted(
            store,
            f"grid-{i}",
            state=state,
            generation=generation,
            owner=owner,
            expires_in=expires_in,
        )
        expected = model(lease, job, clock.now)
        checked = await gstore.check_lease(token_hash)
        admitted = await gstore.admit(write(token_hash))
        assert (checked.lease, admitted.lease) == (expected, expected), (state, job, lease)


async def test_an_unknown_token_and_a_purged_job(store: LeaseStore, gstore: GatewayStore) -> None:
    unknown = tokens.hash_token(tokens.new_token()[0])
    assert (await gstore.check_lease(unknown)).lease is Reason.INVALID_FENCING_TOKEN
    assert (await gstore.admit(write(unknown))).lease is Reason.INVALID_FENCING_TOKEN
    token_hash, lease, _ = await granted(
        store, "gone", state=State.COMPLETED, generation=4, owner="worker-1", expires_in=30.0
    )
    await store.purge_job("gone")
    assert model(lease, None, 0.0) is Reason.STALE_GENERATION
    assert (await gstore.check_lease(token_hash)).lease is Reason.STALE_GENERATION
    assert (await gstore.admit(write(token_hash))).lease is Reason.STALE_GENERATION


async def fence_of(store: LeaseStore, job_id: str) -> int | None:
    async with store.backend.transaction() as conn:
        found = await conn.execute(sa.select(fences.c.generation).where(fences.c.job_id == job_id))
        return found.scalar_one_or_none()


# -- leases of other sources -------------------------------------------------------------------


def external(
    generation: int | None,
    *,
    refused: Lost | None = None,
    expires_in: float | None = None,
    now: float = 0.0,
    holder: str = "holder-1",
    job: str = "src/j",
) -> ExternalLease:
    expires_at = None if expires_in is None else now + expires_in
    return ExternalLease(
        "src", job, generation, "owner", refused=refused, expires_at=expires_at, holder=holder
    )


async def fenced(store: LeaseStore, job_id: str, generation: int, holder: str | None) -> None:
    async with store.backend.transaction() as conn:
        await conn.execute(
            sa.insert(fences).values(
                job_id=job_id, generation=generation, holder=holder, updated_at=0.0
            )
        )


# (source's finding, generation, fence, expires in, reason of the check)
EXTERNAL = [
    (None, 5, None, None, None),
    (None, 5, 5, None, None),
    (None, 5, 6, None, Reason.STALE_GENERATION),
    # stale comes before the source's own finding and before the expiry (spec order)
    (Lost.RELEASED, 5, 6, None, Reason.STALE_GENERATION),
    (Lost.NEWER_HOLDER, 5, 5, None, Reason.STALE_GENERATION),
    (None, 5, 6, -50.0, Reason.STALE_GENERATION),
    (Lost.RELEASED, 5, 5, None, Reason.LEASE_ENDED),
    (Lost.EXPIRED, None, 9, None, Reason.LEASE_EXPIRED),
    (Lost.OUT_OF_RANGE, None, None, None, Reason.INVALID_FENCING_TOKEN),
    (Lost.RELEASED, 5, 4, -1.0, Reason.LEASE_ENDED),  # the finding before the expiry
    (None, 5, 4, 0.0, Reason.LEASE_EXPIRED),  # expires_at <= now
    (None, 5, 4, 0.5, None),
]


@pytest.mark.parametrize(("refused", "generation", "fence", "expires_in", "expected"), EXTERNAL)
async def test_external_verdicts_in_the_tables_order(
    store: LeaseStore,
    gstore: GatewayStore,
    clock: FakeClock,
    refused: Lost | None,
    generation: int | None,
    fence: int | None,
    expires_in: float | None,
    expected: Reason | None,
) -> None:
    lease = external(generation, refused=refused, expires_in=expires_in, now=clock.now)
    if fence is not None:
        await fenced(store, lease.job_id, fence, holder_digest(lease))
    checked = await gstore.check_external(lease)
    assert checked.lease is expected
    assert checked.presented is not None and checked.presented.refused is expected
    if refused is None and generation is not None:
        # The admission's verdict, from the fence row it locked: the same.
        admitted = await gstore.admit_external(lease, write(None))
        assert admitted.lease is expected
        assert admitted.claimed is (expected is None)


async def test_a_generation_bound_to_another_holder_is_refused_by_the_admission(
    store: LeaseStore, gstore: GatewayStore
) -> None:
    first, second = external(5, holder="first"), external(5, holder="second")
    assert (await gstore.admit_external(first, write(None, "a"))).lease is None
    # The check before the body binds no holder (as before): the admission refuses.
    assert (await gstore.check_external(second)).lease is None
    refused = await gstore.admit_external(second, write(None, "b"))
    assert refused.lease is Reason.GENERATION_REISSUED and not refused.claimed
    # A fence above the generation is stale first, whoever holds it.
    await gstore.admit_external(external(6, holder="third"), write(None, "c"))
    assert (await gstore.admit_external(second, write(None, "d"))).lease is (
        Reason.STALE_GENERATION
    )


# -- unknown outcomes ------------------------------------------------------------------------


async def test_list_unknown_lists_unknown_overdue_and_resolving_newest_first(
    store: LeaseStore, gstore: GatewayStore, clock: FakeClock
) -> None:
    token = await store.acquire(job_id="u", owner="w", ttl=3000.0, queue="q")
    assert token.lease_token is not None
    token_hash = tokens.hash_token(token.lease_token)

    async def admitted(key: str, deadline_in: float) -> str:
        admission = await gstore.admit(
            WriteRequest(token_hash, key, "fp", "pay", "POST", "/x", deadline_in)
        )
        assert admission.claimed and admission.attempt is not None
        clock.advance(1)
        return admission.attempt

    unknown = await admitted("unknown", 300.0)
    await gstore.settle(
        "u", "unknown", unknown, state=RecordState.UNKNOWN, status=None, headers=None, body=None
    )
    await admitted("overdue", 5.0)
    await admitted("running", 300.0)  # in flight within its deadline: not listed
    await admitted("resolving", 300.0)
    async with store.backend.transaction() as conn:  # as if re-sent by the gateway
        await conn.execute(
            sa.update(requests).where(requests.c.key == "resolving").values(resolve_attempts=1)
        )
    clock.advance(10)  # "overdue" is past its deadline
    items = await gstore.list_unknown()
    assert [(i["key"], i["state"]) for i in items] == [
        ("resolving", "resolving"),
        ("overdue", RecordState.UNKNOWN.value),
        ("unknown", RecordState.UNKNOWN.value),
    ]
    assert set(items[0]) == {
        "job_id", "key", "state", "generation", "upstream", "method", "path", "status",
        "note", "resolve_attempts", "resolvable", "updated_at",
    }  # fmt: skip
    assert all(i["resolvable"] is False and i["job_id"] == "u" for i in items)
    assert [i["key"] for i in await gstore.list_unknown(limit=2)] == ["resolving", "overdue"]


async def test_a_record_is_overdue_from_its_deadline_by_the_databases_clock(
    store: LeaseStore, gstore: GatewayStore, clock: FakeClock
) -> None:
    """``past_deadline`` decides, read as a record's ``overdue`` by the record's read and
    by the admission that finds it: an in-flight record whose deadline has come is an
    unknown outcome (``fence.effective_state`` judges no clock)."""
    token = await store.acquire(job_id="o", owner="w", ttl=3000.0, queue="q")
    assert token.lease_token is not None
    token_hash = tokens.hash_token(token.lease_token)
    first = await gstore.admit(WriteRequest(token_hash, "k", "fp", "pay", "POST", "/x", 5.0))
    assert first.claimed
    found = await gstore.record("o", "k")
    assert found is not None and not found.overdue
    clock.advance(4.999)
    again = await gstore.admit(WriteRequest(token_hash, "k", "fp", "pay", "POST", "/x", 5.0))
    assert again.record is not None and not again.record.overdue
    assert fence.record_reason(again.record, "fp", "hold") is Reason.REQUEST_IN_PROGRESS
    clock.advance(0.001)  # exactly its deadline
    found = await gstore.record("o", "k")
    assert found is not None and found.overdue and found.state is RecordState.IN_FLIGHT
    again = await gstore.admit(WriteRequest(token_hash, "k", "fp", "pay", "POST", "/x", 5.0))
    assert again.record is not None and again.record.overdue
    assert fence.record_reason(again.record, "fp", "hold") is Reason.OUTCOME_UNKNOWN
