"""The fault suite's harness: real ``fencegate serve`` replicas and ``verify``'s recording
upstream (``verify.upstream``, keeping every write received), each a process of
``verify.procs``, and workers (asyncio tasks in the test process) that claim jobs and
write their steps through the gateway.

Everything a worker sees is kept as an ``Attempt`` (and each lease granted as a
``Grant``); ``check_run`` turns them into ``verify.check``'s history and holds it against
the upstream's ledger, and holds the gateway's database and its list of unknown outcomes
against the upstream's record (``verify.records``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from fencegate_client import FencedResponse, Lease, LeaseClient, RemoteError, step_key
from fencegate_client import errors as exc
from gateway.records.schema import requests
from lease_core.schema import jobs
from verify import records as account
from verify import stack
from verify.check import check
from verify.cluster import free_port
from verify.events import HistoryEvent, LedgerEntry, read_ledger, sha256_hex
from verify.procs import FENCEGATE, Child, Children, child_env
from verify.roles import resolution
from verify.stack import migrate

__all__ = ["FENCEGATE", "UpstreamProc", "child_env", "migrate"]  # the failover tests' too

PROBLEM = "application/problem+json"

# Gateway answers after which the same request may simply be sent again.
RETRYABLE = frozenset(
    {
        "request-in-progress",
        "ordering-timeout",
        "store-unavailable",
        "upstream-unavailable",
        "upstream-timeout",
        "gateway-overloaded",
    }
)
PARKED = "parked: an unknown outcome holds a step"
PARK_SECONDS = 86400.0


class BugReproduced(AssertionError):
    """The symptom of a known bug: what an ``xfail(strict=True, raises=BugReproduced)``
    test expects, so that any other failure of such a test still fails."""


@contextlib.contextmanager
def symptom() -> Iterator[None]:
    """Assertions in this block check the known bug's symptom."""
    try:
        yield
    except AssertionError as error:
        raise BugReproduced(str(error)) from error


# -- processes ------------------------------------------------------------------------------


class ProcessGroup(Children):
    """Every process a test starts (``verify.procs``: each in a session of its own, its
    output in ``NAME.log`` of the test's folder); ``cleanup`` (a fixture's teardown) ends
    them all, each by its own group, after a SIGCONT in case one was frozen."""

    def cleanup(self) -> None:
        self.kill_all()

    def logs(self) -> str:
        """The tail of every process's output, for failure messages."""
        return "\n".join(f"--- {c.name} ---\n{c.tail(4000)}" for c in self.all)


class Replica(stack.Replica):
    """A replica of ``verify.stack`` on 127.0.0.1, on the ports it took."""

    @property
    def proc(self) -> Child:
        assert self.child is not None, f"{self.name} was never started"
        return self.child

    def freeze(self) -> None:
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)


# -- the upstream -------------------------------------------------------------------------

UpstreamProc = stack.Upstream


async def start_upstream(
    group: ProcessGroup,
    name: str = "upstream",
    port: int = 0,
    seed: int | None = None,
    **knobs: Any,
) -> UpstreamProc:
    """``verify.upstream`` keeping every write received (``upstream.events()``), its
    ledger in ``NAME-ledger.jsonl``; ``knobs``: its faults (``delay=[0, 0.3], hang=0.05``,
    verify.upstream says which)."""
    upstream = await stack.start_upstream(
        group,
        group.folder / f"{name}-ledger.jsonl",
        port=port,
        seed=seed,
        received=group.folder / f"{name}.jsonl",
        name=name,
    )
    if knobs:
        await upstream.set_knobs(**knobs)
    return upstream


def ledger(upstream: UpstreamProc) -> list[LedgerEntry]:
    """What the upstream applied, in order (``verify.events.LedgerEntry``)."""
    assert upstream.ledger is not None
    return read_ledger(upstream.ledger)


# -- gateway replicas -----------------------------------------------------------------------


@dataclass(frozen=True)
class UpstreamSpec:
    name: str
    path: str = "hold"  # the upstream's path: hold (apply all) or dedupe (by key)
    policy: str = "hold"
    timeout: float = 1.0
    connect_timeout: float = 0.3

    def deadline(self, ordering_wait: float) -> float:
        """How long a record of this upstream stays in flight before it counts as unknown
        (the gateway's ordering wait + timeout + connect timeout + its 5 s margin)."""
        return ordering_wait + self.timeout + self.connect_timeout + 5.0


PAY = UpstreamSpec("pay")
DEDUPE = UpstreamSpec("dedupe", path="dedupe", policy="retry")
SLOW = UpstreamSpec("slow", timeout=5.0)
ORDERING_WAIT = 0.3


def write_config(
    folder: Path,
    database_url: str,
    upstream_url: str,
    upstreams: Iterable[UpstreamSpec] = (PAY, DEDUPE),
    *,
    name: str = "fencegate.toml",
    ordering_wait: float = ORDERING_WAIT,
    shutdown_timeout: float = 10.0,
    extra: str = "",
) -> Path:
    path = folder / name
    text = (
        f'database_url = "{database_url}"\n'
        'proxy_listen = "127.0.0.1:0"\n'
        'control_listen = "127.0.0.1:0"\n'
        "[lease]\n"
        "default_ttl_seconds = 5\n"
        "max_ttl_seconds = 600\n"
        "default_max_attempts = 100\n"
        "[gateway]\n"
        f"ordering_wait_seconds = {ordering_wait}\n"
        f"shutdown_timeout_seconds = {shutdown_timeout}\n"
        f"{extra}\n"
    )
    for spec in upstreams:
        text += (
            "[[upstreams]]\n"
            f'name = "{spec.name}"\n'
            f'url = "{upstream_url}/{spec.path}"\n'
            f'unknown_outcome = "{spec.policy}"\n'
            f"timeout_seconds = {spec.timeout}\n"
            f"connect_timeout_seconds = {spec.connect_timeout}\n"
        )
    path.write_text(text, encoding="utf-8")
    return path


async def start_replica(group: ProcessGroup, config: Path, name: str) -> Replica:
    """``fencegate serve --config CONFIG``, once ``/healthz`` answers."""
    replica = Replica(name, config, "127.0.0.1", 0, 0, None, group)
    await replica.start()
    return replica


async def start_replicas(group: ProcessGroup, config: Path, count: int = 2) -> list[Replica]:
    names = [f"replica-{chr(ord('a') + i)}" for i in range(count)]
    return list(await asyncio.gather(*(start_replica(group, config, n) for n in names)))


async def start_stack(
    group: ProcessGroup,
    database_url: str,
    upstreams: Iterable[UpstreamSpec] = (PAY, DEDUPE),
    *,
    replicas: int = 2,
    shutdown_timeout: float = 10.0,
    **knobs: Any,
) -> tuple[UpstreamProc, list[Replica]]:
    """The upstream (``knobs``) and ``replicas`` gateway replicas on ``database_url``,
    started side by side."""
    port = free_port()
    config = write_config(
        group.folder,
        database_url,
        f"http://127.0.0.1:{port}",
        upstreams,
        shutdown_timeout=shutdown_timeout,
    )
    upstream, started = await asyncio.gather(
        start_upstream(group, port=port, **knobs), start_replicas(group, config, replicas)
    )
    return upstream, started


# -- plain HTTP -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    headers: dict[str, str]

    @property
    def problem(self) -> dict[str, Any] | None:
        if not self.headers.get("Content-Type", "").startswith(PROBLEM):
            return None
        try:
            doc = json.loads(self.body)
        except ValueError:
            return {"reason": "(not a JSON problem document)"}
        return doc if isinstance(doc, dict) else None

    @property
    def reason(self) -> str | None:
        problem = self.problem
        return None if problem is None else str(problem.get("reason"))

    @property
    def replayed(self) -> bool:
        return self.headers.get("Idempotent-Replayed") == "true"


async def http(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    json_body: Any = None,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10,
) -> Answer:
    async with session.request(
        method,
        url,
        json=json_body,
        data=data,
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=timeout),
    ) as resp:
        body = await resp.read()
        return Answer(resp.status, body, dict(resp.headers))


async def acquire(
    session: aiohttp.ClientSession, replica: Replica, job: str, owner: str, ttl: float
) -> dict[str, Any]:
    answer = await http(
        session,
        "PUT",
        f"{replica.control}/v1/jobs/{job}/lease",
        json_body={"owner": owner, "ttl_seconds": ttl},
    )
    assert answer.status == 201, answer
    doc: dict[str, Any] = json.loads(answer.body)
    return doc


async def unknown_outcomes(
    session: aiohttp.ClientSession, replica: Replica
) -> list[dict[str, Any]]:
    answer = await http(session, "GET", f"{replica.control}/admin/unknown-outcomes?limit=500")
    assert answer.status == 200, answer
    items: list[dict[str, Any]] = json.loads(answer.body)["items"]
    return items


# -- what workers saw ---------------------------------------------------------------------


@dataclass
class Attempt:
    """One write (or, with ``step`` ``complete``, one complete) a worker tried, and what
    came back."""

    worker: str
    job: str
    step: str
    key: str
    generation: int
    via: str  # the replica's name
    status: int | None = None  # None: no HTTP answer (connection error, timeout)
    reason: str | None = None  # the gateway's problem reason, when it answered itself
    replayed: bool = False
    body: bytes | None = None
    error: str | None = None
    zombie: bool = False
    after_stall: bool = False
    sent: float | None = None  # time.time() when it was sent; None: never sent
    answered: float | None = None  # time.time() when its answer (or error) came
    request_sha256: str | None = None  # the body sent

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    def events(self, process: str) -> list[HistoryEvent]:
        """Its invoke and completion in ``verify.check``'s history."""
        assert self.sent is not None
        f = "complete" if self.step == "complete" else "write"
        common: dict[str, Any] = {
            "process": process,
            "f": f,
            "job": self.job,
            "generation": self.generation,
            "key": self.key if f == "write" else None,
        }
        sha = self.request_sha256 if f == "write" else None
        invoke = HistoryEvent(time=self.sent, type="invoke", body_sha256=sha, **common)
        done = self.answered if self.answered is not None else self.sent
        if self.status is None:
            return [invoke, HistoryEvent(time=done, type="info", **common)]
        answer = sha256_hex(self.body) if self.body is not None and f == "write" else None
        end = HistoryEvent(
            time=done,
            type="ok" if self.ok else "fail",
            status=self.status,
            reason=self.reason,
            body_sha256=answer,
            **common,
        )
        return [invoke, end]


@dataclass(frozen=True)
class Grant:
    """A lease a worker was granted: asked for at ``asked``, granted by ``at``."""

    job: str
    generation: int
    owner: str
    asked: float
    at: float = field(default_factory=time.time)


def steps_of(job: str, steps: int) -> list[str]:
    return [f"s{i}" for i in range(steps)]


def step_body(job: str, step: str) -> dict[str, Any]:
    """The same request every time this step is tried (so a repeat is a duplicate)."""
    return {"job": job, "step": step, "amount": sum(map(ord, job + step)) % 997}


def step_bytes(job: str, step: str) -> bytes:
    """``step_body`` as the bytes sent (their sha256 is in the history)."""
    return json.dumps(step_body(job, step)).encode()


JSON = {"Content-Type": "application/json"}


# -- a run of workers ---------------------------------------------------------------------


@dataclass
class Scale:
    jobs: int
    steps: int
    workers: int
    zombies: int = 0
    ttl: float = 2.0
    run_timeout: float = 60.0


class Run:
    """N jobs of ``steps`` steps each on one queue, and the workers that do them."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        database_url: str,
        scale: Scale,
        *,
        upstreams: Sequence[str] = ("pay",),
        queue: str = "faults",
        write_timeout: float = 4.0,
        seed: int = 0,
        write_via: Sequence[Replica] | None = None,
    ) -> None:
        self.replicas = list(replicas)
        self.gateways = list(write_via or replicas)
        self.scale = scale
        self.upstreams = list(upstreams)
        self.queue = queue
        self.write_timeout = write_timeout
        self.jobs = [f"job-{i:04d}" for i in range(scale.jobs)]
        self.attempts: list[Attempt] = []
        self.random = random.Random(seed)
        self.engine: AsyncEngine = create_async_engine(database_url, pool_size=2, max_overflow=2)
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.zombies: list[asyncio.Task[None]] = []
        self.grants: list[Grant] = []

    def steps(self, job: str) -> list[str]:
        return steps_of(job, self.scale.steps)

    def keys(self, job: str) -> list[str]:
        return [step_key(job, s) for s in self.steps(job)]

    def upstream_of(self, step: str) -> str:
        return self.upstreams[int(step[1:]) % len(self.upstreams)]

    async def enqueue(self) -> None:
        async with aiohttp.ClientSession() as session:
            for job in self.jobs:
                answer = await http(
                    session,
                    "POST",
                    f"{self.replicas[0].control}/v1/jobs",
                    json_body={"queue": self.queue, "job_id": job, "max_attempts": 1000},
                )
                assert answer.status == 201, answer

    def diagnostics(self) -> str:
        """Workers that died, and the last attempts: for failure messages."""
        lines = []
        for task in self.tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                lines.append(f"{task.get_name()} died: {task.exception()!r}")
        lines += [repr(a) for a in self.attempts[-15:]]
        return "\n".join(lines)

    async def stop_workers(self) -> None:
        self.stop.set()
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()

    async def close(self) -> None:
        await self.stop_workers()
        await self.engine.dispose()

    # -- progress -----------------------------------------------------------------------

    async def job_rows(self) -> dict[str, sa.RowMapping]:
        stmt = sa.select(jobs.c.job_id, jobs.c.state, jobs.c.generation, jobs.c.error).where(
            jobs.c.queue == self.queue
        )
        async with self.engine.connect() as conn:
            rows = (await conn.execute(stmt)).mappings().all()
        return {row["job_id"]: row for row in rows}

    async def progress(self) -> tuple[int, int]:
        """(completed, parked) jobs, from the database."""
        rows = (await self.job_rows()).values()
        completed = sum(1 for r in rows if r["state"] == "completed")
        parked = sum(1 for r in rows if r["state"] == "pending" and r["error"] == PARKED)
        return completed, parked

    async def until_settled(self, timeout: float | None = None) -> tuple[int, int]:
        """Wait until every job is completed or parked (or the time is up)."""
        deadline = time.monotonic() + (timeout or self.scale.run_timeout)
        completed = parked = 0
        while time.monotonic() < deadline:
            try:
                completed, parked = await self.progress()
            except (sa.exc.DBAPIError, OSError):
                pass  # the database is away for a moment (a fault under test)
            if completed + parked == len(self.jobs):
                break
            await asyncio.sleep(0.2)
        self.stop.set()
        return completed, parked

    # -- workers --------------------------------------------------------------------------

    def spawn(self, coro: Any, name: str) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(coro, name=name))

    def start_workers(self, count: int | None = None, prefix: str = "w") -> None:
        for i in range(self.scale.workers if count is None else count):
            self.spawn(self.worker(f"{prefix}{i}", i), f"{prefix}{i}")

    def start_zombies(self, stall: float, rounds: int = 1) -> None:
        for i in range(self.scale.zombies):
            self.spawn(self.zombie(f"zombie{i}", i, stall, rounds), f"zombie{i}")
            self.zombies.append(self.tasks[-1])

    async def zombies_done(self, timeout: float = 30) -> None:
        """Wait for every zombie to wake up and finish what it does."""
        if self.zombies:
            await asyncio.wait_for(asyncio.gather(*self.zombies), timeout)

    def pairs(self, index: int) -> Iterator[tuple[Replica, Replica]]:
        """(control, gateway) replicas a worker uses: rotating, and often mixed."""
        turn = index
        while True:
            yield (
                self.replicas[turn % len(self.replicas)],
                self.gateways[(turn + index) % len(self.gateways)],
            )
            turn += 1

    async def worker(self, name: str, index: int) -> None:
        clients: dict[tuple[str, str], LeaseClient] = {}
        try:
            for control, gateway in self.pairs(index):
                if self.stop.is_set():
                    return
                pair = (control.name, gateway.name)
                if pair not in clients:
                    clients[pair] = LeaseClient(
                        control.control,
                        gateway_url=gateway.proxy,
                        timeout=self.write_timeout,
                    )
                client = clients[pair]
                try:
                    asked = time.time()
                    async with client.claim(self.queue, owner=name, ttl=self.scale.ttl) as lease:
                        if lease is None:
                            await asyncio.sleep(0.05 + self.random.random() * 0.1)
                            continue
                        self.grants.append(Grant(lease.job_id, lease.generation, name, asked))
                        await self.do_job(name, lease, gateway)
                except (exc.LeaseError, aiohttp.ClientError, TimeoutError, ValueError):
                    await asyncio.sleep(0.1 + self.random.random() * 0.2)
        finally:
            for client in clients.values():
                await client.close()

    async def do_job(self, name: str, lease: Lease, gateway: Replica) -> str:
        for step in self.steps(lease.job_id):
            outcome = await self.do_step(name, lease, gateway, step)
            if outcome == "held":
                with contextlib.suppress(exc.LeaseError, aiohttp.ClientError, TimeoutError):
                    await lease.fail(error=PARKED, retry_in=PARK_SECONDS)
                return "parked"
            if outcome != "ok":
                return outcome
        for _ in range(20):
            attempt = Attempt(name, lease.job_id, "complete", "", lease.generation, gateway.name)
            attempt.sent = time.time()
            self.attempts.append(attempt)
            try:
                await lease.complete({"by": name})
                attempt.status = 200
                return "completed"
            except exc.LeaseLost as error:
                attempt.status, attempt.reason = 409, error.reason
                return "lost"
            except (exc.LeaseError, aiohttp.ClientError, TimeoutError) as error:
                attempt.error = f"{type(error).__name__}: {error}"
                await asyncio.sleep(0.2)
            finally:
                attempt.answered = time.time()
        return "gave-up"

    async def do_step(self, name: str, lease: Lease, gateway: Replica, step: str) -> str:
        job = lease.job_id
        path = f"/{self.upstream_of(step)}/charges"
        for _ in range(30):
            attempt = Attempt(name, job, step, step_key(job, step), lease.generation, gateway.name)
            if not lease.held:  # the client's own check: it would not send
                attempt.error = "lapsed locally, not sent"
                self.attempts.append(attempt)
                return "lost"
            body = step_bytes(job, step)
            attempt.sent, attempt.request_sha256 = time.time(), sha256_hex(body)
            try:
                answer: FencedResponse = await lease.http.post(
                    path, step=step, data=body, headers=JSON, timeout=self.write_timeout
                )
            except exc.LeaseLost as error:
                if error.detail.startswith("the lease lapsed"):
                    attempt.error, attempt.sent = "lapsed locally, not sent", None
                else:
                    attempt.status, attempt.reason = 409, error.reason
                    attempt.answered = time.time()
                self.attempts.append(attempt)
                return "lost"
            except (aiohttp.ClientError, TimeoutError) as error:
                attempt.error = f"{type(error).__name__}: {error}"
                attempt.answered = time.time()
                self.attempts.append(attempt)
                await asyncio.sleep(0.1 + self.random.random() * 0.2)
                continue
            attempt.answered = time.time()
            problem = answer.problem
            attempt.status, attempt.body, attempt.replayed = (
                answer.status,
                answer.body,
                answer.replayed,
            )
            attempt.reason = str(problem["reason"]) if problem else None
            self.attempts.append(attempt)
            if attempt.ok:
                return "ok"
            if attempt.reason == "outcome-unknown":
                return "held"
            if attempt.reason in RETRYABLE:
                await asyncio.sleep(0.1 + self.random.random() * 0.2)
                continue
            return "gave-up"
        return "gave-up"

    # -- zombies: stall past the lease, then keep writing (raw HTTP: no local check) ------

    async def zombie(self, name: str, index: int, stall: float, rounds: int) -> None:
        async with aiohttp.ClientSession() as session:
            done = 0
            for control, gateway in self.pairs(index):
                if self.stop.is_set() or done >= rounds:
                    return
                asked = time.time()
                try:
                    answer = await http(
                        session,
                        "POST",
                        f"{control.control}/v1/queues/{self.queue}/claim",
                        json_body={"owner": name, "ttl_seconds": self.scale.ttl},
                    )
                except (aiohttp.ClientError, TimeoutError):
                    await asyncio.sleep(0.1)
                    continue
                if answer.status != 200:
                    await asyncio.sleep(0.05)
                    continue
                lease = json.loads(answer.body)
                self.grants.append(Grant(lease["job_id"], lease["generation"], name, asked))
                steps = self.steps(lease["job_id"])
                before = self.random.randint(1, max(len(steps) - 1, 1))
                for step in steps[:before]:
                    await self.raw_write(session, name, lease, gateway, step, after_stall=False)
                await asyncio.sleep(stall)  # a GC pause, a stopped VM: no renewal
                for step in steps:
                    await self.raw_write(session, name, lease, gateway, step, after_stall=True)
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    sent = time.time()
                    end = await http(
                        session,
                        "POST",
                        f"{control.control}/v1/leases/complete",
                        json_body={"lease_token": lease["lease_token"]},
                    )
                    # Recorded as a write-less attempt, so the test can check it was refused.
                    self.attempts.append(
                        Attempt(
                            name,
                            lease["job_id"],
                            "complete",
                            "",
                            lease["generation"],
                            control.name,
                            status=end.status,
                            reason=end.reason,
                            zombie=True,
                            after_stall=True,
                            sent=sent,
                            answered=time.time(),
                        )
                    )
                done += 1

    async def raw_write(
        self,
        session: aiohttp.ClientSession,
        name: str,
        lease: dict[str, Any],
        gateway: Replica,
        step: str,
        *,
        after_stall: bool,
    ) -> Attempt:
        attempt = await raw_write(
            session,
            name,
            lease,
            gateway,
            self.upstream_of(step),
            step,
            timeout=self.write_timeout,
            zombie=True,
            after_stall=after_stall,
        )
        self.attempts.append(attempt)
        return attempt

    # -- after the faults: an operator, then one last worker ----------------------------

    async def finish(self, replica: Replica, timeout: float = 60) -> None:
        """Acquire every job that is not completed by name and do it (parked ones too)."""
        deadline = time.monotonic() + timeout
        async with LeaseClient(
            replica.control, gateway_url=replica.proxy, timeout=self.write_timeout
        ) as client:
            while time.monotonic() < deadline:
                rows = await self.job_rows()
                left = [j for j in self.jobs if rows[j]["state"] != "completed"]
                if not left:
                    return
                for job in left:
                    asked = time.time()
                    try:
                        async with client.acquire(job, owner="finisher", ttl=30) as lease:
                            assert lease is not None
                            self.grants.append(Grant(job, lease.generation, "finisher", asked))
                            await self.do_job("finisher", lease, replica)
                    except (exc.LeaseError, RemoteError, aiohttp.ClientError, TimeoutError):
                        await asyncio.sleep(0.2)
        rows = await self.job_rows()
        left = {j: dict(rows[j]) for j in self.jobs if rows[j]["state"] != "completed"}
        pytest.fail(f"jobs not finished after the faults: {left}")


async def resolve_unknowns(
    replica: Replica, events: list[dict[str, Any]]
) -> list[tuple[str, str, bool]]:
    """What an operator does: look each unknown outcome up at the upstream (``events``:
    every write it received) and resolve it applied (with the answer the upstream gave)
    or not applied (``verify.roles.resolution``)."""
    applied: dict[tuple[str, str], dict[str, Any]] = {}
    for event in events:
        if event["event"] == "applied":
            applied.setdefault((event["job"], event["key"]), event)
    done = []
    async with aiohttp.ClientSession() as session:
        for item in await unknown_outcomes(session, replica):
            found = applied.get((item["job_id"], item["key"]))
            body = resolution(item["job_id"], item["key"], found)
            answer = await http(
                session,
                "POST",
                f"{replica.control}/admin/unknown-outcomes/resolve",
                json_body=body,
            )
            assert answer.status == 200, answer
            done.append((item["job_id"], item["key"], found is not None))
    return done


async def raw_write(
    session: aiohttp.ClientSession,
    name: str,
    lease: dict[str, Any],
    gateway: Replica,
    upstream: str,
    step: str,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
    zombie: bool = False,
    after_stall: bool = False,
) -> Attempt:
    """One step's write with plain HTTP (no client-side lease check), as an Attempt."""
    job = lease["job_id"]
    key = step_key(job, step)
    body = step_bytes(job, step)
    attempt = Attempt(
        name,
        job,
        step,
        key,
        lease["generation"],
        gateway.name,
        zombie=zombie,
        after_stall=after_stall,
        sent=time.time(),
        request_sha256=sha256_hex(body),
    )
    try:
        answer = await http(
            session,
            "POST",
            f"{gateway.proxy}/{upstream}/charges",
            data=body,
            headers={
                **JSON,
                **(headers or {}),
                "Fencing-Token": lease["lease_token"],
                "Idempotency-Key": key,
            },
            timeout=timeout,
        )
    except (aiohttp.ClientError, TimeoutError) as error:
        attempt.error = f"{type(error).__name__}: {error}"
    else:
        attempt.status, attempt.body = answer.status, answer.body
        attempt.reason, attempt.replayed = answer.reason, answer.replayed
    attempt.answered = time.time()
    return attempt


# -- the database, read directly --------------------------------------------------------


@contextlib.asynccontextmanager
async def database(url: str) -> AsyncIterator[AsyncEngine]:
    """An engine on the test's database, for reading it directly."""
    engine = create_async_engine(url, pool_size=2, max_overflow=2)
    try:
        yield engine
    finally:
        await engine.dispose()


async def records(engine: AsyncEngine) -> tuple[list[dict[str, Any]], float]:
    """Every idempotency record, and the database's now."""
    now = sa.select(sa.cast(sa.extract("epoch", sa.func.now()), sa.Float))
    async with engine.connect() as conn:
        rows = (await conn.execute(sa.select(requests))).mappings().all()
        db_now = float((await conn.execute(now)).scalar_one())
    return [dict(r) for r in rows], db_now


async def wait_no_live_in_flight(engine: AsyncEngine, timeout: float = 30) -> None:
    """Until no record is in flight within its deadline (every forward settled, or its
    replica gave up on it and it turned unknown)."""
    deadline = time.monotonic() + timeout
    while True:
        rows, now = await records(engine)
        live = [r for r in rows if r["state"] == "in_flight" and r["deadline"] > now]
        if not live:
            return
        assert time.monotonic() < deadline, f"records still in flight: {live}"
        wait = min(r["deadline"] for r in live) - now
        await asyncio.sleep(min(max(wait, 0.05), 1.0))


# -- the checks ---------------------------------------------------------------------------


def history(attempts: Iterable[Attempt], grants: Iterable[Grant] = ()) -> list[HistoryEvent]:
    """What the workers saw as ``verify.check``'s history, in time order: each lease
    granted and each write or complete sent an operation of a process of its own (one
    worker may have several outstanding)."""
    events: list[HistoryEvent] = []
    for n, grant in enumerate(grants):
        common: dict[str, Any] = {"process": f"{grant.owner}#c{n}", "f": "claim", "job": grant.job}
        events.append(HistoryEvent(time=grant.asked, type="invoke", **common))
        events.append(HistoryEvent(time=grant.at, type="ok", generation=grant.generation, **common))
    for n, attempt in enumerate(attempts):
        if attempt.sent is not None:
            events += attempt.events(f"{attempt.worker}#{n}")
    return sorted(events, key=lambda e: (e.time, e.type != "invoke"))


async def check_run(
    engine: AsyncEngine,
    replica: Replica,
    upstream: UpstreamProc,
    *,
    attempts: Sequence[Attempt],
    grants: Sequence[Grant] = (),
    jobs: dict[str, Any] | None = None,
    keys_of: Callable[[str], list[str]] = lambda job: [],
) -> list[str]:
    """Every problem of a run, as sentences (call it once nothing is in flight any more):

    - ``verify.check``'s invariants 1-6 and 8-12 on the workers' history and the
      upstream's ledger: each key applied at most once, and exactly once when a worker
      got a 2xx; generations in order at the upstream; every 2xx the upstream's first
      answer; no write applied that was refused, or sent after a newer grant, or never
      sent with that body. Liveness (7) is the tests' own, stricter: every job ends.
    - ``verify.records``: every job the database says completed had each step
      (``keys_of``) applied once; every 2xx the upstream's first answer, status and
      body; per job, no lower generation received after a higher one (applied or not);
      the records and ``replica``'s list of unknown outcomes.
    """
    applied = ledger(upstream)
    found = problems(attempts, grants, applied, upstream.events(), jobs or {}, keys_of)
    rows, now = await records(engine)
    async with aiohttp.ClientSession() as session:
        listed = await unknown_outcomes(session, replica)
    return found + account.stored_records(rows, now, applied, listed)


def problems(
    attempts: Sequence[Attempt],
    grants: Sequence[Grant],
    applied: Sequence[LedgerEntry],
    received: Sequence[dict[str, Any]],
    jobs: Mapping[str, Mapping[str, Any]],
    keys_of: Callable[[str], Sequence[str]],
) -> list[str]:
    """``check_run``'s checks that need no database: ``verify.check`` (but 7) and
    ``verify.records``' completed jobs, answers acknowledged and order of receipt."""
    report = check(history(attempts, grants), applied)
    found = [
        f"[{v.invariant} {v.name}] job {v.job!r}: {v.message}: {v.events}"
        for v in report.violations
        if v.invariant != 7
    ]
    found += account.completed_jobs(jobs, keys_of, applied)
    acks = [(a.job, a.key, int(a.status or 0), a.body or b"") for a in attempts if a.ok and a.key]
    found += account.acknowledged(acks, applied)
    return found + account.received_in_order(received)


def summary(events: Sequence[dict[str, Any]], attempts: Sequence[Attempt]) -> str:
    """One line about the run, for the test's output."""
    kinds = Counter(e["event"] for e in events)
    faults = Counter(e["fault"] for e in events)
    answers: Counter[str] = Counter()
    for attempt in attempts:
        replayed = " replayed" if attempt.replayed else ""
        status = f"{attempt.status}{replayed}" if attempt.status else ""
        answers[attempt.reason or status or "no answer"] += 1
    return (
        f"upstream: {dict(kinds)} faults {dict(faults)}; "
        f"workers saw: {dict(sorted(answers.items()))}"
    )
