"""What a worker says to the lease API and the gateway and how it reads the answers,
whatever the HTTP library: the header names, the key of a named step, the calls of the
lease API, the state of a lease (held, lost, ended) and the gateway's answer with the
lease loss it may report. No I/O here: ``aio`` (aiohttp), ``sync`` and ``httpx``
(httpx), ``requests`` and ``boto3`` only send what this module prepares and hand back
what they received."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import SplitResult, urlsplit

from . import errors as exc
from .errors import LOST_BY_REASON, LeaseLost, RemoteError, error_from_problem
from .reasons import Reason, Sent, sent_of

log = logging.getLogger("fencegate.client")

FENCING_TOKEN = "Fencing-Token"
"""The header that carries the lease token to the gateway (never further)."""
IDEMPOTENCY_KEY = "Idempotency-Key"
"""The header that names the step, the same in every retry and every generation."""
IDEMPOTENT_REPLAYED = "Idempotent-Replayed"
"""``true`` on an answer the gateway gave from its store instead of calling the upstream."""
PROBLEM_CONTENT_TYPE = "application/problem+json"
LOST_STATUS = 409
"""The status of every gateway answer that reports a lost lease."""


def step_key(job_id: str, step: str) -> str:
    """The idempotency key of a named step of a job: the same on every retry and in every
    generation, so a repeated step gets the stored answer instead of a second effect."""
    return "step-" + hashlib.sha256(f"{job_id}\x00{step}".encode()).hexdigest()[:40]


def idempotency_key(job_id: str, *, step: str | None, key: str | None) -> str | None:
    """``key``, else the key of ``step`` (``step_key``), else None."""
    if key is not None:
        return key
    return step_key(job_id, step) if step is not None else None


# -- the gateway's answer -------------------------------------------------------------------


def lease_lost(status: int, content_type: str, body: bytes) -> LeaseLost | None:
    """The ``LeaseLost`` error an answer reports (the gateway refused the write as
    ``stale-generation``, ``lease-expired`` or ``lease-ended``), or None."""
    if not may_report_loss(status, content_type):
        return None
    problem = problem_of(content_type, body)
    if problem is None or problem["reason"] not in LOST_BY_REASON:
        return None
    error = LOST_BY_REASON[problem["reason"]](str(problem.get("detail", "")))
    error.sent = sent_of(problem)
    return error


def may_report_loss(status: int, content_type: str) -> bool:
    """Whether an answer can report a lost lease, judged without its body (so a transport
    reads the body of these answers only)."""
    return status == LOST_STATUS and content_type.startswith(PROBLEM_CONTENT_TYPE)


def problem_of(content_type: str, body: bytes) -> dict[str, Any] | None:
    """The gateway's own problem document, when the gateway answered itself."""
    if not content_type.startswith(PROBLEM_CONTENT_TYPE):
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and "reason" in doc else None


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
        return problem_of(self.headers.get("Content-Type", ""), self.body)

    @property
    def sent(self) -> Sent | None:
        """When the gateway answered itself: whether the write reached the upstream
        (its problem's ``sent``, ``reasons.sent_of``). None when the answer is the
        upstream's (relayed, or replayed to a duplicate)."""
        problem = self.problem
        return sent_of(problem) if problem is not None else None

    @property
    def new_key_safe(self) -> bool:
        """Whether the write may be sent again under a new key: only when the gateway
        answered that it was never sent."""
        return self.sent is Sent.NEVER

    def raise_for_problem(self) -> None:
        """Raise the gateway's own answer as its error (``error_from_problem``: the
        class of its reason, else ``RemoteError``; ``.sent`` says what became of the
        write); nothing when the answer is the upstream's."""
        problem = self.problem
        if problem is not None:
            raise error_from_problem(self.status, problem)

    def lease_lost(self) -> LeaseLost | None:
        """The ``LeaseLost`` error this answer reports (the gateway refused the write as
        ``stale-generation``, ``lease-expired`` or ``lease-ended``), or None."""
        return lease_lost(self.status, self.headers.get("Content-Type", ""), self.body)


def fenced_response(status: int, headers: Mapping[str, str], body: bytes) -> FencedResponse:
    """The answer to a write; ``headers`` must look names up case-insensitively."""
    return FencedResponse(status, headers, body, headers.get(IDEMPOTENT_REPLAYED) == "true")


# -- the lease API --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """One request to the lease API (control listener)."""

    method: str
    path: str
    body: dict[str, Any] | None = None


def _present(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def enqueue_call(
    *,
    queue: str | None = None,
    job_id: str | None = None,
    payload: Any = None,
    max_attempts: int | None = None,
) -> Call:
    body = _present(queue=queue, job_id=job_id, payload=payload, max_attempts=max_attempts)
    return Call("POST", "/v1/jobs", body)


def claim_call(queue: str, *, owner: str, ttl: float | None = None) -> Call:
    """The next claimable job of ``queue`` (answered 204, None, when there is none)."""
    return Call("POST", f"/v1/queues/{queue}/claim", {"owner": owner, **_present(ttl_seconds=ttl)})


def acquire_call(
    job_id: str,
    *,
    owner: str,
    ttl: float | None = None,
    queue: str | None = None,
    payload: Any = None,
) -> Call:
    """A named job's lease, creating the job if absent."""
    body = {"owner": owner, **_present(ttl_seconds=ttl, queue=queue, payload=payload)}
    return Call("PUT", f"/v1/jobs/{job_id}/lease", body)


def get_job_call(job_id: str) -> Call:
    return Call("GET", f"/v1/jobs/{job_id}")


def renew_call(token: str, ttl: float | None = None) -> Call:
    return Call("POST", "/v1/leases/renew", {"lease_token": token, **_present(ttl_seconds=ttl)})


def complete_call(token: str, result: Any = None) -> Call:
    return Call("POST", "/v1/leases/complete", {"lease_token": token, "result": result})


def fail_call(token: str, error: str | None = None, retry_in: float = 0) -> Call:
    body = {"lease_token": token, "error": error, "retry_in_seconds": retry_in}
    return Call("POST", "/v1/leases/fail", body)


def release_call(token: str) -> Call:
    return Call("POST", "/v1/leases/release", {"lease_token": token})


def control_answer(call: Call, status: int, raw: bytes) -> Any:
    """The JSON document the lease API answered (None for 204), or the error its problem
    document stands for, raised."""
    if status == 204:
        return None
    try:
        doc = json.loads(raw) if raw else None
    except ValueError:
        doc = None
        if status < 400:
            raise RemoteError(
                status, Reason.INVALID_RESPONSE, f"not JSON from {call.path}: {raw[:200]!r}", {}
            ) from None
    if status >= 400:
        if not isinstance(doc, dict):
            doc = {"detail": f"HTTP {status} from {call.path}: {raw[:200]!r}"}
        raise error_from_problem(status, doc)
    return doc


def exit_error_text(error: BaseException) -> str:
    """What a lease left by an exception is failed with."""
    return f"{type(error).__name__}: {error}"[:10_000]


def renew_interval(ttl_seconds: float) -> float:
    """How long a renewer waits between renewals: a third of the TTL."""
    return max(ttl_seconds / 3, 0.05)


# -- a lease's state --------------------------------------------------------------------------


class Flag(Protocol):
    """``asyncio.Event`` or ``threading.Event``: what a lease's ``lost`` is."""

    def is_set(self) -> bool: ...

    def set(self) -> None: ...


_CURRENT: ContextVar[LeaseState | None] = ContextVar("fencegate_current_lease", default=None)
_STEP: ContextVar[str | None] = ContextVar("fencegate_current_step", default=None)


def current_lease() -> LeaseState | None:
    """The lease whose ``with`` (or ``async with``) block is running here, if any: the one
    the transports fence with when they are not given a lease."""
    return _CURRENT.get()


def current_step() -> str | None:
    """The step named by the innermost ``lease.step(name)`` block running here."""
    return _STEP.get()


@dataclass(eq=False, kw_only=True)
class LeaseState:
    """A lease this worker holds, as far as this worker can tell: the fields of the grant,
    whether it is lost or ended, and the local deadline after which it must be assumed to
    have lapsed (``time.monotonic()``). Both clients' ``Lease`` classes are this plus I/O."""

    job_id: str
    generation: int
    owner: str
    token: str
    ttl_seconds: float
    payload: Any
    expires_at: str
    gateway_url: str | None = None
    lost: Flag
    lost_reason: exc.LeaseError | None = None
    ended: bool = False
    _valid_until: float = 0.0  # time.monotonic() after which we must assume it lapsed

    def __post_init__(self) -> None:
        self._valid_until = time.monotonic() + self.ttl_seconds

    @staticmethod
    def grant_fields(doc: Mapping[str, Any]) -> dict[str, Any]:
        """The fields of a lease from the lease API's lease document."""
        return {
            "job_id": doc["job_id"],
            "generation": doc["generation"],
            "owner": doc["owner"],
            "token": doc["lease_token"],
            "ttl_seconds": float(doc["ttl_seconds"]),
            "payload": doc.get("payload"),
            "expires_at": doc["expires_at"],
        }

    def _granted_at(self, asked: float) -> None:
        # Judged from when we asked, as on renew: never later than the server's expiry.
        self._valid_until = asked + self.ttl_seconds

    def _renewed(self, doc: Mapping[str, Any], started: float) -> None:
        self.ttl_seconds = float(doc["ttl_seconds"])
        self.expires_at = doc["expires_at"]
        # Judged from when we asked, not when the answer came: never later than the server.
        self._valid_until = started + self.ttl_seconds

    @property
    def held(self) -> bool:
        """Still ours, as far as this worker can tell (not lost, ended or lapsed)."""
        return not self.lost.is_set() and not self.ended and time.monotonic() < self._valid_until

    @property
    def lapsed(self) -> bool:
        """Past the local deadline, neither ended nor known lost yet (a renewer that wakes
        up to this says so with ``_lapse``)."""
        return not self.ended and not self.lost.is_set() and time.monotonic() >= self._valid_until

    def check(self) -> None:
        """Raise the reason the lease is gone, if it is."""
        if self.lost_reason is not None:
            raise self.lost_reason
        if self.ended:
            raise exc.LeaseEnded("this worker already completed, failed or released the lease")
        if time.monotonic() >= self._valid_until:
            self._lapse()
            raise exc.LeaseExpired("the lease lapsed before it could be renewed")

    def _lapse(self) -> None:
        self._lose(exc.LeaseExpired("the lease lapsed before it could be renewed"))

    def _lose(self, error: exc.LeaseError) -> None:
        if self.ended:
            return  # a renewal refused after this worker ended the lease: nothing is lost
        if self.lost_reason is None:
            self.lost_reason = error
            log.warning(
                "lease on job %s (generation %d) lost: %s",
                self.job_id,
                self.generation,
                error.reason,
            )
        self.lost.set()

    # -- fencing --------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[str]:
        """Name the step the writes in this block belong to: the transports send its key
        (``step_key(job_id, name)``, yielded) as ``Idempotency-Key``."""
        token = _STEP.set(name)
        try:
            yield step_key(self.job_id, name)
        finally:
            _STEP.reset(token)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Make this the lease the transports fence with in this block (the lease's own
        ``with`` block does this)."""
        token = _CURRENT.set(self)
        try:
            yield
        finally:
            _CURRENT.reset(token)

    def fence_headers(
        self,
        headers: Mapping[str, str] | None = None,
        *,
        step: str | None = None,
        key: str | None = None,
    ) -> dict[str, str]:
        """``headers`` with the fencing headers of a write (``fencing_headers``)."""
        send = {n: v for n, v in (headers or {}).items() if n.lower() != FENCING_TOKEN.lower()}
        has_key = any(n.lower() == IDEMPOTENCY_KEY.lower() for n in send)
        send.update(self.fencing_headers(has_key=has_key, step=step, key=key))
        return send

    def fencing_headers(
        self, *, has_key: bool = False, step: str | None = None, key: str | None = None
    ) -> dict[str, str]:
        """The headers that fence a write: this lease's ``Fencing-Token`` and, unless the
        request has an ``Idempotency-Key`` already (``has_key``), the key: ``key``, else
        ``step``'s (``step_key``), else the current ``lease.step(...)`` block's, else none.
        Raises the lease's ``LeaseLost`` error instead, when it is known to be gone."""
        self.check()
        send = {FENCING_TOKEN: self.token}
        if has_key:
            return send
        chosen = idempotency_key(self.job_id, step=step, key=key)
        if chosen is None and current_step() is not None:
            chosen = step_key(self.job_id, str(current_step()))
        if chosen is not None:
            send[IDEMPOTENCY_KEY] = chosen
        return send

    def settle(self, status: int, content_type: str, body: bytes) -> None:
        """Mark the lease lost and raise, when the gateway's answer says it is."""
        error = lease_lost(status, content_type, body)
        if error is not None:
            self._lose(error)
            raise error

    def answer(self, status: int, headers: Mapping[str, str], body: bytes) -> FencedResponse:
        """The answer to a write sent with ``fence_headers`` (after ``settle``)."""
        self.settle(status, headers.get("Content-Type", ""), body)
        return fenced_response(status, headers, body)

    def gateway_path_url(self, path: str) -> str:
        if self.gateway_url is None:
            raise ValueError("LeaseClient(gateway_url=...) is needed to write through the gateway")
        return self.gateway_url + path


def to_gateway(url: str, gateway_url: str) -> bool:
    """Whether ``url`` goes to the gateway at ``gateway_url`` (the only place a
    ``Fencing-Token`` may go: it is a credential): same scheme, host and port, and a path
    under the gateway's."""
    target, base = urlsplit(url), urlsplit(gateway_url)
    if (target.scheme.lower(), _netloc(target)) != (base.scheme.lower(), _netloc(base)):
        return False
    prefix = base.path.rstrip("/")
    return target.path == prefix or target.path.startswith(prefix + "/")


def _netloc(parts: SplitResult) -> tuple[str, int | None]:
    default = {"http": 80, "https": 443}.get(parts.scheme.lower())
    return (parts.hostname or "").lower(), parts.port or default


def fence_for(lease: LeaseState | None) -> LeaseState | None:
    """The lease a transport fences with: its own, else the current one."""
    return lease if lease is not None else current_lease()
