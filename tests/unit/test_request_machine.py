"""One request's state machine (``gateway.fencing.machine``), driven by hand: no server,
no database, no aiohttp. Each test feeds what an act would have found (its event) and
checks the act the machine asks for next, or its verdict."""

from __future__ import annotations

import io

import pytest
from multidict import CIMultiDict

from fencegate_client.reasons import REASONS, Sent
from gateway.fencing import resolution
from gateway.fencing.after_forward import Exchange, Fate
from gateway.fencing.deadlines import (
    MARGIN,
    RESOLVE_MARGIN,
    DuplicateWait,
    Timing,
    resolve_claim_seconds,
    resolve_window,
    send_left,
)
from gateway.fencing.decision import Act, Facts, Outcome, Verdict
from gateway.fencing.events import (
    RELEASED,
    Admitted,
    BodyRead,
    ClaimSeen,
    FirstSettled,
    LeaseSeen,
    OlderSettled,
    SlotTaken,
)
from gateway.fencing.fence import (
    Admission,
    ClaimState,
    Presented,
    Reason,
    Record,
    RecordState,
    UnknownOutcome,
)
from gateway.fencing.machine import MachineError, RequestMachine
from gateway.fencing.profiles import Answer

TIMING = Timing(ordering_wait=30.0, timeout=10.0, connect_timeout=5.0)
PRESENTED = Presented(job_id="job-1", generation=3, owner="w", job=None)


def machine(**kwargs: object) -> RequestMachine:
    options: dict[str, object] = {"timing": TIMING, "body_arrived": True}
    options.update(kwargs)
    return RequestMachine(Facts(), 0.0, **options)  # type: ignore[arg-type]


def admission(**kwargs: object) -> Admission:
    fields: dict[str, object] = {"now": 1000.0, "presented": PRESENTED, "lease": None}
    fields.update(kwargs)
    return Admission(**fields)  # type: ignore[arg-type]


def claimed(**kwargs: object) -> Admission:
    return admission(claimed=True, attempt="a1", highest=3, **kwargs)


def to_admission(m: RequestMachine) -> None:
    """TAKE_SLOT, READ_BODY: the steps before the admission of a body that arrived."""
    assert m.next() is Act.TAKE_SLOT
    m.feed(SlotTaken("fenced"))
    assert m.next() is Act.READ_BODY
    m.feed(BodyRead(io.BytesIO(b"{}"), "fp"))
    assert m.next() is Act.ADMIT


def test_a_body_still_coming_has_its_lease_read_before_a_slot_is_taken() -> None:
    m = machine(body_arrived=False)
    assert m.next() is Act.CHECK_LEASE
    m.feed(LeaseSeen(admission()))
    assert m.next() is Act.TAKE_SLOT


def test_an_arrived_body_lets_the_admission_tell_about_the_lease() -> None:
    m = machine()
    to_admission(m)
    m.feed(Admitted(admission(lease=Reason.STALE_GENERATION), 0, 0, behind=False, gone=False))
    verdict = m.next()
    assert isinstance(verdict, Verdict) and verdict.reason is Reason.STALE_GENERATION


def test_no_slot_free_reads_the_lease_then_is_overloaded() -> None:
    m = machine()
    assert m.next() is Act.TAKE_SLOT
    m.feed(SlotTaken(None))
    assert m.next() is Act.CHECK_LEASE
    m.feed(LeaseSeen(admission()))
    verdict = m.next()
    assert isinstance(verdict, Verdict) and verdict.reason is Reason.OVERLOADED


def test_an_unknown_token_is_refused() -> None:
    m = machine()
    to_admission(m)
    m.feed(Admitted(None, 0, 0, behind=False, gone=False))
    verdict = m.next()
    assert isinstance(verdict, Verdict) and verdict.reason is Reason.INVALID_FENCING_TOKEN


def test_a_fresh_admission_is_the_judgement_before_the_send() -> None:
    m = machine()
    to_admission(m)
    m.feed(Admitted(claimed(), 100.0, 100.01, behind=False, gone=False))
    verdict = m.next()
    assert isinstance(verdict, Verdict) and verdict.outcome is Outcome.FORWARD
    assert m.send_left == pytest.approx(TIMING.claim_seconds - MARGIN - 0.01)


@pytest.mark.parametrize("resolving, answered", [(False, 100.3), (True, 100.01)])
def test_a_slow_admission_or_a_resolver_running_reads_the_claim_again(
    resolving: bool, answered: float
) -> None:
    m = machine(resolving=resolving)
    to_admission(m)
    m.feed(Admitted(claimed(), 100.0, answered, behind=False, gone=False))
    assert m.next() is Act.READ_CLAIM


def test_an_older_write_in_flight_is_waited_for_however_fast_the_admission() -> None:
    """The ordering barrier holds for a fresh admission too (mutant
    ``barrier-quick-admission``)."""
    m = machine()
    to_admission(m)
    m.feed(Admitted(claimed(older_in_flight=True), 100.0, 100.0, behind=False, gone=False))
    assert m.next() is Act.WAIT_OLDER


def test_after_the_wait_a_newer_generation_makes_the_write_stale_and_its_claim_undone() -> None:
    m = machine()
    to_admission(m)
    m.feed(Admitted(claimed(older_in_flight=True), 0, 0, behind=False, gone=False))
    assert m.feed(OlderSettled(True)) is Act.CHECK_LEASE
    m.feed(LeaseSeen(admission(highest=4)))
    assert m.next() is Act.RELEASE  # refused with our claim: undone first
    m.feed(RELEASED)
    verdict = m.next()
    assert isinstance(verdict, Verdict) and verdict.reason is Reason.STALE_GENERATION


def test_older_writes_not_settled_in_time_are_an_ordering_timeout() -> None:
    m = machine()
    to_admission(m)
    m.feed(Admitted(claimed(older_in_flight=True), 0, 0, behind=False, gone=False))
    assert m.feed(OlderSettled(False)) is Act.RELEASE
    m.feed(RELEASED)
    verdict = m.next()
    assert isinstance(verdict, Verdict) and verdict.reason is Reason.ORDERING_TIMEOUT


def test_at_the_send_a_newer_fence_is_stale_and_a_lost_claim_is_not_sent() -> None:
    for state, reason in (
        (ClaimState(now=1000.0, fence=4, deadline=1040.0, older_in_flight=False), "stale"),
        (ClaimState(now=1000.0, fence=3, deadline=None, older_in_flight=False), "ordering"),
        (
            ClaimState(now=1000.0, fence=3, deadline=1000.0 + MARGIN, older_in_flight=False),
            "ordering",
        ),
    ):
        m = machine()
        to_admission(m)
        m.feed(Admitted(claimed(), 0.0, 1.0, behind=False, gone=False))
        m.feed(ClaimSeen(state, 1.0))
        assert m.next() is Act.RELEASE
        m.feed(RELEASED)
        verdict = m.next()
        assert isinstance(verdict, Verdict) and verdict.reason is not None
        assert verdict.reason.value.startswith(reason), (state, verdict)


def test_at_the_send_an_older_write_claimed_since_is_waited_for() -> None:
    m = machine()
    to_admission(m)
    m.feed(Admitted(claimed(), 0.0, 1.0, behind=False, gone=False))
    m.feed(ClaimSeen(ClaimState(now=1000.0, fence=3, deadline=1040.0, older_in_flight=True), 1.0))
    assert m.next() is Act.WAIT_OLDER


def test_the_send_is_judged_by_the_earlier_of_both_clocks() -> None:
    assert (
        send_left(send_by_monotonic=50.0, now_monotonic=10.0, deadline=1020.0, db_now=1000.0)
        == 20.0 - MARGIN
    )
    assert (
        send_left(send_by_monotonic=15.0, now_monotonic=10.0, deadline=1100.0, db_now=1000.0) == 5.0
    )
    assert send_left(send_by_monotonic=15.0, now_monotonic=10.0, deadline=None, db_now=1000.0) < 0
    assert TIMING.send_by_monotonic(100.0) == 100.0 + 30.0 + 10.0 + 5.0


def record(state: RecordState, *, deadline: float = 2000.0, body: bytes | None = b"ok") -> Record:
    overdue = deadline <= 1000.0  # the admission's clock, as the SQL reads it
    return Record("fp", state, 3, "a0", deadline, overdue, status=201, headers=[], body=body)


@pytest.mark.parametrize(
    "found, reason",
    [
        (record(RecordState.COMPLETED), Reason.IDEMPOTENT_REPLAY),
        (record(RecordState.COMPLETED, body=None), Reason.REPLAY_UNAVAILABLE),
        (record(RecordState.IN_FLIGHT), Reason.REQUEST_IN_PROGRESS),
        (record(RecordState.IN_FLIGHT, deadline=1000.0), Reason.OUTCOME_UNKNOWN),
        (record(RecordState.UNKNOWN), Reason.OUTCOME_UNKNOWN),
    ],
)
def test_the_keys_record_answers(found: Record, reason: Reason) -> None:
    m = machine()
    to_admission(m)
    m.feed(Admitted(admission(record=found, highest=3), 0, 0, behind=False, gone=False))
    verdict = m.next()
    assert isinstance(verdict, Verdict) and verdict.reason is reason


def test_a_duplicate_that_asked_to_wait_is_answered_from_the_store() -> None:
    """After the wait: the lease looked at again (no slot, no admission: an answer from
    the store competes for no forwarding slot), then the stored answer. The waiter gave
    its body up when it began to wait (issue 52: a waiter holds its fingerprint only)."""
    m = machine(wait=DuplicateWait(5))
    to_admission(m)
    in_flight = admission(record=record(RecordState.IN_FLIGHT), highest=3)
    m.feed(Admitted(in_flight, 0, 0, behind=False, gone=False))
    assert m.next() is Act.WAIT_FIRST
    assert m.body is None and m.fingerprint == "fp"
    m.slot_given_back()
    m.feed(FirstSettled(True, record(RecordState.COMPLETED)))
    assert m.next() is Act.CHECK_LEASE
    m.feed(LeaseSeen(admission()))
    verdict = m.next()
    assert isinstance(verdict, Verdict) and verdict.outcome is Outcome.REPLAY
    assert m.wait is not None and m.wait.waited and m.wait.asked


def test_a_waiter_whose_lease_went_stale_is_refused_not_replayed() -> None:
    m = machine(wait=DuplicateWait(5))
    to_admission(m)
    m.feed(
        Admitted(admission(record=record(RecordState.IN_FLIGHT)), 0, 0, behind=False, gone=False)
    )
    m.feed(FirstSettled(True, record(RecordState.COMPLETED)))
    assert m.next() is Act.CHECK_LEASE
    m.feed(LeaseSeen(admission(lease=Reason.STALE_GENERATION)))
    verdict = m.next()
    assert isinstance(verdict, Verdict) and verdict.reason is Reason.STALE_GENERATION


@pytest.mark.parametrize(
    "found",
    [None, record(RecordState.IN_FLIGHT), record(RecordState.UNKNOWN)],
    ids=["released", "in-flight-again", "unknown-retry"],
)
def test_a_waiter_whose_key_is_free_again_is_told_to_send_again(found: Record | None) -> None:
    """The first attempt ended without an answer to replay (released, "not processed",
    or to be forwarded again): the waiter holds no body, so it is not forwarded; it is
    told that nothing of it was sent (request-in-progress, Retry-After)."""
    m = machine(wait=DuplicateWait(5), policy=UnknownOutcome.RETRY)
    to_admission(m)
    m.feed(
        Admitted(admission(record=record(RecordState.IN_FLIGHT)), 0, 0, behind=False, gone=False)
    )
    m.feed(FirstSettled(True, found))
    verdict = m.next()
    assert isinstance(verdict, Verdict) and verdict.reason is Reason.REQUEST_IN_PROGRESS
    assert verdict.detail is not None and "Nothing of this request was sent" in verdict.detail
    assert REASONS[Reason.REQUEST_IN_PROGRESS].sent is Sent.NEVER


def test_a_failure_before_the_forward_is_never_sent_after_it_maybe() -> None:
    m = machine()
    to_admission(m)
    m.feed(Admitted(claimed(), 0, 0, behind=False, gone=False))
    assert m.unsent_claim
    assert m.failed().reason is Reason.STORE_UNAVAILABLE
    m.forwarding(CIMultiDict())
    assert not m.unsent_claim
    assert m.failed().reason is Reason.INTERNAL_ERROR
    assert REASONS[Reason.INTERNAL_ERROR].sent is Sent.MAYBE


def test_a_duplicate_of_an_answer_settling_here_waits_without_asking() -> None:
    m = machine()
    to_admission(m)
    in_flight = admission(record=record(RecordState.IN_FLIGHT), highest=3)
    m.feed(Admitted(in_flight, 0, 0, behind=True, gone=False))
    assert m.next() is Act.WAIT_FIRST
    assert m.wait is not None and not m.wait.asked
    m.feed(FirstSettled(False, None))
    verdict = m.next()
    assert isinstance(verdict, Verdict) and verdict.reason is Reason.REQUEST_IN_PROGRESS


def test_a_client_gone_does_not_wait() -> None:
    m = machine(wait=DuplicateWait(5))
    to_admission(m)
    in_flight = admission(record=record(RecordState.IN_FLIGHT), highest=3)
    m.feed(Admitted(in_flight, 0, 0, behind=False, gone=True))
    verdict = m.next()
    assert isinstance(verdict, Verdict) and verdict.reason is Reason.REQUEST_IN_PROGRESS


def test_expect_continue_stops_at_the_body_and_goes_on_with_the_same_machine() -> None:
    """The lease is looked at before the body comes; the request then goes on with the
    same machine (the intake is not run again): a slot, the body, the admission."""
    m = machine(body_arrived=False)
    m.before_body()
    assert m.next() is Act.CHECK_LEASE
    assert m.feed(LeaseSeen(admission())) is Act.READ_BODY
    m.body_coming()
    assert m.next() is Act.TAKE_SLOT
    assert m.feed(SlotTaken("fenced")) is Act.READ_BODY
    assert m.feed(BodyRead(io.BytesIO(b"{}"), "fp")) is Act.ADMIT


@pytest.mark.parametrize(
    "event",
    [LeaseSeen(None), BodyRead(None, None), RELEASED, OlderSettled(True)],
    ids=["lease", "body", "released", "older"],
)
def test_an_event_that_does_not_answer_the_act_asked_for_raises(event: object) -> None:
    """h11's rule for every act: the machine asked for a slot; anything else fed back is
    the driver's bug, and changes nothing."""
    m = machine()
    assert m.next() is Act.TAKE_SLOT
    before = repr(m)
    with pytest.raises(MachineError):
        m.feed(event)  # type: ignore[arg-type]
    assert repr(m) == before


def test_nothing_may_be_fed_once_the_machine_has_its_verdict() -> None:
    m = machine()
    to_admission(m)
    assert isinstance(m.feed(Admitted(None, 0, 0)), Verdict)  # an unknown token, refused
    with pytest.raises(MachineError):
        m.feed(LeaseSeen(admission()))


# -- the resolver's rules: the same send verdict and deadline policy -----------------------


def test_the_resolver_re_sends_only_inside_the_window() -> None:
    """A re-send must reach the upstream while it still remembers the key: the window
    less the exchange and the margin (mutant ``resolver-window-sign``)."""
    assert resolve_window(dedup_window=3600.0, timeout=10.0) == 3600.0 - 10.0 - RESOLVE_MARGIN
    assert resolve_claim_seconds(timeout=10.0, connect_timeout=5.0) == 15.0 + 2 * RESOLVE_MARGIN


@pytest.mark.parametrize(
    "claim, outcome",
    [
        (ClaimState(now=100.0, fence=3, deadline=120.0, older_in_flight=False), None),
        (ClaimState(now=100.0, fence=4, deadline=120.0, older_in_flight=False), "superseded"),
        (ClaimState(now=100.0, fence=3, deadline=None, older_in_flight=False), "unknown"),
        (ClaimState(now=100.0, fence=3, deadline=100.5, older_in_flight=False), "unknown"),
    ],
)
def test_the_resolver_does_not_re_send_after_a_newer_generation_or_past_its_claim(
    claim: ClaimState, outcome: str | None
) -> None:
    settled = resolution.before_resend(3, claim)
    assert (settled and settled.outcome) == outcome
    if settled is not None:
        assert not settled.resolved and settled.keep is (outcome == "unknown")


@pytest.mark.parametrize(
    "answered, mismatch, outcome, keep",
    [
        (Answer.FINAL, False, "resolved", False),
        (Answer.FINAL, True, "mismatch", False),
        (Answer.PRECONDITION_FAILED, False, "unknown", True),
        (Answer.UNKNOWN, False, "unknown", True),
        (Answer.NOT_PROCESSED, False, "unknown", True),
    ],
)
def test_the_answer_to_a_re_send(
    answered: Answer, mismatch: bool, outcome: str, keep: bool
) -> None:
    settled = resolution.after_resend(200, answered, mismatch=mismatch)
    assert (settled.outcome, settled.keep) == (outcome, keep)
    assert (settled.reason is Reason.AUTO_RESOLVED) is (outcome == "resolved")


# -- the exchange's end: an event of the machine (issue 52) ---------------------------------


def forwarding_machine(*, keyed: bool = True) -> RequestMachine:
    m = machine()
    to_admission(m)
    if keyed:
        m.feed(Admitted(claimed(), 0, 0, behind=False, gone=False))
    m.forwarding(CIMultiDict())
    return m


@pytest.mark.parametrize(
    "ended, fate",
    [
        (Exchange.NOT_SENT, Fate.RELEASE),
        (Exchange.CONNECT_TIMEOUT, Fate.RELEASE),
        (Exchange.NO_ANSWER, Fate.HOLD_UNKNOWN),
        (Exchange.NO_ANSWER_IN_TIME, Fate.HOLD_UNKNOWN),
        (Answer.FINAL, Fate.KEEP),
        (Answer.NOT_PROCESSED, Fate.RELEASE),
        (Answer.UNKNOWN, Fate.HOLD_UNKNOWN),
        (Answer.PRECONDITION_FAILED, Fate.RELEASE),
    ],
)
def test_the_exchange_end_decides_the_keys_fate(ended: Exchange | Answer, fate: Fate) -> None:
    m = forwarding_machine()
    assert m.exchange_ended(ended) is fate


def test_a_pass_through_has_no_key_to_settle() -> None:
    m = forwarding_machine(keyed=False)
    assert m.exchange_ended(Exchange.NO_ANSWER) is None
    verdict = m.answer_after()
    assert verdict.reason is Reason.UPSTREAM_CONNECTION_LOST
    assert verdict.detail is not None and "held as unknown" not in verdict.detail


def test_a_sent_write_whose_fate_the_store_refused_is_still_told_it_was_sent() -> None:
    """The database failing as the unknown outcome is held changes nothing of what the
    worker is told: sent, outcome unknown (never store-unavailable)."""
    m = forwarding_machine()
    assert m.exchange_ended(Exchange.NO_ANSWER_IN_TIME) is Fate.HOLD_UNKNOWN
    m.fate_performed(False)
    verdict = m.answer_after()
    assert verdict.reason is Reason.UPSTREAM_TIMEOUT and not verdict.retry_after
    assert verdict.detail is not None and "could not be recorded" in verdict.detail
    assert REASONS[Reason.UPSTREAM_TIMEOUT].sent is Sent.MAYBE
    assert m.failed().reason is Reason.INTERNAL_ERROR  # anything after: maybe, too


def test_an_end_the_machine_did_not_ask_for_raises() -> None:
    """h11's rule: feeding the machine an event it did not ask for is a bug, and raises."""
    m = machine()
    to_admission(m)
    with pytest.raises(MachineError):
        m.exchange_ended(Exchange.NOT_SENT)  # the forward has not begun
    with pytest.raises(MachineError):
        m.answer_after()
    m = forwarding_machine()
    with pytest.raises(MachineError):
        m.fate_performed(True)  # no end yet
    m.exchange_ended(Exchange.NOT_SENT)
    with pytest.raises(MachineError):
        m.exchange_ended(Exchange.NO_ANSWER)  # twice
    m.fate_performed(True)
    with pytest.raises(MachineError):
        m.fate_performed(True)
