"""The answers after the forward: how an exchange with the upstream ended, as
``forwarding`` reports it (a fact), turned into the gateway's own answer.

The decision table (``decision``) ends with the verdict to forward; what happens then is
no longer a choice among rows in the spec's order but one small table: an exchange that
did not reach the upstream is ``upstream-unavailable`` (sent never), one that was sent
and got no answer ``upstream-timeout`` or ``upstream-connection-lost`` (sent maybe); an
answer whose meaning for the key (``profiles.answer_of``) is
"the request's own precondition failed" is ``precondition-failed``. Every other answer
is the upstream's own, streamed back. What every end does to the write's key (``FATES``:
released, kept, held unknown) is this module's too; the request's machine asks it, the
proxy performs it. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Final

from gateway.fencing.decision import Outcome, Verdict
from gateway.fencing.fence import Reason
from gateway.fencing.profiles import Answer


class Exchange(StrEnum):
    """How an exchange that brought no answer to stream back ended."""

    CONNECT_TIMEOUT = "connect-timeout"  # not sent: no connection in time
    NOT_SENT = "not-sent"  # not sent: refused, unreachable
    NO_ANSWER_IN_TIME = "no-answer-in-time"  # sent (or maybe sent), no answer in time
    NO_ANSWER = "no-answer"  # sent (or maybe sent), the connection failed


Ended = Exchange | Answer  # an exchange's end, or the meaning of the answer's head


class Fate(StrEnum):
    """What the exchange's end does to the key the write claimed."""

    RELEASE = "release"  # nothing sent, or nothing done: free again (or back as it was)
    KEEP = "keep"  # the upstream's final answer: the key's, replayed to every retry
    HOLD_UNKNOWN = "hold-unknown"  # sent, no final answer: whether it was applied is unknown


# fmt: off
FATES: Final[Mapping[Ended, Fate]] = {
    Exchange.CONNECT_TIMEOUT:   Fate.RELEASE,
    Exchange.NOT_SENT:          Fate.RELEASE,
    Exchange.NO_ANSWER_IN_TIME: Fate.HOLD_UNKNOWN,
    Exchange.NO_ANSWER:         Fate.HOLD_UNKNOWN,
    Answer.PRECONDITION_FAILED: Fate.RELEASE,  # not applied (RFC 9110 13.1)
    Answer.NOT_PROCESSED:       Fate.RELEASE,  # "not processed, try later"
    Answer.FINAL:               Fate.KEEP,
    Answer.UNKNOWN:             Fate.HOLD_UNKNOWN,  # cut short, a proxy's 502/504, ...
}
# fmt: on

# fmt: off
AFTER_FORWARD: Final[Mapping[Ended, Reason]] = {
    # Each reason says one thing of the write (its ``sent``): never, or maybe.
    Exchange.CONNECT_TIMEOUT:    Reason.UPSTREAM_UNAVAILABLE,
    Exchange.NOT_SENT:           Reason.UPSTREAM_UNAVAILABLE,
    Exchange.NO_ANSWER_IN_TIME:  Reason.UPSTREAM_TIMEOUT,
    Exchange.NO_ANSWER:          Reason.UPSTREAM_CONNECTION_LOST,
    # Not applied (RFC 9110 13.1): told in the gateway's words, not in the upstream's.
    Answer.PRECONDITION_FAILED:  Reason.PRECONDITION_FAILED,
}
# fmt: on


# What each end means for the worker: nothing was sent (safe to retry, with
# ``Retry-After``), or it was sent and whether it was applied is unknown.
NOT_SENT: Final = frozenset({Exchange.CONNECT_TIMEOUT, Exchange.NOT_SENT})
_FREED = " Nothing of the request was sent{key}: safe to retry."
_UNKNOWN = " The request was sent: whether the upstream applied it is unknown.{key}"
_HELD = (
    " Its key's outcome is held as unknown: a retry with the same key is answered as the "
    "upstream's unknown_outcome says (GET /admin/unknown-outcomes lists it)."
)
# fmt: off
_DETAILS: Final[Mapping[Exchange, str]] = {
    Exchange.CONNECT_TIMEOUT:   "The upstream did not accept a connection in time." + _FREED,
    Exchange.NOT_SENT:          "The upstream could not be reached (the connection was "
                                "refused, its name did not resolve, or the TLS handshake "
                                "failed)." + _FREED,
    Exchange.NO_ANSWER_IN_TIME: "The upstream did not answer in time." + _UNKNOWN,
    Exchange.NO_ANSWER:         "The connection to the upstream failed before its answer "
                                "arrived." + _UNKNOWN,
}
# fmt: on


_NOT_KEPT = (
    " The database was unavailable, so its key could not be recorded as unknown yet: a "
    "retry with the same key is answered request-in-progress until the claim's deadline, "
    "then as the upstream's unknown_outcome says."
)


def answer_after(ended: Ended, *, keyed: bool = False, kept: bool = True) -> Verdict:
    """The gateway's answer to an exchange that ended without an answer to stream back;
    ``keyed``: the write had a key (released when nothing was sent, else held unknown);
    ``kept``: what its end does to the key was written (the database may have failed,
    which changes nothing of what happened to the write, only what a retry meets).
    Nothing sent: ``Retry-After``, the worker may send it again at once."""
    reason = AFTER_FORWARD[ended]
    if not isinstance(ended, Exchange):
        return Verdict(Outcome.REFUSE, reason)
    if ended in NOT_SENT:
        key = (
            ", and its Idempotency-Key is back as it was (free, or an earlier attempt's "
            "unknown outcome)"
            if keyed
            else ""
        )
        return Verdict(Outcome.REFUSE, reason, _DETAILS[ended].format(key=key), retry_after=True)
    held = (_HELD if kept else _NOT_KEPT) if keyed else ""
    return Verdict(Outcome.REFUSE, reason, _DETAILS[ended].format(key=held))


def documented(reason: Reason) -> list[str]:
    """The details an exchange's end answers with under ``reason``, as the OpenAPI
    document lists them (a keyed write's; ``[not sent]``: with ``Retry-After``)."""
    found = []
    for ended, chosen in AFTER_FORWARD.items():
        if chosen is reason and isinstance(ended, Exchange):
            verdict = answer_after(ended, keyed=True)
            assert verdict.detail is not None
            found.append(verdict.detail + (" [Retry-After]" if verdict.retry_after else ""))
    return found
