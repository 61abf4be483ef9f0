"""``fence.send_verdict``: a claimed write judged again right before it is sent."""

from __future__ import annotations

import pytest

from gateway.fencing.fence import Reason, send_verdict


@pytest.mark.parametrize(
    ("generation", "fence", "seconds_left", "expected"),
    [
        (1, 1, 3.0, None),  # our own admission raised the fence: send
        (1, None, 3.0, None),  # no fence row (cannot happen after an admission): send
        (2, 1, 3.0, None),
        (1, 2, 3.0, Reason.STALE_GENERATION),  # a newer generation was admitted meanwhile
        (1, 2, -1.0, Reason.STALE_GENERATION),  # the fence wins over the deadline
        (1, 1, 0.0, Reason.ORDERING_TIMEOUT),  # at the deadline (less the margin): never
        (1, 1, -5.0, Reason.ORDERING_TIMEOUT),
        (1, None, -1.0, Reason.ORDERING_TIMEOUT),  # the claim is gone
    ],
)
def test_send_verdict(
    generation: int, fence: int | None, seconds_left: float, expected: Reason | None
) -> None:
    assert send_verdict(generation, fence, seconds_left) is expected
