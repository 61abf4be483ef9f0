"""A single-member etcd on the loopback, as both of its users start it: the Patroni
cluster's store (``verify.patroni``) and the lease-source tests' etcd
(``tests/support.EtcdServer``).

Only what etcd itself asks for lives here: its command line and the answer that says it
serves. Each user keeps its own way of running the process (log file, deadline, the error
it raises), since those are what differ between a verification run and a test session.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .cluster import free_port


@dataclass(frozen=True)
class EtcdMember:
    """One etcd that is a cluster of its own (``--initial-cluster`` names only itself),
    its client and peer URLs on 127.0.0.1."""

    name: str
    data_dir: Path
    client_url: str
    peer_url: str

    @classmethod
    def on_free_ports(cls, name: str, data_dir: Path) -> EtcdMember:
        """A member on two ports free now (client, then peer): several etcds, of this run
        or another's, then share a machine without a port fixed in advance."""
        client_url = f"http://127.0.0.1:{free_port()}"
        peer_url = f"http://127.0.0.1:{free_port()}"
        return cls(name=name, data_dir=data_dir, client_url=client_url, peer_url=peer_url)

    def argv(self, binary: str = "etcd") -> list[str]:
        """The command that starts it; ``binary`` is the ``etcd`` to run (a full path
        when the caller looked it up)."""
        return [
            binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.name}={self.peer_url}",
        ]

    def healthy(self) -> bool:
        """Whether ``/health`` answers true: the port opens before etcd has elected itself
        leader, and only then does it serve reads and writes. An etcd not listening yet,
        or not answering within a second, is not healthy (False, not an error)."""
        try:
            with urllib.request.urlopen(self.client_url + "/health", timeout=1) as answer:
                return b"true" in answer.read()
        except OSError:
            return False
