"""Locks held through etcd, for the lock workers (``verify.locks``) of the lease source
``etcdlocks`` (``kind = "etcd"``), and the run's ``etcd`` that the ``etcd-loss`` nemesis
makes lose them.

``EtcdStore``: one ``etcd`` on a free client port (``verify.etcd.EtcdMember``), its data
in the run's folder, listening on 127.0.0.1 and on the host's side of each replica's
network namespace. ``lose`` (every lease revoked at once: every lock key gone, as
an operator's ``etcdctl lease revoke`` or a lease that lapsed during a long pause), ``kill``
and ``start`` (kill -9, then the same member again on its data: locks and revisions stay,
and the leases get their TTL again when it is back) are the nemesis's.

``EtcdLock``: etcd's lock recipe, as etcd's own ``concurrency.Mutex`` keeps it and the
gateway's etcd source reads it: a lease of a TTL of whole seconds, the key
``<lock>/<lease id in hex>`` created under it, and the lock held by the key under
``<lock>/`` with the lowest create revision, which is the generation. It does not wait
in line: a key that is not the lowest is taken back and the acquire fails
(``lock-held``), as a Redis lock's ``SET NX`` does. ``extend`` is a keep-alive of the
lease (False once it is gone: revoked or lapsed), ``release`` revokes it. Through etcd's
JSON gateway (``/v3/...``), as the gateway's source reads it.
"""

from __future__ import annotations

import base64
import math
import shutil
from typing import Any

import aiohttp

from verify.cluster import free_port
from verify.etcd import EtcdMember
from verify.procs import Children, Service

SOURCE = "etcdlocks"  # the lease source's name at the gateway: tokens "etcdlocks:<key>"
# etcd's smallest lease TTL is 1.5 election timeouts (1.5 s with its defaults): its TTLs
# are whole seconds, so the workers' are 2 or 3.
TTLS = (2, 3)
CALL_TIMEOUT = 2.0


def etcd_binary() -> str | None:
    """Debian's etcd (the ``etcd-server`` package) on PATH, or None."""
    return shutil.which("etcd")


def _b64(value: str) -> str:
    return base64.b64encode(value.encode("utf-8")).decode("ascii")


def _prefix_end(prefix: str) -> str:
    """etcd's range end for the keys under ``prefix`` (which ends in ``/``)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class EtcdError(Exception):
    """etcd answered with an error, or not at all."""


async def call(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> Any:
    """One call to etcd's JSON gateway; its answer (an ``error`` member: ``EtcdError``)."""
    try:
        async with session.post(
            url + path, json=body, timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT)
        ) as resp:
            answer = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
        raise EtcdError(f"{path}: {type(error).__name__}: {error}") from error
    if isinstance(answer, dict) and "error" in answer:
        raise EtcdError(f"{path}: {answer.get('message') or answer['error']}")
    if isinstance(answer, dict) and isinstance(answer.get("result"), dict):
        return answer["result"]  # a stream's one message (keepalive)
    return answer


class EtcdStore(Service):
    """The run's ``etcd``: its data stays across a kill, and ``start`` brings the same
    member back on it."""

    def __init__(self, binary: str, children: Children, hosts: list[str]) -> None:
        super().__init__(children)
        self.binary = binary
        self.hosts = hosts  # 127.0.0.1 first, then each namespace's host address
        self.port = free_port()
        self.member = EtcdMember(
            name="verify",
            data_dir=children.folder / "etcd-data",
            client_url=f"http://127.0.0.1:{self.port}",
            peer_url=f"http://127.0.0.1:{free_port()}",
        )
        self.url = self.member.client_url

    def url_for(self, host: str) -> str:
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        argv = self.member.argv(self.binary)
        listen = ",".join(self.url_for(h) for h in self.hosts)
        argv = [a for a in argv if not a.startswith("--listen-client-urls=")]
        argv.append(f"--listen-client-urls={listen}")
        self.spawn("etcd", argv, self.member.healthy, timeout, every=0.1)

    def lose(self) -> int:
        """Every lease revoked (every lock key with it); how many."""
        import json
        import urllib.request

        def post(path: str, body: dict[str, Any]) -> Any:
            request = urllib.request.Request(
                self.url + path,
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=CALL_TIMEOUT) as answer:
                return json.loads(answer.read() or b"{}")

        leases = post("/v3/lease/leases", {}).get("leases") or []
        for lease in leases:
            try:
                post("/v3/lease/revoke", {"ID": lease["ID"]})
            except OSError:
                pass  # revoked meanwhile (released, or lapsed)
        return len(leases)


class EtcdLock:
    """One attempt at the lock ``name`` (see the module's doc)."""

    def __init__(
        self, session: aiohttp.ClientSession, url: str, name: str, ttl_seconds: float, source: str
    ) -> None:
        self.session = session
        self.url = url
        self.name = name
        self.ttl_ms = max(TTLS[0], math.ceil(ttl_seconds)) * 1000
        self.source = source
        self.lease: int | None = None
        self.fence: int = 0  # the key's create revision, once held
        self.holder = ""  # the lease id in hex, once granted

    @property
    def key(self) -> str:
        return f"{self.name}/{self.holder}"

    @property
    def token(self) -> str:
        return f"{self.source}:{self.key}"

    async def acquire(self) -> bool:
        """The lock, if nobody holds it: True (``fence`` is its generation); False when
        another key is older (this one is taken back)."""
        granted = await call(
            self.session, self.url, "/v3/lease/grant", {"TTL": self.ttl_ms // 1000}
        )
        self.lease = int(granted["ID"])
        self.ttl_ms = int(granted.get("TTL", self.ttl_ms // 1000)) * 1000
        self.holder = f"{self.lease:x}"
        key = _b64(self.key)
        await call(
            self.session,
            self.url,
            "/v3/kv/txn",
            {
                "compare": [
                    {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
                ],
                "success": [{"request_put": {"key": key, "value": "", "lease": str(self.lease)}}],
            },
        )
        prefix = self.name + "/"
        found = await call(
            self.session,
            self.url,
            "/v3/kv/range",
            {
                "key": _b64(prefix),
                "range_end": _b64(_prefix_end(prefix)),
                "sort_order": "ASCEND",
                "sort_target": "CREATE",
                "limit": 1,
                "keys_only": True,
            },
        )
        kvs = found.get("kvs") or []
        if kvs and base64.b64decode(kvs[0]["key"]).decode() == self.key:
            self.fence = int(kvs[0]["create_revision"])
            return True
        await self.release()
        return False

    async def extend(self) -> bool:
        """A keep-alive of the lease: False once it is gone (revoked, or lapsed)."""
        assert self.lease is not None
        kept = await call(self.session, self.url, "/v3/lease/keepalive", {"ID": str(self.lease)})
        return int(kept.get("TTL", 0)) > 0

    async def release(self) -> bool:
        """The lease revoked, and the key with it: False when it was gone already."""
        assert self.lease is not None
        try:
            await call(self.session, self.url, "/v3/lease/revoke", {"ID": str(self.lease)})
        except EtcdError as error:
            if "not found" in str(error):
                return False
            raise
        return True
