"""The request machine's events: what an act found out, fed back through
``RequestMachine.feed`` (``gateway.fencing.machine``), one type per answer to an act. A
time in an event is the driver's reading of the clock: the machine reads none."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Final

from gateway.fencing.decision import Act
from gateway.fencing.fence import Admission, ClaimState, Record


@dataclass(frozen=True, slots=True)
class LeaseSeen:
    """CHECK_LEASE: the lease as the database (and its source) sees it now; None: no such
    token."""

    admission: Admission | None


@dataclass(frozen=True, slots=True)
class SlotTaken:
    """TAKE_SLOT: the pool whose slot is now held; None: none was free."""

    pool: str | None


@dataclass(frozen=True, slots=True)
class BodyRead:
    """READ_BODY: the body (None: over the upstream's limit), hashed on the way."""

    body: io.BytesIO | None
    fingerprint: str | None


@dataclass(frozen=True, slots=True)
class BodyLate:
    """READ_BODY: the body did not arrive in time."""


@dataclass(frozen=True, slots=True)
class Admitted:
    """ADMIT, asked at ``asked_monotonic`` and answered at ``answered_monotonic``: the
    lease judged by the statement, and the key claimed or its record read (None: no
    such token). ``behind``: a settle of this key is being written here (its answer
    given), asked before the admission; ``gone``: the client has gone away."""

    admission: Admission | None
    asked_monotonic: float
    answered_monotonic: float
    behind: bool = False
    gone: bool = False


@dataclass(frozen=True, slots=True)
class FirstSettled:
    """WAIT_FIRST (the slot and the body given back): the key's first attempt settled
    within the wait, and its record as then read (None: free again)."""

    settled: bool
    record: Record | None


@dataclass(frozen=True, slots=True)
class OlderSettled:
    """WAIT_OLDER: older generations' writes to the job settled within the wait."""

    settled: bool


@dataclass(frozen=True, slots=True)
class ClaimSeen:
    """READ_CLAIM, read at ``now_monotonic``: the claim and the job's fence right before
    the first byte goes out."""

    claim: ClaimState
    now_monotonic: float


@dataclass(frozen=True, slots=True)
class Released:
    """RELEASE: the claim is undone."""


Event = (
    LeaseSeen
    | SlotTaken
    | BodyRead
    | BodyLate
    | Admitted
    | FirstSettled
    | OlderSettled
    | ClaimSeen
    | Released
)

BODY_LATE: Final = BodyLate()
RELEASED: Final = Released()

# The events that answer each act: any other fed in answer to it raises MachineError.
ANSWERS: Final[dict[Act, tuple[type, ...]]] = {
    Act.CHECK_LEASE: (LeaseSeen,),
    Act.TAKE_SLOT: (SlotTaken,),
    Act.READ_BODY: (BodyRead, BodyLate),
    Act.ADMIT: (Admitted,),
    Act.WAIT_FIRST: (FirstSettled,),
    Act.WAIT_OLDER: (OlderSettled,),
    Act.READ_CLAIM: (ClaimSeen,),
    Act.RELEASE: (Released,),
}
