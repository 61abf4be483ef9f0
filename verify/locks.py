"""Workers whose jobs are Redis locks: the lease source ``locks`` (``kind = "redis"``) of
the gateway replicas, Fencegate's lock recipe (``fencegate_client.redis_lock``), and the
``redis-server`` of the run that the ``lock-loss`` nemesis makes lose its fence counters.

``LockStore``: one ``redis-server`` on a free port, in memory only (no RDB, no AOF: a
restart loses every key, as a Redis run without persistence does), listening on 127.0.0.1
and on the host's side of each replica's network namespace. ``flush`` (``FLUSHALL``),
``kill`` and ``start`` are the nemesis's.

``LockWorker`` (``python -m verify.worker --redis URL``): until SIGTERM it takes one of a
few shared locks (``lock-0`` ..., a TTL drawn from 1-3 s, extended in the background at a
third of it), does 2-4 steps through a gateway replica with ``Fencing-Token:
locks:<lock>:<value>``, then releases the lock. The gateway's job is ``locks/<lock>``,
the generation the lock's fence. Each holding's keys and bodies are its own (its key
``<holder>-step<i>``, the holder being the value's random part), so the checker can tell
which holder an applied write came from. A share of the holdings (``LockWorker.lapse``)
take a lock of the worker's own, write once, stop extending and write again after the
lock lapsed, before anyone else took it (the gateway must refuse those writes). A share
of the writes is held at the upstream (``Verify-Apply-Delay``) so that a lost counter
often falls while one is in flight. A write refused 409 ends the holding: a careful
holder releases the lock, a reckless one first sends its remaining steps once each (a
zombie); a holding refused ``stale-generation`` (its fence below the job's: the counter
was lost) is followed at once by another acquire of the same lock, so the counter climbs
back to the fence, where the gateway must tell the new holder of a generation from the
one it admitted before.

Recorded like the queue workers' jobs (``verify.events``): the acquire is a ``claim``
(``ok`` with the generation, the TTL and ``holder``), the extends ``renew``, the release
``complete``; every event of a holding carries ``holder``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
from typing import Any, Protocol

import aiohttp
import redis
import redis.asyncio
from redis.exceptions import RedisError

from fencegate_client import protocol as p
from fencegate_client.redis_lock import VALUE, AsyncRedisLock
from verify.cluster import free_port
from verify.etcd_locks import SOURCE as ETCD_SOURCE
from verify.etcd_locks import EtcdError, EtcdLock
from verify.events import Type, sha256_hex
from verify.procs import Children, Service
from verify.worker import (
    RETRY_STATUSES,
    SOURCE_LAPSE_PAST,
    SOURCE_LAPSE_SHARE,
    SOURCE_MAX_SENDS,
    WRITE_TIMEOUT,
    History,
    SourceWorker,
)

SOURCE = "locks"  # the lease source's name at the gateway: tokens "locks:<lock>:<value>"
LOCKS = 4
IN_FLIGHT_SHARE = 0.3
RECKLESS_SHARE = 0.5
# Of the holdings: a lock of the worker's own, which nobody else takes, held for one step
# and then let lapse (no more extends) for its TTL and SOURCE_LAPSE_PAST more before the
# remaining steps are sent once each: writes after the lock lapsed and before anyone else
# took it, which the gateway must refuse (invariant 11): SOURCE_LAPSE_SHARE and
# SOURCE_LAPSE_PAST, verify.worker's.


def job_of(lock: str, source: str = SOURCE) -> str:
    """The job the gateway forwards for a lock of the source (``Fencing-Job``)."""
    return f"{source}/{lock}"


def holder_of(value: str) -> str:
    """A lock value's random part: who holds this generation."""
    match = VALUE.fullmatch(value)
    assert match is not None, value
    return match.group(2)


class Lock(Protocol):
    """One attempt at a lock, as the workers hold it: Redis's (``AsyncRedisLock``) or
    etcd's (``verify.etcd_locks.EtcdLock``)."""

    @property
    def name(self) -> str: ...
    @property
    def ttl_ms(self) -> int: ...
    @property
    def fence(self) -> int: ...
    @property
    def token(self) -> str: ...

    async def acquire(self) -> bool: ...
    async def extend(self) -> bool: ...
    async def release(self) -> bool: ...


class Kind(Protocol):
    """Where a worker's locks are held: the lease source's name at the gateway, how a
    lock is made, who holds it (``holder`` of the history) and the errors that leave an
    operation's outcome unknown. ``lapse``: what lets a holding's lock go once its extends
    stop (nothing where the lock has a TTL; ZooKeeper's lives as long as its session).
    ``lapse_past``: how long past a lapsed lock's TTL its holder waits before it writes
    again (the store's own delay in letting it go, and the gateway's cache of a held lock,
    fit in it)."""

    source: str
    errors: tuple[type[BaseException], ...]
    lapse_past: tuple[float, float]

    def make(self, name: str, ttl_seconds: float) -> Lock: ...
    def holder(self, lock: Any) -> str: ...
    async def lapse(self, lock: Any) -> None: ...
    async def close(self) -> None: ...


class RedisKind:
    """Fencegate's Redis lock recipe on the run's ``redis-server``."""

    source = SOURCE
    errors: tuple[type[BaseException], ...] = (RedisError, OSError)
    lapse_past = SOURCE_LAPSE_PAST

    def __init__(self, url: str) -> None:
        self.redis = redis.asyncio.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=1)

    def make(self, name: str, ttl_seconds: float) -> Lock:
        return AsyncRedisLock(self.redis, name, ttl_seconds=ttl_seconds, source=SOURCE)

    def holder(self, lock: Any) -> str:
        assert lock.value is not None
        return holder_of(lock.value)

    async def lapse(self, lock: Any) -> None:
        """Nothing: the lock's TTL runs out once the extends stop."""

    async def close(self) -> None:
        await self.redis.aclose()


class EtcdKind:
    """etcd's lock recipe on the run's ``etcd`` (``verify.etcd_locks``). etcd lets a
    lapsed lease go up to half a second late, and the gateway believes a lock it read as
    held for half a second more (``cache_seconds``): its lapses wait a second longer."""

    source = ETCD_SOURCE
    errors: tuple[type[BaseException], ...] = (EtcdError,)
    lapse_past = (SOURCE_LAPSE_PAST[0] + 1.0, SOURCE_LAPSE_PAST[1] + 1.0)

    def __init__(self, url: str) -> None:
        self.url = url
        self.session = aiohttp.ClientSession()

    def make(self, name: str, ttl_seconds: float) -> Lock:
        return EtcdLock(self.session, self.url, name, ttl_seconds, ETCD_SOURCE)

    def holder(self, lock: Any) -> str:
        return str(lock.holder)

    async def lapse(self, lock: Any) -> None:
        """Nothing: the lease's TTL runs out once the keep-alives stop."""

    async def close(self) -> None:
        await self.session.close()


def lock_body(lock: str, holder: str, step: int) -> bytes:
    return json.dumps({"holder": holder, "lock": lock, "step": step}, sort_keys=True).encode()


class LockStore(Service):
    """The run's ``redis-server``, in memory only: a kill brings it back empty."""

    def __init__(self, binary: str, children: Children, hosts: list[str]) -> None:
        super().__init__(children)
        self.binary = binary
        self.hosts = hosts  # 127.0.0.1 first, then each namespace's host address
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def url_for(self, host: str) -> str:
        return f"redis://{host}:{self.port}/0"

    def start(self, timeout: float = 20.0) -> None:
        argv = [
            self.binary, "--port", str(self.port), "--bind", *self.hosts,
            "--save", "", "--appendonly", "no", "--dir", str(self.children.folder),
            "--protected-mode", "no",
        ]  # fmt: skip
        self.spawn("redis", argv, self.answers, timeout, every=0.05)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def lose(self) -> None:
        """``FLUSHALL``: every lock and every fence counter gone at once."""
        with redis.Redis.from_url(self.url, socket_timeout=2) as client:
            client.flushall()


class Holding:
    """One lock held: its job, generation and holder, as the history records them."""

    def __init__(self, lock: Lock, kind: Kind) -> None:
        self.lock = lock
        self.job = job_of(lock.name, kind.source)
        self.generation = lock.fence
        self.holder = kind.holder(lock)
        self.lost = False
        self.lapsing = False  # extends stop at the renewer's next turn


class LockWorker(SourceWorker):
    """The lock workload of one worker process (see the module's doc)."""

    def __init__(
        self, worker_name: str, seed: str, history: History, kind: Kind, gateways: list[str]
    ) -> None:
        super().__init__(worker_name, seed, history, gateways, kind.source)
        self.kind = kind
        self.locks = [f"lock-{i}" for i in range(LOCKS)]

    async def close(self) -> None:
        await self.kind.close()
        await super().close()

    async def run(self) -> None:
        again: str | None = None
        while True:
            lapse = again is None and self.random.random() < SOURCE_LAPSE_SHARE
            name = again or (f"lock-{self.name}" if lapse else self.random.choice(self.locks))
            ttl = round(self.random.uniform(1.0, 3.0), 2)
            lock = self.kind.make(name, ttl)
            holding = await self.acquire(lock)
            if holding is None:
                again = None
                await asyncio.sleep(self.random.uniform(0.05, 0.15))
                continue
            gateway = self.random.choice(self.gateways)
            if lapse:
                outcome = await self.lapse(holding, gateway)
            else:
                outcome = await self.hold(holding, gateway)
            again = name if outcome == "stale-generation" else None

    async def acquire(self, lock: Lock) -> Holding | None:
        process, history = self.name, self.history
        history.invoke(process, "claim", job_of(lock.name, self.kind.source))
        try:
            got = await lock.acquire()
        except self.kind.errors as error:
            history.complete(process, "info", reason=type(error).__name__)
            return None
        if not got:
            history.complete(process, "fail", reason="lock-held")
            return None
        holding = Holding(lock, self.kind)
        history.complete(
            process,
            "ok",
            generation=holding.generation,
            status=200,
            ttl=lock.ttl_ms / 1000,
            holder=holding.holder,
        )
        return holding

    async def hold(self, holding: Holding, gateway: str) -> str:
        """The holding's steps, then its release; the refusal that ended it, or ``done``."""
        renewer = asyncio.get_running_loop().create_task(self.extend_forever(holding))
        reckless = self.random.random() < RECKLESS_SHARE
        ended = "done"
        try:
            for step in range(2 + self.random.randrange(3)):
                await asyncio.sleep(self.random.uniform(0.02, 0.3))
                if holding.lost and not reckless:
                    break
                outcome = await self.write(holding, gateway, step, once=ended != "done")
                if outcome == "down":  # the replica is down: the lock is left to expire
                    break
                if outcome not in ("ok", "gave-up") and ended == "done":
                    ended = outcome
                    if not reckless:
                        break
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            if self.history.outstanding(f"{self.name}/renew"):
                self.history.complete(f"{self.name}/renew", "info", reason="abandoned")
        await self.release(holding)
        return ended

    async def lapse(self, holding: Holding, gateway: str) -> str:
        """A holding of the worker's own lock that lapses: one step, then the extends stop
        (at the renewer's next turn, so none is left of unknown outcome), the kind lets
        the lock go where a TTL does not (``Kind.lapse``), and the worker
        waits the lock's TTL and ``SOURCE_LAPSE_PAST`` more, so the lock has lapsed in Redis
        before it sends its remaining steps, once each; nobody else takes this lock, so
        the gateway sees a token whose lock is simply gone. Released only when the first
        step was not answered 2xx (the holding ends there); else it lapsed."""
        renewer = asyncio.get_running_loop().create_task(self.extend_forever(holding))
        steps = 2 + self.random.randrange(3)
        ended = "done"
        try:
            outcome = await self.write(holding, gateway, 0, once=False)
            if outcome != "ok":
                ended = "released"
                return outcome
            holding.lapsing = True
            await renewer
            await self.kind.lapse(holding.lock)
            past = self.random.uniform(*self.kind.lapse_past)
            await asyncio.sleep(holding.lock.ttl_ms / 1000 + past)
            for step in range(1, steps):
                outcome = await self.write(holding, gateway, step, once=True)
                if outcome == "down":
                    break
                if outcome not in ("ok", "gave-up") and ended == "done":
                    ended = outcome
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            if self.history.outstanding(f"{self.name}/renew"):
                self.history.complete(f"{self.name}/renew", "info", reason="abandoned")
            if ended == "released":
                await self.release(holding)
        return ended

    async def extend_forever(self, holding: Holding) -> None:
        process, history, lock = f"{self.name}/renew", self.history, holding.lock
        while not holding.lost:
            await asyncio.sleep(p.renew_interval(lock.ttl_ms / 1000))
            if holding.lapsing:
                return
            history.invoke(process, "renew", holding.job, holding.generation, holder=holding.holder)
            try:
                extended = await lock.extend()
            except self.kind.errors as error:
                history.complete(process, "info", reason=type(error).__name__)
                continue
            if not extended:
                history.complete(process, "fail", status=409, reason="lock-lost")
                holding.lost = True
                return
            history.complete(process, "ok", status=200, ttl=lock.ttl_ms / 1000)

    async def release(self, holding: Holding) -> None:
        process, history = self.name, self.history
        history.invoke(process, "complete", holding.job, holding.generation, holder=holding.holder)
        try:
            released = await holding.lock.release()
        except self.kind.errors as error:
            history.complete(process, "info", reason=type(error).__name__)
            return
        if released:
            history.complete(process, "ok", status=200)
        else:
            history.complete(process, "fail", status=409, reason="lock-lost")

    async def write(self, holding: Holding, gateway: str, step: int, *, once: bool) -> str:
        """One step's write until answered: ``ok``; the reason of a 409 (the holding is
        over: any 409, whatever its reason is called); ``down`` (the replica refused the
        connection); ``gave-up``."""
        process, history = self.name, self.history
        key = f"{holding.holder[:16]}-step{step}"
        body = lock_body(holding.lock.name, holding.holder, step)
        headers = {
            "Content-Type": "application/json",
            p.FENCING_TOKEN: holding.lock.token,
            p.IDEMPOTENCY_KEY: key,
        }
        if self.random.random() < IN_FLIGHT_SHARE:
            headers["Verify-Apply-Delay"] = f"{self.random.uniform(0.2, 0.7):.3f}"
        timeouts = 0
        for _ in range(1 if once else SOURCE_MAX_SENDS):
            history.invoke(
                process, "write", holding.job, holding.generation, key, sha256_hex(body),
                holder=holding.holder,
            )  # fmt: skip
            try:
                async with self.session.post(
                    f"{gateway}/pay/charges",
                    data=body,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=WRITE_TIMEOUT),
                ) as resp:
                    raw, status = await resp.read(), resp.status
                    content_type = resp.headers.get("Content-Type", "")
                    replayed = resp.headers.get(p.IDEMPOTENT_REPLAYED) == "true"
            except aiohttp.ClientConnectorError:
                history.complete(process, "info", reason="connection-refused")
                return "down"
            except (aiohttp.ClientError, TimeoutError) as error:
                history.complete(process, "info", reason=type(error).__name__)
                timeouts += 1
                if timeouts >= 3:
                    return "gave-up"
                continue
            problem = p.problem_of(content_type, raw)
            reason = str(problem["reason"]) if problem else None
            type_: Type = "ok" if 200 <= status <= 299 else "fail"
            history.complete(
                process, type_, status=status, reason=reason, body_sha256=sha256_hex(raw),
                replayed=replayed if type_ == "ok" else None,
            )  # fmt: skip
            if type_ == "ok":
                return "ok"
            if status == 409:
                holding.lost = True
                return reason or "refused"
            if reason == "outcome-unknown":
                return "gave-up"
            if status not in RETRY_STATUSES and status != 425:
                return "gave-up"
            await asyncio.sleep(self.random.uniform(0.05, 0.2))
        return "gave-up"


def redis_binary() -> str | None:
    """Debian's redis-server on PATH, or None."""
    return shutil.which("redis-server")
