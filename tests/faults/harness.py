"""The fault harness: real ``fencegate serve`` replicas, the fault-injection upstream as
its own process, and workers (asyncio tasks in the test process) that claim jobs and write
their steps through the gateway.

Everything a worker sees is kept as an ``Attempt``; the upstream logs what it applied;
``tests.faults.checker`` holds the two against each other and against the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
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
from verify.cluster import free_port

FENCEGATE = str(Path(sys.executable).with_name("fencegate"))
UPSTREAM_APP = Path(__file__).with_name("upstream_app.py")
LISTENING = re.compile(r"fencegate listening: .*?control=([\w.:\[\]-]+).*?proxy=([\w.:\[\]-]+)")
UPSTREAM_LISTENING = re.compile(r"upstream listening on (\d+)")
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


def child_env(**extra: str) -> dict[str, str]:
    """Our environment without FENCEGATE_* settings: the config file decides."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("FENCEGATE_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


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


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, sig: signal.Signals) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    async def wait(self, timeout: float) -> int:
        return await asyncio.to_thread(self.popen.wait, timeout)


class ProcessGroup:
    """Every process a test starts; ``cleanup`` (a fixture's teardown) ends them all, one
    by one, by their own pid."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[Proc] = []

    def spawn(self, name: str, args: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        log = self.folder / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                list(args),
                cwd=self.folder,
                env=env or child_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)  # a frozen one too
                    os.kill(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=30)

    def logs(self) -> str:
        """The tail of every process's output, for failure messages."""
        return "\n".join(f"--- {p.name} ---\n{p.output()[-4000:]}" for p in self.procs)


async def _wait_for_line(proc: Proc, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while True:
        match = pattern.search(proc.output())
        if match is not None:
            return match
        if not proc.alive():
            pytest.fail(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.output()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{proc.name} did not start in {timeout:g}s:\n{proc.output()}")
        await asyncio.sleep(0.05)


# -- the upstream -------------------------------------------------------------------------


@dataclass
class UpstreamProc:
    proc: Proc
    url: str
    events_file: Path

    def events(self) -> list[dict[str, Any]]:
        """What it received, in the order it received it."""
        try:
            lines = self.events_file.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    async def state(self) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(self.url + "/__state") as resp,
        ):
            doc: dict[str, Any] = await resp.json()
            return doc

    async def set_knobs(self, **knobs: Any) -> None:
        async with (
            aiohttp.ClientSession() as session,
            session.post(self.url + "/__knobs", json=knobs) as resp,
        ):
            assert resp.status == 200, await resp.text()

    async def wait_received(self, predicate: Any, timeout: float = 10) -> dict[str, Any]:
        """The first logged event that ``predicate`` accepts (waits for it)."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events():
                if predicate(event):
                    return event
            assert time.monotonic() < deadline, "the upstream never received the write"
            await asyncio.sleep(0.02)


async def start_upstream(
    group: ProcessGroup, name: str = "upstream", port: int = 0, **knobs: Any
) -> UpstreamProc:
    """``--delay 0.1:0.3 --hang 0.05 ...``: knobs as keyword arguments."""
    events = group.folder / f"{name}.jsonl"
    args = [sys.executable, str(UPSTREAM_APP), "--log", str(events), "--port", str(port)]
    for knob, value in knobs.items():
        args += [f"--{knob.replace('_', '-')}", str(value)]
    proc = group.spawn(name, args)
    match = await _wait_for_line(proc, UPSTREAM_LISTENING, 30)
    return UpstreamProc(proc, f"http://127.0.0.1:{match[1]}", events)


# -- gateway replicas -----------------------------------------------------------------------


@dataclass
class Replica:
    proc: Proc
    control: str
    proxy: str

    @property
    def name(self) -> str:
        return self.proc.name

    def freeze(self) -> None:
        self.proc.send(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send(signal.SIGCONT)


@dataclass(frozen=True)
class UpstreamSpec:
    name: str
    path: str = "hold"  # the upstream process's behaviour: hold (apply all) or dedupe
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
    proc = group.spawn(name, [FENCEGATE, "serve", "--config", str(config), "--log-format", "json"])
    match = await _wait_for_line(proc, LISTENING, 60)
    replica = Replica(proc, f"http://{match[1]}", f"http://{match[2]}")
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(replica.control + "/healthz") as resp:
                    if resp.status == 200:
                        return replica
            if time.monotonic() > deadline:
                pytest.fail(f"{name}: /healthz never answered:\n{proc.output()}")
            await asyncio.sleep(0.05)


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


def migrate(database_url: str, cwd: Path) -> None:
    """``fencegate migrate`` with ``FENCEGATE_DATABASE_URL``, as a deploy step runs it."""
    result = subprocess.run(
        [FENCEGATE, "migrate"],
        env=child_env(FENCEGATE_DATABASE_URL=database_url),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


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
    headers: dict[str, str] | None = None,
    timeout: float = 10,
) -> Answer:
    async with session.request(
        method,
        url,
        json=json_body,
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
    """One write a worker tried, and what came back."""

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
    at: float = field(default_factory=time.monotonic)

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def steps_of(job: str, steps: int) -> list[str]:
    return [f"s{i}" for i in range(steps)]


def step_body(job: str, step: str) -> dict[str, Any]:
    """The same request every time this step is tried (so a repeat is a duplicate)."""
    return {"job": job, "step": step, "amount": sum(map(ord, job + step)) % 997}


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
        self.grants: list[tuple[str, int, str]] = []  # (job, generation, owner)

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
                    async with client.claim(self.queue, owner=name, ttl=self.scale.ttl) as lease:
                        if lease is None:
                            await asyncio.sleep(0.05 + self.random.random() * 0.1)
                            continue
                        self.grants.append((lease.job_id, lease.generation, name))
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
            try:
                await lease.complete({"by": name})
                return "completed"
            except exc.LeaseLost:
                return "lost"
            except (exc.LeaseError, aiohttp.ClientError, TimeoutError):
                await asyncio.sleep(0.2)
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
            try:
                answer: FencedResponse = await lease.http.post(
                    path, step=step, json=step_body(job, step), timeout=self.write_timeout
                )
            except exc.LeaseLost as error:
                if error.detail.startswith("the lease lapsed"):
                    attempt.error = "lapsed locally, not sent"
                else:
                    attempt.status, attempt.reason = 409, error.reason
                self.attempts.append(attempt)
                return "lost"
            except (aiohttp.ClientError, TimeoutError) as error:
                attempt.error = f"{type(error).__name__}: {error}"
                self.attempts.append(attempt)
                await asyncio.sleep(0.1 + self.random.random() * 0.2)
                continue
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
                self.grants.append((lease["job_id"], lease["generation"], name))
                steps = self.steps(lease["job_id"])
                before = self.random.randint(1, max(len(steps) - 1, 1))
                for step in steps[:before]:
                    await self.raw_write(session, name, lease, gateway, step, after_stall=False)
                await asyncio.sleep(stall)  # a GC pause, a stopped VM: no renewal
                for step in steps:
                    await self.raw_write(session, name, lease, gateway, step, after_stall=True)
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
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
                    try:
                        async with client.acquire(job, owner="finisher", ttl=30) as lease:
                            assert lease is not None
                            self.grants.append((job, lease.generation, "finisher"))
                            await self.do_job("finisher", lease, replica)
                    except (exc.LeaseError, RemoteError, aiohttp.ClientError, TimeoutError):
                        await asyncio.sleep(0.2)
        rows = await self.job_rows()
        left = {j: dict(rows[j]) for j in self.jobs if rows[j]["state"] != "completed"}
        pytest.fail(f"jobs not finished after the faults: {left}")


async def resolve_unknowns(
    replica: Replica, events: list[dict[str, Any]]
) -> list[tuple[str, str, bool]]:
    """What an operator does: look each unknown outcome up at the upstream (its log) and
    resolve it applied (with the answer the upstream gave) or not applied."""
    applied = {(e["job"], e["key"]): e for e in events if e["event"] == "applied"}
    done = []
    async with aiohttp.ClientSession() as session:
        for item in await unknown_outcomes(session, replica):
            event = applied.get((item["job_id"], item["key"]))
            body: dict[str, Any] = {
                "job_id": item["job_id"],
                "key": item["key"],
                "applied": event is not None,
            }
            if event is not None:
                body |= {
                    "status": event["status"],
                    "body": event["answer"],
                    "headers": {"Content-Type": "application/json"},
                }
            answer = await http(
                session,
                "POST",
                f"{replica.control}/admin/unknown-outcomes/resolve",
                json_body=body,
            )
            assert answer.status == 200, answer
            done.append((item["job_id"], item["key"], event is not None))
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
    attempt = Attempt(
        name,
        job,
        step,
        key,
        lease["generation"],
        gateway.name,
        zombie=zombie,
        after_stall=after_stall,
    )
    try:
        answer = await http(
            session,
            "POST",
            f"{gateway.proxy}/{upstream}/charges",
            json_body=step_body(job, step),
            headers={
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
