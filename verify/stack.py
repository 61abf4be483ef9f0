"""The system under test: the database (a SQLite file, or a fresh database on a PostgreSQL
cluster of the run's own), the recording upstream, and the gateway replicas, each a real
``fencegate serve`` in a network namespace of its own (``verify.netns``) so that the
``partition`` nemesis can cut it off the upstream or the database. Where namespaces do not
work (not root), replicas listen on 127.0.0.1 and ``partition`` is not available.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from verify import netns
from verify.cluster import ClusterError, PgCluster, execute, free_port
from verify.config import UpstreamTable, replica_config
from verify.etcd_locks import SOURCE as ETCD_SOURCE
from verify.etcd_locks import EtcdStore, etcd_binary
from verify.locks import SOURCE, LockStore, redis_binary
from verify.patroni import PatroniCluster
from verify.procs import FENCEGATE, Child, Children, StartError, child_env, wait_for_line
from verify.signed import SigningKey
from verify.worker import RESOLVING
from verify.zk_locks import SOURCE as ZK_SOURCE
from verify.zk_locks import ZkStore, zk_binary

REPO = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"fencegate listening: .*?control=([\w.:\[\]-]+).*?proxy=([\w.:\[\]-]+)")
UPSTREAM_LISTENING = re.compile(r"upstream listening on (\d+)")
PROXY_PORT, CONTROL_PORT = 8080, 8081
ORDERING_WAIT = 0.3
# The upkeep (expired last attempts, retention) runs every second in verify's replicas,
# not every minute: no replica lives a minute in a run (each is restarted several times),
# so a purge that deletes records still within retention (a day, unchanged) would never
# run. Run so often, a correct purge deletes nothing within a run, and a wrong one is seen.
PURGE_INTERVAL = 1.0
UPSTREAM_TIMEOUT = 1.0
UPSTREAM_CONNECT_TIMEOUT = 0.3
SHUTDOWN_GRACE = 2.0
# The upstream whose unknown outcomes the gateway resolves itself (``unknown_outcome =
# "resolve"``): the recording upstream's ``/dedupe/`` paths, which keep a key for
# DEDUP_WINDOW seconds after its application (``verify.upstream --dedup-window``). The
# gateway's resolver re-sends a held write only while it is younger than the window less
# the upstream's timeout and its margin (``gateway.fencing.deadlines.resolve_window``:
# 4 - 1 - 1 = 2 s), every RESOLVE_INTERVAL, at most RESOLVE_ATTEMPTS times. A share of
# the workers' jobs write there (``verify.worker.RESOLVING``). Only with ``--resolving``:
# a gateway with such an upstream judges every write once more right before the send
# (the resolver may claim an older write after the admission's snapshot), which masks
# the barrier's mutants. It is reached on a port of its own (``Stack.resolving_port``),
# which the partition nemesis cuts with the other: a request the gateway let go of
# cannot arrive after its exchange's deadline (the gateway resets the connection and
# bounds its unacknowledged bytes, ``gateway.upstream.connection``), so a re-send made
# inside the window is not applied past it. Before that fix, with a window of 4 s, a
# re-send arrived seconds late after a partition healed and was applied twice (issue 53's
# runs), and this upstream was left out of the partitions' reach.
DEDUP_WINDOW = 4.0
# The writes whose connection the gateway closed gracefully before their answer, as the
# upstream saw them (``verify.upstream --let-go``; invariant 16)
LET_GO = "let-go.jsonl"
RESOLVE_INTERVAL = 0.5
RESOLVE_ATTEMPTS = 10
# With the shutdown nemesis: a grace shorter than the ordering wait, so that a SIGTERM
# finds writes waiting behind an older generation's and the grace ends before their wait.
SHUTDOWN_GRACE_UNDER_NEMESIS = 0.2
# With the shutdown nemesis: a longer ordering wait, so that the nemesis, which looks at
# a replica's /metrics for a write waiting behind an older generation's and then sends
# the SIGTERM (verify.outages.waiter), finds the write still waiting with more than the
# grace left (the look itself takes a tenth of a second or more on a loaded machine).
# Only where shutdown comes alone (or with store, as in .ci/run's own run of the two):
# under ``all`` the longer wait made the barrier's mutant barrier-quick-admission take
# 58 s to die on seed 2 (9 s with 0.3 s), next to the fast set's 60 s.
ORDERING_WAIT_UNDER_SHUTDOWN = 1.0
SHUTDOWN_ALONE = frozenset({"shutdown", "store"})


# libfaketime as the ``faketime`` command preloads it (``$LIB``: the loader's own folder)
FAKETIME_LIBRARY = "/usr/$LIB/faketime/libfaketime.so.1"


def live_clock(db: str) -> bool:
    """Whether the replicas' clocks move while they run (the clock nemesis writes each
    one's offset to its file) rather than by a restart under libfaketime. Only where
    the database's clock decides expiry (PostgreSQL): on SQLite the replica's clock is the
    authority, and a jump in a running replica would reorder its own claims."""
    return db != "sqlite" and shutil.which("faketime") is not None


def python_env(**extra: str) -> dict[str, str]:
    """The environment of our Python children: ``verify`` importable from anywhere."""
    path = os.environ.get("PYTHONPATH", "")
    return child_env(PYTHONPATH=f"{REPO}{os.pathsep}{path}" if path else str(REPO), **extra)


@dataclass
class Replica:
    name: str
    config: Path
    bind: str  # the address it listens on
    proxy_port: int  # 0 in its config: the port it took, once started
    control_port: int
    namespace: netns.Namespace | None
    children: Children
    child: Child | None = None
    skew: str | None = None  # faketime's offset while it runs under one ("+5m")
    # PostgreSQL: the replica always runs under libfaketime reading its offset from this
    # file ("+0", or the clock nemesis's "-5m"), so its clock moves while it runs
    clock_file: Path | None = None

    @property
    def control(self) -> str:
        return f"http://{self.bind}:{self.control_port}"

    @property
    def proxy(self) -> str:
        return f"http://{self.bind}:{self.proxy_port}"

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()

    async def start(self, skew: str | None = None, timeout: float = 60.0) -> None:
        """Start it (under libfaketime with the offset ``SKEW`` when given, or reading
        ``clock_file``) and wait until it answers."""
        argv = [FENCEGATE, "serve", "--config", str(self.config), "--log-format", "json"]
        env = child_env()
        if skew is not None:
            # libfaketime preloaded as ``faketime -f SKEW`` does, without its wrapper
            # process (it forks the command and dies of a SIGTERM at once: the replica
            # itself is the process started, and its graceful stop is its own).
            env |= {
                "LD_PRELOAD": FAKETIME_LIBRARY,
                "FAKETIME": skew,
                "FAKETIME_DONT_FAKE_MONOTONIC": "1",  # timers stay real: only the wall clock
            }
        elif self.clock_file is not None:
            if not self.clock_file.exists():
                self.clock_file.write_text("+0\n")
            env.pop("FAKETIME", None)  # it would win over the file
            env |= {
                "LD_PRELOAD": FAKETIME_LIBRARY,
                "FAKETIME_TIMESTAMP_FILE": str(self.clock_file),
                "FAKETIME_NO_CACHE": "1",  # read at every call: the offset moves at once
                "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            }
        if self.namespace is not None:
            argv = self.namespace.command(argv)
        since = len(_read(self.children.folder / f"{self.name}.log"))
        self.child = self.children.spawn(self.name, argv, env=env)
        self.skew = skew
        listening = await wait_for_line(self.child, LISTENING, timeout, since)
        # the ports it listens on (those configured, or the ones it took for a 0)
        self.control_port = int(listening[1].rpartition(":")[2])
        self.proxy_port = int(listening[2].rpartition(":")[2])
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(self.control + "/healthz") as resp:
                        if resp.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline or not self.child.alive():
                    raise StartError(f"{self.name}: /healthz never answered:\n{self.child.tail()}")
                await asyncio.sleep(0.05)

    def set_clock(self, skew: str | None) -> None:
        """Move its running clock by ``skew`` ("-5m"), or back to the real one (None);
        only a replica with a ``clock_file``."""
        assert self.clock_file is not None
        self.clock_file.write_text(f"{skew or '+0'}\n")
        self.skew = skew

    def kill(self) -> None:
        if self.child is not None:
            self.child.kill()

    def signal(self, sig: signal.Signals) -> None:
        """``sig`` to the replica's process (SIGSTOP and SIGCONT: the freeze nemesis)."""
        if self.child is not None:
            self.child.signal(sig)

    def stop(self, timeout: float = 5.0) -> bool:
        """SIGTERM, SIGKILL after ``timeout``: whether it ended before the SIGKILL."""
        return self.child.stop(timeout=timeout) if self.child is not None else True


@dataclass
class Upstream:
    child: Child
    port: int
    url: str  # on 127.0.0.1 (the direct baseline's workers)
    faults: dict[str, Any] = field(default_factory=dict)
    ledger: Path | None = None
    received: Path | None = None  # every write received (``--received``), when kept
    let_go: Path | None = None  # writes let go of gracefully (``--let-go``), when kept

    async def set_faults(self, mode: str, probability: float = 0.0, slow: float = 2.0) -> None:
        await self.set_knobs(mode=mode, probability=probability, slow_seconds=slow)

    async def set_knobs(self, **doc: Any) -> None:
        """``POST /__faults`` (verify.upstream says what each knob does)."""
        async with (
            aiohttp.ClientSession() as session,
            session.post(self.url + "/__faults", json=doc) as resp,
        ):
            if resp.status != 200:
                raise RuntimeError(f"upstream /__faults: {resp.status} {await resp.text()}")
        self.faults = {**self.faults, **doc}

    async def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until the upstream has no write in hand (``/__state``'s ``handling``):
        every write it received is in the ledger then. False: not within ``timeout``."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                try:
                    async with session.get(self.url + "/__state") as resp:
                        if (await resp.json()).get("handling", 0) == 0:
                            return True
                except (aiohttp.ClientError, ValueError):
                    return False
                await asyncio.sleep(0.1)
        return False

    def events(self) -> list[dict[str, Any]]:
        """Every write received so far, in the order received, with its ``event``
        (applied, duplicate, dropped): the ``--received`` file."""
        assert self.received is not None, "started without --received"
        return [json.loads(line) for line in _read(self.received).splitlines() if line.strip()]

    async def wait_received(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0
    ) -> dict[str, Any]:
        """The first write received that ``predicate`` accepts (waits for it)."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events():
                if predicate(event):
                    return event
            if time.monotonic() > deadline:
                raise TimeoutError("the upstream never received the write")
            await asyncio.sleep(0.02)


async def start_upstream(
    children: Children,
    ledger: Path,
    *,
    port: int = 0,
    hosts: Sequence[str] = ("127.0.0.1",),
    seed: int | None = None,
    received: Path | None = None,
    name: str = "upstream",
    dedup_window: float | None = None,
    second_port: int | None = None,
    let_go: Path | None = None,
) -> Upstream:
    """``python -m verify.upstream`` as a child, once it listens (``port`` 0: a free one)."""
    argv = [
        sys.executable, "-m", "verify.upstream", "--port", str(port),
        "--hosts", ",".join(hosts), "--ledger", str(ledger),
    ]  # fmt: skip
    if seed is not None:
        argv += ["--seed", str(seed)]
    if received is not None:
        argv += ["--received", str(received)]
    if dedup_window is not None:
        argv += ["--dedup-window", f"{dedup_window:g}"]
    if second_port is not None:
        argv += ["--second-port", str(second_port)]
    if let_go is not None:
        argv += ["--let-go", str(let_go)]
    child = children.spawn(name, argv, env=python_env())
    port = int((await wait_for_line(child, UPSTREAM_LISTENING, 30))[1])
    return Upstream(
        child, port, f"http://127.0.0.1:{port}", ledger=ledger, received=received, let_go=let_go
    )


def migrate(database_url: str, cwd: Path) -> None:
    """``fencegate migrate`` with ``FENCEGATE_DATABASE_URL``, as a deploy step runs it
    (``ClusterError`` with its output when it fails)."""
    result = subprocess.run(
        [FENCEGATE, "migrate"],
        env=child_env(FENCEGATE_DATABASE_URL=database_url),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise ClusterError(f"fencegate migrate failed:\n{result.stdout}{result.stderr}")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


class Stack:
    """Everything the run starts; ``close`` ends it all (also after a failed start)."""

    def __init__(
        self,
        out: Path,
        *,
        db: str,
        replicas: int,
        seed: int,
        use_netns: bool,
        locks: bool = False,
        etcd: bool = False,
        zookeeper: bool = False,
        shutdown_grace: float = SHUTDOWN_GRACE,
        signed: bool = False,
        ordering_wait: float = ORDERING_WAIT,
        resolving: bool = False,
    ) -> None:
        self.out = out
        # The upstream whose unknown outcomes the gateway resolves, on its own port.
        self.resolving_port = free_port() if resolving else None
        self.ordering_wait = ordering_wait
        # The signed tokens' key pair (verify.signed), when signed workers run.
        self.signing = SigningKey(out / "signing.pem") if signed else None
        self.shutdown_grace = shutdown_grace
        self.locks = locks
        self.lock_store: LockStore | None = None
        self.etcd = etcd  # the etcd lock workers' etcd (verify.etcd_locks)
        self.etcd_store: EtcdStore | None = None
        self.zookeeper = zookeeper  # the ZooKeeper lock workers' (verify.zk_locks)
        self.zk_store: ZkStore | None = None
        self.db = db
        self.count = replicas
        self.seed = seed
        self.children = Children(out)
        self.namespaces: list[netns.Namespace] = []
        self.cluster: PgCluster | None = None
        self.patroni: PatroniCluster | None = None
        self.replicas: list[Replica] = []
        self.upstream: Upstream | None = None
        self.worker_token = "worker-" + secrets.token_hex(16)
        self.admin_token = "admin-" + secrets.token_hex(16)
        self.use_netns = use_netns

    # -- start ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.use_netns:
            base = 1 + (os.getpid() % 55) * 4  # 1..220: apart from another run's, most likely
            for i in range(self.count):  # else the next free index (netns.claim)
                name = f"{netns.PREFIX}-{os.getpid()}-{i}"
                self.namespaces.append(await asyncio.to_thread(netns.claim, name, base + i))
        urls = await self._database()
        if self.locks:
            binary = redis_binary()
            if binary is None:
                raise StartError("the lock workers need redis-server: apt-get install redis-server")
            hosts = ["127.0.0.1", *(n.host_addr for n in self.namespaces)]
            self.lock_store = LockStore(binary, self.children, hosts)
            await asyncio.to_thread(self.lock_store.start)
        if self.etcd:
            etcd = etcd_binary()
            if etcd is None:
                raise StartError("the etcd lock workers need etcd: apt-get install etcd-server")
            hosts = ["127.0.0.1", *(n.host_addr for n in self.namespaces)]
            self.etcd_store = EtcdStore(etcd, self.children, hosts)
            await asyncio.to_thread(self.etcd_store.start)
        if self.zookeeper:
            script = zk_binary()
            if script is None:
                raise StartError("the ZooKeeper lock workers need apt-get install zookeeper")
            hosts = ["127.0.0.1", *(n.host_addr for n in self.namespaces)]
            self.zk_store = ZkStore(script, self.children, hosts)
            await asyncio.to_thread(self.zk_store.start)
        upstream_port = free_port()
        self.replicas = [self._replica(i, url, upstream_port) for i, url in enumerate(urls)]
        upstream_task = asyncio.ensure_future(self._upstream(upstream_port))
        try:
            await asyncio.gather(*(replica.start() for replica in self.replicas))
        finally:
            self.upstream = await upstream_task

    async def _database(self) -> list[str]:
        """One database URL per replica (the address it reaches the database at)."""
        if self.db == "sqlite":
            return [f"sqlite+aiosqlite:///{self.out / 'fencegate.db'}"] * self.count
        hosts = [n.host_addr for n in self.namespaces] or ["127.0.0.1"] * self.count
        cluster: PgCluster | PatroniCluster
        if self.db == "patroni":
            cluster = self.patroni = PatroniCluster(3)
            await asyncio.to_thread(cluster.up)
            primary = await asyncio.to_thread(cluster.wait_primary)
            await execute(cluster.member_url(primary.name), 'CREATE DATABASE "verify"')
        else:
            cluster = self.cluster = PgCluster(listen=[n.host_addr for n in self.namespaces])
            await asyncio.to_thread(cluster.up)
            await cluster.execute('CREATE DATABASE "verify"')
        await asyncio.to_thread(migrate, cluster.url("verify"), self.out)
        return [cluster.url("verify", host) for host in hosts]

    def database_ports(self) -> list[int]:
        """The ports the replicas reach the database at (every member's, on Patroni)."""
        if self.patroni is not None:
            return [node.port for node in self.patroni.nodes]
        return [self.cluster.port] if self.cluster is not None else []

    def _replica(self, index: int, database_url: str, upstream_port: int) -> Replica:
        name = f"replica-{chr(ord('a') + index)}"
        namespace = self.namespaces[index] if self.namespaces else None
        if namespace is not None:
            bind, upstream_host = namespace.addr, namespace.host_addr
            proxy_port, control_port = PROXY_PORT, CONTROL_PORT
        else:
            bind, upstream_host = "127.0.0.1", "127.0.0.1"
            proxy_port, control_port = free_port(), free_port()
        config = self.out / f"{name}.toml"
        sources = self.signing.source_config() if self.signing is not None else ""
        if self.etcd_store is not None:
            sources += (
                "[[lease_sources]]\n"
                f'name = "{ETCD_SOURCE}"\n'
                'kind = "etcd"\n'
                f'endpoints = ["{self.etcd_store.url_for(upstream_host)}"]\n'
                "timeout_seconds = 1\n"
            )
        if self.zk_store is not None:
            sources += (
                "[[lease_sources]]\n"
                f'name = "{ZK_SOURCE}"\n'
                'kind = "zookeeper"\n'
                f'hosts = ["{self.zk_store.hosts_for(upstream_host)}"]\n'
                "timeout_seconds = 1\n"
                "session_timeout_seconds = 4\n"
            )
        if self.lock_store is not None:
            sources += (
                "[[lease_sources]]\n"
                f'name = "{SOURCE}"\n'
                'kind = "redis"\n'
                f'url = "{self.lock_store.url_for(upstream_host)}"\n'
                "timeout_seconds = 1\n"
            )
        upstreams = [
            UpstreamTable(
                "pay",
                f"http://{upstream_host}:{upstream_port}",
                "hold",
                UPSTREAM_TIMEOUT,
                UPSTREAM_CONNECT_TIMEOUT,
            )
        ]
        if self.resolving_port is not None:
            upstreams.append(
                UpstreamTable(
                    RESOLVING,
                    f"http://{upstream_host}:{self.resolving_port}/dedupe",
                    "resolve",
                    UPSTREAM_TIMEOUT,
                    UPSTREAM_CONNECT_TIMEOUT,
                    dedup={
                        "header": "Idempotency-Key",
                        "window_seconds": DEDUP_WINDOW,
                        "final_statuses": ["2xx"],
                    },
                )
            )
        config.write_text(
            replica_config(
                database_url=database_url,
                proxy_listen=f"{bind}:{proxy_port}",
                control_listen=f"{bind}:{control_port}",
                upstreams=upstreams,
                gateway={
                    "ordering_wait_seconds": self.ordering_wait,
                    "shutdown_timeout_seconds": self.shutdown_grace,
                    "purge_interval_seconds": PURGE_INTERVAL,
                    "resolve_interval_seconds": RESOLVE_INTERVAL,
                    "resolve_max_attempts": RESOLVE_ATTEMPTS,
                },
                max_attempts=1000,
                tokens=(self.worker_token, self.admin_token),
                extra=sources,
            ),
            encoding="utf-8",
        )
        replica = Replica(name, config, bind, proxy_port, control_port, namespace, self.children)
        if live_clock(self.db):
            replica.clock_file = self.out / f"clock-{name}.rc"
        return replica

    def lock_store_of(self, target: str) -> LockStore | EtcdStore | ZkStore:
        """The lock store a ``lock-loss`` (``redis``), ``etcd-loss`` (``etcd``) or
        ``zk-loss`` (``zookeeper``) fault targets."""
        stores = {"redis": self.lock_store, "etcd": self.etcd_store, "zookeeper": self.zk_store}
        store = stores.get(target)
        assert store is not None, f"no {target} in this run"
        return store

    @property
    def steer_file(self) -> Path:
        """The replica whose clock is behind, by its index (empty: none); the workers
        send a lapsed job's late writes to it (``verify.worker --steer``)."""
        return self.out / "steer"

    def steer(self, replica: Replica | None) -> None:
        index = "" if replica is None else str(self.replicas.index(replica))
        self.steer_file.write_text(index, encoding="utf-8")

    async def _upstream(self, port: int) -> Upstream:
        hosts = ["127.0.0.1", *(n.host_addr for n in self.namespaces)]
        return await start_upstream(
            self.children,
            self.out / "ledger.jsonl",
            port=port,
            hosts=hosts,
            seed=self.seed,
            dedup_window=DEDUP_WINDOW,
            second_port=self.resolving_port,
            let_go=self.out / LET_GO,
        )

    def spawn_worker(
        self,
        name: str,
        seed: int,
        direct: bool,
        lock: bool = False,
        signed: bool = False,
        etcd: bool = False,
        zookeeper: bool = False,
    ) -> Child:
        """A worker of the queue's jobs, or (``lock``) of the Redis locks (verify.locks),
        or (``etcd``) of etcd's, or (``zookeeper``) of ZooKeeper's, or (``signed``) of
        signed tokens (verify.signed)."""
        assert self.upstream is not None
        argv = [
            sys.executable, "-m", "verify.worker", "--id", name,
            "--control", ",".join(r.control for r in self.replicas),
            "--gateway", ",".join(r.proxy for r in self.replicas),
            "--history", str(self.out / f"history-{name}.jsonl"),
            "--seed", str(seed), "--token", self.worker_token,
            "--steer", str(self.steer_file),
        ]  # fmt: skip
        if self.resolving_port is not None:
            argv += ["--resolving"]
        if lock:
            assert self.lock_store is not None
            argv += ["--redis", self.lock_store.url]
        elif etcd:
            assert self.etcd_store is not None
            argv += ["--etcd", self.etcd_store.url]
        elif zookeeper:
            assert self.zk_store is not None
            argv += ["--zookeeper", self.zk_store.hosts]
        elif signed:
            assert self.signing is not None
            argv += ["--signed", str(self.signing.path)]
        elif direct:
            argv += ["--direct", self.upstream.url]
        return self.children.spawn(name, argv, env=python_env(), log=f"worker-{name}")

    # -- the end ----------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process, remove the namespaces and the cluster (never raises)."""
        self.children.kill_all()
        for namespace in self.namespaces:
            try:
                namespace.destroy()
            except Exception as error:  # keep cleaning up
                print(f"verify: could not remove namespace {namespace.name}: {error}")
        if self.cluster is not None:
            try:
                self.cluster.destroy()
            except Exception as error:
                print(f"verify: could not remove the PostgreSQL cluster: {error}")
        if self.patroni is not None:
            try:
                self.patroni.down()
            except Exception as error:
                print(f"verify: could not remove the Patroni cluster: {error}")
