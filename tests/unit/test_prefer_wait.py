"""``Prefer: wait=N`` (RFC 7240): the gateway's reading of the header, and the clients'
rule for retrying a write answered ``request-in-progress``."""

from __future__ import annotations

import json

import pytest

from fencegate_client.protocol import FencedResponse, fenced_response
from fencegate_client.waits import MAX_RETRIES, InProgressRetries, in_progress
from gateway.proxy.duplicates import Settles, prefer_wait


@pytest.mark.parametrize(
    ("values", "seconds"),
    [
        (["wait=5"], 5),
        (["WAIT=5"], 5),  # the token is case-insensitive
        (["Wait = 7"], 7),  # BWS around "="
        (['wait="3"'], 3),  # a quoted word
        (["respond-async, wait=10"], 10),
        (["return=minimal; foo=bar, wait=2; x"], 2),  # parameters are ignored
        (['handling=lenient, foo="a, wait=9", wait=4'], 4),  # commas inside quotes
        (["respond-async", "wait=6"], 6),  # several header lines
        (["wait=1, wait=8"], 1),  # only the first instance counts
        (["wait=0"], 0),
        ([], None),
        (["respond-async"], None),
        (["wait"], None),
        (["wait="], None),
        (["wait=soon"], None),
        (["wait=1.5"], None),
        (["wait=-1"], None),
        (["wait=12345678901"], None),
        (["waiting=5"], None),
        (["x-wait=5"], None),
    ],
)
def test_the_wait_preference(values: list[str], seconds: int | None) -> None:
    assert prefer_wait(values) == seconds


async def test_settles_wake_the_waiters_of_a_key_and_forget_it_after() -> None:
    settles = Settles()
    with settles.watch("job", "k") as one, settles.watch("job", "k") as two:
        first, second = one.current(), two.current()
        assert first is second
        settles.notify("job", "other")
        assert not first.is_set()
        settles.notify("job", "k")
        assert first.is_set()
        assert not one.current().is_set()  # a fresh event for the next wait
        assert len(settles) == 1
    assert len(settles) == 0
    settles.notify("job", "k")  # nobody waits: nothing kept
    assert len(settles) == 0


def answer(reason: str | None, status: int = 409, **headers: str) -> FencedResponse:
    if reason is None:
        return fenced_response(status, {"Content-Type": "application/json", **headers}, b"{}")
    body = json.dumps({"reason": reason, "status": status}).encode()
    return fenced_response(status, {"Content-Type": "application/problem+json", **headers}, body)


def test_only_request_in_progress_is_retried() -> None:
    assert in_progress(answer("request-in-progress"))
    for other in (answer("outcome-unknown"), answer("stale-generation"), answer(None, 201)):
        assert not in_progress(other)
        assert InProgressRetries(5, 60).headers(other, None) is None


def test_retries_ask_to_wait_and_are_bounded() -> None:
    busy = answer("request-in-progress")
    waited = answer("request-in-progress", **{"Preference-Applied": "wait=1"})
    retries = InProgressRetries(30, 60)
    sent = [retries.headers(busy, {"Accept": "application/json", "prefer": "return=minimal"})]
    while (again := retries.headers(waited, None)) is not None:
        sent.append(again)
    assert len(sent) == MAX_RETRIES
    assert sent[0] == {"Accept": "application/json", "Prefer": "return=minimal, wait=29"}
    assert all(s is not None and s["Prefer"].startswith("wait=2") for s in sent[1:])
    # Not without a retry_wait; never past the request's own timeout; no second retry
    # when the gateway did not wait.
    assert InProgressRetries(None, 60).headers(busy, None) is None
    assert InProgressRetries(0, 60).headers(busy, None) is None
    assert InProgressRetries(30, 5).headers(busy, None) == {"Prefer": "wait=4"}
    assert InProgressRetries(30, 1.5).headers(busy, None) is None
    once = InProgressRetries(30, 60)
    assert once.headers(busy, None) is not None
    assert once.headers(busy, None) is None
