"""What a worker says to the gateway and how it reads the answer, whatever the HTTP
library: the header names, the key of a named step, the gateway's answer and the lease
loss it may report. No I/O here."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import LOST_BY_REASON, LeaseLost

FENCING_TOKEN = "Fencing-Token"
"""The header that carries the lease token to the gateway (never further)."""
IDEMPOTENCY_KEY = "Idempotency-Key"
"""The header that names the step, the same in every retry and every generation."""
IDEMPOTENT_REPLAYED = "Idempotent-Replayed"
"""``true`` on an answer the gateway gave from its store instead of calling the upstream."""
PROBLEM_CONTENT_TYPE = "application/problem+json"


def step_key(job_id: str, step: str) -> str:
    """The idempotency key of a named step of a job: the same on every retry and in every
    generation, so a repeated step gets the stored answer instead of a second effect."""
    return "step-" + hashlib.sha256(f"{job_id}\x00{step}".encode()).hexdigest()[:40]


@dataclass(frozen=True, slots=True)
class FencedResponse:
    """An upstream's answer as relayed (or replayed) by the gateway."""

    status: int
    headers: Mapping[str, str]
    body: bytes
    replayed: bool

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def problem(self) -> dict[str, Any] | None:
        """The gateway's own problem document, when the gateway answered itself."""
        if not self.headers.get("Content-Type", "").startswith(PROBLEM_CONTENT_TYPE):
            return None
        try:
            doc = json.loads(self.body)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) and "reason" in doc else None

    def lease_lost(self) -> LeaseLost | None:
        """The ``LeaseLost`` error this answer reports (the gateway refused the write as
        ``stale-generation``, ``lease-expired`` or ``lease-ended``), or None."""
        problem = self.problem
        if problem is None or problem["reason"] not in LOST_BY_REASON:
            return None
        return LOST_BY_REASON[problem["reason"]](str(problem.get("detail", "")))
