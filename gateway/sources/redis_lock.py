"""``redis``: a lock taken with Fencegate's Redis recipe (``fencegate_client.redis_lock``:
one Lua script raises the lock's fence counter and sets the lock to ``<fence>.<random>``).
The token is ``<lock name>:<value>``; the job is the lock's name, the generation the
fence. The gateway reads the lock and its counter (one ``MGET``, both keys in one hash
slot) through ``redis.asyncio``; nothing is cached."""

from __future__ import annotations

import redis.asyncio
from redis.exceptions import RedisError

from fencegate_client.redis_lock import fence_of, lock_keys
from gateway.config import RedisSourceSettings
from gateway.fencing.fence import Lost
from gateway.sources.base import ExternalLease, log, namespaced
from lease_core import exceptions as lease_exc

COUNTER_LOST = (
    "Redis says this lock is held with this fence, but a higher generation of this job "
    "has already written, or another holder of the lock already wrote under this one: "
    "the lock's fence counter went backwards (Redis lost it: a "
    "restart without an append-only file, a FLUSHALL, an eviction, a failover to a replica "
    "that had not received it). Run Redis with appendonly yes and appendfsync always, and "
    "maxmemory-policy noeviction; then raise the counter past highest_generation "
    "(SET fencegate:fence:{<lock name>} <highest_generation>) and acquire again."
)


class RedisSource:
    def __init__(self, settings: RedisSourceSettings) -> None:
        self.name = settings.name
        self.settings = settings
        self.client: redis.asyncio.Redis | None = None

    def well_formed(self, token: str) -> bool:
        name, colon, value = token.rpartition(":")
        return (
            bool(name and colon)
            and len(token) <= 1024
            and fence_of(value) is not None
            and token.isprintable()
        )

    async def start(self) -> None:
        timeout = self.settings.timeout_seconds
        self.client = redis.asyncio.Redis.from_url(
            self.settings.url, socket_timeout=timeout, socket_connect_timeout=timeout
        )

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def check(self, token: str) -> ExternalLease | None:
        name, _, value = token.rpartition(":")
        job_id = namespaced(self.name, name)
        fence = fence_of(value)
        if job_id is None or fence is None:
            return None
        held, counter = await self._read(name)
        if held == value:
            # Current; its holder is the value (the fence and the holding's random part).
            return ExternalLease(
                self.name,
                job_id,
                fence,
                "",
                holder=value,
                counter_lost=COUNTER_LOST,
                reissued=COUNTER_LOST,
            )
        held_fence = None if held is None else fence_of(held)
        if counter is None or fence > counter or held_fence == fence:
            # Never granted by this counter, or a value the holding of that fence never
            # had: not a token of this lock.
            return None
        if held_fence is not None and held_fence > fence:  # somebody newer holds it
            return ExternalLease(self.name, job_id, fence, "", Lost.NEWER_HOLDER, newer=held_fence)
        # Released or expired (Redis keeps no trace of which), nobody newer holds it.
        return ExternalLease(self.name, job_id, fence, "", Lost.RELEASED)

    async def _read(self, name: str) -> tuple[str | None, int | None]:
        """The lock's value and its counter; Redis unreachable: 503, as for the
        database (nothing is forwarded on a lease nobody can confirm)."""
        assert self.client is not None, "the source was not started"
        try:
            held, counter = await self.client.mget(lock_keys(name))
        except (RedisError, OSError) as error:
            log.warning("%s: Redis did not answer: %s", self.name, error)
            raise lease_exc.StoreUnavailable(
                f"lease source {self.name}: Redis did not answer"
            ) from error
        text = held.decode("utf-8", "replace") if isinstance(held, bytes) else held
        try:
            count = None if counter is None else int(counter)
        except ValueError:
            count = None
        return text, count
