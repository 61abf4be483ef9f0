"""One worker of a verification run, run as its own process::

    python -m verify.worker --id w3 --control URL[,URL...] --gateway URL[,URL...]
        --history FILE --seed S --token T
        [--direct UPSTREAM_URL | --redis URL | --etcd URL | --zookeeper HOSTS]

Until SIGTERM it claims jobs from the queue with the project's worker client
(``fencegate_client.LeaseClient``, a TTL drawn from 1-3 s), renews the lease in the
background, and does the job's steps (3-5, fixed per job): for each, it decides (the lease
is still held, as far as it can tell: the fencing headers are made then), works a little
(20-400 ms, so a pause can fall between deciding and sending, and a job lives through
renewals), then sends one write with the key ``{job}-step{i}`` and a body fixed per
(job, step), so that the next worker's retry of the step is the same request; half the
steps also send a key of the generation's own, ``{job}-g{generation}-step{i}``, which no
other generation sends. Then it completes the job. A share of the steps answered 2xx is
sent once more under its key with a body rebuilt differently (a worker bug the gateway
must refuse ``idempotency-key-reused``).

How a job is worked is drawn per job (``Conduct``): careful, as above; or reckless, with
no look at the lease before a write and, after a refusal that says the lease is gone, the
job's remaining steps sent once each (a zombie); of the reckless, some stop renewing and
work past the TTL (lapse), and some make two generations write at once on purpose
(``Worker.overlap``: the old one's write in flight while the successor writes, or the
old one waking the moment the successor is granted).

Each job goes through one gateway replica (``--control``/``--gateway`` are paired by
position), drawn at random. A replica that is down (connection refused or dropped) or a
lost lease (the client says so, or the gateway answers 409 ``stale-generation``,
``lease-ended``, ``lease-expired``) abandons the job: the lease expires and the next worker
retries it, as real job queues do. A step held as ``outcome-unknown`` parks the job (its
lease is failed with a short retry delay) until the operator resolves the key.

``--steer FILE``: a lapsed job's late writes go to the replica the file names (by index)
while it names one: the clock nemesis's replica whose clock is behind (``verify.stack``).

``--redis URL``: the worker holds Redis locks instead of the queue's jobs
(``verify.locks.LockWorker``, the ``lock-loss`` nemesis's workload); ``--etcd URL``:
etcd's locks (the same worker, ``verify.etcd_locks``; the ``etcd-loss`` nemesis's);
``--zookeeper HOSTS``: ZooKeeper's (``verify.zk_locks``; the ``zk-loss`` nemesis's).

``--signed KEYFILE``: the worker signs tokens of its own job and writes with them
instead (``verify.signed.SignedWorker``).

Both write through the replicas' proxy only, with no lease API: what they share (the
worker's name, its random, history, gateways and session) is ``SourceWorker``'s.

``--direct``: the same steps go straight to the upstream with ``Fencing-Job``,
``Fencing-Generation`` and ``Idempotency-Key`` and no gateway: the baseline.

A lapsed job (``Conduct.lapse``) writes after its stall as process ``{id}/late`` and ends
with its complete, sent once without the client's look at the lease: the gateway must
refuse every one of them.

The fault suite (``tests/faults/harness.py`` ``Run``) runs the same ``Worker`` in its own
process against its replicas, with hooks of the constructor: the (lease API, proxy)
pairs, a second upstream for a share of the jobs, a fixed conduct (its zombies lapse every
job), how long a parked job waits, a number of jobs to work.

Every claim, renew, write and complete is recorded in ``--history`` as an invoke and its
completion (``verify.events``). The client's own renewer has no hook, so the worker runs
the renewal loop itself with the client's ``Lease.renew`` at the client's interval (a
third of the TTL), as process ``{id}/renew``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import signal
import sys
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

from fencegate_client import Lease, LeaseClient, RemoteError
from fencegate_client import errors as exc
from fencegate_client import protocol as p
from verify.events import F, HistoryEvent, JsonlWriter, Type, sha256_hex

if TYPE_CHECKING:
    from verify.locks import LockWorker
    from verify.signed import SignedWorker

QUEUE = "verify"
UPSTREAM = "pay"  # the upstream's name at the gateway
# The upstream whose unknown outcomes the gateway resolves itself (``unknown_outcome =
# "resolve"``, ``verify.stack``; only with ``--resolving``): a share of the jobs write
# there, with their own key in ``Verify-Key`` (the gateway sends the upstream a digest of
# it), and every request of a share of their keys is applied (once: the upstream
# deduplicates) and cut without an answer (``Verify-Fault: cut``), the resolver's
# re-sends too: held until the upstream forgets the key, which only an operator may
# settle then.
RESOLVING = "dedup"
RESOLVING_SHARE = 0.25
ALWAYS_CUT_SHARE = 0.15
WRITE_TIMEOUT = 5.0
CONTROL_TIMEOUT = 3.0
PARK_RETRY_SECONDS = 2.0
PARKED = "parked: outcome-unknown"  # the error a parked job's lease is failed with
# A job parked on a key of ``RESOLVING``: the gateway re-sends such a key itself while
# the job's next generation has not written (a newer generation's write stops the
# re-sends), so the job waits out the resolver's part, as a worker that leaves those
# keys to the gateway would (``verify.roles.RESOLVER_HANDS_OFF``, 7 s, and a little more).
PARK_RESOLVING_SECONDS = 8.0
# Answers after which the same request is simply sent again, with the same key (a
# worker never makes a new key: each step's key is fixed, so after a ``maybe`` answer,
# upstream-timeout or upstream-connection-lost, the retry is the same request, and the
# gateway answers it from the key's record: a replay, or outcome-unknown, which parks it).
RETRYABLE = frozenset(
    {
        "request-in-progress",
        "ordering-timeout",
        "store-unavailable",
        "upstream-unavailable",
        "upstream-timeout",
        "upstream-connection-lost",
        "gateway-overloaded",
    }
)
# Of a worker's rounds: a solo round (``Worker.solo``): a job of a queue of the worker's
# own, claimed and left to lapse without a renewal, then claimed again from that queue
# every SOLO_POLL seconds as soon as the queue gives it (invariant 15: not before the
# first lease could end). Drawn from a random of its own, so the rest of a seed's
# workload is drawn as before.
SOLO_SHARE = 0.1
SOLO_POLL = 0.05
RETRY_STATUSES = frozenset({429, 502, 503, 504})
MAX_SENDS = 40
# The source workers' (``verify.locks``, ``verify.signed``): of their holdings, a share
# let lapse and written with again ``SOURCE_LAPSE_PAST`` seconds past the lapse (each
# module says how it lapses); a write sent at most ``SOURCE_MAX_SENDS`` times while it is
# answered one of ``RETRY_STATUSES``.
SOURCE_LAPSE_SHARE = 0.2
SOURCE_LAPSE_PAST = (0.7, 1.5)
SOURCE_MAX_SENDS = 20
# Of the jobs: worked recklessly (no look at the lease before a write, a zombie after a
# refusal); of those, with renewals that stop (lapse), or with a write in flight while
# the next generation writes (overlap). Of the steps: also a key of the generation's own.
RECKLESS_SHARE = 0.6
LAPSE_SHARE = 0.25
OVERLAP_SHARE = 0.3
OWN_KEY_SHARE = 0.5
# Of the steps answered 2xx: sent once more under the same key with another body (a retry
# that rebuilt its payload, a worker bug), which the gateway must refuse 422
# idempotency-key-reused (invariant 14).
REBUILT_SHARE = 0.15
# overlap: the old write leaves this long before the lease's expiry, and the upstream
# waits APPLY_DELAY before applying it (under the gateway's upstream timeout, 1 s, so the
# gateway still has it in flight when the successor's first write comes).
IN_FLIGHT_LEAD = 0.25
APPLY_DELAY = 0.7
APPLY_DELAY_HEADER = "Verify-Apply-Delay"


def _share_of(text: str) -> float:
    """A number in [0, 1) fixed by ``text``."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 2**32


def upstream_of(job: str, other: str = RESOLVING) -> str:
    """The upstream a job's writes go to, fixed per job: ``other`` for a share of the jobs
    (``RESOLVING_SHARE``), ``UPSTREAM`` for the rest."""
    return other if _share_of(f"{job}/upstream") < RESOLVING_SHARE else UPSTREAM


def always_cut(job: str, key: str) -> bool:
    """Whether every request under this key of a job of ``RESOLVING`` is cut."""
    return upstream_of(job) == RESOLVING and _share_of(f"{job}/{key}/cut") < ALWAYS_CUT_SHARE


def parked_for(upstream: str) -> float:
    """Seconds a job of ``upstream`` parked on an unknown outcome waits before its next
    claim."""
    return PARK_RESOLVING_SECONDS if upstream == RESOLVING else PARK_RETRY_SECONDS


def steps_of(job: str) -> int:
    """3-5 steps, fixed per job."""
    return 3 + int(hashlib.sha256(job.encode()).hexdigest()[:8], 16) % 3


def step_key(job: str, step: int) -> str:
    return f"{job}-step{step}"


def own_key(job: str, generation: int, step: int) -> str:
    """A key only generation ``generation`` sends: a late write under it is never a replay."""
    return f"{job}-g{generation}-step{step}"


def own_body(job: str, generation: int, step: int) -> bytes:
    return json.dumps(
        {"generation": generation, "job": job, "notify": step}, sort_keys=True
    ).encode()


def step_body(job: str, step: int) -> bytes:
    """The same bytes every time this step is sent (a retry is the same request)."""
    amount = int(hashlib.sha256(f"{job}/{step}".encode()).hexdigest()[:6], 16) % 10_000
    return json.dumps({"amount": amount, "job": job, "step": step}, sort_keys=True).encode()


def rebuilt_body(job: str, step: int) -> bytes:
    """The step's body rebuilt differently: another request under the step's key."""
    body = json.loads(step_body(job, step))
    return json.dumps({**body, "rebuilt": True}, sort_keys=True).encode()


def error_status(error: exc.LeaseError) -> int:
    return error.remote_status if isinstance(error, RemoteError) else error.status


def error_reason(error: exc.LeaseError) -> str:
    return error.remote_reason if isinstance(error, RemoteError) else str(error.reason)


class History:
    """This worker's history file: invokes and completions, one process each at a time."""

    def __init__(self, path: str) -> None:
        self.writer = JsonlWriter(path)
        self.open: dict[str, tuple[F, str, int | None, str | None, str | None]] = {}

    def invoke(
        self,
        process: str,
        f: F,
        job: str = "",
        generation: int | None = None,
        key: str | None = None,
        body_sha256: str | None = None,
        *,
        holder: str | None = None,
    ) -> None:
        self.open[process] = (f, job, generation, key, holder)
        self._write(
            process, "invoke", f, job, generation, key, None, None, body_sha256, None, holder
        )

    def complete(
        self,
        process: str,
        type_: Type,
        *,
        job: str | None = None,
        generation: int | None = None,
        status: int | None = None,
        reason: str | None = None,
        body_sha256: str | None = None,
        ttl: float | None = None,
        holder: str | None = None,
        replayed: bool | None = None,
    ) -> None:
        f, invoked_job, invoked_generation, key, invoked_holder = self.open.pop(process)
        job = invoked_job if job is None else job
        generation = invoked_generation if generation is None else generation
        holder = invoked_holder if holder is None else holder
        self._write(
            process, type_, f, job, generation, key, status, reason, body_sha256, ttl, holder,
            replayed,
        )  # fmt: skip

    def outstanding(self, process: str) -> bool:
        return process in self.open

    def _write(
        self,
        process: str,
        type_: Type,
        f: F,
        job: str,
        generation: int | None,
        key: str | None,
        status: int | None,
        reason: str | None,
        body_sha256: str | None,
        ttl: float | None,
        holder: str | None,
        replayed: bool | None = None,
    ) -> None:
        event = HistoryEvent(
            time=time.time(),
            process=process,
            type=type_,
            f=f,
            job=job,
            generation=generation,
            key=key,
            status=status,
            reason=reason,
            body_sha256=body_sha256,
            ttl=ttl,
            holder=holder,
            replayed=replayed,
        )
        self.writer.write(event)


class SourceWorker:
    """What the workers whose leases come from a lease source, not the queue, share
    (``--redis``, ``--signed``): the worker's name, its random (seeded with the run's
    seed, the name and ``workload``), its history, the replicas' proxy URLs and a session
    that opens a connection per request (as ``Worker``'s, for the reason given there).
    ``close`` closes the session, then the history."""

    def __init__(
        self, worker_name: str, seed: str, history: History, gateways: list[str], workload: str
    ) -> None:
        self.name = worker_name
        self.random = random.Random(f"{seed}/{worker_name}/{workload}")
        self.history = history
        self.gateways = [g.rstrip("/") for g in gateways]
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))

    async def close(self) -> None:
        await self.session.close()
        self.history.writer.close()


@dataclass
class Target:
    """One gateway replica: its lease API (a client) and where writes go."""

    client: LeaseClient
    writes_to: str  # the gateway's proxy URL, or the upstream's in --direct mode


class Worker:
    """One worker of the queue's jobs: ``run`` until cancelled. ``pairs``: each replica's
    lease API and where its writes go (its proxy, or the upstream in ``direct`` mode),
    one drawn per job. In a process of its own (``from_args``) or in-process (the fault
    suite's ``Run``), with the hooks a scripted test needs: ``second``, the upstream a
    share of the jobs write to (``upstream_of``; ``RESOLVING`` with ``--resolving``, none:
    every job writes to ``UPSTREAM``); ``conduct``, one ``Conduct`` for every job instead
    of a draw; ``park``, seconds a parked job waits before its next claim instead of
    ``parked_for``'s; ``rounds``, the jobs worked before ``run`` returns (None: no end)."""

    def __init__(
        self,
        name: str,
        history: History,
        pairs: Sequence[tuple[str, str]],
        *,
        seed: str = "0",
        token: str | None = None,
        direct: bool = False,
        steer: str | None = None,
        second: str | None = None,
        conduct: Conduct | None = None,
        park: float | None = None,
        rounds: int | None = None,
    ) -> None:
        self.name = name
        self.direct = direct
        self.random = random.Random(f"{seed}/{name}")
        self.solo_random = random.Random(f"{seed}/{name}/solo")
        self.solos = 0
        self.history = history
        self.steer = steer
        self.second = second
        self.fixed_conduct = conduct
        self.park = park
        self.rounds = rounds
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        # A connection per request: a kept-alive connection that a replica closed (killed,
        # restarted, idle) while this worker was stopped fails at once without sending a
        # byte, so a paused worker's late write would never reach the gateway; a fresh
        # connection delivers it, as the stalled workers the fence is for do.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        self.targets = [
            Target(
                LeaseClient(
                    control,
                    gateway_url=writes_to if not direct else None,
                    token=token,
                    timeout=CONTROL_TIMEOUT,
                    session=self.session,
                ),
                writes_to.rstrip("/"),
            )
            for control, writes_to in pairs
        ]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Worker:
        """The worker ``python -m verify.worker`` runs."""
        controls = args.control.split(",")
        gateways = args.gateway.split(",") if args.gateway else controls
        if len(controls) == 1:
            controls *= len(gateways)
        pairs = zip(controls, gateways, strict=True)
        return cls(
            args.id,
            History(args.history),
            [(c, args.direct if args.direct is not None else g) for c, g in pairs],
            seed=args.seed,
            token=args.token,
            direct=args.direct is not None,
            steer=args.steer,
            second=RESOLVING if args.resolving else None,
        )

    async def close(self) -> None:
        for target in self.targets:
            await target.client.close()
        await self.session.close()
        self.history.writer.close()

    async def run(self) -> None:
        worked = 0
        while self.rounds is None or worked < self.rounds:
            if self.solo_random.random() < SOLO_SHARE:
                await self.solo(self.solo_random.choice(self.targets))
                continue
            target = self.random.choice(self.targets)
            lease = await self.claim(target)
            if lease is None:
                await asyncio.sleep(self.random.uniform(0.05, 0.15))
                continue
            outcome = await self.work(target, lease, self.conduct())
            worked += 1
            if outcome == "park":
                await self.give_back(lease)
            elif outcome not in ("completed", "lost"):
                await asyncio.sleep(self.random.uniform(0.1, 0.3))

    async def give_back(self, lease: Lease) -> None:
        """Park the job: its lease failed with ``PARKED``, the job pending again in
        ``park`` seconds (or its upstream's ``parked_for``). Recorded as ``fail``: a lease
        given back ends before its TTL, and a named acquire (the fault tests' finisher)
        may be granted the job at once (invariant 15)."""
        retry_in = self.park
        if retry_in is None:
            retry_in = parked_for(self.upstream_for(lease.job_id))
        process, history = self.name, self.history
        history.invoke(process, "fail", lease.job_id, lease.generation)
        try:
            await lease.fail(error=PARKED, retry_in=retry_in)
        except exc.LeaseError as error:
            history.complete(
                process, "fail", status=error_status(error), reason=error_reason(error)
            )
        except (aiohttp.ClientError, TimeoutError) as error:
            history.complete(process, "info", reason=type(error).__name__)
        else:
            history.complete(process, "ok", status=200)

    def upstream_for(self, job: str) -> str:
        """Where a job's writes go: the second upstream for a share of the jobs
        (``upstream_of``) when there is one (``RESOLVING`` with ``--resolving``), else
        ``UPSTREAM``."""
        return upstream_of(job, self.second) if self.second else UPSTREAM

    def conduct(self) -> Conduct:
        """How the next job is worked, drawn from this worker's seed (or the one given)."""
        if self.fixed_conduct is not None:
            return self.fixed_conduct
        reckless = self.random.random() < RECKLESS_SHARE
        shape = self.random.random()
        return Conduct(
            reckless=reckless,
            lapse=reckless and shape < LAPSE_SHARE,
            overlap=reckless and LAPSE_SHARE <= shape < LAPSE_SHARE + OVERLAP_SHARE,
            woken=self.random.random() < 0.5,
        )

    async def work(self, target: Target, lease: Lease, conduct: Conduct) -> str:
        """The job under ``lease``, with its renewer running meanwhile."""
        renewer = asyncio.get_running_loop().create_task(
            self.renew_forever(lease), name=f"{self.name}/renew"
        )
        try:
            if conduct.overlap:
                return await self.overlap(target, lease, renewer, conduct.woken)
            return await self.do_job(target, lease, conduct, renewer)
        finally:
            await _cancel(renewer)

    # -- the lease ------------------------------------------------------------------------

    async def solo(self, target: Target) -> None:
        """A solo round: a job of the queue ``solo-<worker>``, claimed with a TTL of 1-2 s
        and left to lapse (no renewal, no write), then claimed again from that queue by
        ``<worker>/next`` every ``SOLO_POLL`` s until it is granted (the second lease is
        completed) or twice the TTL and 2 s have passed. Nothing else is in that queue
        but earlier rounds' jobs, so the queue hands the job out the moment it is
        claimable: a lease core that hands it out before the first lease could end breaks
        invariant 15. Right after the first grant, ``<worker>/next`` also asks for the job
        by name (an acquire, another owner) while the first lease is current: it must be
        refused ``lease-held`` (issue 53: an independent review's mutant, an acquire that
        takes a held job from any owner, survived every run, as no other workload
        acquires a job someone else holds)."""
        queue = f"solo-{self.name}"
        self.solos += 1
        try:
            await target.client.enqueue(
                queue=queue, job_id=f"{queue}-{self.solos}", max_attempts=1000
            )
        except (exc.LeaseError, aiohttp.ClientError, TimeoutError):
            return
        ttl = round(self.solo_random.uniform(1.0, 2.0), 2)
        first, _ = await self.grant("", target.client.claim(queue, owner=self.name, ttl=ttl))
        if first is None:
            return
        until = time.monotonic() + 2 * ttl + 2.0
        process = f"{self.name}/next"
        asking = target.client.acquire(first.job_id, owner=process, ttl=ttl, queue=queue)
        taken, _ = await self.grant(first.job_id, asking, process=process)
        if taken is not None:  # the first lease was over already (a pause): it is done
            await self.complete(target, taken, process=process)
            return
        while time.monotonic() < until:
            await asyncio.sleep(SOLO_POLL)
            asking = target.client.claim(queue, owner=process, ttl=ttl)
            second, _ = await self.grant("", asking, process=process)
            if second is not None:
                await self.complete(target, second, process=process)
                return

    async def grant(
        self, job: str, asking: Awaitable[Lease | None], *, process: str | None = None
    ) -> tuple[Lease | None, str]:
        """One claim from the queue or acquire of a named ``job`` (``""``: a queue's),
        recorded as a ``claim`` (by ``process``, the worker's own by default): the lease,
        or None and why (the refusal's reason, ``connection-refused``, ``unknown`` when no
        answer came, ``nothing`` on a 204)."""
        process, history = process or self.name, self.history
        history.invoke(process, "claim", job)
        try:
            lease = await asking
        except exc.LeaseError as error:
            reason = error_reason(error)
            history.complete(process, "fail", status=error_status(error), reason=reason)
            return None, reason
        except aiohttp.ClientConnectorError:
            history.complete(process, "fail", reason="connection-refused")
            return None, "connection-refused"
        except (aiohttp.ClientError, TimeoutError) as error:
            history.complete(process, "info", reason=type(error).__name__)
            return None, "unknown"
        if lease is None:
            history.complete(process, "fail", status=204)
            return None, "nothing"
        history.complete(
            process,
            "ok",
            job=lease.job_id,
            generation=lease.generation,
            status=200,
            ttl=lease.ttl_seconds,
        )
        return lease, ""

    async def claim(self, target: Target) -> Lease | None:
        ttl = round(self.random.uniform(1.0, 3.0), 2)
        lease, why = await self.grant("", target.client.claim(QUEUE, owner=self.name, ttl=ttl))
        if lease is None and why not in ("unknown", "nothing"):
            await asyncio.sleep(self.random.uniform(0.1, 0.3))
        return lease

    async def renew_forever(self, lease: Lease) -> None:
        process, history = f"{self.name}/renew", self.history
        try:
            while lease.held:
                await asyncio.sleep(p.renew_interval(lease.ttl_seconds))
                if not lease.held:
                    return
                history.invoke(process, "renew", lease.job_id, lease.generation)
                try:
                    await lease.renew()
                except exc.LeaseLost as error:
                    history.complete(process, "fail", status=409, reason=str(error.reason))
                    return
                except exc.LeaseError as error:
                    reason = error_reason(error)
                    history.complete(process, "fail", status=error_status(error), reason=reason)
                except aiohttp.ClientConnectorError:
                    history.complete(process, "fail", reason="connection-refused")
                except (aiohttp.ClientError, TimeoutError) as error:
                    history.complete(process, "info", reason=type(error).__name__)
                else:
                    history.complete(process, "ok", status=200, ttl=lease.ttl_seconds)
        finally:
            if history.outstanding(process):  # cancelled while renewing
                history.complete(process, "info", reason="abandoned")

    async def complete(self, target: Target, lease: Lease, *, process: str | None = None) -> str:
        process, history = process or self.name, self.history
        for _ in range(5):
            if not lease.held:
                return "lost"
            history.invoke(process, "complete", lease.job_id, lease.generation)
            try:
                await lease.complete({"by": self.name})
            except exc.LeaseLost as error:
                history.complete(process, "fail", status=409, reason=str(error.reason))
                return "lost"
            except exc.LeaseError as error:
                reason = error_reason(error)
                history.complete(process, "fail", status=error_status(error), reason=reason)
                if reason not in RETRYABLE:
                    return "gave-up"
            except aiohttp.ClientConnectorError:
                history.complete(process, "fail", reason="connection-refused")
                return "down"
            except (aiohttp.ClientError, TimeoutError) as error:
                history.complete(process, "info", reason=type(error).__name__)
            else:
                history.complete(process, "ok", status=200)
                return "completed"
            await asyncio.sleep(self.random.uniform(0.1, 0.3))
        return "gave-up"

    # -- the job ----------------------------------------------------------------------------

    async def do_job(
        self, target: Target, lease: Lease, conduct: Conduct, renewer: asyncio.Task[None]
    ) -> str:
        """The job's steps, then its completion. A ``reckless`` worker that learns it lost
        the lease goes on with the remaining steps, each sent once (a zombie), and ends
        there; a ``lapse`` stops renewing after the first step and works past the TTL, as
        process ``{id}/late``, and ends with its complete, sent once whatever it knows
        (``late_complete``)."""
        lost = False
        writes_to, process = target, self.name
        for step in range(steps_of(lease.job_id)):
            if conduct.lapse and step == 1:
                await _cancel(renewer)
                await asyncio.sleep(_valid_for(lease) + self.random.uniform(0.3, 1.5))
                writes_to, process = self.steered(target), f"{self.name}/late"
            outcome = await self.step(writes_to, lease, step, process, conduct.reckless, lost)
            if outcome == "lost" and conduct.reckless:
                lost = True
            elif outcome != "ok" and not lost:
                return outcome
        if conduct.lapse:
            return await self.late_complete(target, lease, process)
        return "lost" if lost else await self.complete(target, lease)

    async def late_complete(self, target: Target, lease: Lease, process: str) -> str:
        """A lapsed job's complete: sent once with the lease's token, without the client's
        look at the lease (which would not send it), as a process that stalled past its
        lease and did not look does; the gateway refuses it (``completed``: it did not)."""
        history, job = self.history, lease.job_id
        call = p.complete_call(lease.token, {"by": self.name})
        history.invoke(process, "complete", job, lease.generation)
        try:
            async with self.session.post(
                target.client.control_url + call.path,
                json=call.body,
                headers=self.auth,
                timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT),
            ) as resp:
                raw, status = await resp.read(), resp.status
                content_type = resp.headers.get("Content-Type", "")
        except aiohttp.ClientConnectorError:
            history.complete(process, "fail", reason="connection-refused")
            return "down"
        except (aiohttp.ClientError, TimeoutError) as error:
            history.complete(process, "info", reason=type(error).__name__)
            return "gave-up"
        problem = p.problem_of(content_type, raw)
        reason = str(problem["reason"]) if problem else None
        if 200 <= status <= 299:
            history.complete(process, "ok", status=status)
            return "completed"
        history.complete(process, "fail", status=status, reason=reason)
        return "lost"

    def steered(self, target: Target) -> Target:
        """Where a lapsed job's late writes go: the replica whose clock the clock nemesis
        put behind, while it is (on PostgreSQL only the database's clock may judge them
        late), else ``target``."""
        if self.steer is None:
            return target
        try:
            with open(self.steer, encoding="utf-8") as file:
                index = file.read().strip()
        except OSError:
            return target
        return self.targets[int(index)] if index.isdigit() else target

    async def step(
        self,
        target: Target,
        lease: Lease,
        step: int,
        process: str,
        reckless: bool,
        zombie: bool,
        *,
        delay: float = 0.0,
        work: bool = True,
    ) -> str:
        """One step: its write (a key the next generation retries) and, half the time, a
        write of a key of this generation's own, which no other generation sends."""
        job, generation = lease.job_id, lease.generation
        outcome = await self.write(
            target,
            lease,
            step_key(job, step),
            step_body(job, step),
            process,
            reckless=reckless,
            once=zombie,
            delay=delay,
            work=work,
        )
        if outcome == "ok" and self.random.random() < REBUILT_SHARE:
            # Sent once, whatever comes back: expected 422 idempotency-key-reused.
            await self.write(
                target,
                lease,
                step_key(job, step),
                rebuilt_body(job, step),
                process,
                reckless=reckless,
                once=True,
                work=False,
            )
        if outcome in ("ok", "lost") and self.random.random() < OWN_KEY_SHARE:
            own = await self.write(
                target,
                lease,
                own_key(job, generation, step),
                own_body(job, generation, step),
                process,
                reckless=reckless,
                once=zombie or outcome == "lost",
            )
            outcome = outcome if outcome == "lost" else own
        return outcome

    async def overlap(
        self, target: Target, lease: Lease, renewer: asyncio.Task[None], woken: bool
    ) -> str:
        """Two generations of one job writing at once, on purpose: the first step as
        usual, then renewals stop, and at the expiry this worker acquires the job again by
        name (a new generation) and works it as its successor, while the old generation,
        as process ``{id}/old``, goes on as a zombie (``zombie``):

        - in flight (``woken`` false): shortly before the expiry the old generation sends
          its next step with the upstream told to wait before applying it
          (``APPLY_DELAY``), and the successor writes at once: the barrier's case;
        - woken: the old generation wakes the moment the successor is granted and writes
          its remaining steps at once, while the successor is still at its first step's
          work: the fence's case, before the newer generation has written."""
        if await self.step(target, lease, 0, self.name, True, False) != "ok":
            return "gave-up"
        await _cancel(renewer)
        steps = range(1, steps_of(lease.job_id))
        granted = asyncio.Event()
        if not woken:
            await asyncio.sleep(max(0.0, _valid_for(lease) - IN_FLIGHT_LEAD))
        old = asyncio.get_running_loop().create_task(
            self.zombie(target, lease, steps, None if woken else APPLY_DELAY, granted),
            name=f"{self.name}/old",
        )
        try:
            await asyncio.sleep(max(0.0, _valid_for(lease)))
            successor = await self.acquire(target, lease.job_id, deadline=lease.ttl_seconds + 3)
            if successor is None:
                return "gave-up"
            granted.set()
            if woken:
                await asyncio.sleep(self.random.uniform(0.3, 0.8))  # the successor's work
            # First a key of its own (not the old generation's key in flight, which would
            # only wait for that key), then the step the old generation was at.
            job, generation = successor.job_id, successor.generation
            first = await self.write(
                target, successor, own_key(job, generation, 1), own_body(job, generation, 1),
                self.name, work=False,
            )  # fmt: skip
            if first == "ok":
                first = await self.step(target, successor, 1, self.name, False, False)
            if first != "ok":
                return first
            return await self.work_rest(target, successor)
        finally:
            granted.set()
            with contextlib.suppress(Exception):
                await old

    async def work_rest(self, target: Target, lease: Lease) -> str:
        """The successor of ``overlap``: steps 2 on, with its own renewer, then complete."""
        renewer = asyncio.get_running_loop().create_task(
            self.renew_forever(lease), name=f"{self.name}/renew"
        )
        try:
            for step in range(2, steps_of(lease.job_id)):
                outcome = await self.step(target, lease, step, self.name, False, False)
                if outcome != "ok":
                    return outcome
            return await self.complete(target, lease)
        finally:
            await _cancel(renewer)

    async def zombie(
        self,
        target: Target,
        lease: Lease,
        steps: range,
        delay: float | None,
        granted: asyncio.Event,
    ) -> None:
        """``overlap``'s old generation: the remaining steps once each, whatever the
        gateway answers; the first held ``delay`` seconds at the upstream, or (None) sent
        the moment the successor is granted."""
        process = f"{self.name}/old"
        if delay is None:
            await granted.wait()
        for index, step in enumerate(steps):
            await self.step(
                target, lease, step, process, True, True,
                delay=delay if index == 0 and delay else 0.0, work=index > 0,
            )  # fmt: skip

    async def acquire(self, target: Target, job: str, *, deadline: float) -> Lease | None:
        """The named job's lease, asked again every 50 ms while another lease holds it."""
        until = time.monotonic() + deadline
        while time.monotonic() < until:
            ttl = round(self.random.uniform(1.0, 3.0), 2)
            asking = target.client.acquire(job, owner=self.name, ttl=ttl, queue=QUEUE)
            lease, why = await self.grant(job, asking)
            if lease is not None or why not in (*RETRYABLE, "lease-held"):
                return lease
            await asyncio.sleep(0.05)
        return None

    def prepare(
        self, target: Target, lease: Lease, key: str, *, reckless: bool
    ) -> tuple[str, dict[str, str]]:
        """The decision to send: where, and the headers. A careful worker asks the client
        for the fencing headers, which raise the lease's loss when the client knows it is
        gone; a reckless one puts its token on the request whatever it knows, as a process
        that stalled past its lease and did not look does."""
        headers = {"Content-Type": "application/json"}
        if self.direct:
            headers |= {
                "Fencing-Job": lease.job_id,
                "Fencing-Generation": str(lease.generation),
                p.IDEMPOTENCY_KEY: key,
            }
            return f"{target.writes_to}/charges", headers
        upstream = self.upstream_for(lease.job_id)
        url = f"{target.writes_to}/{upstream}/charges"
        if upstream == RESOLVING:
            headers["Verify-Key"] = key
            if always_cut(lease.job_id, key):
                headers["Verify-Fault"] = "cut"
        if reckless:
            return url, headers | {p.FENCING_TOKEN: lease.token, p.IDEMPOTENCY_KEY: key}
        return url, lease.fence_headers(headers, key=key)

    async def write(
        self,
        target: Target,
        lease: Lease,
        key: str,
        body: bytes,
        process: str,
        *,
        reckless: bool = False,
        once: bool = False,
        delay: float = 0.0,
        work: bool = True,
    ) -> str:
        """One write until it is answered: ``ok``, or why the job stops here (``lost``,
        ``park``, ``down``, ``gave-up``). ``once``: sent once, whatever the answer (a
        zombie's). ``delay``: the upstream waits that long before applying it."""
        history = self.history
        job = lease.job_id
        timeouts = 0
        for _ in range(1 if once else MAX_SENDS):
            if not reckless and not lease.held:
                return "lost"
            try:
                url, headers = self.prepare(target, lease, key, reckless=reckless)
            except exc.LeaseLost:
                return "lost"
            if delay:
                headers[APPLY_DELAY_HEADER] = f"{delay:.3f}"
            if work:
                await asyncio.sleep(self.random.uniform(0.02, 0.4))  # jobs outlive a renewal
            history.invoke(process, "write", job, lease.generation, key, sha256_hex(body))
            try:
                async with target.client.session.post(
                    url,
                    data=body,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=WRITE_TIMEOUT),
                ) as resp:
                    raw = await resp.read()
                    status = resp.status
                    answer_headers = CIMultiDictProxy(CIMultiDict(resp.headers))
            except aiohttp.ClientConnectorError:
                history.complete(process, "info", reason="connection-refused")
                return "down"
            except aiohttp.ServerDisconnectedError:
                history.complete(process, "info", reason="disconnected")
                return "down"
            except (aiohttp.ClientError, TimeoutError) as error:
                history.complete(process, "info", reason=type(error).__name__)
                timeouts += 1
                if timeouts >= 3:
                    return "gave-up"
                continue
            problem = p.problem_of(answer_headers.get("Content-Type", ""), raw)
            reason = str(problem["reason"]) if problem else None
            type_: Type = "ok" if 200 <= status <= 299 else "fail"
            replayed = answer_headers.get(p.IDEMPOTENT_REPLAYED) == "true"
            history.complete(
                process,
                type_,
                status=status,
                reason=reason,
                body_sha256=sha256_hex(raw),
                replayed=replayed if type_ == "ok" else None,
            )
            if type_ == "ok":
                return "ok"
            content_type = answer_headers.get("Content-Type", "")
            if p.lease_lost(status, content_type, raw) is not None:
                return "lost"
            if not reckless:
                try:
                    lease.answer(status, answer_headers, raw)
                except exc.LeaseLost:
                    return "lost"
            if reason == "outcome-unknown":
                return "park"
            if reason in RETRYABLE or (reason is None and status in RETRY_STATUSES):
                await asyncio.sleep(self.random.uniform(0.1, 0.3))
                continue
            return "gave-up"
        return "gave-up"


@dataclass(frozen=True)
class Conduct:
    """How a worker works one job."""

    reckless: bool
    """Never asks the client whether the lease is held before a write, and after a refusal
    that says the lease is gone sends the job's remaining steps once each (a zombie)."""
    lapse: bool
    """Stops renewing after the first step and works past the lease's TTL."""
    overlap: bool
    """``Worker.overlap``: two generations writing at once."""
    woken: bool = False
    """With ``overlap``: the old generation wakes as the new one is granted (else: its
    write is in flight as the new one writes)."""


def _valid_for(lease: Lease) -> float:
    """Seconds the client still holds the lease valid (judged from when it asked: never
    later than the database's expiry). The client keeps this private; the harness reads
    it to time a write just before the expiry."""
    return lease._valid_until - time.monotonic()


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m verify.worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--id", required=True)
    parser.add_argument("--control", required=True, help="lease API URL(s), comma list")
    parser.add_argument("--gateway", default="", help="proxy URL(s), paired with --control")
    parser.add_argument("--history", required=True)
    parser.add_argument("--seed", default="0")
    parser.add_argument("--token", default=None)
    parser.add_argument("--direct", default=None, metavar="UPSTREAM_URL")
    parser.add_argument(
        "--steer",
        default=None,
        metavar="FILE",
        help="the index of a replica whose clock is behind (verify.stack.Stack.steer)",
    )
    parser.add_argument(
        "--redis", default=None, metavar="URL", help="work Redis locks (verify.locks) instead"
    )
    parser.add_argument(
        "--etcd",
        default=None,
        metavar="URL",
        help="work etcd locks (verify.locks, verify.etcd_locks) instead",
    )
    parser.add_argument(
        "--zookeeper",
        default=None,
        metavar="HOSTS",
        help="work ZooKeeper locks (verify.locks, verify.zk_locks) instead",
    )
    parser.add_argument(
        "--resolving",
        action="store_true",
        help=f"the replicas have the upstream {RESOLVING}: a share of the jobs write there",
    )
    parser.add_argument(
        "--signed",
        default=None,
        metavar="KEYFILE",
        help="write with signed tokens of this private key (verify.signed) instead",
    )
    return parser.parse_args(argv)


async def amain(args: argparse.Namespace) -> None:
    worker: Worker | LockWorker | SignedWorker
    if args.redis or args.etcd or args.zookeeper:
        from verify.locks import EtcdKind, Kind, LockWorker, RedisKind

        history = History(args.history)
        kind: Kind
        if args.zookeeper:
            from verify.zk_locks import ZkKind

            kind = ZkKind(args.zookeeper, identifier=args.id)
        else:
            kind = RedisKind(args.redis) if args.redis else EtcdKind(args.etcd)
        worker = LockWorker(args.id, args.seed, history, kind, args.gateway.split(","))
    elif args.signed:
        from verify.signed import SignedWorker

        history = History(args.history)
        worker = SignedWorker(args.id, args.seed, history, args.signed, args.gateway.split(","))
    else:
        worker = Worker.from_args(args)
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        await worker.run()
    except asyncio.CancelledError:
        pass
    finally:
        await worker.close()


def main(argv: list[str] | None = None) -> None:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(amain(parse_args(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
