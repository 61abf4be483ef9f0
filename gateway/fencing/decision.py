"""The gateway's decision: the spec's table as data, one row per answer, in its order.

Each row names the answer it gives, the fact it tests and, for a fact that costs I/O to
learn, the act that finds it out (``Act``). ``decide`` walks the rows in order: the
first row whose test holds is the answer; a row whose fact is not known yet stops the
walk with its act. The proxy performs the acts (the lease, a slot, the body, the
admission, a duplicate's wait for its first attempt, the wait for older writes, the last
judgement before the send) and carries out the verdict. Nothing here does I/O.

To add a refusal: a ``Reason`` with its row in ``fencegate_client.reasons`` (status,
title, detail), a fact in ``Facts``, and a row where the spec's table puts it. A
``Reason`` is chosen here, in the rules behind the facts (``fence``) and in the answers
after the forward (``after_forward``), nowhere else in the gateway
(``tests/unit/test_decision_is_the_only_chooser.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from gateway.fencing.fence import Reason


class Act(StrEnum):
    """The one I/O step the proxy performs next: to find out a fact the request itself
    does not carry (a row's ``act``), or to give back a claim (``RELEASE``)."""

    CHECK_LEASE = "check-lease"  # the lease behind the token, as the database sees it now
    TAKE_SLOT = "take-slot"  # one of the pool's concurrency slots, if one is free
    READ_BODY = "read-body"  # the body, read up to the upstream's limit and within its time
    ADMIT = "admit"  # the admission's one transaction: the lease judged, the key claimed
    # ``Prefer: wait``: the slot given back, the key's first attempt settled (a bounded
    # wait holding no slot and no database connection); then answered from the store
    WAIT_FIRST = "wait-first"
    WAIT_OLDER = "wait-older"  # older generations' writes to the job settled (bounded)
    READ_CLAIM = "read-claim"  # right before the first byte: still current, claim in time
    RELEASE = "release"  # the claim undone: the write was never sent


class Outcome(StrEnum):
    PASS = "pass"  # a method that is not fenced: forwarded without the fencing checks
    REFUSE = "refuse"  # answered by the gateway with a problem document
    REPLAY = "replay"  # answered with the key's stored answer
    FORWARD = "forward"  # a fenced write, sent to the upstream


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Final = _Unknown()


# The first segments of the control listener's paths: a request for one of them on the
# proxy listener was meant for the other listener.
CONTROL_NAMES: Final = frozenset({"v1", "admin", "healthz", "readyz", "metrics", "openapi.json"})


@dataclass(frozen=True, slots=True)
class NoUpstream:
    """The upstream name a request asked for that no upstream has, with what may help:
    the nearest configured name, and where the control listener is."""

    name: str
    nearest: str | None = None  # the configured name nearest to ``name``, if one is near
    lease_api_at: str | None = None  # control_listen

    def told(self) -> str:
        said = f"No upstream named {self.name!r}."
        if self.name in CONTROL_NAMES and self.lease_api_at is not None:
            said += (
                f" This is the proxy listener (/<upstream>/<path>); /{self.name}/... is on "
                f"the control listener, {self.lease_api_at} (control_listen)."
            )
        elif self.nearest is not None:
            said += f" Did you mean {self.nearest!r}?"
        return said


@dataclass(slots=True)
class Facts:
    """What is known about one request; ``UNKNOWN`` until its act has run. The proxy
    fills it in; ``decide`` only reads it."""

    bad_target: str | None = None  # why the target or the framing is refused
    unknown_upstream: NoUpstream | None = None  # the name asked for, when no upstream has it
    override_on_unfenced: bool = False  # a method-override header on an unfenced method
    fenced: bool = True
    token_headers: int = 1  # how many Fencing-Token headers
    token_as_bearer: bool = False  # sent as ``Bearer <token>``, as the control listener takes it
    token_well_formed: bool = True
    protected_hop_by_hop: bool = False  # Connection names Fencing-Token or Idempotency-Key
    key_acceptable: bool = True  # a well-formed key, or none where none is required
    # None: the lease may write now; else why not (invalid token, stale, ended, expired).
    lease: Reason | _Unknown | None = UNKNOWN
    slot_free: bool | _Unknown = UNKNOWN  # a slot of the request's pool was free (taken)
    over_limit: bool | _Unknown = UNKNOWN  # the body is over the upstream's limit
    body_in_time: bool | _Unknown = UNKNOWN  # it arrived within the body timeouts
    # A duplicate of a write in flight that asked to wait (``Prefer: wait``): its first
    # attempt settled within the wait. True also when there is nothing to wait for; the
    # admission makes it UNKNOWN when it finds the key in flight and the wait has time
    # left, and the record is found out again after the wait.
    first_settled: bool | _Unknown = True
    # None: the key is this request's to forward (claimed, or taken over); else what its
    # record answers (a replay, a reused key, in progress, an unknown outcome).
    record: Reason | _Unknown | None = UNKNOWN
    older_settled: bool | _Unknown = UNKNOWN  # no older generation's write still in flight
    # Right before the first byte goes out: None, or why the claim no longer allows it
    # (a newer generation admitted meanwhile; the claim near or past its deadline).
    at_send: Reason | _Unknown | None = UNKNOWN


@dataclass(frozen=True, slots=True)
class Verdict:
    """The gateway's one verdict type: what to do with the request (and, refused, why)."""

    outcome: Outcome
    reason: Reason | None = None
    detail: str | None = None  # None: the reason's own detail
    close: bool = False  # close the connection after answering
    retry_after: bool = False  # answered with ``Retry-After: 1`` (besides the reason's own)


FORWARD: Final = Verdict(Outcome.FORWARD)
FROM_FACT: Final = "the fact's own reason"


def _true(value: Any) -> bool:
    return value is True


def _false(value: Any) -> bool:
    return value is False


def _given(value: Any) -> bool:
    return value is not None


@dataclass(frozen=True, slots=True)
class Row:
    answer: Reason | Outcome | str  # FROM_FACT: the fact is itself a Reason
    fact: str  # the ``Facts`` field it tests
    holds: Callable[[Any], bool]
    act: Act | None = None  # how the fact is found out when it is UNKNOWN
    # ``{value}``: the fact's value; a callable: told the value, says the detail
    detail: str | Mapping[Reason, str] | Callable[[Any], str] | None = None
    close: bool = False
    fenced_only: bool = True  # skipped for a method that is not fenced

    def verdict(self, value: Any) -> Verdict:
        answer = value if self.answer == FROM_FACT else self.answer
        if answer is Reason.IDEMPOTENT_REPLAY:
            return Verdict(Outcome.REPLAY, answer)
        if isinstance(answer, Outcome):
            return Verdict(answer)
        reason = Reason(answer)
        detail = self.detail
        if isinstance(detail, Mapping):
            detail = detail.get(reason)
        elif isinstance(detail, str):
            detail = detail.format(value=value)
        elif detail is not None:
            detail = detail(value)
        return Verdict(Outcome.REFUSE, reason, detail, self.close)


# fmt: off
ROWS: Final[tuple[Row, ...]] = (
    # answer                          fact                    holds     act
    Row(Reason.INVALID_REQUEST,       "bad_target",           _given, fenced_only=False,
        detail="{value}", close=True),
    Row(Reason.UNKNOWN_UPSTREAM,      "unknown_upstream",     _given, fenced_only=False,
        detail=NoUpstream.told),
    Row(Reason.INVALID_REQUEST,       "override_on_unfenced", _true, fenced_only=False,
        detail="A method-override header is not allowed on a method that is not fenced: "
               "send the method itself."),
    # A method that is not fenced skips every row below but the slot's and the body's.
    Row(Reason.MISSING_FENCING_TOKEN, "token_headers",        lambda n: n == 0),
    Row(Reason.INVALID_REQUEST,       "token_headers",        lambda n: n > 1,
        detail="Send exactly one Fencing-Token header."),
    Row(Reason.INVALID_FENCING_TOKEN, "token_as_bearer",      _true,
        detail="Send the lease token bare, without \"Bearer \": Fencing-Token: fgl_... "
               "(Authorization: Bearer is the control listener's worker token)."),
    Row(Reason.INVALID_FENCING_TOKEN, "token_well_formed",    _false),
    Row(Reason.INVALID_REQUEST,       "protected_hop_by_hop", _true,
        detail="The Connection header must not name Fencing-Token or Idempotency-Key."),
    Row(Reason.MISSING_IDEMPOTENCY_KEY, "key_acceptable",     _false),
    # invalid-fencing-token (unknown), stale-generation, lease-ended, lease-expired
    Row(FROM_FACT,                    "lease",                _given,   Act.CHECK_LEASE),
    Row(Reason.OVERLOADED,            "slot_free",            _false,   Act.TAKE_SLOT,
        fenced_only=False),
    Row(Reason.BODY_TOO_LARGE,        "over_limit",           _true,    Act.READ_BODY,
        fenced_only=False),
    Row(Reason.BODY_TIMEOUT,          "body_in_time",         _false,   Act.READ_BODY,
        fenced_only=False, close=True),
    # The wait that ``Prefer: wait`` asks for; at its end, still in flight.
    Row(Reason.REQUEST_IN_PROGRESS,   "first_settled",        _false,   Act.WAIT_FIRST,
        detail="The key's first attempt had not settled when this request's wait ended, "
               "or it ended without an answer to replay. Nothing of this request was "
               "sent: send it again with the same key."),
    # idempotent-replay, replay-unavailable, idempotency-key-reused, request-in-progress,
    # outcome-unknown
    Row(FROM_FACT,                    "record",               _given,   Act.ADMIT),
    Row(Reason.ORDERING_TIMEOUT,      "older_settled",        _false,   Act.WAIT_OLDER),
    # stale-generation, ordering-timeout
    Row(FROM_FACT,                    "at_send",              _given,   Act.READ_CLAIM,
        detail={
            Reason.STALE_GENERATION: "A newer generation of this job was admitted before "
                                     "this write could be forwarded; it was not sent.",
            Reason.ORDERING_TIMEOUT: "This write was held past its claim's deadline before "
                                     "it could be forwarded; it was not sent. Retry it.",
        }),
)
# fmt: on


PASS: Final = Verdict(Outcome.PASS)

# Answers outside the table's walk: the database (or a lease source) did not answer while
# facts were gathered; an ``Expect`` other than ``100-continue``.
STORE_UNAVAILABLE: Final = Verdict(Outcome.REFUSE, Reason.STORE_UNAVAILABLE)
# A failure nobody foresaw (a bug): a problem document all the same, never aiohttp's
# plain-text 500; sent "maybe" (the forward may have begun).
INTERNAL_ERROR: Final = Verdict(Outcome.REFUSE, Reason.INTERNAL_ERROR)
EXPECT_UNSUPPORTED: Final = Verdict(
    Outcome.REFUSE, Reason.INVALID_REQUEST, "Only Expect: 100-continue is supported."
)


def http_error(status: int) -> Reason:
    """Either listener's answer to a request refused below the application (bytes the
    HTTP parser refuses; a control body that did not arrive in time, 408):
    ``invalid-request`` for a 400, else ``http-error`` with the status."""
    return Reason.INVALID_REQUEST if status == 400 else Reason.HTTP_ERROR


def decide(facts: Facts) -> Verdict | Act:
    """The first row that holds; the act that finds out the first fact not known yet;
    else forward (pass, for a method that is not fenced)."""
    fenced = facts.fenced
    for row in ROWS:
        if row.fenced_only and not fenced:
            continue
        value = getattr(facts, row.fact)
        if value is UNKNOWN:
            assert row.act is not None, f"{row.fact} has no act that finds it out"
            return row.act
        if row.holds(value):
            return row.verdict(value)
    return FORWARD if fenced else PASS
