"""The lease rules (``lease_core.rules``) as pure functions: properties and edge cases.

The properties drive one job through any sequence of grants, renewals, completions,
failures, releases and clock moves, and hold the rules to an independent model of what
should be current and why a lease that is not current is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import lease_model as rules
from tests.lease_model import Job, Lease, State

MAX_TTL = 600.0
OWNERS = ("alice", "bob", "carol")

# -- the model --------------------------------------------------------------------------


@dataclass
class Grant:
    """What the model knows about one lease ever granted."""

    lease: Lease
    ended: bool = False  # completed, failed or released by its holder


@dataclass
class Model:
    job: Job
    now: float = 1_000.0
    grants: list[Grant] = field(default_factory=list)

    def latest(self) -> Grant | None:
        return self.grants[-1] if self.grants else None

    def expected_current(self, g: Grant) -> bool:
        """Current: the last grant, not ended, and its expiry still ahead of ``now``."""
        return g is self.latest() and not g.ended and self.now < g.lease.expires_at

    def expected_reason(self, g: Grant) -> str:
        if g is not self.latest():
            return "stale-generation"
        if g.ended:
            return "lease-ended"
        assert self.now >= g.lease.expires_at
        return "lease-expired"


ttls = st.integers(min_value=1, max_value=100).map(float)
ops = st.one_of(
    st.tuples(st.just("claim"), st.sampled_from(OWNERS), ttls),
    st.tuples(st.just("acquire"), st.sampled_from(OWNERS), ttls),
    st.tuples(st.just("renew"), st.integers(min_value=0, max_value=50), ttls),
    st.tuples(st.just("complete"), st.integers(min_value=0, max_value=50)),
    st.tuples(st.just("fail"), st.integers(min_value=0, max_value=50), ttls),
    st.tuples(st.just("release"), st.integers(min_value=0, max_value=50)),
    # Moves of the clock: often exactly onto an expiry (the boundary counts as expired).
    st.tuples(st.just("advance"), st.integers(min_value=0, max_value=120).map(float)),
)


def _pick(model: Model, index: int) -> Grant | None:
    if not model.grants:
        return None
    return model.grants[index % len(model.grants)]


def _check_all_leases(model: Model) -> None:
    """At most one lease is current, exactly the one the model expects, and every other
    one is refused for the model's reason."""
    current = [g for g in model.grants if rules.is_current(g.lease, model.job, model.now)]
    assert len(current) <= 1
    for g in model.grants:
        is_current = rules.is_current(g.lease, model.job, model.now)
        assert is_current == model.expected_current(g), (g, model.job, model.now)
        if not is_current:
            reason = rules.refusal_reason(g.lease.generation, model.job, model.now)
            assert reason == model.expected_reason(g), (g, model.job, model.now)


def _run(model: Model, op: tuple[Any, ...]) -> None:
    job, now = model.job, model.now
    kind = op[0]
    if kind in ("claim", "acquire"):
        owner, ttl = op[1], op[2]
        allowed = (
            rules.is_claimable(job, now) if kind == "claim" else rules.can_acquire(job, owner, now)
        )
        if not allowed:
            return
        before = job.generation
        new_job, lease = rules.grant(job, owner, ttl, now)
        # Strictly above every generation ever granted for this job.
        assert new_job.generation > before
        assert all(lease.generation > g.lease.generation for g in model.grants)
        assert new_job.generation == lease.generation
        assert new_job.state is State.LEASED and new_job.owner == owner
        assert new_job.attempts == job.attempts + 1
        assert lease.expires_at == now + ttl
        model.job = new_job
        model.grants.append(Grant(lease))
        assert rules.is_current(lease, new_job, now)
        return
    if kind == "advance":
        model.now = now + op[1]
        return
    g = _pick(model, op[1])
    if g is None:
        return
    # The rules allow the operation only for the current lease; a lease that is not
    # current can do nothing, so the model leaves the job as it is.
    if not rules.is_current(g.lease, job, now):
        return
    if kind == "renew":
        ttl = op[2]
        new_job = rules.renew(job, ttl, now)
        assert new_job.generation == job.generation
        assert new_job.lease_expires_at == now + ttl
        model.job = new_job
        model.grants[-1] = Grant(
            Lease(g.lease.job_id, g.lease.generation, g.lease.owner, now + ttl)
        )
    elif kind == "complete":
        model.job = rules.complete(job)
        assert model.job.state is State.COMPLETED
        g.ended = True
    elif kind == "fail":
        model.job = rules.fail(job, op[2], now)
        expected = State.FAILED if job.attempts >= job.max_attempts else State.PENDING
        assert model.job.state is expected
        g.ended = True
    elif kind == "release":
        model.job = rules.release(job, now)
        assert model.job.state is State.PENDING
        assert model.job.attempts == max(job.attempts - 1, 0)
        g.ended = True
    else:  # pragma: no cover - the strategy has no other kinds
        raise AssertionError(kind)
    assert model.job.generation == job.generation  # only grants move the generation


@settings(max_examples=300, deadline=None)
@given(
    max_attempts=st.integers(min_value=1, max_value=5),
    start_generation=st.integers(min_value=0, max_value=10**12),
    steps=st.lists(ops, max_size=40),
)
def test_generations_increase_and_at_most_one_lease_is_current(
    max_attempts: int, start_generation: int, steps: list[tuple[Any, ...]]
) -> None:
    model = Model(Job("job-1", State.PENDING, start_generation, max_attempts=max_attempts))
    seen_generations = [start_generation]
    for op in steps:
        _run(model, op)
        # Never decreases, whatever the operation.
        assert model.job.generation >= seen_generations[-1]
        seen_generations.append(model.job.generation)
        _check_all_leases(model)
    granted = [g.lease.generation for g in model.grants]
    assert granted == sorted(set(granted))  # strictly increasing, never reused
    assert all(gen > start_generation for gen in granted)


@settings(max_examples=200, deadline=None)
@given(
    owners=st.lists(st.sampled_from(OWNERS), min_size=1, max_size=10),
    ttl=ttls,
    gaps=st.lists(st.integers(min_value=0, max_value=150).map(float), min_size=10, max_size=10),
)
def test_acquire_sequences_never_leave_two_current_leases(
    owners: list[str], ttl: float, gaps: list[float]
) -> None:
    """Named acquires by several owners (same owner again included) at any times: at every
    ``now`` checked, at most one of all leases ever granted is current."""
    job = Job("named", State.PENDING, 0, max_attempts=1000)
    now = 0.0
    leases: list[Lease] = []
    for owner, gap in zip(owners, gaps, strict=False):
        now += gap
        if rules.can_acquire(job, owner, now):
            job, lease = rules.grant(job, owner, ttl, now)
            leases.append(lease)
        for probe in (now, now + ttl / 2, now + ttl, now + 10 * ttl):
            assert sum(rules.is_current(lease, job, probe) for lease in leases) <= 1
        # The same owner acquiring again fences off its own earlier lease.
        for earlier in leases[:-1]:
            assert not rules.is_current(earlier, job, now)
            assert rules.refusal_reason(earlier.generation, job, now) == "stale-generation"


# -- refusal reasons --------------------------------------------------------------------


def _leased(generation: int = 5, expires: float = 100.0, owner: str = "alice") -> Job:
    return Job("j", State.LEASED, generation, owner=owner, lease_expires_at=expires, attempts=1)


def test_current_lease_is_current_until_its_expiry() -> None:
    job = _leased()
    lease = Lease("j", 5, "alice", 100.0)
    assert rules.is_current(lease, job, 99.999)
    assert not rules.is_current(lease, job, 100.0)  # expiry is inclusive
    assert rules.refusal_reason(5, job, 100.0) == "lease-expired"


@pytest.mark.parametrize(
    "lease",
    [
        Lease("other-job", 5, "alice", 100.0),
        Lease("j", 4, "alice", 100.0),
        Lease("j", 5, "bob", 100.0),
    ],
    ids=["other-job", "older-generation", "other-owner"],
)
def test_lease_that_does_not_match_the_job_is_not_current(lease: Lease) -> None:
    assert not rules.is_current(lease, _leased(), 50.0)


def test_older_generation_is_stale_even_when_the_newer_lease_expired() -> None:
    # Fencing does not need a clock: a newer generation wins whatever the time.
    job = _leased(generation=7, expires=10.0)
    assert rules.refusal_reason(6, job, 1_000.0) == "stale-generation"
    assert rules.refusal_reason(6, rules.complete(job), 5.0) == "stale-generation"


def test_refusal_of_a_purged_job_is_stale_generation() -> None:
    assert rules.refusal_reason(3, None, 0.0) == "stale-generation"


@pytest.mark.parametrize(
    "end",
    [
        rules.complete,
        lambda job: rules.fail(job, 30.0, 50.0),
        lambda job: rules.release(job, 50.0),
    ],
    ids=["complete", "fail", "release"],
)
def test_ended_lease_is_refused_as_lease_ended(end: Any) -> None:
    job = end(_leased())
    lease = Lease("j", 5, "alice", 100.0)
    assert not rules.is_current(lease, job, 50.0)
    assert rules.refusal_reason(5, job, 50.0) == "lease-ended"
    # ... also after its expiry would have passed.
    assert rules.refusal_reason(5, job, 500.0) == "lease-ended"


# -- claimability, fail, release ----------------------------------------------------------


def test_fail_goes_back_to_pending_with_a_delay_then_to_failed_when_out_of_attempts() -> None:
    job = Job("j", State.PENDING, 0, max_attempts=2)
    job, _ = rules.grant(job, "alice", 10.0, 0.0)
    job = rules.fail(job, retry_in=30.0, now=5.0)
    assert job.state is State.PENDING
    assert job.claimable_at == 35.0
    assert job.lease_expires_at is None
    assert not rules.is_claimable(job, 34.9)
    assert rules.is_claimable(job, 35.0)

    job, _ = rules.grant(job, "bob", 10.0, 35.0)
    assert job.attempts == 2
    job = rules.fail(job, retry_in=30.0, now=36.0)
    assert job.state is State.FAILED
    assert job.claimable_at is None
    for now in (36.0, 1e9):
        assert not rules.is_claimable(job, now)
        assert not rules.can_acquire(job, "bob", now)


def test_expired_lease_on_last_attempt_is_not_claimable() -> None:
    job = Job("j", State.PENDING, 0, max_attempts=1)
    job, _ = rules.grant(job, "alice", 10.0, 0.0)
    assert rules.is_expired(job, 10.0)
    assert not rules.is_claimable(job, 10.0)


def test_expired_lease_is_claimable_again() -> None:
    job, _ = rules.grant(Job("j", State.PENDING, 0), "alice", 10.0, 0.0)
    assert not rules.is_claimable(job, 9.0)
    assert rules.is_claimable(job, 10.0)


def test_release_does_not_use_up_an_attempt() -> None:
    job, _ = rules.grant(Job("j", State.PENDING, 0, max_attempts=1), "alice", 10.0, 0.0)
    assert not rules.is_claimable(rules.fail(job, 0.0, 1.0), 1.0)
    released = rules.release(job, 1.0)
    assert released.attempts == 0
    assert rules.is_claimable(released, 1.0)


def test_completed_job_cannot_be_acquired_or_claimed() -> None:
    job, _ = rules.grant(Job("j", State.PENDING, 0), "alice", 10.0, 0.0)
    done = rules.complete(job)
    assert not rules.can_acquire(done, "alice", 100.0)
    assert not rules.is_claimable(done, 100.0)


def test_acquire_of_a_held_job() -> None:
    job, _ = rules.grant(Job("j", State.PENDING, 0), "alice", 10.0, 0.0)
    assert not rules.can_acquire(job, "bob", 5.0)
    assert rules.can_acquire(job, "alice", 5.0)  # same owner: a restarted process
    assert rules.can_acquire(job, "bob", 10.0)  # expired


# -- check_ttl ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ttl", "why"),
    [
        (math.nan, "finite"),
        (math.inf, "finite"),
        (-math.inf, "finite"),
        (True, "finite"),
        (False, "finite"),
        ("5", "finite"),
        (None, "finite"),
        (0, "above zero"),
        (0.0, "above zero"),
        (-0.0, "above zero"),
        (-1, "above zero"),
        (-1e-300, "above zero"),
        (MAX_TTL + 0.001, "max_ttl_seconds"),
        (math.nextafter(MAX_TTL, math.inf), "max_ttl_seconds"),
        (1e308, "max_ttl_seconds"),
    ],
)
def test_check_ttl_refuses(ttl: Any, why: str) -> None:
    reason = rules.check_ttl(ttl, MAX_TTL)
    assert reason is not None
    assert why in reason


@pytest.mark.parametrize("ttl", [1e-9, 0.5, 1, 30, MAX_TTL, int(MAX_TTL)])
def test_check_ttl_accepts(ttl: float) -> None:
    assert rules.check_ttl(ttl, MAX_TTL) is None


@given(ttl=st.floats(allow_nan=True, allow_infinity=True))
def test_check_ttl_accepts_exactly_finite_positive_values_up_to_max(ttl: float) -> None:
    accepted = rules.check_ttl(ttl, MAX_TTL) is None
    assert accepted == (math.isfinite(ttl) and 0 < ttl <= MAX_TTL)


# -- ids and owners -----------------------------------------------------------------------

CONTROL_CHARS = [chr(c) for c in [*range(0x20), 0x7F, 0x85]] + ["\u2028", "\u200b"]


@pytest.mark.parametrize("value", ["", "a" * 10_000, "a" * 201, "-leading", "a b", "a/b", "é"])
def test_invalid_ids(value: str) -> None:
    assert not rules.is_valid_id(value)


@pytest.mark.parametrize("value", ["a", "a" * 200, "job-1", "0e5c.x:y@z~w+v=u_t", "Q"])
def test_valid_ids(value: str) -> None:
    assert rules.is_valid_id(value)


@pytest.mark.parametrize("char", CONTROL_CHARS, ids=lambda c: f"U+{ord(c):04X}")
def test_control_characters_are_refused_in_ids_and_owners(char: str) -> None:
    for value in (f"a{char}b", f"ab{char}", char):
        assert not rules.is_valid_id(value)
        assert not rules.is_valid_owner(value)
    # The trailing newline is the classic regex hole ("$" matches before it).
    assert not rules.is_valid_id("job\n")


@pytest.mark.parametrize("value", ["", "a" * 10_000, "a" * 201])
def test_invalid_owners(value: str) -> None:
    assert not rules.is_valid_owner(value)


@pytest.mark.parametrize("value", ["a", "a" * 200, "worker 7 on host-3", "ünïcödé ✓"])
def test_valid_owners(value: str) -> None:
    assert rules.is_valid_owner(value)


@given(st.text(max_size=300))
def test_ids_and_owners_never_contain_unprintable_characters(value: str) -> None:
    if rules.is_valid_id(value):
        assert 1 <= len(value) <= 200 and value.isascii() and value.isprintable()
        assert " " not in value
    if rules.is_valid_owner(value):
        assert 1 <= len(value) <= rules.MAX_OWNER_LENGTH and value.isprintable()
