"""Locks held through ZooKeeper, for the lock workers (``verify.locks``) of the lease source
``zklocks`` (``kind = "zookeeper"``), and the run's ZooKeeper that the ``zk-loss`` nemesis
makes lose them.

``ZkStore``: one standalone ZooKeeper (Debian's ``zkServer.sh``, ``verify.zookeeper``) on a
free client port, its data in the run's folder, listening on every address when the
replicas run in network namespaces (ZooKeeper listens on one address or all), else on
127.0.0.1. ``lose``/``resume`` (SIGSTOP, SIGCONT), ``kill`` and ``start`` (kill -9, then
the same server again on its data) are the nemesis's. What ZooKeeper does then, as Debian's
ZooKeeper 3.8 does it:

- Paused longer than a session's timeout (a GC pause, a stopped VM), it expires that
  session when it wakes, since nobody was heard from meanwhile: the session's lock node
  goes, and its holder, which was never told, goes on believing it holds the lock.
- Killed and started again, it reads its sessions back from its data and gives each its
  timeout again from the moment it serves: a holder whose client reconnects within that
  timeout keeps its session and its lock, however long the server was down; one that does
  not is expired then.

``ZkLock``: kazoo's lock recipe (``kazoo.recipe.lock.Lock``: an ephemeral sequential node
``<path>/<guid>__lock__<sequence>``, the lowest holds the lock) in the gateway's token,
``zklocks:<path>/<node>`` (``fencegate_client.zookeeper.lock_token``); the generation is
the node's ``czxid``, the holder the node. It hardly waits in line (kazoo's acquire with
a timeout of 0.1 s: a node still not the lowest then is taken back, ``lock-held``). The lock
lives as long as the worker's session (``SESSION_SECONDS``), which kazoo keeps alive with
pings of its own; ``extend`` only looks that the node is still there, and the ``ttl`` the
history records for a look is how long the lock can outlive it (``TTL_SECONDS``).
``release`` is kazoo's. A holding that lapses (``ZkKind.lapse``) either releases its node
while its session stays, or loses its session (closed, its node gone with it), in turn;
its holder writes again afterwards, as the other kinds' lapses do.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, LockTimeout
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.recipe.lock import Lock as KazooLock
from kazoo.retry import KazooRetry

from fencegate_client.zookeeper import lock_token
from verify.cluster import free_port
from verify.procs import Children, Service
from verify.zookeeper import TICK_MS, ZooKeeperMember, zookeeper_script

SOURCE = "zklocks"  # the lease source's name at the gateway: tokens "zklocks:<path>/<node>"
ROOT = "/verify-locks"  # the locks' paths: "/verify-locks/lock-0", ...
SESSION_SECONDS = 2.0  # a lock worker's ZooKeeper session
CALL_TIMEOUT = 2.0  # one call to ZooKeeper (an acquire, a look, a release)
# An acquire waits this long in line (kazoo's acquire has no attempt that does not: its
# ``blocking=False`` retries a lost connection for ever), then kazoo takes its node back.
IN_LINE_SECONDS = 0.1
# How long a lock can outlive the last look that found its node: the session's last touch
# is at most a renewal's interval after that look (a holder stopped later would have
# recorded its next look), then the session's timeout, ZooKeeper's rounding of it up to
# its next tick, and half a second for its closing the session and a busy machine. The
# renewals come every third of it (``renew_interval``), so TTL = SESSION + TTL / 3 + tick
# + 0.5.
TTL_SECONDS = 1.5 * (SESSION_SECONDS + TICK_MS / 1000 + 0.5)


def zk_binary() -> str | None:
    """Debian's ``zkServer.sh``, or None."""
    return zookeeper_script()


class ZkError(Exception):
    """ZooKeeper did not answer in time, or the session is gone."""


class ZkStore(Service):
    """The run's ZooKeeper: its data stays across a kill, and ``start`` brings it back on
    it, sessions and all."""

    def __init__(self, script: str, children: Children, hosts: list[str]) -> None:
        super().__init__(children)
        self.script = script
        self.port = free_port()
        # ZooKeeper listens on one address or on all: all when the replicas reach it from
        # their namespaces (at the host side's address).
        address = "127.0.0.1" if hosts == ["127.0.0.1"] else "0.0.0.0"
        self.member = ZooKeeperMember(children.folder / "zookeeper", self.port, address)
        self.hosts = self.member.hosts

    def hosts_for(self, host: str) -> str:
        return f"{host}:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        # forceSync=no: its log is written, not flushed to the disk, at every change: a
        # kill -9 of the process loses nothing of it (the kernel has it), and the lock
        # workers' many sessions do not wait for the disk of a busy machine.
        self.member.write_config(["forceSync=no", "maxSessionTimeout=20000"])
        self.spawn("zookeeper", self.member.argv(self.script), self.member.serves, timeout, 0.1)

    def lose(self) -> None:
        """SIGSTOP (until ``resume``): nobody is heard from meanwhile, and the sessions
        past their timeout expire when it wakes, their lock nodes with them."""
        if self.child is not None:
            self.child.signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.child is not None:
            self.child.signal(signal.SIGCONT)


class ZkKind:
    """kazoo's lock recipe on the run's ZooKeeper, one session at a time per worker (a
    new one after a holding lost it or left its outcome unknown). ZooKeeper lets a lapsed
    lock go at once and the gateway caches nothing: its lapses wait as Redis's do."""

    source = SOURCE
    errors: tuple[type[BaseException], ...] = (ZkError,)
    lapse_past = (0.7, 1.5)

    def __init__(self, hosts: str, identifier: str = "") -> None:
        self.hosts = hosts
        self.identifier = identifier
        self.client: KazooClient | None = None
        self.lapses = 0
        self.retiring: set[asyncio.Task[None]] = set()

    def make(self, name: str, ttl_seconds: float) -> ZkLock:
        return ZkLock(self, f"{ROOT}/{name}")

    def holder(self, lock: Any) -> str:
        return str(lock.holder)

    async def session(self) -> KazooClient:
        """The worker's client, connected (a new session when there is none)."""
        if self.client is None:
            self.client = KazooClient(
                hosts=self.hosts,
                timeout=SESSION_SECONDS,
                connection_retry=KazooRetry(max_tries=-1, max_delay=0.5),
                command_retry=KazooRetry(max_tries=3, delay=0.05, max_delay=0.2),
            )
        client = self.client
        if not client.connected:
            try:
                await asyncio.to_thread(client.start, CALL_TIMEOUT)
            except KazooTimeoutError as error:
                raise ZkError(f"not connected: {error}") from error
        return client

    def retire(self) -> None:
        """The session ended: closed by its client (ZooKeeper deletes its nodes at once,
        or, unheard of, expires it after its timeout); the next holding opens another."""
        client, self.client = self.client, None
        if client is not None:
            task = asyncio.get_running_loop().create_task(asyncio.to_thread(_stop, client))
            self.retiring.add(task)
            task.add_done_callback(self.retiring.discard)

    async def lapse(self, lock: Any) -> None:
        """The holding lapses without its holder knowing: in turn, its node is released
        while its session stays, or its session is lost (closed). A release that fails
        loses the session too, so the lock goes either way."""
        self.lapses += 1
        if self.lapses % 2:
            with contextlib.suppress(ZkError):
                await lock.release()
                return
        self.retire()

    async def close(self) -> None:
        self.retire()
        if self.retiring:
            await asyncio.wait(self.retiring, timeout=15)


def _stop(client: KazooClient) -> None:
    with contextlib.suppress(Exception):
        client.stop()
    with contextlib.suppress(Exception):
        client.close()


def _exists(client: KazooClient, path: str) -> Any:
    """The node's stat, or None; kazoo's own wait bounded (its synchronous calls wait on)."""
    return client.exists_async(path).get(True, CALL_TIMEOUT)


async def _call(fn: Any, *args: Any) -> Any:
    """A blocking kazoo call in a thread, within ``CALL_TIMEOUT`` (and a second)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), CALL_TIMEOUT + 1.0)
    except (KazooException, KazooTimeoutError, TimeoutError) as error:
        raise ZkError(f"{type(error).__name__}: {error}") from error


class ZkLock:
    """One attempt at the lock ``name`` (a path; see the module's doc)."""

    def __init__(self, kind: ZkKind, name: str) -> None:
        self.kind = kind
        self.name = name
        self.ttl_ms = round(TTL_SECONDS * 1000)
        self.fence = 0  # the node's czxid, once held
        self.holder = ""  # the node's name, once held
        self.token = ""  # the gateway's token, once held (kazoo's Lock forgets its node)
        self.lock: KazooLock | None = None
        self.client: KazooClient | None = None

    @property
    def node(self) -> str:
        return f"{self.name}/{self.holder}"

    async def acquire(self) -> bool:
        """The lock, if nobody holds it: True (``fence`` is its generation); False when a
        lower node holds it (this one is taken back). An error leaves the attempt's node
        unknown: the session is retired, and its node goes with it."""
        self.client = client = await self.kind.session()
        self.lock = lock = client.Lock(self.name, self.kind.identifier)
        try:
            try:
                got = await _call(lock.acquire, True, IN_LINE_SECONDS)
            except ZkError as error:
                if isinstance(error.__cause__, LockTimeout):
                    return False  # a lower node held it all along: kazoo took ours back
                raise
            if not got:  # kazoo gave up retrying: whether its node is left is unknown
                raise ZkError("the acquire was given up")
            self.holder = str(lock.node)
            stat = await _call(_exists, client, self.node)
        except ZkError:
            self.kind.retire()
            raise
        if stat is None:  # its session expired meanwhile
            return False
        self.fence = int(stat.czxid)
        self.token = lock_token(lock, source=SOURCE)
        return True

    async def extend(self) -> bool:
        """A look at the node (kazoo's pings keep the session): False once it is gone."""
        assert self.client is not None
        return await _call(_exists, self.client, self.node) is not None

    async def release(self) -> bool:
        """kazoo's release: False when the node was gone already (its session lost). An
        error leaves it unknown: the session is retired, and its node goes with it."""
        assert self.client is not None and self.lock is not None
        if self.client is not self.kind.client:
            return False  # its session was retired: the node went with it
        try:
            stat = await _call(_exists, self.client, self.node)
            await _call(self.lock.release)
        except ZkError:
            self.kind.retire()
            raise
        return stat is not None
