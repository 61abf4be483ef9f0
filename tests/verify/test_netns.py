"""The partition nemesis's namespaces, for real: a replica's side reaches a service on the
host side, a cut stops that (and only that port), a heal brings it back."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from tests.support import namespace_for_test, unavailable
from verify import netns

CONNECT = (
    "import socket, sys\n"
    "s = socket.socket(); s.settimeout(float(sys.argv[3]))\n"
    "try:\n"
    "    s.connect((sys.argv[1], int(sys.argv[2])))\n"
    "    print(s.recv(16).decode())\n"
    "except OSError as exc:\n"
    "    print('failed', type(exc).__name__)\n"
)


@pytest.fixture
def namespace() -> Iterator[netns.Namespace]:
    with namespace_for_test("test", 241, 8) as ns:
        yield ns


def serve(host: str) -> tuple[socket.socket, int]:
    """A TCP server on ``host`` that greets every connection with ``hi``."""
    server = socket.create_server((host, 0))
    port: int = server.getsockname()[1]

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"hi")

    threading.Thread(target=accept, daemon=True).start()
    return server, port


def connect_from(ns: netns.Namespace, host: str, port: int, timeout: float = 1.0) -> str:
    argv = ns.command([sys.executable, "-c", CONNECT, host, str(port), str(timeout)])
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout


def test_a_cut_drops_one_port_and_a_heal_restores_it(namespace: netns.Namespace) -> None:
    first, port = serve(namespace.host_addr)
    second, other = serve(namespace.host_addr)
    try:
        assert connect_from(namespace, namespace.host_addr, port).strip() == "hi"
        namespace.cut(port)
        assert connect_from(namespace, namespace.host_addr, port).startswith("failed")
        assert connect_from(namespace, namespace.host_addr, other).strip() == "hi"
        namespace.heal()
        assert connect_from(namespace, namespace.host_addr, port).strip() == "hi"
    finally:
        first.close()
        second.close()


def test_a_lossy_cut_is_a_rule_of_its_own_and_heals(namespace: netns.Namespace) -> None:
    server, port = serve(namespace.host_addr)
    try:
        namespace.cut(port, loss=0.3)
        rules = subprocess.run(
            namespace.command(["iptables", "-S", "OUTPUT"]),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "--probability 0.29" in rules and f"--dport {port}" in rules
        namespace.heal()
        assert connect_from(namespace, namespace.host_addr, port).strip() == "hi"
    finally:
        server.close()
    with pytest.raises(ValueError):
        namespace.cut(port, loss=1.5)


def test_the_root_namespace_reaches_the_inside(namespace: netns.Namespace) -> None:
    """Workers connect to a replica at ``addr`` from the root namespace."""
    script = (
        "import socket\n"
        f"s = socket.create_server(({namespace.addr!r}, 0))\n"
        "print(s.getsockname()[1], flush=True)\n"
        "c, _ = s.accept(); c.sendall(b'in'); c.close()\n"
    )
    proc = subprocess.Popen(
        namespace.command([sys.executable, "-c", script]), stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with socket.create_connection((namespace.addr, port), timeout=5) as conn:
            assert conn.recv(16) == b"in"
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_destroy_and_sweep_leave_nothing(namespace: netns.Namespace) -> None:
    namespace.destroy()
    namespace.create()
    assert netns.sweep(namespace.name) == [namespace.name]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert namespace.name not in listed


def test_an_index_another_run_holds_is_refused_and_left_whole(namespace: netns.Namespace) -> None:
    """Two runs once drew one index: the second's create deleted the first's interface,
    and the first's replica could not bind its address. Now the second is refused
    (``IndexTaken``, nothing of its own left) and the first's pair still carries its
    address (``netns.claim``, a stack's, moves on to the next index on ``IndexTaken``)."""
    second = netns.Namespace(f"{namespace.name}-second", namespace.index)
    with pytest.raises(netns.IndexTaken):
        second.create()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert second.name not in listed
    inside = namespace.command(["ip", "-o", "addr", "show"])
    addresses = subprocess.run(inside, capture_output=True, text=True, timeout=30).stdout
    assert namespace.addr in addresses
    first, port = serve(namespace.host_addr)
    try:
        assert connect_from(namespace, namespace.host_addr, port).strip() == "hi"
    finally:
        first.close()


def test_claim_moves_on_past_an_index_another_run_holds() -> None:
    """What a stack does when its drawn index is held (``netns.claim``): the next free
    one, the holder's pair untouched. Indexes 249 and 250 are this test's alone."""
    why = netns.unavailable()
    if why is not None:
        unavailable("network namespaces", why)
    holder = netns.Namespace(f"{netns.PREFIX}-holdc", 249)
    holder.create()
    try:
        claimed = netns.claim(f"{netns.PREFIX}-claimc", 249, last=250)
        try:
            assert claimed.index == 250
            server, port = serve(claimed.host_addr)
            try:
                assert connect_from(claimed, claimed.host_addr, port).strip() == "hi"
            finally:
                server.close()
            inside = holder.command(["ip", "-o", "addr", "show"])
            addresses = subprocess.run(inside, capture_output=True, text=True, timeout=30).stdout
            assert holder.addr in addresses
        finally:
            claimed.destroy()
    finally:
        holder.destroy()
