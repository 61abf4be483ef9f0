"""A redis lease source against a secured Redis (a real ``redis-server``, Debian's 7.0):
TLS only (``rediss://``, certificates made by the test, a client certificate required)
and ACL users (the default user off; the gateway's user may only ``MGET`` the locks'
keys). The right settings admit a write; each wrong one is refused at start with a
message that names the setting; a Redis Cluster node is refused at start."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio

from fencegate_client.redis_lock import AsyncRedisLock
from gateway.config import RedisSourceSettings
from gateway.sources.redis_lock import RedisSource
from gateway.sources.secured import SourceRefused
from tests.certs import Pki
from tests.gateway_helpers import ok
from tests.support import RedisServer, Upstream, upstream_config

WORKER_PASSWORD = "worker-redis-secret-1111"
GATEWAY_PASSWORD = "gateway-redis-secret-2222"


@dataclass
class Secured:
    server: RedisServer
    pki: Pki

    def settings(self, **extra: Any) -> dict[str, Any]:
        """The gateway's right settings, overridden by ``extra`` (None removes a key)."""
        assert self.server.client is not None
        source = {
            "name": "locks",
            "kind": "redis",
            "url": self.server.url,
            "username": "gateway",
            "password": GATEWAY_PASSWORD,
            "ca_file": str(self.pki.ca),
            "cert_file": str(self.server.client.cert),
            "key_file": str(self.server.client.key),
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
    folder = tmp_path_factory.mktemp("redis-secured")
    pki = Pki(folder / "pki")
    server = RedisServer(
        folder,
        pki=pki,
        client_certs="yes",
        users=[
            f"worker on >{WORKER_PASSWORD} ~* +@all",
            f"gateway on >{GATEWAY_PASSWORD} ~fencegate:* +mget",
            f"pinger on >{GATEWAY_PASSWORD} ~* +ping",
        ],
    )
    yield Secured(server, pki)
    server.stop()


@pytest.mark.parametrize("credentials", ["settings", "url"])
async def test_the_right_settings_admit_a_write(
    make_stack: Any, upstream: Upstream, secured: Secured, credentials: str
) -> None:
    source = secured.settings()
    if credentials == "url":  # rediss://user:password@host:port, no separate keys
        del source["username"], source["password"]
        source["url"] = secured.server.url.replace(
            "rediss://", f"rediss://gateway:{GATEWAY_PASSWORD}@"
        )
    stack = await make_stack(upstreams=[upstream_config(upstream)], lease_sources=[source])
    client = redis.asyncio.Redis.from_url(secured.server.url, **secured.server.admin)
    try:
        lock = AsyncRedisLock(client, f"order-{uuid.uuid4().hex[:8]}", ttl_seconds=30)
        assert await lock.acquire()
        await ok(await stack.write("/pay/charges", {"lease_token": lock.token}))
    finally:
        await client.aclose()
    assert len(upstream.received) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"password": "not-the-password"}, "Redis refused the credentials"),
        ({"username": "nobody"}, "Redis refused the credentials"),
        ({"username": None, "password": None}, "Redis refused the credentials"),
        ({"username": "pinger"}, r"denied the gateway's read .*\+mget"),
        ({"ca_file": None}, "certificate is not trusted .*set ca_file"),
        ({"cert_file": None, "key_file": None}, "set cert_file and key_file"),
    ],
)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_wrong_settings_are_refused_at_start(
    leaked_sockets: None, secured: Secured, change: dict[str, Any], message: str
) -> None:
    source = RedisSource(RedisSourceSettings(**secured.settings(**change)))
    with pytest.raises(SourceRefused, match=message) as refused:
        await source.start()
    assert GATEWAY_PASSWORD not in str(refused.value)
    assert source.client is None  # closed


async def test_a_redis_cluster_is_refused_at_start(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    server = RedisServer(tmp_path_factory.mktemp("redis-cluster"), cluster=True)
    try:
        source = RedisSource(RedisSourceSettings(name="locks", kind="redis", url=server.url))
        with pytest.raises(SourceRefused, match="Redis Cluster is not supported"):
            await source.start()
    finally:
        server.stop()
