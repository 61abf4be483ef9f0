"""Network namespaces for the ``partition`` nemesis: each gateway replica runs in a
namespace of its own, joined to the root namespace by a veth pair, so that its traffic to
the upstream or the database can be cut (all of it, or a random share of its packets)
without touching anybody else's. Everything stays on this machine: addresses come from
10.213.0.0/16 and no route leaves the pair.

``tc netem`` would be the usual tool for delay, but this machine's kernel has no netem
qdisc; a random share of dropped packets (iptables' ``statistic`` match) delays traffic
by TCP's retransmissions instead, which is what a lossy link does.

Root (CAP_NET_ADMIN) and the ``ip`` and ``iptables`` commands are needed; ``unavailable``
says why not where they are missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess

PREFIX = "fgverify"
SUBNET = "10.213.0.0/16"


class NetnsError(Exception):
    """A namespace command failed."""


class IndexTaken(NetnsError):
    """Another namespace's veth pair has the index's interface names (another run's)."""


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")
    return result


def unavailable() -> str | None:
    """None when namespaces and iptables work here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            package = "iproute2" if tool == "ip" else "iptables"
            return f"`{tool}` is missing: apt-get install {package}"
    # A bare namespace of this process's own (no veth pair: no address to collide with
    # another run's) in which a rule is added and flushed.
    probe = f"{PREFIX}-probe-{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
        inside = ["ip", "netns", "exec", probe, "iptables", "-w"]
        _run([*inside, "-A", "OUTPUT", "-p", "tcp", "--dport", "9", "-j", "DROP"])
        _run([*inside, "-F", "OUTPUT"])
    except NetnsError as exc:
        return f"network namespaces do not work here: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


class Namespace:
    """One namespace joined to the root namespace by a veth pair.

    ``host_addr`` is the root side (services a replica must reach listen there), ``addr``
    the inside (the replica binds there; workers connect there).
    """

    def __init__(self, name: str, index: int) -> None:
        if not 1 <= index <= 250:
            raise ValueError(f"namespace index {index} is outside 1..250")
        self.name = name
        self.index = index
        self.host_addr = f"10.213.{index}.1"
        self.addr = f"10.213.{index}.2"
        # Interface names are limited to 15 characters.
        self._host_if = f"fgv{index}h"
        self._inner_if = f"fgv{index}n"

    def __repr__(self) -> str:
        return f"Namespace({self.name!r}, {self.addr})"

    def create(self) -> None:
        """The namespace and its pair; ``IndexTaken`` (nothing left behind) when another
        run's pair has this index: its interface is never deleted from here (two runs of
        one index once met that way, and one lost its replica's address)."""
        _run(["ip", "netns", "del", self.name], check=False)  # a crashed run's, same name
        _run(["ip", "netns", "add", self.name])
        try:
            _run(["ip", "link", "add", self._host_if, "type", "veth", "peer", self._inner_if])
        except NetnsError as exc:
            _run(["ip", "netns", "del", self.name], check=False)
            if _run(["ip", "link", "show", self._host_if], check=False).returncode == 0:
                raise IndexTaken(str(exc)) from exc
            raise  # not another run's pair: the error as it is (``claim`` stops there)
        try:
            _run(["ip", "link", "set", self._inner_if, "netns", self.name])
            _run(["ip", "addr", "add", f"{self.host_addr}/24", "dev", self._host_if])
            _run(["ip", "link", "set", self._host_if, "up"])
            inside = ["ip", "netns", "exec", self.name]
            _run([*inside, "ip", "addr", "add", f"{self.addr}/24", "dev", self._inner_if])
            _run([*inside, "ip", "link", "set", self._inner_if, "up"])
            _run([*inside, "ip", "link", "set", "lo", "up"])
        except NetnsError:
            self.destroy()
            raise

    def destroy(self) -> None:
        """Remove the namespace and its pair; nothing happens when neither exists."""
        _run(["ip", "netns", "del", self.name], check=False)
        # Deleting the namespace deletes the inner end, and the kernel then the host end,
        # but not always before we return: delete it ourselves (absent is fine).
        _run(["ip", "link", "del", self._host_if], check=False)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def cut(self, port: int, *, loss: float | None = None) -> None:
        """Drop outgoing TCP from the namespace to ``host_addr:port``: every packet, or a
        random share ``loss`` of them."""
        rule = ["-p", "tcp", "-d", self.host_addr, "--dport", str(port)]
        if loss is not None:
            if not 0 < loss < 1:
                raise ValueError(f"loss {loss} is outside (0, 1)")
            rule += ["-m", "statistic", "--mode", "random", "--probability", f"{loss:.3f}"]
        _run(self.command(["iptables", "-w", "-A", "OUTPUT", *rule, "-j", "DROP"]))

    def heal(self) -> None:
        """Remove every cut."""
        _run(self.command(["iptables", "-w", "-F", "OUTPUT"]))


def claim(name: str, first: int, last: int = 220) -> Namespace:
    """A namespace created on the first index from ``first`` on (then from 1, up to
    ``last``) that no other namespace's pair holds."""
    for step in range(last):
        namespace = Namespace(name, (first - 1 + step) % last + 1)
        try:
            namespace.create()
        except IndexTaken:
            continue
        return namespace
    raise NetnsError(f"no index of 1..{last} is free for {name}")


def sweep(prefix: str = PREFIX) -> list[str]:
    """Remove every namespace whose name starts with ``prefix`` (a run killed before its
    cleanup leaves them; by default every one this module made, so not while a run is
    going on); returns their names."""
    listed = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.startswith(prefix)]
    for name in names:
        _run(["ip", "netns", "del", name], check=False)
    return names
