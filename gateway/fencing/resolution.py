"""The resolver's rules (``gateway.proxy.resolve``): whether a claimed unknown outcome may
be re-sent, and what the upstream's answer to the re-send makes of it. The same send
verdict and deadline policy as a worker's write; no I/O."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.fencing.deadlines import resolve_send_left
from gateway.fencing.fence import ClaimState, Reason, RecordState, send_verdict
from gateway.fencing.profiles import Answer


@dataclass(frozen=True, slots=True)
class Settled:
    """What a claimed unknown outcome becomes: stored as the key's answer (``COMPLETED``)
    or back to ``UNKNOWN``, kept for another re-send (``keep``) or left to an operator."""

    state: RecordState
    outcome: str  # the resolutions metric's label
    note: str
    keep: bool = False
    status: int | None = None  # an answer's status kept with an unknown outcome
    reason: Reason | None = None  # the audit's label of a resolved outcome
    # The upstream's answer (status, headers, body): stored with a resolved outcome.
    answer: tuple[int, list[tuple[str, str]], bytes] | None = None

    @property
    def resolved(self) -> bool:
        return self.state is RecordState.COMPLETED


def before_resend(generation: int, claim: ClaimState) -> Settled | None:
    """None: the re-send may go. A newer generation was admitted since (an older write is
    never sent after it), or the resolver's claim ran so near its deadline that another
    replica may claim the record again: not re-sent."""
    why = send_verdict(generation, claim.fence, resolve_send_left(claim.deadline, claim.now))
    if why is Reason.STALE_GENERATION:
        return Settled(
            RecordState.UNKNOWN,
            "superseded",
            "a newer generation of the job has written since: not re-sent; resolve it by hand",
        )
    if why is not None:
        return Settled(
            RecordState.UNKNOWN,
            "unknown",
            "the resolver's claim ran out before the re-send: not re-sent",
            keep=True,
        )
    return None


def written(how: str) -> Settled:
    """The write is known to have been applied (an S3 object carrying its metadata)."""
    return Settled(RecordState.COMPLETED, "resolved", how, reason=Reason.AUTO_RESOLVED)


def after_resend(status: int, answered: Answer, *, mismatch: bool) -> Settled:
    """The upstream's answer to a re-send under the same key: "this key was used with
    other parameters" (``mismatch``) goes to an operator; the object changed since the
    HEAD (a precondition failed) or an answer that is not final is kept for another
    re-send; a final answer is the key's."""
    if mismatch:
        return Settled(
            RecordState.UNKNOWN,
            "mismatch",
            f"re-sent; the upstream answered {status}: this key was used with other "
            "parameters. Resolve it by hand",
            status=status,
        )
    if answered is Answer.PRECONDITION_FAILED:
        return Settled(
            RecordState.UNKNOWN, "unknown", "re-sent; the object changed meanwhile (412)", True
        )
    if answered is not Answer.FINAL:
        return Settled(
            RecordState.UNKNOWN, "unknown", f"re-sent; the upstream answered {status}", True
        )
    return written(f"re-sent ({status})")
