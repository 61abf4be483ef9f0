"""What the worker client makes of a gateway answer's ``sent`` (never / maybe / yes): the
errors and the answer carry it, from the problem document's member or, without one, from
the reason's row in ``REASONS``; only ``never`` may be sent again under a new key; and the
client's own retry follows it, never a detail text or a header. Pure: documents made up."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fencegate_client import errors, sent_of
from fencegate_client.protocol import FencedResponse, fenced_response, lease_lost
from fencegate_client.reasons import REASONS, Layer, Reason, Sent
from fencegate_client.waits import InProgressRetries, in_progress

GATEWAY = [r for r, info in REASONS.items() if Layer.GATEWAY in info.layers]
CONTROL_ONLY = [r for r, info in REASONS.items() if Layer.GATEWAY not in info.layers]


def doc(reason: Reason | str, **members: Any) -> dict[str, Any]:
    value = reason.value if isinstance(reason, Reason) else reason
    status = REASONS[reason].status if isinstance(reason, Reason) else 502
    return {"type": f"https://fencegate.dev/problems/{value}", "title": "t", "status": status,
            "detail": "made up", "reason": value, **members}  # fmt: skip


def answer(problem: dict[str, Any] | None, status: int = 502, **headers: str) -> FencedResponse:
    if problem is None:
        return fenced_response(status, {"Content-Type": "application/json", **headers}, b"{}")
    body = json.dumps(problem).encode()
    return fenced_response(status, {"Content-Type": "application/problem+json", **headers}, body)


@pytest.mark.parametrize("reason", GATEWAY, ids=str)
def test_every_gateway_reason_raises_an_error_with_its_sent(reason: Reason) -> None:
    info = REASONS[reason]
    assert info.sent is not None
    for problem in (doc(reason, sent=info.sent.value), doc(reason)):  # member, or the table
        error = errors.error_from_problem(info.status, problem)
        assert error.sent is info.sent
        assert error.new_key_safe is (info.sent is Sent.NEVER)
        assert "sent" not in error.extra


@pytest.mark.parametrize("reason", CONTROL_ONLY, ids=str)
def test_an_error_of_the_lease_api_alone_says_nothing_of_a_write(reason: Reason) -> None:
    error = errors.error_from_problem(REASONS[reason].status, doc(reason))
    assert error.sent is None and not error.new_key_safe


def test_the_member_is_read_first_and_the_table_only_without_one() -> None:
    # A newer gateway may say more of one occurrence than the table: its member wins.
    assert sent_of(doc(Reason.UPSTREAM_UNAVAILABLE, sent="maybe")) is Sent.MAYBE
    assert sent_of(doc(Reason.UPSTREAM_TIMEOUT)) is Sent.MAYBE
    assert sent_of(doc(Reason.UPSTREAM_CONNECTION_LOST)) is Sent.MAYBE
    assert sent_of(doc(Reason.UPSTREAM_UNAVAILABLE)) is Sent.NEVER
    # A value this client does not know is no value: the table's.
    assert sent_of(doc(Reason.UPSTREAM_UNAVAILABLE, sent="perhaps")) is Sent.NEVER
    assert sent_of(doc(Reason.UPSTREAM_UNAVAILABLE, sent=None)) is Sent.NEVER
    # A reason it does not know, with no member: nothing is known of the write.
    assert sent_of(doc("upstream-on-fire")) is None
    assert sent_of(doc("upstream-on-fire", sent="never")) is Sent.NEVER
    error = errors.error_from_problem(502, doc("upstream-on-fire"))
    assert isinstance(error, errors.RemoteError) and error.sent is None
    assert not error.new_key_safe
    assert errors.error_from_problem(502, doc("upstream-on-fire", sent="never")).new_key_safe


def test_the_detail_and_the_headers_decide_nothing() -> None:
    """An answer's words and headers are for people and timing: the same reason says the
    same of its write whatever they say."""
    worded = doc(Reason.UPSTREAM_UNAVAILABLE, detail="The request was sent: unknown.")
    assert answer(worded).sent is Sent.NEVER  # no Retry-After, an alarming detail
    assert answer(worded, **{"Retry-After": "1"}).sent is Sent.NEVER
    calm = doc(Reason.UPSTREAM_TIMEOUT, detail="Nothing of the request was sent: safe to retry.")
    assert answer(calm, 504, **{"Retry-After": "1"}).sent is Sent.MAYBE
    assert not answer(calm, 504, **{"Retry-After": "1"}).new_key_safe


def test_the_answer_carries_the_fact_and_raises_it() -> None:
    unreachable = answer(doc(Reason.UPSTREAM_UNAVAILABLE, sent="never"), **{"Retry-After": "1"})
    assert unreachable.sent is Sent.NEVER and unreachable.new_key_safe
    with pytest.raises(errors.RemoteError) as raised:
        unreachable.raise_for_problem()
    assert raised.value.remote_reason == "upstream-unavailable"
    assert raised.value.sent is Sent.NEVER and raised.value.new_key_safe
    cut = answer(doc(Reason.UPSTREAM_CONNECTION_LOST, sent="maybe"))
    assert cut.sent is Sent.MAYBE and not cut.new_key_safe
    with pytest.raises(errors.RemoteError) as raised:
        cut.raise_for_problem()
    assert raised.value.sent is Sent.MAYBE and not raised.value.new_key_safe
    # The upstream's own answer, even a 502: not the gateway's, nothing raised.
    relayed = answer(None, 502)
    assert relayed.sent is None and not relayed.new_key_safe
    relayed.raise_for_problem()


def test_a_lost_lease_was_never_sent() -> None:
    body = json.dumps(doc(Reason.STALE_GENERATION, sent="never")).encode()
    lost = lease_lost(409, "application/problem+json", body)
    assert isinstance(lost, errors.StaleGeneration)
    assert lost.sent is Sent.NEVER and lost.new_key_safe
    assert errors.LeaseLost.sent is Sent.NEVER  # the family's, whatever its reason


def test_the_client_sends_again_only_what_was_never_sent() -> None:
    busy = answer(doc(Reason.REQUEST_IN_PROGRESS, sent="never"), 409)
    assert in_progress(busy)
    assert InProgressRetries(5, 60).headers(busy, None) is not None
    # Were the gateway to say that this attempt may have gone out, it is the write's
    # answer: never sent again by the client on its own.
    maybe = answer(doc(Reason.REQUEST_IN_PROGRESS, sent="maybe"), 409)
    assert not in_progress(maybe)
    assert InProgressRetries(5, 60).headers(maybe, None) is None
    for reason in (Reason.UPSTREAM_UNAVAILABLE, Reason.UPSTREAM_TIMEOUT, Reason.OUTCOME_UNKNOWN):
        other = answer(doc(reason), REASONS[reason].status, **{"Retry-After": "1"})
        assert InProgressRetries(5, 60).headers(other, None) is None
