"""Retries of a write whose first attempt is still in flight, for both clients (no I/O).

A write answered ``409 request-in-progress`` (the same key is being forwarded right now,
for example by an earlier attempt whose answer this worker stopped waiting for) is sent
again with ``Prefer: wait=N`` (RFC 7240): the gateway holds it until the first attempt
settles and answers with its stored answer (``Idempotent-Replayed: true``), or answers
``request-in-progress`` again at the end of the wait. The retries are bounded: at most
``MAX_RETRIES``, within ``retry_wait`` seconds in all, and none once the gateway did not
wait (a gateway that does not know the preference, or whose
``gateway.max_prefer_wait_seconds`` is 0).

Whether the write may be sent again at all is read from the answer's ``sent`` alone
(``FencedResponse.sent``): only a write the gateway says was never sent is, and always
under its own key. The reason only picks the wait (``Prefer: wait`` serves
``request-in-progress``); no detail text and no header decides that a write is safe to
send again. Every other answer is the write's answer, returned to the worker.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from .protocol import FencedResponse
from .reasons import Reason, Sent

PREFER = "Prefer"
PREFERENCE_APPLIED = "Preference-Applied"
MAX_RETRIES = 3
DEFAULT_RETRY_WAIT = 5.0
"""Seconds a write answered ``request-in-progress`` may wait in all, by default."""


def in_progress(answer: FencedResponse) -> bool:
    """The gateway answered ``request-in-progress`` and this attempt was never sent: the
    key's first attempt is in flight."""
    problem = answer.problem
    return (
        problem is not None
        and answer.sent is Sent.NEVER
        and problem["reason"] == Reason.REQUEST_IN_PROGRESS.value
    )


class InProgressRetries:
    """The retries of one write answered ``request-in-progress``. ``retry_wait``: seconds
    to wait in all (None or 0: no retry); ``timeout``: each request's own, which a wait
    must stay under."""

    def __init__(self, retry_wait: float | None, timeout: float) -> None:
        self._until = time.monotonic() + retry_wait if retry_wait else None
        self._timeout = timeout
        self._sent = 0

    def headers(
        self, answer: FencedResponse, headers: Mapping[str, str] | None
    ) -> dict[str, str] | None:
        """The headers to send the write again with (``headers`` plus ``Prefer:
        wait=N``), or None: ``answer`` is the write's answer."""
        if self._until is None or self._sent >= MAX_RETRIES or not in_progress(answer):
            return None
        if self._sent and PREFERENCE_APPLIED not in answer.headers:
            return None  # the gateway did not wait: another retry would not either
        seconds = int(min(self._until - time.monotonic(), self._timeout - 1))
        if seconds < 1:
            return None
        self._sent += 1
        send = {n: v for n, v in (headers or {}).items() if n.lower() != PREFER.lower()}
        theirs = [v for n, v in (headers or {}).items() if n.lower() == PREFER.lower()]
        send[PREFER] = ", ".join([*theirs, f"wait={seconds}"])
        return send
