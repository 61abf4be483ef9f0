"""The errors of Fencegate's protocol: one class per problem ``reason``.

Every class carries the HTTP ``status``, the stable ``reason`` and the ``title`` of the
RFC 9457 problem document that stands for it; a class's docstring is its default
message. The worker client raises them from the problems it receives
(``error_from_problem``); the lease service raises the very same classes (as
``lease_core.exceptions``) and its problem middleware writes them out. They live here,
in the client package, because a worker needs them and must not need the service: this
module imports nothing of Fencegate but ``reasons``.

A class names its ``Reason``; its ``status``, ``title`` and ``sent`` are that reason's
row in ``reasons.REASONS`` (set when the class is defined), so a reason's facts are
written once. An error raised from a gateway's answer takes ``sent`` from the problem
document's own ``sent`` member when it has one (``reasons.sent_of``): what the worker may
do next (send again under a new key, or only under the same one) is read from it alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from .reasons import REASONS, Reason, Sent, sent_of


class LeaseError(Exception):
    """The lease service refused the request."""

    reason: ClassVar[Reason] = Reason.INTERNAL_ERROR
    status: ClassVar[int] = REASONS[Reason.INTERNAL_ERROR].status
    title: ClassVar[str] = REASONS[Reason.INTERNAL_ERROR].title
    headers: ClassVar[dict[str, str]] = {}
    sent: Sent | None = REASONS[Reason.INTERNAL_ERROR].sent
    """Of a gateway's answer: whether the write reached the upstream (``Sent``); None
    for an error that answers no write (the lease API's own)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "reason" in cls.__dict__:  # a class of its own reason: the reason's facts
            info = REASONS[cls.reason]
            cls.status = info.status
            cls.title = info.title
            cls.sent = info.sent

    def __init__(self, detail: str | None = None, **extra: Any) -> None:
        self.detail = detail or (self.__doc__ or "").strip()
        self.extra = {k: v for k, v in extra.items() if v is not None}
        super().__init__(self.detail)

    @property
    def new_key_safe(self) -> bool:
        """Whether the write this error answers may be sent again under a new key: only
        when it was never sent (``sent`` is ``never``). Otherwise retry it only under the
        same key, or have its outcome resolved."""
        return self.sent is Sent.NEVER


class InvalidRequest(LeaseError):
    """The request is not valid."""

    reason = Reason.INVALID_REQUEST


class Unauthorized(LeaseError):
    """A valid bearer token is required."""

    reason = Reason.UNAUTHORIZED
    headers = {"WWW-Authenticate": 'Bearer realm="fencegate"'}  # noqa: RUF012


class Forbidden(LeaseError):
    """This token may not use this path."""

    reason = Reason.FORBIDDEN


class InvalidLeaseToken(LeaseError):
    """The lease token is malformed or unknown."""

    reason = Reason.INVALID_LEASE_TOKEN


class JobNotFound(LeaseError):
    """No job with this id."""

    reason = Reason.JOB_NOT_FOUND


class NotFound(LeaseError):
    """Nothing lives at this path."""

    reason = Reason.NOT_FOUND


class MethodNotAllowed(LeaseError):
    """This method is not allowed on this path."""

    reason = Reason.METHOD_NOT_ALLOWED


class JobExists(LeaseError):
    """A job with this id exists already."""

    reason = Reason.JOB_EXISTS


class LeaseHeld(LeaseError):
    """The job is held by another current lease."""

    reason = Reason.LEASE_HELD


class JobFinished(LeaseError):
    """The job has completed or failed; it cannot be leased again."""

    reason = Reason.JOB_FINISHED


class LeaseLost(LeaseError):
    """The lease is no longer current."""

    status = 409
    title = "Lease lost"
    sent: Sent | None = Sent.NEVER  # a lost lease's write is refused before it is sent


class LeaseExpired(LeaseLost):
    """The lease has expired."""

    reason = Reason.LEASE_EXPIRED


class StaleGeneration(LeaseLost):
    """A newer generation of this job exists."""

    reason = Reason.STALE_GENERATION


class LeaseEnded(LeaseLost):
    """The lease was completed, failed or released."""

    reason = Reason.LEASE_ENDED


class GenerationReissued(LeaseLost):
    """Another holder of this lock was admitted under this generation: the lock service
    issued it twice. Acquire the lock again once its counter is past the fence."""

    reason = Reason.GENERATION_REISSUED


class StoreUnavailable(LeaseError):
    """The database is not reachable; try again shortly."""

    reason = Reason.STORE_UNAVAILABLE


LOST_BY_REASON: dict[str, type[LeaseLost]] = {
    cls.reason: cls for cls in (LeaseExpired, StaleGeneration, LeaseEnded, GenerationReissued)
}


class RemoteError(LeaseError):
    """The server refused the request."""

    def __init__(self, status: int, reason: str, detail: str, doc: Mapping[str, Any]) -> None:
        super().__init__(detail)
        self.remote_status = status
        self.remote_reason = reason
        self.problem = dict(doc)
        self.sent = sent_of(doc)


def _by_reason(cls: type[LeaseError], out: dict[str, type[LeaseError]]) -> None:
    for sub in cls.__subclasses__():
        if "reason" in sub.__dict__:
            out.setdefault(sub.reason, sub)
        _by_reason(sub, out)


_PROBLEMS: dict[str, type[LeaseError]] = {}
_by_reason(LeaseError, _PROBLEMS)


def error_from_problem(status: int, doc: Mapping[str, Any]) -> LeaseError:
    """The exception that a problem document stands for: the class of its ``reason``,
    else ``RemoteError``; its ``sent`` is the document's (``reasons.sent_of``)."""
    reason = str(doc.get("reason", ""))
    detail = str(doc.get("detail") or doc.get("title") or f"HTTP {status}")
    cls = _PROBLEMS.get(reason)
    if cls is None:
        return RemoteError(status, reason, detail, doc)
    extra = {k: v for k, v in doc.items() if k not in _MEMBERS}
    error = cls(detail, **extra)
    if "sent" in doc:
        error.sent = sent_of(doc)
    return error


_MEMBERS = frozenset({"type", "title", "status", "detail", "reason", "sent"})
"""The members a problem document's error keeps as attributes, not in ``extra``."""
