"""``gateway.fencing.fence``, the fencing decision as pure functions: table-driven, no I/O.

Keys (``parse_key``, ``canonical_key``), fingerprints, a key's record
(``effective_state``, ``record_reason``), the problem document's extension members and
the reason catalogue, each row by row. (The lease behind a token is judged by the
admission's SQL: ``tests/integration/test_sql_verdicts.py``.)
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fencegate_client.errors import LOST_BY_REASON
from fencegate_client.reasons import AUDIT_ONLY
from gateway.fencing import fence
from gateway.fencing.fence import PROBLEMS, Presented, Reason, Record, RecordState
from lease_core.rules import Job, State

TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
VISIBLE = "".join(chr(c) for c in range(0x20, 0x7F))  # what a structured-field string holds

# -- parse_key ------------------------------------------------------------------------------

PARSED: list[tuple[str, str]] = [
    # (header, key): bare tokens
    ("abc", "abc"),
    ("step-1", "step-1"),
    ("0f8e6b1c-3b9d-4c1e-9a57-2f0d8c7e6a11", "0f8e6b1c-3b9d-4c1e-9a57-2f0d8c7e6a11"),  # a UUID
    (TOKEN_CHARS, TOKEN_CHARS),  # every token character, bare
    ("x", "x"),
    # structured-field strings: the same key as bare, and what bare cannot carry
    ('"abc"', "abc"),
    ('"a b"', "a b"),
    ('" padded "', " padded "),  # spaces inside the quotes are the key's
    ('"a/b,c;d=e"', "a/b,c;d=e"),
    ('"(){}[]<>@:?"', "(){}[]<>@:?"),
    # escapes: only \" and \\ , each one character of the key
    ('"a\\"b"', 'a"b'),
    ('"a\\\\b"', "a\\b"),
    ('"\\\\\\""', '\\"'),
    # optional white space around the value, never inside a bare token
    ("  abc", "abc"),
    ("abc\t", "abc"),
    (' \t"abc" ', "abc"),
]


@pytest.mark.parametrize(("header", "key"), PARSED)
def test_parse_key_accepts(header: str, key: str) -> None:
    assert fence.parse_key(header) == key


MALFORMED: list[str] = [
    "",  # nothing
    "   ",
    '""',  # an empty string is no key
    '"abc',  # unterminated
    'abc"',
    '"a"b"',  # a bare quote inside
    '"a\\b"',  # an escape other than \" and \\
    '"abc\\"',  # the closing quote escaped
    "a b",  # space in a bare token
    "a,b",  # comma: a list, not a key
    "a;b",
    "a/b",
    "(abc)",
    '"abc";p=1',  # parameters are not part of the grammar
    '"abc", "def"',
    "abc\n",  # only space and tab are stripped
    "\nabc",
    '"a\tb"',  # controls are not string characters
    "a\x00b",
    '"\x7f"',  # DEL
    "é",  # not ASCII
    '"é"',
    "\u2205abc",  # the anonymous prefix is no key character
    '"\u2205abc"',
]


@pytest.mark.parametrize("header", MALFORMED)
def test_parse_key_refuses_malformed(header: str) -> None:
    assert fence.parse_key(header) is None


@pytest.mark.parametrize(
    ("header", "max_length", "key"),
    [
        ("a" * 255, 255, "a" * 255),
        ("a" * 256, 255, None),
        ('"' + "a" * 255 + '"', 255, "a" * 255),
        ('"' + "a" * 256 + '"', 255, None),
        # the limit counts the key's characters, not the header's: 255 escaped quotes
        ('"' + '\\"' * 255 + '"', 255, '"' * 255),
        ('"' + '\\"' * 256 + '"', 255, None),
        # the default is 255; another limit is honoured both ways
        ("abcd", 3, None),
        ("abc", 3, "abc"),
        ('"ab c"', 3, None),
        ("a", 1, "a"),
    ],
)
def test_parse_key_length_limits(header: str, max_length: int, key: str | None) -> None:
    assert fence.parse_key(header, max_length=max_length) == key


def test_parse_key_default_limit_is_255() -> None:
    assert fence.parse_key("k" * 255) == "k" * 255
    assert fence.parse_key("k" * 256) is None


# -- canonical_key --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "canonical"),
    [
        ("abc", "abc"),
        ("step-1", "step-1"),
        (TOKEN_CHARS, TOKEN_CHARS),
        ("0f8e6b1c-3b9d-4c1e-9a57-2f0d8c7e6a11", "0f8e6b1c-3b9d-4c1e-9a57-2f0d8c7e6a11"),
        ("a b", '"a b"'),
        (" ", '" "'),
        ("a/b", '"a/b"'),
        ('a"b', '"a\\"b"'),
        ("a\\b", '"a\\\\b"'),
        ('\\"', '"\\\\\\""'),
    ],
)
def test_canonical_key(key: str, canonical: str) -> None:
    assert fence.canonical_key(key) == canonical
    assert fence.parse_key(canonical) == key


@pytest.mark.parametrize(("header", "key"), PARSED)
def test_every_spelling_of_a_key_goes_upstream_in_one_form(header: str, key: str) -> None:
    """``"abc"`` and ``abc`` are one key and leave as one header value."""
    canonical = fence.canonical_key(key)
    assert fence.canonical_key(fence.parse_key(canonical) or "") == canonical
    if all(c in TOKEN_CHARS for c in key):
        assert canonical == key
        assert fence.parse_key(f'"{key}"') == key


keys = st.one_of(
    st.text(alphabet=TOKEN_CHARS, min_size=1, max_size=255),
    st.text(alphabet=VISIBLE, min_size=1, max_size=255),
    st.text(alphabet='ab "\\', min_size=1, max_size=255),  # quotes and escapes, densely
)


@given(keys)
def test_canonical_key_round_trips(key: str) -> None:
    canonical = fence.canonical_key(key)
    assert fence.parse_key(canonical) == key
    # bare exactly when every character is a token character
    assert (canonical == key) == all(c in TOKEN_CHARS for c in key)


@given(st.text(max_size=40))
def test_parse_key_gives_only_keys_canonical_key_can_send(header: str) -> None:
    key = fence.parse_key(header)
    if key is not None:
        assert 1 <= len(key) <= 255
        assert not fence.is_anonymous(key)
        assert fence.parse_key(fence.canonical_key(key)) == key


def test_anonymous_keys_are_unique_and_never_parsed() -> None:
    made = {fence.anonymous_key() for _ in range(100)}
    assert len(made) == 100
    assert all(fence.is_anonymous(k) for k in made)
    assert not any(fence.is_anonymous(key) for _, key in PARSED)
    assert all(fence.parse_key(k) is None for k in made)


# -- fingerprints ---------------------------------------------------------------------------

BASE: dict[str, Any] = {
    "method": "POST",
    "upstream": "payments",
    "path": "/charges",
    "query": "currency=EUR",
    "body": b'{"amount": 500}',
}


def fp(**change: Any) -> str:
    parts = {**BASE, **change}
    return fence.fingerprint(
        parts["method"], parts["upstream"], parts["path"], parts["query"], parts["body"]
    )


def test_the_same_request_has_the_same_fingerprint() -> None:
    assert fp() == fp()
    assert len(fp()) == 64 and int(fp(), 16) >= 0
    # methods are compared upper-cased (the gateway sees them so)
    assert fp(method="post") == fp()


@pytest.mark.parametrize(
    "change",
    [
        {"method": "PUT"},
        {"upstream": "payments2"},
        {"path": "/charges/"},
        {"path": "/Charges"},
        {"query": "currency=USD"},
        {"query": ""},
        {"body": b'{"amount": 501}'},
        {"body": b""},
        {"body": b'{"amount": 500} '},
        {"path": "/charges\udcff"},  # a path that is not UTF-8 (surrogate escapes)
    ],
)
def test_each_part_of_the_request_changes_the_fingerprint(change: dict[str, Any]) -> None:
    assert fp(**change) != fp()


@pytest.mark.parametrize(
    ("one", "other"),
    [
        # the same characters split differently between two parts
        ({"upstream": "ab", "path": "c"}, {"upstream": "a", "path": "bc"}),
        ({"method": "PO", "upstream": "STx"}, {"method": "POST", "upstream": "x"}),
        ({"path": "/a?b", "query": ""}, {"path": "/a", "query": "b"}),
        ({"path": "/a", "query": "b"}, {"path": "/ab", "query": ""}),
        ({"query": "x", "body": b""}, {"query": "", "body": b"x"}),
        ({"query": "", "body": b"\x00" * 8}, {"query": "\x00" * 8, "body": b""}),
        ({"upstream": "", "path": "ab"}, {"upstream": "ab", "path": ""}),
    ],
)
def test_no_request_is_another_split_differently(
    one: dict[str, Any], other: dict[str, Any]
) -> None:
    assert fp(**one) != fp(**other)


parts = st.tuples(
    st.text(alphabet="AB", max_size=3),
    st.text(alphabet="ab", max_size=3),
    st.text(alphabet="ab", max_size=3),
    st.text(alphabet="ab", max_size=3),
    st.text(alphabet="ab", max_size=3).map(str.encode),
)


@given(parts, parts)
def test_different_requests_have_different_fingerprints(
    one: tuple[str, str, str, str, bytes], other: tuple[str, str, str, str, bytes]
) -> None:
    """Over a tiny alphabet, so that concatenations collide often: only equal requests
    share a fingerprint."""
    assert (fence.fingerprint(*one) == fence.fingerprint(*other)) == (one == other)


@given(st.binary(max_size=300), st.lists(st.integers(min_value=0, max_value=300), max_size=6))
def test_a_body_hashed_in_pieces_is_the_body_hashed_whole(body: bytes, cuts: list[int]) -> None:
    hasher = fence.fingerprint_hasher("PUT", "store", "/objects/1", "v=2")
    edges = [0, *sorted(min(c, len(body)) for c in cuts), len(body)]
    for start, end in itertools.pairwise(edges):
        hasher.update(body[start:end])
    assert hasher.hexdigest() == fence.fingerprint("PUT", "store", "/objects/1", "v=2", body)


def test_a_hasher_without_a_body_is_the_empty_body() -> None:
    hasher = fence.fingerprint_hasher("DELETE", "store", "/objects/1", "")
    assert hasher.hexdigest() == fence.fingerprint("DELETE", "store", "/objects/1", "", b"")


# -- a presented lease ------------------------------------------------------------------------

NOW = 1_000.0


def job(
    state: State = State.LEASED,
    generation: int = 4,
    owner: str | None = "worker-1",
    expires: float | None = NOW + 30,
) -> Job:
    return Job("job-1", state, generation, owner=owner, lease_expires_at=expires)


def presented(the_job: Job | None, generation: int = 4, owner: str = "worker-1") -> Presented:
    return Presented("job-1", generation, owner, the_job)


# -- records: effective_state and record_reason ---------------------------------------------

FP = "f" * 64


def record(
    state: RecordState,
    deadline: float = NOW + 10,
    fingerprint: str = FP,
    body: bytes | None = b"{}",
) -> Record:
    # ``overdue``: as the SQL's past_deadline reads it at NOW
    return Record(
        fingerprint,
        state,
        generation=4,
        attempt="a1",
        deadline=deadline,
        overdue=deadline <= NOW,
        body=body,
    )


@pytest.mark.parametrize(
    ("stored", "state"),
    [
        (record(RecordState.IN_FLIGHT), RecordState.IN_FLIGHT),
        (record(RecordState.IN_FLIGHT, deadline=NOW + 0.001), RecordState.IN_FLIGHT),
        (record(RecordState.IN_FLIGHT, deadline=NOW), RecordState.UNKNOWN),
        (record(RecordState.IN_FLIGHT, deadline=NOW - 60), RecordState.UNKNOWN),
        (record(RecordState.COMPLETED, deadline=NOW - 60), RecordState.COMPLETED),
        (record(RecordState.COMPLETED), RecordState.COMPLETED),
        (record(RecordState.UNKNOWN), RecordState.UNKNOWN),
        (record(RecordState.UNKNOWN, deadline=NOW - 60), RecordState.UNKNOWN),
    ],
)
def test_effective_state(stored: Record, state: RecordState) -> None:
    assert fence.effective_state(stored) is state


REUSED = Reason.IDEMPOTENCY_KEY_REUSED
IN_PROGRESS = Reason.REQUEST_IN_PROGRESS
UNKNOWN = Reason.OUTCOME_UNKNOWN
REPLAY = Reason.IDEMPOTENT_REPLAY
# To be forwarded again (retry), but the admission did not take the key over: another
# request took it over first.
TAKEN = Reason.REQUEST_IN_PROGRESS


@pytest.mark.parametrize(
    ("case", "stored", "policy", "reason"),
    [
        # another request under the key: refused whatever the record's state
        ("reused, completed", record(RecordState.COMPLETED, fingerprint="0" * 64), "hold", REUSED),
        ("reused, in flight", record(RecordState.IN_FLIGHT, fingerprint="0" * 64), "hold", REUSED),
        ("reused, unknown", record(RecordState.UNKNOWN, fingerprint="0" * 64), "retry", REUSED),
        (
            "reused, in flight past its deadline",
            record(RecordState.IN_FLIGHT, deadline=NOW - 1, fingerprint="0" * 64),
            "retry",
            REUSED,
        ),
        # the same request
        ("replay", record(RecordState.COMPLETED), "hold", REPLAY),
        ("replay under retry", record(RecordState.COMPLETED), "retry", REPLAY),
        ("replay, long after", record(RecordState.COMPLETED, deadline=NOW - 60), "hold", REPLAY),
        (
            "applied, the answer too large to keep",
            record(RecordState.COMPLETED, body=None),
            "hold",
            Reason.REPLAY_UNAVAILABLE,
        ),
        ("vanished between the claim and the read", None, "hold", IN_PROGRESS),
        ("in progress", record(RecordState.IN_FLIGHT), "hold", IN_PROGRESS),
        ("in progress under retry", record(RecordState.IN_FLIGHT), "retry", IN_PROGRESS),
        ("unknown, hold", record(RecordState.UNKNOWN), "hold", UNKNOWN),
        ("unknown, retry", record(RecordState.UNKNOWN), "retry", TAKEN),
        (
            "in flight past its deadline, hold",
            record(RecordState.IN_FLIGHT, deadline=NOW - 1),
            "hold",
            UNKNOWN,
        ),
        (
            "in flight past its deadline, retry",
            record(RecordState.IN_FLIGHT, deadline=NOW - 1),
            "retry",
            TAKEN,
        ),
        (
            "in flight to exactly now, hold",
            record(RecordState.IN_FLIGHT, deadline=NOW),
            "hold",
            UNKNOWN,
        ),
    ],
)
def test_record_reason(case: str, stored: Record | None, policy: str, reason: Reason) -> None:
    assert fence.record_reason(stored, FP, policy) is reason, case
    assert fence.in_progress(reason) is (reason is Reason.REQUEST_IN_PROGRESS)


@pytest.mark.parametrize(
    ("lease", "highest", "expected"),
    [
        (None, None, None),
        (None, 4, None),
        (None, 5, Reason.STALE_GENERATION),  # a newer generation admitted meanwhile
        (Reason.LEASE_ENDED, 5, Reason.LEASE_ENDED),
        (Reason.LEASE_EXPIRED, 3, Reason.LEASE_EXPIRED),
    ],
)
def test_lease_after_wait(lease: Reason | None, highest: int | None, expected: Reason) -> None:
    assert fence.lease_after_wait(lease, highest, generation=4) is expected


# -- problem_extra --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seen", "highest", "extra"),
    [
        (None, None, {}),
        (None, 7, {}),
        (
            presented(None),
            None,
            {"job_id": "job-1", "generation": 4, "highest_generation": None},
        ),
        (presented(None), 6, {"job_id": "job-1", "generation": 4, "highest_generation": 6}),
        (presented(None), 0, {"job_id": "job-1", "generation": 4, "highest_generation": 0}),
        (presented(job()), None, {"job_id": "job-1", "generation": 4, "highest_generation": 4}),
        (
            presented(job(generation=7)),
            None,
            {"job_id": "job-1", "generation": 4, "highest_generation": 7},
        ),
        (
            presented(job(generation=7)),
            9,
            {"job_id": "job-1", "generation": 4, "highest_generation": 9},
        ),
        (
            presented(job(generation=7)),
            5,
            {"job_id": "job-1", "generation": 4, "highest_generation": 7},
        ),
    ],
)
def test_problem_extra(seen: Presented | None, highest: int | None, extra: dict[str, Any]) -> None:
    assert fence.problem_extra(seen, highest) == extra


# -- the reason catalogue -------------------------------------------------------------------


def test_every_refusal_has_a_problem_and_a_replay_has_none() -> None:
    assert set(PROBLEMS) == set(fence.GATEWAY_REASONS) - AUDIT_ONLY


@pytest.mark.parametrize("reason", [r for r in fence.GATEWAY_REASONS if r not in AUDIT_ONLY])
def test_each_reason_is_a_complete_problem(reason: Reason) -> None:
    info = PROBLEMS[reason]
    assert 400 <= info.status <= 599
    assert info.title.strip() and info.detail.strip()


# The statuses the specification's table gives (SPEC.md, "Gateway protocol").
SPEC_STATUSES = {
    Reason.UNKNOWN_UPSTREAM: 404,
    Reason.MISSING_FENCING_TOKEN: 428,
    Reason.INVALID_FENCING_TOKEN: 403,
    Reason.MISSING_IDEMPOTENCY_KEY: 400,
    Reason.STALE_GENERATION: 409,
    Reason.LEASE_ENDED: 409,
    Reason.LEASE_EXPIRED: 409,
    Reason.GENERATION_REISSUED: 409,  # the 2026-12-06 extension "one holder per generation"
    Reason.BODY_TOO_LARGE: 413,
    Reason.IDEMPOTENCY_KEY_REUSED: 422,
    Reason.REQUEST_IN_PROGRESS: 409,
    Reason.OUTCOME_UNKNOWN: 409,
    Reason.ORDERING_TIMEOUT: 503,
    Reason.UPSTREAM_UNAVAILABLE: 502,
    Reason.UPSTREAM_TIMEOUT: 504,
}


@pytest.mark.parametrize(("reason", "status"), SPEC_STATUSES.items())
def test_statuses_are_the_specifications(reason: Reason, status: int) -> None:
    assert PROBLEMS[reason].status == status


def test_the_gateway_names_a_lost_lease_as_the_client_reads_it() -> None:
    """The worker client turns exactly these refusals into ``LeaseLost``."""
    lost = {
        Reason.STALE_GENERATION,
        Reason.LEASE_ENDED,
        Reason.LEASE_EXPIRED,
        Reason.GENERATION_REISSUED,
    }
    assert set(LOST_BY_REASON) == {r.value for r in lost}
