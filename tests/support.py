"""What the tests share besides fixtures: the PostgreSQL server's address and admin
connection, a controllable clock, a recording upstream and a gateway replica's clients.
Tests import these from here; ``conftest.py`` holds only fixtures."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from aiohttp.test_utils import TestClient
from sqlalchemy.ext.asyncio import create_async_engine

from lease_core.schema import metadata
from tests.certs import Issued, Pki
from verify import netns
from verify.etcd import EtcdMember
from verify.zookeeper import SCRIPT, ZooKeeperMember, zookeeper_script

PG_URL = os.environ.get(
    "FENCEGATE_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")


class FakeClock:
    """A clock the test moves by hand (seconds since the epoch)."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def unavailable(service: str, message: str) -> None:
    """A service a test needs is missing: the test fails in CI, and skips elsewhere."""
    if IN_CI:
        pytest.fail(f"{service} is required in CI: {message}", pytrace=False)
    pytest.skip(f"{service} not available: {message}")


@contextlib.contextmanager
def namespace_for_test(tag: str, first_index: int, indexes: int) -> Iterator[netns.Namespace]:
    """A network namespace for a test (``verify.netns``; failing in CI where namespaces
    do not work, else skipping). One subnet (and veth name) per xdist worker, from
    ``first_index`` on, ``indexes`` of them: two workers' tests run at once, and a shared
    index made one's ``ip link add`` meet the other's interface. verify's stacks take
    1..220; tests/faults/test_partitioned_send.py 221..229, tests/verify/test_netns.py
    241..248, and 249..250 for its test of ``netns.claim``."""
    why = netns.unavailable()
    if why is not None:
        unavailable("network namespaces", why)
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    ns = netns.Namespace(
        f"{netns.PREFIX}-{tag}{os.getpid() % 1000}", first_index + worker % indexes
    )
    ns.create()
    try:
        yield ns
    finally:
        ns.destroy()


def postgres_unavailable(message: str) -> None:
    unavailable("PostgreSQL", message)


def etcd_unavailable(message: str) -> None:
    unavailable("etcd", message)


def redis_unavailable(message: str) -> None:
    unavailable("Redis", message)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServiceProcess:
    """A real server process a test starts (etcd, redis-server), its output in a log file
    of ``folder``; started once ``ready()`` says so, or the test fails in CI (skips
    elsewhere) with the log's name."""

    service = ""
    binary_name = ""
    package = ""

    def start(
        self,
        folder: Path,
        argv: list[str],
        ready: Callable[[], bool],
        env: dict[str, str] | None = None,
    ) -> None:
        log_name = f"{self.binary_name}.log"
        self.log = (folder / log_name).open("wb")
        self.process = subprocess.Popen(
            argv,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env},
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                if ready():
                    return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                unavailable(
                    self.service, f"{self.binary_name} did not start (see {folder / log_name})"
                )
            time.sleep(0.1)

    def binary(self) -> str:
        found = shutil.which(self.binary_name)
        if found is None:
            unavailable(
                self.service,
                f"no {self.binary_name} binary on PATH (apt-get install {self.package})",
            )
            raise AssertionError("unreachable")
        return found

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class EtcdServer(ServiceProcess):
    """A real ``etcd`` process (Debian's etcd-server) on free ports, with its own data
    directory; ``url`` is its client URL (the JSON gateway answers there too). Its command
    line and readiness check are verify's (``verify.etcd``), shared with the Patroni
    cluster's etcd."""

    service, binary_name, package = "etcd", "etcd", "etcd-server"

    def __init__(self, folder: Path) -> None:
        binary = self.binary()
        etcd = EtcdMember.on_free_ports("test", folder / "data")
        self.url = etcd.client_url
        self.start(folder, etcd.argv(binary), etcd.healthy)


class SecureEtcdServer(ServiceProcess):
    """A real ``etcd`` serving its clients over TLS only (``https://``, a certificate of
    ``pki``), asking every client for a certificate of the same CA
    (``--client-cert-auth``); ``enable_auth`` turns its users on. Its simple tokens last
    ``token_ttl`` seconds unused."""

    service, binary_name, package = "etcd", "etcd", "etcd-server"

    def __init__(self, folder: Path, pki: Pki, token_ttl: int = 300) -> None:
        import dataclasses

        binary = self.binary()
        member = EtcdMember.on_free_ports("secure", folder / "data")
        member = dataclasses.replace(
            member, client_url=member.client_url.replace("http://", "https://")
        )
        self.url = member.client_url
        server = pki.issue("etcd-server", server=True, client_too=True)
        self.client = pki.issue("etcd-client", server=False, common_name=False)
        self.context = pki.client_context(self.client)
        argv = [
            *member.argv(binary),
            f"--cert-file={server.cert}",
            f"--key-file={server.key}",
            f"--trusted-ca-file={pki.ca}",
            "--client-cert-auth",
            "--auth-token=simple",
            f"--auth-token-ttl={token_ttl}",
        ]

        def ready() -> bool:
            with urllib.request.urlopen(
                self.url + "/health", timeout=1, context=self.context
            ) as answer:
                return b"true" in answer.read()

        self.start(folder, argv, ready)

    def call(self, path: str, body: dict[str, Any], token: str | None = None) -> Any:
        """One call to the JSON gateway over TLS (with the client certificate)."""
        import json

        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Authorization": token} if token else {},
        )
        with urllib.request.urlopen(request, timeout=5, context=self.context) as answer:
            return json.loads(answer.read())

    def enable_auth(self, users: dict[str, str], readers: list[str]) -> None:
        """``root`` (password ``users["root"]``) and the other users; ``readers`` may
        read every key (a role ``reader``); then ``auth enable``."""
        self.call("/v3/auth/role/add", {"name": "root"})
        self.call("/v3/auth/role/add", {"name": "reader"})
        self.call(
            "/v3/auth/role/grant",
            {"name": "reader", "perm": {"permType": "READ", "key": "AA==", "range_end": "AA=="}},
        )
        for user, password in users.items():
            self.call("/v3/auth/user/add", {"name": user, "password": password})
        self.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        for user in readers:
            self.call("/v3/auth/user/grant", {"user": user, "role": "reader"})
        self.call("/v3/auth/enable", {})


class RedisServer(ServiceProcess):
    """A real ``redis-server`` (Debian's redis-server) on a free port, in memory only (no
    RDB or AOF files), with its own working directory; ``url`` is its address.

    Secured: with ``pki`` it speaks TLS only (``rediss://``, a certificate of that CA;
    ``client_certs`` is its ``tls-auth-clients``: ``"no"``, ``"optional"``, ``"yes"``);
    ``users`` are ACL rules (``"worker on >pw ~* +@all"``), the default user turned off
    when there are some; ``cluster`` makes it a Redis Cluster node."""

    service, binary_name, package = "Redis", "redis-server", "redis-server"

    def __init__(
        self,
        folder: Path,
        *,
        pki: Pki | None = None,
        client_certs: str = "no",
        users: list[str] | None = None,
        cluster: bool = False,
    ) -> None:
        binary = self.binary()
        port = free_port()
        while cluster and not (port < 55536 and _port_free(port + 10000)):
            port = free_port()  # a cluster node listens on port + 10000 too (its bus)
        argv = [
            *(binary, "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no", "--dir", str(folder)),
        ]
        if pki is None:
            self.url = f"redis://127.0.0.1:{port}"
            argv += ["--port", str(port)]
            self.client = None
        else:
            self.url = f"rediss://127.0.0.1:{port}"
            server = pki.issue("redis-server", server=True)
            self.client = pki.issue("redis-client", server=False)
            argv += ["--port", "0", "--tls-port", str(port)]
            argv += ["--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key)]
            argv += ["--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", client_certs]
        for rule in users or []:
            argv += ["--user", *rule.split()]
        if users:
            argv += ["--user", "default", "off"]
        if cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        self.admin: dict[str, Any] = {}
        if users:
            name, _, rest = users[0].partition(" ")
            password = next(w[1:] for w in rest.split() if w.startswith(">"))
            self.admin = {"username": name, "password": password}
        if pki is not None:
            self.admin |= {
                "ssl_ca_certs": str(pki.ca),
                "ssl_certfile": str(self.client.cert) if self.client else None,
                "ssl_keyfile": str(self.client.key) if self.client else None,
            }

        def ready() -> bool:
            import redis

            try:
                with redis.Redis.from_url(self.url, socket_timeout=1, **self.admin) as client:
                    return bool(client.ping())
            except redis.RedisError:
                return False

        self.start(folder, argv, ready)


class ZooKeeperServer(ServiceProcess):
    """A real standalone ZooKeeper (Debian's zookeeper package: ``zkServer.sh``, off
    PATH, which execs the JVM) on a free port, with its own config and data directory;
    ``hosts`` is its address for kazoo. Java takes seconds: one per test session.

    With ``pki`` it also serves TLS on ``secure_hosts`` (``secureClientPort``, Netty,
    PEM key and trust stores of that CA, client certificates required: ZooKeeper's
    ``ssl.clientAuth`` default)."""

    service, binary_name, package = "ZooKeeper", "zkServer.sh", "zookeeper"

    def __init__(self, folder: Path, pki: Pki | None = None) -> None:
        binary = self.binary()
        member = ZooKeeperMember(folder, free_port())
        self.hosts = member.hosts
        lines: list[str] = []
        self.client: Issued | None = None
        if pki is not None:
            secure = free_port()
            self.secure_hosts = f"127.0.0.1:{secure}"
            server = pki.issue("zookeeper-server", server=True)
            self.client = pki.issue("zookeeper-client", server=False)
            keystore = folder / "keystore.pem"
            keystore.write_bytes(server.key.read_bytes() + server.cert.read_bytes())
            lines += [
                f"secureClientPort={secure}",
                "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
                f"ssl.keyStore.location={keystore}",
                "ssl.keyStore.type=PEM",
                f"ssl.trustStore.location={pki.ca}",
                "ssl.trustStore.type=PEM",
            ]
        member.write_config(lines)

        def ready() -> bool:
            if pki is not None:  # Netty answers no four-letter word here: a session
                return _kazoo_connects(self.hosts)
            return member.serves()

        # Debian's zookeeper.jar names netty-handler on its Class-Path but not
        # netty-codec (whose ByteToMessageDecoder Netty's SslHandler extends) nor
        # netty-resolver: NettyServerCnxnFactory, which TLS needs, dies on its first
        # connection without them. They are added here (a later -cp wins), with slf4j's
        # simple logger so that the log says why when the server does not start.
        env = None
        if pki is not None:
            jars = ["netty-codec", "netty-resolver", "netty-transport-native-unix-common"]
            classpath = ":".join(
                ["/etc/zookeeper/conf", "/usr/share/java/zookeeper.jar"]
                + [f"/usr/share/java/{jar}.jar" for jar in [*jars, "slf4j-simple"]]
            )
            env = {"SERVER_JVMFLAGS": f"-cp {classpath}"}
        self.start(folder, member.argv(binary), ready, env)

    def binary(self) -> str:
        script = zookeeper_script()
        if script is None:
            unavailable(self.service, f"no {SCRIPT} (apt-get install {self.package})")
            raise AssertionError("unreachable")
        return script


def _kazoo_connects(hosts: str) -> bool:
    from kazoo.client import KazooClient
    from kazoo.handlers.threading import KazooTimeoutError

    client = KazooClient(hosts=hosts, connection_retry={"max_tries": 0})
    try:
        client.start(timeout=1)
    except KazooTimeoutError:
        return False
    finally:
        client.stop()
        client.close()
    return True


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class MotoServer(ServiceProcess):
    """moto's server mode (the AWS wire protocols, DynamoDB's among them; a dev
    dependency) on a free port; ``url`` is its endpoint. Any credentials are accepted."""

    service, binary_name, package = "moto", "moto_server", "moto[server]"

    def __init__(self, folder: Path) -> None:
        import importlib.util
        import sys

        if importlib.util.find_spec("moto.server") is None:
            unavailable(self.service, "moto[server] is not installed (pip install -e '.[dev]')")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            with urllib.request.urlopen(self.url + "/moto-api/", timeout=1) as answer:
                return answer.status == 200

        self.start(
            folder, [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], ready
        )


async def pg_admin(sql: str) -> None:
    """Run one statement on the PostgreSQL server outside a transaction
    (``CREATE DATABASE``, ``DROP DATABASE``)."""
    engine = create_async_engine(PG_URL, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            await conn.execute(sa.text(sql))
    finally:
        await engine.dispose()


def pg_url_of(database: str) -> str:
    """The test server's URL for another database on it."""
    return sa.make_url(PG_URL).set(database=database).render_as_string(hide_password=False)


async def truncate_all(url: str) -> None:
    """Empty every table of a migrated PostgreSQL database."""
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            names = ", ".join(f'"{t.name}"' for t in metadata.sorted_tables)
            await conn.execute(sa.text(f"TRUNCATE {names}"))
    finally:
        await engine.dispose()


class Upstream:
    """A real HTTP server standing in for a payment / storage API. It records every
    request it receives; ``behaviour`` decides the answer."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.status = 201
        self.delay = 0.0
        self.body: bytes | None = None
        self.headers: dict[str, str] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.url = ""

    async def handler(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.read()
        record = {
            "method": request.method,
            "path": request.path_qs,
            "headers": dict(request.headers),
            "body": body,
            "generation": request.headers.get("Fencing-Generation"),
            "key": request.headers.get("Idempotency-Key"),
        }
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            self.received.append(record)
        finally:
            self.in_flight -= 1
        answer = self.body if self.body is not None else (b'{"applied": %d}' % len(self.received))
        return web.Response(
            status=self.status,
            body=answer,
            content_type="application/json",
            headers=self.headers,
        )


class Stack:
    """A control client and a proxy client on one store (one gateway replica)."""

    def __init__(self, control: TestClient[Any, Any], proxy: TestClient[Any, Any]) -> None:
        self.control = control
        self.proxy = proxy

    async def lease(self, job_id: str, owner: str = "worker-a", ttl: float = 30) -> dict[str, Any]:
        resp = await self.control.put(
            f"/v1/jobs/{job_id}/lease", json={"owner": owner, "ttl_seconds": ttl}
        )
        assert resp.status == 201, await resp.text()
        lease: dict[str, Any] = await resp.json()
        return lease

    async def write(
        self,
        path: str,
        lease: dict[str, Any] | None,
        key: str | None = "k1",
        body: Any = None,
        method: str = "POST",
        headers: dict[str, str] | None = None,
    ) -> Any:
        h = dict(headers or {})
        if lease is not None:
            h["Fencing-Token"] = lease["lease_token"]
        if key is not None:
            h["Idempotency-Key"] = key
        return await self.proxy.request(method, path, json=body or {"amount": 1}, headers=h)

    async def written(self) -> None:
        """Until what this replica writes behind its answers (the records of its final
        answers, its audit entries) is in the database: another replica's read finds it
        only then."""
        from gateway.service.admin import GATEWAY_STATE

        gateway = self.control.app[GATEWAY_STATE]
        await gateway.behind.flush()
        await gateway.audit.flush()

    async def audit(self, **query: str) -> list[dict[str, Any]]:
        resp = await self.control.get("/admin/rejections", params=query)
        assert resp.status == 200, await resp.text()
        items: list[dict[str, Any]] = (await resp.json())["items"]
        return items


def upstream_config(up: Upstream, name: str = "pay", **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": up.url, **extra}
