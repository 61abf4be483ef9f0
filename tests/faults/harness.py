"""The fault suite's harness: real ``fencegate serve`` replicas and ``verify``'s recording
upstream (``verify.upstream``, keeping every write received), each a process of
``verify.procs``, and ``verify``'s workers (``verify.worker.Worker``, asyncio tasks in the
test process) that claim jobs and write their steps through the gateway.

The workers, and the test's scripted writes (``raw_write``), record what they see as
``verify.events`` history (``history-NAME.jsonl`` in the test's folder); ``check_run``
holds it against the upstream's ledger with ``verify.check``, and holds the gateway's
database and its list of unknown outcomes against the upstream's record
(``verify.records``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from fencegate_client import step_key
from gateway.records.schema import requests
from lease_core.schema import jobs
from verify import records as account
from verify import stack
from verify.check import check
from verify.cluster import free_port
from verify.config import UpstreamTable, replica_config
from verify.events import HistoryEvent, LedgerEntry, read_history, read_ledger, sha256_hex
from verify.procs import FENCEGATE, Child, Children, child_env
from verify.roles import resolution
from verify.stack import migrate
from verify.worker import PARKED, QUEUE, UPSTREAM, Conduct, History, Worker, steps_of, upstream_of
from verify.worker import step_key as worker_key

__all__ = ["FENCEGATE", "UpstreamProc", "child_env", "migrate"]  # the failover tests' too

PROBLEM = "application/problem+json"


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
        let_go=group.folder / f"{name}-let-go.jsonl",
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
    """A replica's config file, written as verify's replicas' are (``verify.config``):
    ``upstreams`` at ``upstream_url``'s paths; ``extra``: more TOML tables."""
    path = folder / name
    tables = [
        UpstreamTable(
            spec.name,
            f"{upstream_url}/{spec.path}",
            spec.policy,
            spec.timeout,
            spec.connect_timeout,
        )
        for spec in upstreams
    ]
    text = replica_config(
        database_url=database_url,
        proxy_listen="127.0.0.1:0",
        control_listen="127.0.0.1:0",
        upstreams=tables,
        gateway={
            "ordering_wait_seconds": ordering_wait,
            "shutdown_timeout_seconds": shutdown_timeout,
        },
        max_attempts=100,
        extra=extra,
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


# -- scripted writes ------------------------------------------------------------------


def step_body(job: str, step: str) -> dict[str, Any]:
    """A scripted write's body: the same request every time this step is tried (so a
    repeat is a duplicate)."""
    return {"job": job, "step": step, "amount": sum(map(ord, job + step)) % 997}


def step_bytes(job: str, step: str) -> bytes:
    """``step_body`` as the bytes sent (their sha256 is in the history)."""
    return json.dumps(step_body(job, step)).encode()


JSON = {"Content-Type": "application/json"}
_SCRIPTED = itertools.count()


@dataclass(frozen=True)
class Written:
    """A scripted write's answer (``answer`` None: none came, ``error`` says why)."""

    answer: Answer | None
    error: str | None = None

    @property
    def status(self) -> int | None:
        return None if self.answer is None else self.answer.status

    @property
    def reason(self) -> str | None:
        return None if self.answer is None else self.answer.reason

    @property
    def replayed(self) -> bool:
        return self.answer is not None and self.answer.replayed

    @property
    def body(self) -> bytes | None:
        return None if self.answer is None else self.answer.body

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status <= 299


def scripted(group: ProcessGroup) -> History:
    """The history of a test's scripted writes (``raw_write``), beside its workers'."""
    return History(str(group.folder / "history-scripted.jsonl"))


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
    history: History | None = None,
) -> Written:
    """One step's write with plain HTTP (no client-side lease check); recorded in
    ``history`` (``verify.events``: an invoke and its completion, as a process of its own)
    when given."""
    job = lease["job_id"]
    key = step_key(job, step)
    body = step_bytes(job, step)
    process = f"{name}#{next(_SCRIPTED)}"
    if history is not None:
        history.invoke(process, "write", job, lease["generation"], key, sha256_hex(body))
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
        if history is not None:
            history.complete(process, "info", reason=type(error).__name__)
        return Written(None, f"{type(error).__name__}: {error}")
    written = Written(answer)
    if history is not None:
        history.complete(
            process,
            "ok" if written.ok else "fail",
            status=answer.status,
            reason=answer.reason,
            body_sha256=sha256_hex(answer.body),
            replayed=answer.replayed if written.ok else None,
        )
    return written


def events_of(*histories: History) -> list[HistoryEvent]:
    """What ``histories`` recorded so far, as ``verify.check`` reads it, in time order."""
    events = [e for h in histories for e in read_history(h.writer.path)]
    return sorted(events, key=lambda e: e.time)


# -- a run of verify's workers ------------------------------------------------------------


@dataclass
class Scale:
    jobs: int
    workers: int
    zombies: int = 0
    run_timeout: float = 60.0


# A stalled worker: no look at the lease, renewals stop after the first step, then it
# writes past its lease as ``{id}/late`` and completes (``verify.worker.Worker.do_job``).
LAPSE = Conduct(reckless=True, lapse=True, overlap=False)
CAREFUL = Conduct(reckless=False, lapse=False, overlap=False)
# A job parked on an unknown outcome stays parked until the operator resolves its key.
PARK_SECONDS = 86400.0


class Run:
    """N jobs on verify's queue, and verify's workers (``verify.worker.Worker``) that do
    them, in this process: each through a (lease API, proxy) pair of the replicas drawn
    per job, with every pair of ``replicas`` and ``write_via`` (default: ``replicas``),
    their history in ``history-NAME.jsonl`` of the test's folder."""

    def __init__(
        self,
        group: ProcessGroup,
        replicas: Sequence[Replica],
        database_url: str,
        scale: Scale,
        *,
        upstreams: Sequence[str] = ("pay",),
        seed: int = 0,
        write_via: Sequence[Replica] | None = None,
    ) -> None:
        self.folder = group.folder
        self.replicas = list(replicas)
        self.pairs = [(c.control, g.proxy) for c in replicas for g in (write_via or replicas)]
        self.scale = scale
        self.second = upstreams[1] if len(upstreams) > 1 else None
        self.seed = seed
        self.queue = QUEUE
        self.jobs = [f"job-{i:04d}" for i in range(scale.jobs)]
        self.engine: AsyncEngine = create_async_engine(database_url, pool_size=2, max_overflow=2)
        self.workers: dict[str, Worker] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.zombies: list[asyncio.Task[None]] = []

    def keys(self, job: str) -> list[str]:
        """The keys of a job's steps (``verify.worker``)."""
        return [worker_key(job, step) for step in range(steps_of(job))]

    def upstream_of(self, job: str) -> str:
        return upstream_of(job, self.second) if self.second else UPSTREAM

    def worker(self, name: str, **hooks: Any) -> Worker:
        worker = Worker(
            name,
            History(str(self.folder / f"history-{name}.jsonl")),
            self.pairs,
            seed=str(self.seed),
            second=self.second,
            park=PARK_SECONDS,
            **hooks,
        )
        self.workers[name] = worker
        return worker

    def history(self) -> list[HistoryEvent]:
        """Every worker's history so far, in time order."""
        return events_of(*(w.history for w in self.workers.values()))

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
        """Workers that died, and the last events: for failure messages."""
        lines = []
        for task in self.tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                lines.append(f"{task.get_name()} died: {task.exception()!r}")
        lines += [repr(e) for e in self.history()[-15:]]
        return "\n".join(lines)

    async def stop_workers(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()

    async def close(self) -> None:
        await self.stop_workers()
        for worker in self.workers.values():
            with contextlib.suppress(Exception):
                await worker.close()
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
        return completed, parked

    # -- workers --------------------------------------------------------------------------

    def spawn(self, worker: Worker) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(worker.run(), name=worker.name)
        self.tasks.append(task)
        return task

    def start_workers(self, count: int | None = None, prefix: str = "w") -> None:
        """verify's workers, each job's conduct drawn as in a verification run."""
        for i in range(self.scale.workers if count is None else count):
            self.spawn(self.worker(f"{prefix}{i}"))

    def start_zombies(self, rounds: int = 1) -> None:
        """Workers whose every job lapses (``LAPSE``), ``rounds`` jobs each."""
        for i in range(self.scale.zombies):
            self.zombies.append(self.spawn(self.worker(f"zombie{i}", conduct=LAPSE, rounds=rounds)))

    async def zombies_done(self, timeout: float = 30) -> None:
        """Wait for every zombie to wake up and finish what it does."""
        if self.zombies:
            await asyncio.wait_for(asyncio.gather(*self.zombies), timeout)

    # -- after the faults: one last worker ------------------------------------------------

    async def finish(self, replica: Replica, timeout: float = 60) -> None:
        """Acquire every job that is not completed by name and do it (parked ones too),
        carefully, through ``replica``."""
        finisher = Worker(
            "finisher",
            History(str(self.folder / "history-finisher.jsonl")),
            [(replica.control, replica.proxy)],
            seed=str(self.seed),
            second=self.second,
        )
        self.workers[finisher.name] = finisher
        target = finisher.targets[0]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = await self.job_rows()
            left = [j for j in self.jobs if rows[j]["state"] != "completed"]
            if not left:
                return
            for job in left:
                lease = await finisher.acquire(target, job, deadline=10)
                if lease is None:
                    await asyncio.sleep(0.2)
                    continue
                await finisher.work(target, lease, CAREFUL)
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


async def check_run(
    engine: AsyncEngine,
    replica: Replica,
    upstream: UpstreamProc,
    *,
    history: Sequence[HistoryEvent],
    jobs: dict[str, Any] | None = None,
    keys_of: Callable[[str], list[str]] = lambda job: [],
) -> list[str]:
    """Every problem of a run, as sentences (call it once nothing is in flight any more):

    - ``verify.check``'s invariants on the workers' ``history`` (``verify.events``, as
      verify's workers and ``raw_write`` recorded it) and the upstream's ledger: each key
      applied at most once, and exactly once when a worker got a 2xx; generations in
      order at the upstream; every 2xx the upstream's first answer; no write applied that
      was refused, or sent after a newer grant or its lease's end, or never sent with
      that body; no lease granted while an older one could be current; no write's
      connection closed gracefully before its answer (16). Liveness (7) is the tests'
      own, stricter: every job ends.
    - ``verify.records``: every job the database says completed had each step
      (``keys_of``) applied once; every 2xx the upstream's first answer, status and
      body; per job, no lower generation received after a higher one (applied or not);
      the records and ``replica``'s list of unknown outcomes.
    """
    applied = ledger(upstream)
    let_go = read_ledger(upstream.let_go) if upstream.let_go and upstream.let_go.exists() else []
    found = problems(history, applied, upstream.events(), jobs or {}, keys_of, let_go=let_go)
    rows, now = await records(engine)
    async with aiohttp.ClientSession() as session:
        listed = await unknown_outcomes(session, replica)
    return found + account.stored_records(rows, now, applied, listed)


def problems(
    history: Sequence[HistoryEvent],
    applied: Sequence[LedgerEntry],
    received: Sequence[dict[str, Any]],
    jobs: Mapping[str, Mapping[str, Any]],
    keys_of: Callable[[str], Sequence[str]],
    *,
    let_go: Sequence[LedgerEntry] = (),
) -> list[str]:
    """``check_run``'s checks that need no database: ``verify.check`` (but 7; 16 over
    ``let_go``, the upstream's ``--let-go`` file) and ``verify.records``' completed jobs,
    answers acknowledged and order of receipt."""
    report = check(sorted(history, key=lambda e: e.time), applied, let_go=let_go)
    found = [
        f"[{v.invariant} {v.name}] job {v.job!r}: {v.message}: {v.events}"
        for v in report.violations
        if v.invariant != 7
    ]
    found += account.completed_jobs(jobs, keys_of, applied)
    found += account.acknowledged(history, applied)
    return found + account.received_in_order(received)


def answers(history: Iterable[HistoryEvent]) -> Counter[str]:
    """How the writes and completes of ``history`` were answered: reason, status (with
    ``replayed``) or ``no answer``."""
    seen: Counter[str] = Counter()
    for event in history:
        if event.type == "invoke" or event.f not in ("write", "complete"):
            continue
        replayed = " replayed" if event.replayed else ""
        status = f"{event.status}{replayed}" if event.status else ""
        seen[event.reason or status or "no answer"] += 1
    return seen


def summary(events: Sequence[dict[str, Any]], history: Sequence[HistoryEvent]) -> str:
    """One line about the run, for the test's output."""
    kinds = Counter(e["event"] for e in events)
    faults = Counter(e["fault"] for e in events)
    seen = answers(history)
    return (
        f"upstream: {dict(kinds)} faults {dict(faults)}; workers saw: {dict(sorted(seen.items()))}"
    )
