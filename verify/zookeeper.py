"""A standalone ZooKeeper on the loopback, as both of its users start it: the ZooKeeper lock
workers' store (``verify.zk_locks``) and the lease-source tests' ZooKeeper
(``tests/support.ZooKeeperServer``).

Only what ZooKeeper itself asks for lives here: where Debian's package puts its script,
its configuration file and the answer that says it serves. Each user keeps its own way of
running the process (log file, deadline, the error it raises), as with ``verify.etcd``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SCRIPT = "/usr/share/zookeeper/bin/zkServer.sh"  # Debian's zookeeper package, off PATH
TICK_MS = 500  # sessions of 1 to 10 s (ZooKeeper's bounds: 2 and 20 ticks)


def zookeeper_script() -> str | None:
    """Debian's ``zkServer.sh`` (it execs the JVM), or None when it is not installed."""
    return SCRIPT if os.access(SCRIPT, os.X_OK) else None


@dataclass(frozen=True)
class ZooKeeperMember:
    """One ZooKeeper that is an ensemble of its own, its data in ``folder / "data"`` and its
    configuration in ``folder / "zoo.cfg"``; ``address`` is where the client port listens
    (``0.0.0.0``: every address of the machine, network namespaces' host sides too)."""

    folder: Path
    port: int
    address: str = "127.0.0.1"

    @property
    def hosts(self) -> str:
        """Its address for kazoo (``hosts``)."""
        return f"127.0.0.1:{self.port}"

    @property
    def config(self) -> Path:
        return self.folder / "zoo.cfg"

    def write_config(self, extra: Sequence[str] = ()) -> Path:
        """The configuration file (``extra``: more ``key=value`` lines); the data folder made."""
        (self.folder / "data").mkdir(parents=True, exist_ok=True)
        lines = [
            f"tickTime={TICK_MS}",
            f"dataDir={self.folder / 'data'}",
            f"clientPort={self.port}",
            f"clientPortAddress={self.address}",
            "admin.enableServer=false",
            "4lw.commands.whitelist=srvr",
            *extra,
        ]
        self.config.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return self.config

    def argv(self, script: str = SCRIPT) -> list[str]:
        """The command that runs it in the foreground."""
        return [script, "start-foreground", str(self.config)]

    def serves(self) -> bool:
        """Whether it answers ``srvr`` as a standalone server (the port opens before it has
        loaded its data). Not listening yet, or no answer within a second: False."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"srvr")
                return b"Mode: standalone" in sock.recv(512)
        except OSError:
            return False
