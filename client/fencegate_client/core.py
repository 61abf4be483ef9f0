"""Both clients written once, without I/O. Every operation of the asyncio client (``aio``)
and the synchronous one (``sync``) is a *flow* here: a generator that yields the HTTP
requests it needs (``Request``) and is sent their answers (``Answer``), as httpx's
``Auth.auth_flow`` is, and returns the operation's result or raises its error. A client
only drives flows (``Run``: send each request with its HTTP library, hand the answer
back), renews in a task or in a thread, and spells its methods ``async`` or not; what a
lease, a grant, a fenced write and the lease API do is decided here, once.

.. code-block:: python

    async def _drive(self, flow: Flow[T]) -> T:  # aio's; sync's is the same without await
        run = Run(flow)
        while (request := run.request) is not None:
            run.answer(await self._exchange(request))
        return run.result
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from contextvars import Token
from dataclasses import dataclass
from typing import Any, Generic, TypedDict, TypeVar

from . import errors as exc
from . import protocol as p
from .protocol import FencedResponse, LeaseState
from .waits import DEFAULT_RETRY_WAIT, InProgressRetries

log = logging.getLogger("fencegate.client")

T = TypeVar("T")
G = TypeVar("G")
L = TypeVar("L", bound=LeaseState)

_PENDING: Any = object()


@dataclass(frozen=True, slots=True)
class Request:
    """An HTTP request a flow needs sent."""

    method: str
    url: str
    headers: Mapping[str, str]
    timeout: float
    json: Any = None
    data: bytes | str | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """Its answer; ``headers`` must look names up case-insensitively."""

    status: int
    headers: Mapping[str, str]
    body: bytes


Flow = Generator[Request, Answer, T]
"""An operation: yields the requests to send, is sent their answers, returns the result."""


class Run(Generic[T]):
    """A flow being driven: send ``request`` and give its answer to ``answer`` until
    ``request`` is None; then ``result`` is what the flow returned. The flow's errors
    (a lost lease, a refusal of the lease API) come out of ``Run(...)`` and ``answer``."""

    def __init__(self, flow: Flow[T]) -> None:
        self._flow = flow
        self._result: T = _PENDING
        self.request: Request | None = self._step(lambda: next(flow))

    def answer(self, answer: Answer) -> None:
        self.request = self._step(lambda: self._flow.send(answer))

    def _step(self, advance: Callable[[], Request]) -> Request | None:
        try:
            return advance()
        except StopIteration as done:
            self._result = done.value
            return None

    @property
    def result(self) -> T:
        if self._result is _PENDING:
            raise RuntimeError("the flow has not finished")
        return self._result


# -- the lease API --------------------------------------------------------------------------


class NewJob(TypedDict, total=False):
    """What ``LeaseClient.enqueue`` takes (all optional, keyword-only)."""

    queue: str | None
    job_id: str | None
    payload: Any
    max_attempts: int | None


class ClientOptions(TypedDict, total=False):
    """What both clients' ``LeaseClient`` take besides the control URL and their HTTP
    session, all keyword-only (``ClientBase``)."""

    gateway_url: str | None
    token: str | None
    timeout: float
    retry_wait: float | None


class ClientBase(Generic[G]):
    """What both clients' ``LeaseClient`` are without their HTTP library: the lease API's
    address and credentials, the gateway's address, the retry wait of fenced writes, and
    the grants (``claim``, ``acquire``: ``G`` is the client's ``_Grant``).

    ``gateway_url``: the proxy listener, for fenced writes; ``token``: a worker token;
    ``timeout``: seconds per call of the lease API; ``retry_wait``: a write answered
    ``request-in-progress`` is sent again with ``Prefer: wait=N`` for up to this many
    seconds in all (None or 0: not sent again)."""

    def __init__(
        self,
        control_url: str,
        *,
        gateway_url: str | None = None,
        token: str | None = None,
        timeout: float = 10.0,
        retry_wait: float | None = DEFAULT_RETRY_WAIT,
    ) -> None:
        self.control_url = control_url.rstrip("/")
        self.gateway_url = gateway_url.rstrip("/") if gateway_url else None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout
        self.retry_wait = retry_wait

    def _control(self, call: p.Call) -> Flow[Any]:
        """One call of the lease API: its JSON answer (None for 204), or its error."""
        answer = yield Request(
            call.method, self.control_url + call.path, self._headers, self._timeout, call.body
        )
        return p.control_answer(call, answer.status, answer.body)

    def _document(self, call: p.Call) -> Flow[dict[str, Any]]:
        """A call that answers a document (a job, a lease)."""
        doc: dict[str, Any] = yield from self._control(call)
        return doc

    def _grant(self, call: p.Call) -> G:
        raise NotImplementedError

    def claim(self, queue: str, *, owner: str, ttl: float | None = None) -> G:
        """The next claimable job of ``queue`` (None when there is none)."""
        return self._grant(p.claim_call(queue, owner=owner, ttl=ttl))

    def acquire(
        self,
        job_id: str,
        *,
        owner: str,
        ttl: float | None = None,
        queue: str | None = None,
        payload: Any = None,
    ) -> G:
        """A named job's lease, creating the job if absent (raises ``LeaseHeld`` when
        another current lease holds it)."""
        return self._grant(
            p.acquire_call(job_id, owner=owner, ttl=ttl, queue=queue, payload=payload)
        )


class GrantBase(Generic[L]):
    """A call of the lease API that grants a lease (claim, acquire), not sent yet: the
    client's ``_Grant`` sends it when awaited, taken or entered."""

    def __init__(self, client: ClientBase[Any], call: p.Call, lease: Callable[..., L]) -> None:
        self._client, self._call, self._new = client, call, lease
        self._lease: L | None = None

    def _granting(self) -> Flow[L | None]:
        asked = time.monotonic()
        doc = yield from self._client._control(self._call)
        if doc is None:
            return None
        fields = LeaseState.grant_fields(doc)
        lease = self._new(client=self._client, gateway_url=self._client.gateway_url, **fields)
        # Judged from when we asked, as on renew: never later than the server's expiry.
        lease._granted_at(asked)
        return lease


# -- a lease ------------------------------------------------------------------------------


@dataclass(eq=False, kw_only=True)
class LeaseBase(LeaseState):
    """A lease with the lease API's calls it makes (renew, complete, fail, release) and
    the block it is the current lease of; the client's ``Lease`` adds the renewer."""

    client: ClientBase[Any]
    _entered: Token[LeaseState | None] | None = None

    def _renewal(self, ttl: float | None) -> Flow[None]:
        self.check()
        started = time.monotonic()
        with self._losing():
            doc = yield from self.client._control(p.renew_call(self.token, ttl))
        self._renewed(doc, started)

    def _ending(self, call: p.Call) -> Flow[dict[str, Any]]:
        """Complete, fail or release (``call``); the client then stops renewing."""
        self.check()
        with self._losing():
            doc = yield from self.client._document(call)
        self.ended = True
        return doc

    def _renewal_failed(self, error: BaseException) -> None:
        """A renewal that failed for a reason that may pass (the renewer tries again)."""
        log.warning("renewing lease on job %s failed (%s); retrying", self.job_id, error)

    @contextlib.contextmanager
    def _losing(self) -> Iterator[None]:
        """The lease API's answer that the lease is lost marks it lost (and is raised)."""
        try:
            yield
        except exc.LeaseLost as error:
            self._lose(error)
            raise

    def _enter_block(self) -> None:
        self._entered = p._CURRENT.set(self)

    def _leave_block(self) -> None:
        if self._entered is not None:
            p._CURRENT.reset(self._entered)
            self._entered = None

    def _exit_call(
        self,
        error: BaseException | None,
        interrupt: type[BaseException] | tuple[type[BaseException], ...],
    ) -> p.Call | None:
        """What leaving the lease's block sends once the renewer stopped: fail with the
        error the block raised (an ``interrupt`` is no failure of the job), else release;
        nothing when the lease is ended or lost already."""
        if self.ended or self.lost.is_set():
            return None
        if error is not None and not isinstance(error, interrupt):
            return p.fail_call(self.token, p.exit_error_text(error))
        return p.release_call(self.token)


# -- fenced writes ------------------------------------------------------------------------


class WriteOptions(TypedDict, total=False):
    """What ``FencedSession.request`` (and ``.post`` ...) take besides the method and the
    path, all keyword-only; see ``write``."""

    step: str | None
    key: str | None
    json: Any
    data: bytes | str | None
    headers: Mapping[str, str] | None
    timeout: float


def write(
    lease: LeaseBase,
    method: str,
    path: str,
    *,
    step: str | None = None,
    key: str | None = None,
    json: Any = None,
    data: bytes | str | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> Flow[FencedResponse]:
    """Send ``method path`` (``/{upstream}/...``) through the gateway.

    The key is ``key``, else derived from ``step`` (see ``step_key``), else the current
    ``lease.step(...)`` block's, else none (for upstreams that do not require one). Raises
    the lease's ``LeaseLost`` error instead of sending when the lease is gone, and marks it
    lost when the gateway says so.

    Answered ``request-in-progress`` (the key's first attempt is still in flight), it is
    sent again with ``Prefer: wait=N``, so that the gateway answers with the first
    attempt's answer once it has settled (``fencegate_client.waits``; the client's
    ``retry_wait``).
    """
    retries = InProgressRetries(lease.client.retry_wait, timeout)
    send = headers
    while True:
        fenced = lease.fence_headers(send, step=step, key=key)
        url = lease.gateway_path_url(path)
        answer = yield Request(method, url, fenced, timeout, json, data)
        response = lease.answer(answer.status, answer.headers, answer.body)
        send = retries.headers(response, headers)
        if send is None:
            return response
