"""The answers after the forward: how an exchange with the upstream ended, as
``forwarding`` reports it (a fact), turned into the gateway's own answer.

The decision table (``decision``) ends with the verdict to forward; what happens then is
no longer a choice among rows in the spec's order but one small table: an exchange that
did not reach the upstream, or got no answer, is ``upstream-timeout`` or
``upstream-unavailable``; an answer whose meaning for the key (``profiles.answer_of``) is
"the request's own precondition failed" is ``precondition-failed``. Every other answer
is the upstream's own, streamed back (and kept, freed or held unknown for the key by
``forwarding``). Pure: no I/O.
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

# fmt: off
AFTER_FORWARD: Final[Mapping[Ended, Reason]] = {
    Exchange.CONNECT_TIMEOUT:    Reason.UPSTREAM_TIMEOUT,
    Exchange.NOT_SENT:           Reason.UPSTREAM_UNAVAILABLE,
    Exchange.NO_ANSWER_IN_TIME:  Reason.UPSTREAM_TIMEOUT,
    Exchange.NO_ANSWER:          Reason.UPSTREAM_UNAVAILABLE,
    # Not applied (RFC 9110 13.1): told in the gateway's words, not in the upstream's.
    Answer.PRECONDITION_FAILED:  Reason.PRECONDITION_FAILED,
}
# fmt: on


def answer_after(ended: Ended) -> Verdict:
    """The gateway's answer to an exchange that ended without an answer to stream back."""
    return Verdict(Outcome.REFUSE, AFTER_FORWARD[ended])
