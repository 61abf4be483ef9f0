"""An etcd lease source against a secured etcd (a real ``etcd`` process, Debian's
etcd-server): clients over TLS only (certificates made by the test, a client certificate
required) and users on (``auth enable``, short-lived simple tokens). The right settings
admit a write; each wrong one is refused, at start when etcd says so, with a message
that names the setting."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.config import EtcdSourceSettings
from gateway.service.admin import GATEWAY_STATE
from gateway.sources.etcd import EtcdSource
from gateway.sources.secured import SourceRefused
from tests.certs import Pki
from tests.gateway_helpers import ok, problem
from tests.integration.test_source_etcd import Etcd
from tests.support import SecureEtcdServer, Upstream, upstream_config

ROOT_PASSWORD = "root-etcd-secret-1111"
GATEWAY_PASSWORD = "gateway-etcd-secret-2222"
TOKEN_TTL = 2  # seconds a simple token lives unused


@dataclass
class Secured:
    server: SecureEtcdServer
    pki: Pki
    folder: Path

    def settings(self, **extra: Any) -> dict[str, Any]:
        """The gateway's right settings, overridden by ``extra`` (None removes a key)."""
        source = {
            "name": "etcd",
            "kind": "etcd",
            "endpoints": [self.server.url],
            "cache_seconds": 0,
            "timeout_seconds": 5,
            "ca_file": str(self.pki.ca),
            "cert_file": str(self.server.client.cert),
            "key_file": str(self.server.client.key),
            "username": "gateway",
            "password": GATEWAY_PASSWORD,
            **extra,
        }
        return {k: v for k, v in source.items() if v is not None}


# Every test here: a refused handshake's socket is collected in its own test
# (``leaked_sockets``, tests/conftest.py), where this mark lets its warning pass.
pytestmark = [
    pytest.mark.usefixtures("leaked_sockets"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    folder = tmp_path_factory.mktemp("etcd-secured")
    pki = Pki(folder / "pki")
    server = SecureEtcdServer(folder, pki, token_ttl=TOKEN_TTL)
    try:
        server.enable_auth({"root": ROOT_PASSWORD, "gateway": GATEWAY_PASSWORD}, ["gateway"])
        yield Secured(server, pki, folder)
    finally:
        server.stop()


@pytest.fixture
async def worker(secured: Secured) -> AsyncIterator[Any]:
    """``await worker()``: a worker's side of etcd (root, over TLS), with a fresh token."""
    sessions: list[aiohttp.ClientSession] = []
    connector_context = secured.server.context

    async def make() -> Etcd:
        answer = secured.server.call(
            "/v3/auth/authenticate", {"name": "root", "password": ROOT_PASSWORD}
        )
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=connector_context),
            headers={"Authorization": answer["token"]},
        )
        sessions.append(session)
        return Etcd(secured.server.url, session)

    yield make
    for session in sessions:
        await session.close()


def lock_name() -> str:
    return f"/locks/order-{uuid.uuid4().hex[:8]}"


async def test_the_right_settings_admit_a_write_and_an_expired_token_is_renewed(
    make_stack: Any, upstream: Upstream, secured: Secured, worker: Any
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[secured.settings()]
    )
    etcd = await worker()
    key = await etcd.lock(lock_name(), await etcd.grant(30))
    await ok(await stack.write("/pay/charges", {"lease_token": f"etcd:{key}"}, key="k1"))
    source = stack.control.app[GATEWAY_STATE].sources["etcd"]
    first = source._token
    assert first

    # Unused past its TTL, etcd forgets the token: the gateway asks for another.
    await asyncio.sleep(TOKEN_TTL + 1.5)
    etcd = await worker()
    key = await etcd.lock(lock_name(), await etcd.grant(30))
    await ok(await stack.write("/pay/charges", {"lease_token": f"etcd:{key}"}, key="k2"))
    assert source._token not in (None, first)
    assert len(upstream.received) == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"password": "not-the-password"}, "refused username 'gateway' with this password"),
        ({"username": "nobody"}, "refused username 'nobody' with this password"),
        ({"ca_file": None}, "certificate is not trusted .*set ca_file"),
        ({"cert_file": None, "key_file": None}, "set cert_file and key_file"),
        ({"cert_file": "named", "key_file": "named"}, "without one"),
    ],
)
async def test_wrong_settings_are_refused_at_start(
    secured: Secured, change: dict[str, Any], message: str
) -> None:
    if change.get("cert_file") == "named":  # a client certificate with a CommonName
        named = secured.pki.issue("gateway-named", server=False)
        change = {"cert_file": str(named.cert), "key_file": str(named.key)}
    source = EtcdSource(EtcdSourceSettings(**secured.settings(**change)))
    with pytest.raises(SourceRefused, match=message) as refused:
        await source.start()
    assert GATEWAY_PASSWORD not in str(refused.value)
    assert source.session is None  # closed


async def test_without_credentials_a_check_is_refused_and_says_why(
    make_stack: Any,
    upstream: Upstream,
    secured: Secured,
    worker: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Status answers without a token, so the start passes; etcd then denies the read,
    and nothing is forwarded on a lock nobody could confirm."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream)],
        lease_sources=[secured.settings(username=None, password=None)],
    )
    etcd = await worker()
    key = await etcd.lock(lock_name(), await etcd.grant(30))
    with caplog.at_level(logging.WARNING, logger="fencegate.sources"):
        await problem(
            await stack.write("/pay/charges", {"lease_token": f"etcd:{key}"}),
            503,
            "store-unavailable",
        )
    assert "set username and password" in caplog.text
    assert upstream.received == []
