"""A zookeeper lease source against a secured ZooKeeper (a real one, Debian's 3.8
package): locks whose ACLs admit only digest users, a chroot in ``hosts``, and TLS on
the secureClientPort (Netty, certificates made by the test, client certificates
required). The right settings admit a write; each wrong one is refused, and says why."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.security import make_digest_acl

from fencegate_client.zookeeper import lock_token
from tests.certs import Pki
from tests.gateway_helpers import ok, problem
from tests.support import Upstream, ZooKeeperServer, upstream_config

WORKER_PASSWORD = "worker-zk-secret-1111"
GATEWAY_PASSWORD = "gateway-zk-secret-2222"
CHROOT = "/fencegate"


@dataclass
class Secured:
    server: ZooKeeperServer
    pki: Pki
    folder: Path

    def settings(self, **extra: Any) -> dict[str, Any]:
        """The gateway's right settings (digest, plain port), overridden by ``extra``
        (None removes a key)."""
        source = {
            "name": "zk",
            "kind": "zookeeper",
            "hosts": [self.server.hosts],
            "timeout_seconds": 2,
            "username": "gateway",
            "password": GATEWAY_PASSWORD,
            **extra,
        }
        return {k: v for k, v in source.items() if v is not None}

    def tls(self, **extra: Any) -> dict[str, Any]:
        assert self.server.client is not None
        tls = {
            "hosts": [self.server.secure_hosts],
            "use_tls": True,
            "ca_file": str(self.pki.ca),
            "cert_file": str(self.server.client.cert),
            "key_file": str(self.server.client.key),
        }
        return self.settings(**{**tls, **extra})


# Every test here: a refused handshake's socket is collected in its own test
# (``leaked_sockets``, tests/conftest.py), where this mark lets its warning pass.
pytestmark = [
    pytest.mark.usefixtures("leaked_sockets"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    folder = tmp_path_factory.mktemp("zookeeper-secured")
    pki = Pki(folder / "pki")
    server = ZooKeeperServer(folder, pki)
    root = KazooClient(hosts=server.hosts)
    root.start(10)
    root.ensure_path(CHROOT)
    root.stop()
    root.close()
    yield Secured(server, pki, folder)
    server.stop()


@pytest.fixture
def worker(secured: Secured) -> Iterator[Any]:
    """``await worker(chroot)``: a worker's kazoo client whose nodes only the worker (all
    rights) and the gateway's user (read) may see."""
    clients: list[KazooClient] = []

    async def make(chroot: str = "") -> KazooClient:
        client = KazooClient(
            hosts=secured.server.hosts + chroot,
            auth_data=[("digest", f"worker:{WORKER_PASSWORD}")],
            default_acl=[
                make_digest_acl("worker", WORKER_PASSWORD, all=True),
                make_digest_acl("gateway", GATEWAY_PASSWORD, read=True),
            ],
        )
        await asyncio.to_thread(client.start, 10)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.stop()
        client.close()


async def locked(client: KazooClient, chroot: str = "") -> dict[str, Any]:
    """A lock the worker holds; its token names the path as a gateway with ``chroot``
    in its hosts reads it."""
    lock = client.Lock(f"/locks/order-{uuid.uuid4().hex[:8]}", "worker-a")
    assert await asyncio.to_thread(lock.acquire, True, 10)
    return {"lease_token": lock_token(lock, source="zk", chroot=chroot)}


@pytest.mark.parametrize("transport", ["plain", "tls"])
async def test_the_right_settings_admit_a_write(
    make_stack: Any, upstream: Upstream, secured: Secured, worker: Any, transport: str
) -> None:
    source = secured.settings() if transport == "plain" else secured.tls()
    stack = await make_stack(upstreams=[upstream_config(upstream)], lease_sources=[source])
    await ok(await stack.write("/pay/charges", await locked(await worker())))
    assert len(upstream.received) == 1


async def test_a_chroot_in_hosts(
    make_stack: Any, upstream: Upstream, secured: Secured, worker: Any
) -> None:
    """``host:port/fencegate``: the worker's lock paths are below the chroot, and so are
    the gateway's reads; without the chroot the same token names no lock."""
    inside = await make_stack(
        upstreams=[upstream_config(upstream)],
        lease_sources=[secured.settings(hosts=[secured.server.hosts + CHROOT])],
    )
    outside = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[secured.settings()]
    )
    client = await worker(CHROOT)
    token = await locked(client, CHROOT)
    # The same path read from the root names no lock there.
    await problem(await outside.write("/pay/charges", token), 403, "invalid-fencing-token")
    await ok(await inside.write("/pay/charges", token))
    # A gateway without a chroot reads the full path.
    await ok(await outside.write("/pay/charges", await locked(client)))
    assert len(upstream.received) == 2


@pytest.mark.parametrize(
    ("change", "logged"),
    [
        ({"password": "not-the-password"}, "does not admit user 'gateway' with this password"),
        ({"username": None, "password": None}, "does not admit the gateway (no username)"),
    ],
)
async def test_wrong_credentials_are_refused_by_the_acl(
    make_stack: Any,
    upstream: Upstream,
    secured: Secured,
    worker: Any,
    caplog: pytest.LogCaptureFixture,
    change: dict[str, Any],
    logged: str,
) -> None:
    """ZooKeeper takes any digest credentials (addauth cannot fail); the lock's ACL then
    refuses the read, and nothing is forwarded."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[secured.settings(**change)]
    )
    token = await locked(await worker())
    with caplog.at_level(logging.WARNING, logger="fencegate.sources"):
        await problem(await stack.write("/pay/charges", token), 503, "store-unavailable")
    assert logged in caplog.text
    assert GATEWAY_PASSWORD not in caplog.text
    assert upstream.received == []


@pytest.mark.parametrize(
    "change",
    [
        {"ca_file": None},  # the system's CAs do not know the test's
        {"cert_file": None, "key_file": None},  # ZooKeeper requires a client certificate
        {"use_tls": None, "ca_file": None, "cert_file": None, "key_file": None},  # plain
    ],
)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_wrong_tls_settings_never_connect(
    leaked_sockets: None,
    make_stack: Any,
    upstream: Upstream,
    secured: Secured,
    worker: Any,
    caplog: pytest.LogCaptureFixture,
    change: dict[str, Any],
) -> None:
    with caplog.at_level(logging.WARNING, logger="fencegate.sources"):
        stack = await make_stack(
            upstreams=[upstream_config(upstream)], lease_sources=[secured.tls(**change)]
        )
        token = await locked(await worker())
        await problem(await stack.write("/pay/charges", token), 503, "store-unavailable")
    assert "not connected to ZooKeeper" in caplog.text
    assert upstream.received == []
