"""The decision table, row by row and pair by pair: the first row that holds answers,
a fact not known yet is asked for only when no earlier row holds, and a method that is
not fenced meets only the rows that apply to it."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest

from gateway.fencing.after_forward import AFTER_FORWARD, Exchange, answer_after
from gateway.fencing.decision import (
    EXPECT_UNSUPPORTED,
    FROM_FACT,
    ROWS,
    STORE_UNAVAILABLE,
    UNKNOWN,
    Act,
    Facts,
    NoUpstream,
    Outcome,
    Row,
    Verdict,
    decide,
    http_error,
)
from gateway.fencing.fence import PROBLEMS, Reason
from gateway.fencing.profiles import Answer

# Every fact known, and none of them refusing: a fenced write that goes out.
CLEAR = Facts(
    lease=None,
    slot_free=True,
    over_limit=False,
    body_in_time=True,
    record=None,
    older_settled=True,
    at_send=None,
)

# A value of each row's fact that makes the row hold.
HOLDING: dict[int, Any] = {}
for index, row in enumerate(ROWS):
    HOLDING[index] = {
        "bad_target": "Dot-segments are not allowed in the path.",
        "unknown_upstream": NoUpstream("nope"),
        "token_as_bearer": True,
        "override_on_unfenced": True,
        "token_headers": 0 if row.answer is Reason.MISSING_FENCING_TOKEN else 2,
        "token_well_formed": False,
        "protected_hop_by_hop": True,
        "key_acceptable": False,
        "lease": Reason.STALE_GENERATION,
        "slot_free": False,
        "over_limit": True,
        "body_in_time": False,
        "first_settled": False,
        "record": Reason.IDEMPOTENCY_KEY_REUSED,
        "older_settled": False,
        "at_send": Reason.ORDERING_TIMEOUT,
    }[row.fact]


def holding(facts: Facts, index: int) -> Facts:
    return replace(facts, **{ROWS[index].fact: HOLDING[index]})


def expected(index: int) -> Verdict:
    return ROWS[index].verdict(HOLDING[index])


def test_every_fact_clear_forwards() -> None:
    assert decide(CLEAR) == Verdict(Outcome.FORWARD)


def test_the_defaults_pass_every_row_that_needs_no_act() -> None:
    """What intake leaves unset passes its row: only the facts that take a step are
    unknown at first, and the first of them is asked for."""
    assert decide(Facts()) == Act.CHECK_LEASE


@pytest.mark.parametrize("index", range(len(ROWS)), ids=lambda i: f"{i}-{ROWS[i].fact}")
def test_each_row_answers_when_its_fact_holds(index: int) -> None:
    verdict = decide(holding(CLEAR, index))
    assert verdict == expected(index)
    assert verdict.outcome is Outcome.REFUSE
    assert verdict.reason is not None and verdict.reason in PROBLEMS


PAIRS = [
    (i, j) for i, j in itertools.combinations(range(len(ROWS)), 2) if ROWS[i].fact != ROWS[j].fact
]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{ROWS[p[0]].fact}-before-{ROWS[p[1]].fact}")
def test_of_two_rows_that_hold_the_earlier_answers(pair: tuple[int, int]) -> None:
    first, second = pair
    assert decide(holding(holding(CLEAR, first), second)) == expected(first)


STEPPED = [i for i, row in enumerate(ROWS) if row.act is not None]


@pytest.mark.parametrize("index", STEPPED, ids=lambda i: ROWS[i].fact)
def test_an_unknown_fact_is_asked_for_only_when_no_earlier_row_holds(index: int) -> None:
    row = ROWS[index]
    unknown = replace(CLEAR, **{row.fact: UNKNOWN})
    assert decide(unknown) == row.act
    for earlier in range(index):
        if ROWS[earlier].fact != row.fact:
            assert decide(holding(unknown, earlier)) == expected(earlier)


def test_the_lease_and_the_record_answer_with_their_own_reason() -> None:
    for reason in (
        Reason.INVALID_FENCING_TOKEN,
        Reason.STALE_GENERATION,
        Reason.LEASE_ENDED,
        Reason.LEASE_EXPIRED,
    ):
        assert decide(replace(CLEAR, lease=reason)) == Verdict(Outcome.REFUSE, reason)
    for reason in (
        Reason.IDEMPOTENCY_KEY_REUSED,
        Reason.REQUEST_IN_PROGRESS,
        Reason.OUTCOME_UNKNOWN,
        Reason.REPLAY_UNAVAILABLE,
    ):
        assert decide(replace(CLEAR, record=reason)) == Verdict(Outcome.REFUSE, reason)
    assert decide(replace(CLEAR, record=Reason.IDEMPOTENT_REPLAY)) == Verdict(
        Outcome.REPLAY, Reason.IDEMPOTENT_REPLAY
    )


def test_a_method_that_is_not_fenced_meets_only_its_rows() -> None:
    unfenced = Facts(fenced=False)
    assert decide(unfenced) == Act.TAKE_SLOT
    unfenced = replace(unfenced, slot_free=True)
    assert decide(unfenced) == Act.READ_BODY
    read = replace(unfenced, over_limit=False, body_in_time=True)
    assert decide(read) == Verdict(Outcome.PASS)
    assert decide(replace(read, over_limit=True)).reason is Reason.BODY_TOO_LARGE
    assert decide(replace(read, body_in_time=False)).reason is Reason.BODY_TIMEOUT
    assert decide(replace(read, slot_free=False)).reason is Reason.OVERLOADED
    # The fencing rows do not apply: no token, no key, nothing asked of the database.
    bare = replace(read, token_headers=0, key_acceptable=False)
    assert decide(bare) == Verdict(Outcome.PASS)
    overridden = replace(unfenced, override_on_unfenced=True)
    assert decide(overridden).reason is Reason.INVALID_REQUEST


def test_details_and_closing() -> None:
    verdict = decide(replace(CLEAR, bad_target="Backslashes are not allowed in the path."))
    assert (verdict.detail, verdict.close) == ("Backslashes are not allowed in the path.", True)
    verdict = decide(replace(CLEAR, unknown_upstream=NoUpstream("pay'")))
    assert verdict.detail == 'No upstream named "pay\'".'
    assert decide(replace(CLEAR, token_headers=2)).close is False


def test_every_row_can_be_reached_and_every_act_is_used() -> None:
    # every act but RELEASE (the machine's, to undo a claim) finds out a fact
    assert {row.act for row in ROWS} - {None} == set(Act) - {Act.RELEASE}
    refusals = {row.answer for row in ROWS if isinstance(row.answer, Reason)}
    assert refusals <= set(PROBLEMS)
    assert all(isinstance(row, Row) for row in ROWS)
    assert sum(row.answer == FROM_FACT for row in ROWS) == 3


def test_a_write_held_back_at_the_send_says_why() -> None:
    stale = decide(replace(CLEAR, at_send=Reason.STALE_GENERATION))
    assert stale.reason is Reason.STALE_GENERATION
    assert stale.detail is not None and "not sent" in stale.detail
    late = decide(replace(CLEAR, at_send=Reason.ORDERING_TIMEOUT))
    assert late.reason is Reason.ORDERING_TIMEOUT
    assert late.detail is not None and "deadline" in late.detail


def test_a_request_without_a_current_lease_is_refused_before_it_takes_a_slot() -> None:
    """The lease row comes before the slot's: a made-up token never holds a slot while
    its body trickles in, and a full pool does not hide a lease refusal."""
    facts = Facts(lease=Reason.INVALID_FENCING_TOKEN)
    assert decide(facts) == Verdict(Outcome.REFUSE, Reason.INVALID_FENCING_TOKEN)
    assert decide(Facts(lease=None)) == Act.TAKE_SLOT
    assert decide(Facts(lease=None, slot_free=True)) == Act.READ_BODY


# -- the answers after the forward, and outside the table's walk ----------------------------


@pytest.mark.parametrize(
    ("ended", "reason"),
    [
        (Exchange.CONNECT_TIMEOUT, Reason.UPSTREAM_UNAVAILABLE),
        (Exchange.NOT_SENT, Reason.UPSTREAM_UNAVAILABLE),
        (Exchange.NO_ANSWER_IN_TIME, Reason.UPSTREAM_TIMEOUT),
        (Exchange.NO_ANSWER, Reason.UPSTREAM_CONNECTION_LOST),
        (Answer.PRECONDITION_FAILED, Reason.PRECONDITION_FAILED),
    ],
)
def test_the_answers_after_the_forward(ended: Exchange | Answer, reason: Reason) -> None:
    verdict = answer_after(ended)
    assert (verdict.outcome, verdict.reason) == (Outcome.REFUSE, reason)
    assert PROBLEMS[reason].status in (412, 502, 504)


@pytest.mark.parametrize("keyed", [True, False])
def test_an_exchange_that_ended_says_whether_anything_was_sent(keyed: bool) -> None:
    """Not sent: safe to retry, with Retry-After (the key free again); sent: unknown
    whether applied (the key held unknown), no Retry-After."""
    for ended in (Exchange.CONNECT_TIMEOUT, Exchange.NOT_SENT):
        verdict = answer_after(ended, keyed=keyed)
        assert verdict.retry_after and verdict.detail is not None
        assert "Nothing of the request was sent" in verdict.detail
        assert ("Idempotency-Key is back as it was" in verdict.detail) is keyed
    for ended in (Exchange.NO_ANSWER_IN_TIME, Exchange.NO_ANSWER):
        verdict = answer_after(ended, keyed=keyed)
        assert not verdict.retry_after and verdict.detail is not None
        assert "whether the upstream applied it is unknown" in verdict.detail
        assert ("held as unknown" in verdict.detail) is keyed
    assert answer_after(Answer.PRECONDITION_FAILED) == Verdict(
        Outcome.REFUSE, Reason.PRECONDITION_FAILED
    )


def test_every_way_an_exchange_ends_without_an_answer_has_its_row() -> None:
    assert set(Exchange) <= set(AFTER_FORWARD)
    # The other meanings of an answer are the upstream's own answer, streamed back.
    assert set(AFTER_FORWARD) - set(Exchange) == {Answer.PRECONDITION_FAILED}


def test_the_answers_outside_the_walk() -> None:
    assert STORE_UNAVAILABLE == Verdict(Outcome.REFUSE, Reason.STORE_UNAVAILABLE)
    assert EXPECT_UNSUPPORTED.reason is Reason.INVALID_REQUEST
    assert EXPECT_UNSUPPORTED.detail == "Only Expect: 100-continue is supported."
    assert http_error(400) is Reason.INVALID_REQUEST
    assert http_error(408) is Reason.HTTP_ERROR
    assert http_error(431) is Reason.HTTP_ERROR


def test_an_unknown_upstream_is_told_what_it_may_have_meant() -> None:
    """A lease call on the proxy listener is told where the control listener is; a
    misspelt upstream, the nearest configured name."""
    lease_call = decide(replace(CLEAR, unknown_upstream=NoUpstream("v1", None, "10.0.0.5:8081")))
    assert lease_call.reason is Reason.UNKNOWN_UPSTREAM
    assert lease_call.detail == (
        "No upstream named 'v1'. This is the proxy listener (/<upstream>/<path>); /v1/... is "
        "on the control listener, 10.0.0.5:8081 (control_listen)."
    )
    misspelt = decide(replace(CLEAR, unknown_upstream=NoUpstream("paymnts", "payments", "x")))
    assert misspelt.detail == "No upstream named 'paymnts'. Did you mean 'payments'?"


def test_a_token_sent_as_bearer_is_told_to_go_bare() -> None:
    verdict = decide(replace(CLEAR, token_as_bearer=True, token_well_formed=False))
    assert verdict.reason is Reason.INVALID_FENCING_TOKEN
    assert verdict.detail is not None and "Send the lease token bare" in verdict.detail
    assert decide(replace(CLEAR, token_well_formed=False)).detail is None  # the reason's own
