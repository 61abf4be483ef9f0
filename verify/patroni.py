"""A replicated PostgreSQL that fails over by itself: three PostgreSQL instances of the
machine's binaries, each run by Patroni (Debian's ``patroni`` package), with an etcd of
their own as Patroni's store.

Synchronous mode, strict, with every standby synchronous (``synchronous_node_count`` =
members - 1): a commit is acknowledged only once each standby has it, so the standby
Patroni promotes never lacks an acknowledged commit. ``synchronous=False`` makes the
cluster that can lose one (tests/failover shows how): standbys replicate asynchronously
and a failover may promote one that is behind.

Used by ``python -m verify run --db patroni``, the failover tests, and a person who wants
to try it (``deploy/patroni/cluster.sh``, which runs ``python -m verify.patroni``).
Blocking methods: call them from a thread when an event loop must keep running.

As root, Patroni and PostgreSQL run as the ``postgres`` OS user (``initdb`` refuses
root); Debian's ``patroni`` runs on the system's Python, readable by that user.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cluster import OS_USER, PG_BIN, TRUSTED_SUBNET, ClusterError, free_port
from .etcd import EtcdMember

PATRONI = "patroni"
PATRONICTL = "patronictl"
SCOPE = "fencegate"
# Patroni's timing: a leader key lives TTL seconds; members look every LOOP_WAIT. A
# crashed primary is failed over at once (primary_start_timeout 0: with synchronous
# replication no commit is lost by not waiting for it to come back).
TTL = 10
LOOP_WAIT = 1
RETRY_TIMEOUT = 4


@dataclass(frozen=True)
class Member:
    """One member as Patroni's REST API reports it (``GET /cluster``)."""

    name: str
    role: str  # leader, sync_standby, replica
    state: str  # running, streaming, starting, stopped, ...
    port: int
    timeline: int | None

    @property
    def primary(self) -> bool:
        return self.role == "leader" and self.state == "running"


@dataclass
class _Node:
    name: str
    port: int
    rest_port: int
    config: Path
    data: Path
    process: subprocess.Popen[bytes] | None = None


class PatroniCluster:
    """etcd + ``members`` Patroni-run PostgreSQL instances in a folder of their own."""

    def __init__(
        self,
        members: int = 3,
        *,
        synchronous: bool = True,
        base: Path | None = None,
        listen: str = "*",
    ) -> None:
        """``listen``: PostgreSQL's listen_addresses (``*``: every address, so gateway
        replicas in ``verify.netns`` namespaces reach it through their veth pair)."""
        if members < 2:
            raise ValueError("a replicated cluster needs at least 2 members")
        self.synchronous = synchronous
        self.listen = listen
        self.base = base or Path(tempfile.mkdtemp(prefix="fencegate-patroni-"))
        self.base.mkdir(parents=True, exist_ok=True)
        self.as_root = os.geteuid() == 0
        self.etcd_url = ""
        self.etcd: subprocess.Popen[bytes] | None = None
        self.nodes = [
            _Node(
                name=f"pg{i}",
                port=free_port(),
                rest_port=free_port(),
                config=self.base / f"pg{i}.yml",
                data=self.base / f"pg{i}",
            )
            for i in range(members)
        ]

    # -- starting and stopping --------------------------------------------------------

    def up(self, timeout: float = 120) -> None:
        """etcd, then every member; returns once a primary runs and, in synchronous mode,
        every standby streams synchronously."""
        for binary in (PATRONI, "etcd"):
            if shutil.which(binary) is None:
                package = "patroni" if binary == PATRONI else "etcd-server"
                raise ClusterError(f"no {binary} on PATH (apt-get install {package})")
        if not (PG_BIN / "postgres").is_file():
            raise ClusterError(f"no PostgreSQL binaries in {PG_BIN}")
        if self.as_root:
            shutil.chown(self.base, user=OS_USER)
        self._start_etcd()
        for node in self.nodes:
            node.config.write_text(json.dumps(self._config(node), indent=2))
            self.start_member(node.name)
            if node is self.nodes[0]:
                self.wait_primary(timeout)  # the first bootstraps; the others copy it
        self.wait_healthy(timeout)

    def _start_etcd(self) -> None:
        etcd = EtcdMember.on_free_ports("fencegate", self.base / "etcd")
        self.etcd_url = etcd.client_url
        with (self.base / "etcd.log").open("ab") as log:  # the child keeps its own copy
            self.etcd = subprocess.Popen(
                etcd.argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while not etcd.healthy():
            if self.etcd.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"etcd did not start; see {self.base / 'etcd.log'}")
            time.sleep(0.1)

    def _config(self, node: _Node) -> dict[str, Any]:
        others = len(self.nodes) - 1
        dcs: dict[str, Any] = {
            "ttl": TTL,
            "loop_wait": LOOP_WAIT,
            "retry_timeout": RETRY_TIMEOUT,
            "primary_start_timeout": 0,
            "synchronous_mode": self.synchronous,
            "synchronous_mode_strict": self.synchronous,
            "synchronous_node_count": others,
            "postgresql": {
                "use_pg_rewind": True,
                "use_slots": True,
                "parameters": {
                    "wal_log_hints": "on",
                    "max_connections": 300,
                    "max_wal_senders": 10,
                    "max_replication_slots": 10,
                    "wal_keep_size": "128MB",
                    "shared_buffers": "32MB",
                    # A killed process leaves the OS's cache intact: nothing a test does
                    # needs the disk to hold a write, and fsync costs a slow disk seconds.
                    "fsync": "off",
                    "full_page_writes": "on",
                    "autovacuum": "off",
                },
            },
        }
        hba = [
            "local all all trust",
            "local replication all trust",
            "host all all 127.0.0.1/32 trust",
            "host replication all 127.0.0.1/32 trust",
            f"host all all {TRUSTED_SUBNET} trust",
        ]
        return {
            "scope": SCOPE,
            "name": node.name,
            "restapi": {
                "listen": f"127.0.0.1:{node.rest_port}",
                "connect_address": f"127.0.0.1:{node.rest_port}",
            },
            "etcd3": {"hosts": [self.etcd_url.removeprefix("http://")]},
            "bootstrap": {
                "dcs": dcs,
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}, "no-sync"],
                "pg_hba": hba,
            },
            "postgresql": {
                "listen": f"{self.listen}:{node.port}",
                "connect_address": f"127.0.0.1:{node.port}",
                "data_dir": str(node.data),
                "bin_dir": str(PG_BIN),
                "pgpass": str(self.base / f"{node.name}.pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres"},
                    "replication": {"username": "postgres"},
                    "rewind": {"username": "postgres"},
                },
                "parameters": {"unix_socket_directories": str(self.base)},
                "pg_hba": hba,
            },
            "tags": {"nofailover": False, "noloadbalance": False},
        }

    def start_member(self, name: str) -> None:
        """Start (or start again) one member's Patroni, which starts its PostgreSQL."""
        node = self._node(name)
        if node.process is not None and node.process.poll() is None:
            return
        argv = [PATRONI, str(node.config)]
        if self.as_root:
            argv = ["runuser", "-u", OS_USER, "--", *argv]
        with (self.base / f"{node.name}.patroni.log").open("ab") as log:
            node.process = subprocess.Popen(
                argv,
                cwd=self.base,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def down(self) -> None:
        """Every member (Patroni stops its PostgreSQL), then etcd; the folder goes."""
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.process.pid, signal.SIGTERM)
        for node in self.nodes:
            if node.process is not None:
                try:
                    node.process.wait(30)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(node.process.pid, signal.SIGKILL)
            self._kill_postmaster(node)  # one Patroni could not stop
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.etcd.wait(10)
        shutil.rmtree(self.base, ignore_errors=True)

    # -- what runs where ---------------------------------------------------------------

    def _node(self, name: str) -> _Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def members(self) -> list[Member]:
        """The cluster as any member that answers sees it (empty when none answers)."""
        for node in self.nodes:
            url = f"http://127.0.0.1:{node.rest_port}/cluster"
            try:
                with urllib.request.urlopen(url, timeout=2) as answer:
                    data = json.loads(answer.read())
            except (OSError, ValueError):
                continue
            return [
                Member(
                    name=m["name"],
                    role=m.get("role", ""),
                    state=m.get("state", ""),
                    port=int(m.get("port") or 0),
                    timeline=m.get("timeline"),
                )
                for m in data.get("members", [])
            ]
        return []

    def primary(self) -> Member | None:
        return next((m for m in self.members() if m.primary), None)

    def wait_primary(self, timeout: float = 60, *, other_than: str | None = None) -> Member:
        """The running primary, once there is one (not ``other_than``)."""
        deadline = time.monotonic() + timeout
        while True:
            primary = self.primary()
            if primary is not None and primary.name != other_than:
                return primary
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"no primary after {timeout:g} s: {self.members()}; logs in {self.base}"
                )
            time.sleep(0.2)

    def healthy(self) -> bool:
        """A primary runs and every other member streams (synchronously, in synchronous
        mode)."""
        members = self.members()
        if len(members) != len(self.nodes) or not any(m.primary for m in members):
            return False
        wanted = "sync_standby" if self.synchronous else None
        for member in members:
            if member.primary:
                continue
            if member.state not in ("streaming", "running"):
                return False
            if wanted is not None and member.role != wanted:
                return False
        return True

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"the cluster is not healthy after {timeout:g} s: {self.members()}; "
                    f"logs in {self.base}"
                )
            time.sleep(0.3)

    def url(self, database: str = "postgres", host: str = "127.0.0.1") -> str:
        """A database URL naming every member, for the member that takes writes."""
        hosts = "&".join(f"host={host}:{node.port}" for node in self.nodes)
        return f"postgresql+asyncpg://postgres@/{database}?{hosts}&target_session_attrs=read-write"

    def member_port(self, name: str) -> int:
        return self._node(name).port

    def member_url(self, name: str, database: str = "postgres") -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self._node(name).port}/{database}"

    # -- failovers ---------------------------------------------------------------------

    def switchover(self, candidate: str | None = None) -> str:
        """``patronictl switchover``: the primary steps down for ``candidate`` (or one
        Patroni picks); returns the old primary's name."""
        primary = self.wait_primary()
        argv = [PATRONICTL, "-c", str(self.nodes[0].config), "switchover", SCOPE]
        argv += ["--leader", primary.name, "--force"]
        if candidate is not None:
            argv += ["--candidate", candidate]
        if self.as_root:
            argv = ["runuser", "-u", OS_USER, "--", *argv]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        if result.returncode != 0:
            raise ClusterError(f"patronictl switchover failed: {result.stdout}{result.stderr}")
        return primary.name

    def kill_primary(self) -> str:
        """kill -9 of the primary's postmaster: Patroni fails over to a synchronous
        standby (primary_start_timeout 0); returns the old primary's name."""
        primary = self.wait_primary()
        if not self._kill_postmaster(self._node(primary.name)):
            raise ClusterError(f"{primary.name}'s postmaster is not running")
        return primary.name

    def _kill_postmaster(self, node: _Node) -> bool:
        pid = postmaster_pid(node.data)
        if pid is None:
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True


def postmaster_pid(data: Path) -> int | None:
    try:
        first = (data / "postmaster.pid").read_text().split("\n", 1)[0]
        return int(first)
    except (OSError, ValueError):
        return None


# -- for a person: deploy/patroni/cluster.sh ---------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m verify.patroni",
        description="Start a three-member synchronous Patroni cluster in FOLDER and keep it "
        "running until Ctrl-C (then stop it and remove FOLDER).",
    )
    parser.add_argument("folder", type=Path, help="a new or empty folder for the cluster")
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument(
        "--async",
        dest="synchronous",
        action="store_false",
        help="asynchronous standbys (the setup `fencegate serve` refuses; for trying that)",
    )
    args = parser.parse_args(argv)
    if args.folder.exists() and any(args.folder.iterdir()):
        parser.error(f"{args.folder} is not empty")
    cluster = PatroniCluster(args.members, synchronous=args.synchronous, base=args.folder)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops it like Ctrl-C
    print(f"starting {args.members} members in {args.folder} ...", flush=True)
    try:
        cluster.up()
        config = cluster.nodes[0].config
        print(
            "ready.\n"
            f'  database_url = "{cluster.url("postgres")}"\n'
            f"  members:       patronictl -c {config} list\n"
            f"  switchover:    patronictl -c {config} switchover --force\n"
            "Ctrl-C stops the cluster and removes its folder.",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping ...", flush=True)
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        cluster.down()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
