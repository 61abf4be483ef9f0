"""Fenced Celery tasks: each run of a task holds a lease on its job, and the task's writes
through the gateway are fenced by it (the synchronous client, ``fencegate_client.sync``).

.. code-block:: python

    import httpx
    from celery import Celery
    from fencegate_client.celery import FencedTask, step
    from fencegate_client.httpx import FencedTransport

    app = Celery("shop", broker="redis://127.0.0.1:6379/0")
    app.conf.fencegate_control_url = "http://127.0.0.1:8081"
    app.conf.fencegate_gateway_url = "http://127.0.0.1:8080"
    app.conf.fencegate_token = "worker-token..."          # when auth is on
    http = httpx.Client(transport=FencedTransport(gateway_url="http://127.0.0.1:8080"))

    @app.task(base=FencedTask, fence_job="order_id", fence_ttl=30)
    def charge(order_id: str, amount: int) -> dict:
        with step("charge"):
            answer = http.post("http://127.0.0.1:8080/payments/charges", json={"amount": amount})
        return answer.json()

A run of a ``FencedTask`` (in the worker, or ``apply()``):

1. acquires the lease on its job: the task's id by default (the same in every retry of
   the task), or a named job: ``fence_job`` names the argument that holds the job id, or
   is a function of the task's arguments that returns it;
2. renews it in a thread at a third of ``fence_ttl`` (``fence_renew=False`` turns that
   off) and makes it the current lease of the run, the one ``FencedTransport``,
   ``fence_session`` and ``fenced_s3_client`` fence with; ``step(name)`` names the step
   of the writes in its block, ``self.lease`` (``bind=True``) is the lease itself;
3. completes the job with the task's return value when the run returns (the value if it
   is JSON, else None), fails it with the error when the run raises, and releases it when
   the run ends in ``self.retry()`` (Celery's ``Retry``), ``Ignore`` or ``Reject``:
   Celery's retry policy decides, not the job's attempts;
4. turns a lost lease (``LeaseLost`` from a write, from a renewal refused or lapsed, or
   from completing the job) into ``self.retry(exc=lost, countdown=fence_retry_delay)``:
   never a success. Once ``max_retries`` is used up the task fails with that
   ``LeaseLost``. The retry takes a new lease (a higher generation); its repeated steps
   get the gateway's stored answers, so each step lands once.

A job that another current lease holds (``LeaseHeld``: a copy of the task redelivered
while the first still runs) is retried after ``fence_ttl`` seconds; a job already completed
(``JobFinished``: a redelivery after the job was done) is not run again: the task returns
the job's stored result. ``fencegate_control_url`` (required), ``fencegate_gateway_url``
and ``fencegate_token`` come from the app's configuration, or per task from
``fence_control_url``, ``fence_gateway_url`` and ``fence_token``. Needs the ``celery``
extra (``pip install 'fencegate-client[celery]'``).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from ._needs import needs

try:
    import celery
    import httpx
    from celery.exceptions import Ignore, Reject, Retry
except ModuleNotFoundError as error:
    for library in ("celery", "httpx"):
        needs(error, __name__, library, install="'fencegate-client[celery]'")
    raise

from . import errors as exc
from . import protocol as p
from .sync import Lease, LeaseClient

log = logging.getLogger("fencegate.client")

JobOf = Callable[..., Any]
"""A function of a task's arguments that returns its job id."""

_CLIENTS: dict[tuple[int, str, str | None, str | None], LeaseClient] = {}
_CLIENTS_LOCK = threading.Lock()
_RELEASE_ON = (Retry, Ignore, Reject)


class FencedTask(celery.Task):  # type: ignore[misc]  # celery has no type information
    """A Celery task whose every run holds a lease on its job (see the module). Use it as
    ``@app.task(base=FencedTask, ...)`` or through ``fenced(app, ...)``; the ``fence_*``
    attributes are task options."""

    fence_job: ClassVar[str | JobOf | None] = None
    """None: the job is the task's id. A name: the argument that holds the job id. A
    function: called with the task's arguments, returns the job id."""
    fence_ttl: ClassVar[float | None] = 30.0
    """The lease's TTL in seconds (None: the lease service's default)."""
    fence_renew: ClassVar[bool] = True
    """Renew the lease in a thread while the task runs."""
    fence_retry_delay: ClassVar[float] = 1.0
    """Seconds before the retry of a run whose lease was lost (a run that found the job
    held by another waits ``fence_ttl``)."""
    fence_control_url: ClassVar[str | None] = None
    fence_gateway_url: ClassVar[str | None] = None
    fence_token: ClassVar[str | None] = None

    # -- what a run fences with ---------------------------------------------------------------

    @property
    def lease(self) -> Lease:
        """The lease of the run under way in this thread."""
        lease = p.current_lease()
        if not isinstance(lease, Lease):
            raise RuntimeError(f"task {self.name} holds no lease here (not inside a run)")
        return lease

    def fence_job_id(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The job this run leases (``fence_job``)."""
        chosen = inspect.getattr_static(self, "fence_job")  # a function, not a method
        if isinstance(chosen, staticmethod):
            chosen = chosen.__func__
        if chosen is None:
            task_id = self.request.id
            if not task_id:
                raise ValueError(
                    f"task {self.name} was called directly: it has no task id to lease "
                    "(use delay()/apply(), or name the job with fence_job)"
                )
            return str(task_id)
        if callable(chosen):
            return str(chosen(*args, **kwargs))
        try:
            bound = inspect.signature(self.run).bind_partial(*args, **kwargs)
        except TypeError as error:
            raise ValueError(f"task {self.name}: {error}") from error
        if chosen not in bound.arguments:
            raise ValueError(f"task {self.name}: fence_job names {chosen!r}, which was not given")
        return str(bound.arguments[chosen])

    def fence_owner(self) -> str:
        """The owner of this run's lease: the worker, its process, the task id and a
        number of this run, so that no other run (a redelivered copy of the task, even in
        this process) counts as the same owner: it is refused (``LeaseHeld``) while this
        run's lease is current, instead of taking the job over."""
        host = self.request.hostname or socket.gethostname()
        run = uuid.uuid4().hex[:8]
        return f"celery:{host}:{os.getpid()}:{self.request.id or 'direct'}:{run}"[-200:]

    def fence_client(self) -> LeaseClient:
        """This process's lease client for the configured control and gateway URLs (one per
        process: a forked pool child makes its own)."""
        conf = self.app.conf
        control = self.fence_control_url or conf.get("fencegate_control_url")
        gateway = self.fence_gateway_url or conf.get("fencegate_gateway_url")
        token = self.fence_token or conf.get("fencegate_token")
        if not control:
            raise ValueError(
                f"task {self.name}: set app.conf.fencegate_control_url (or fence_control_url)"
            )
        key = (os.getpid(), str(control), gateway, token)
        with _CLIENTS_LOCK:
            client = _CLIENTS.get(key)
            if client is None:
                client = _CLIENTS[key] = LeaseClient(str(control), gateway_url=gateway, token=token)
            return client

    # -- a run --------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        client = self.fence_client()
        job_id = self.fence_job_id(args, kwargs)
        try:
            lease = client.acquire(job_id, owner=self.fence_owner(), ttl=self.fence_ttl).take()
        except exc.LeaseHeld as held:
            # Another run holds it: by one TTL from now it has renewed it or lost it.
            countdown = self.fence_ttl if self.fence_ttl is not None else self.fence_retry_delay
            raise self.retry(exc=held, countdown=countdown) from held
        except exc.JobFinished:
            job = client.get_job(job_id)
            if job["state"] != "completed":
                raise
            log.info("task %s: job %s is completed already; not run again", self.name, job_id)
            return job["result"]
        assert lease is not None  # acquire answers a lease or raises
        if self.fence_renew:
            lease.start_renewing()
        try:
            with lease.current():
                result = super().__call__(*args, **kwargs)
        except exc.LeaseLost as lost:
            _end(lease, lease.release)  # only when the loss was another lease's
            raise self._retry_lost(lease, lost) from lost
        except _RELEASE_ON:
            _end(lease, lease.release)
            raise
        except BaseException as error:
            if isinstance(error, KeyboardInterrupt | SystemExit):
                _end(lease, lease.release)
            else:
                text = p.exit_error_text(error)
                _end(lease, lambda: lease.fail(error=text))
            raise
        finally:
            lease.stop_renewing()
        try:
            lease.complete(_json_or_none(result))
        except exc.LeaseLost as lost:
            # The work ran, but not under a current lease to its end: not a success.
            raise self._retry_lost(lease, lost) from lost
        return result

    def _retry_lost(self, lease: Lease, lost: exc.LeaseLost) -> BaseException:
        log.warning(
            "task %s[%s]: lease on job %s (generation %d) lost (%s); retrying",
            self.name,
            self.request.id,
            lease.job_id,
            lease.generation,
            lost.reason,
        )
        retry: BaseException = self.retry(exc=lost, countdown=self.fence_retry_delay)
        return retry


def fenced(app: celery.Celery, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``@fenced(app, fence_job="order_id")``: ``app.task(base=FencedTask, **options)``."""
    options.setdefault("base", FencedTask)
    decorator: Callable[[Callable[..., Any]], Any] = app.task(**options)
    return decorator


@contextlib.contextmanager
def step(name: str) -> Iterator[str]:
    """Name the step of the fenced writes in this block, for the current lease (the
    running task's): ``lease.step(name)`` without the lease at hand."""
    lease = p.current_lease()
    if lease is None:
        raise RuntimeError("no current lease: step() is for the body of a fenced task")
    with lease.step(name) as key:
        yield key


def _end(lease: Lease, how: Callable[[], object]) -> None:
    """End a lease that may be gone already (then there is nothing to end)."""
    if lease.ended or lease.lost.is_set():
        return
    try:
        how()
    except exc.LeaseLost:
        pass
    except (httpx.HTTPError, exc.LeaseError) as error:  # the lease expires on its own
        log.warning("ending lease on job %s failed: %s", lease.job_id, error)


def _json_or_none(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return None
    return value
