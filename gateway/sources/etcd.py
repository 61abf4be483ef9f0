"""``etcd``: the key of a lock held through etcd's lock API (``<name>/<lease id>``); the
job is the lock's name, the generation the key's create revision. Read through etcd's JSON
gateway (``/v3/kv/range``, ``/v3/lease/timetolive``), a held lock briefly cached
(``cache_seconds``)."""

from __future__ import annotations

import base64
import re
import time
from collections import OrderedDict
from typing import Any

import aiohttp

from gateway.config import EtcdSourceSettings
from gateway.fencing.fence import Lost
from gateway.sources.base import ExternalLease, log, namespaced
from lease_core import exceptions as lease_exc

COUNTER_LOST = (
    "etcd says this key holds the lock under this revision, but a higher generation of "
    "this job has already written, or another lock key already wrote under this "
    "revision: etcd's revisions went backwards (its data directory was lost or restored "
    "from an older snapshot). Restore etcd from its newest snapshot, or move the job to "
    "a new lock name."
)


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def _prefix_end(prefix: bytes) -> bytes:
    """etcd's range end for every key that starts with ``prefix``."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


class EtcdSource:
    """Locks of etcd's lock API. The lock key is ``<name>/<lease id in hex>``; the lock
    is held by the key under ``<name>/`` with the lowest create revision."""

    CACHE_SIZE = 10_000

    def __init__(self, settings: EtcdSourceSettings) -> None:
        self.name = settings.name
        self.settings = settings
        self.session: aiohttp.ClientSession | None = None
        # key -> (believed until, monotonic; create revision): locks read as held.
        self._held: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def well_formed(self, token: str) -> bool:
        name, slash, lease = token.rpartition("/")
        return (
            bool(name and slash)
            and len(token) <= 1024
            and re.fullmatch(r"[0-9a-f]{1,16}", lease) is not None
            and token.isprintable()
        )

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_seconds)
        self.session = aiohttp.ClientSession(timeout=timeout)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def check(self, token: str) -> ExternalLease | None:
        name, _, lease_hex = token.rpartition("/")
        job_id = namespaced(self.name, name)
        if job_id is None:
            return None
        cached = self._held.get(token)
        if cached is not None and cached[0] > time.monotonic():
            return self._current(job_id, cached[1], token, lease_hex)
        prefix = (name + "/").encode("utf-8")
        holder = await self._range(prefix, _prefix_end(prefix), first_created=True)
        if holder is not None and holder[0] == token:
            revision = holder[1]
            if self.settings.cache_seconds > 0:
                self._remember(token, revision)
            return self._current(job_id, revision, token, lease_hex)
        self._held.pop(token, None)
        mine = await self._range(token.encode("utf-8"), None, first_created=False)
        if mine is not None:
            # The key is there but is not the lowest: it waits for the lock, never held it.
            return None
        if holder is not None:  # released or expired, and somebody newer holds it now
            return ExternalLease(
                self.name, job_id, None, lease_hex, Lost.NEWER_HOLDER, newer=holder[1]
            )
        alive = await self._lease_alive(int(lease_hex, 16))
        refused = Lost.RELEASED if alive else Lost.EXPIRED
        return ExternalLease(self.name, job_id, None, lease_hex, refused)

    def _current(self, job_id: str, revision: int, token: str, lease_hex: str) -> ExternalLease:
        """The lock held by this key: its holder is the key (the lock's name and the
        holder's etcd lease)."""
        return ExternalLease(
            self.name,
            job_id,
            revision,
            lease_hex,
            holder=token,
            counter_lost=COUNTER_LOST,
            reissued=COUNTER_LOST,
        )

    def _remember(self, token: str, revision: int) -> None:
        self._held[token] = (time.monotonic() + self.settings.cache_seconds, revision)
        self._held.move_to_end(token)
        while len(self._held) > self.CACHE_SIZE:
            self._held.popitem(last=False)

    async def _range(
        self, key: bytes, range_end: bytes | None, *, first_created: bool
    ) -> tuple[str, int] | None:
        """(key, create revision) of the key, or of the oldest key in the range."""
        body: dict[str, Any] = {"key": _b64(key), "keys_only": True}
        if range_end is not None:
            body["range_end"] = _b64(range_end)
        if first_created:
            body.update(limit=1, sort_order="ASCEND", sort_target="CREATE")
        answer = await self._call("/v3/kv/range", body)
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        return base64.b64decode(kv["key"]).decode("utf-8", "replace"), int(kv["create_revision"])

    async def _lease_alive(self, lease_id: int) -> bool:
        answer = await self._call("/v3/lease/timetolive", {"ID": str(lease_id)})
        return int(answer.get("TTL", -1)) > 0

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call to the first endpoint that answers; none: the store is unavailable
        (503, as for the database: nothing is forwarded on a lease nobody can confirm)."""
        assert self.session is not None, "the source was not started"
        last: Exception | None = None
        for endpoint in self.settings.endpoints:
            try:
                async with self.session.post(endpoint + path, json=body) as response:
                    if response.status != 200:
                        raise aiohttp.ClientResponseError(
                            response.request_info, (), status=response.status
                        )
                    answer: dict[str, Any] = await response.json(content_type=None)
                    return answer
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                last = error
                continue
        log.warning("%s: no etcd endpoint answered: %s", self.name, last)
        raise lease_exc.StoreUnavailable(f"lease source {self.name}: etcd did not answer")
