"""A fenced lock on Redis (Fencegate's recipe; a ``kind = "redis"`` lease source).

Redis has no fenced lock, so Fencegate publishes one. Per lock name two keys, in one
hash slot (Redis Cluster): ``fencegate:lock:{<name>}``, the lock, and
``fencegate:fence:{<name>}``, its fence counter. ``ACQUIRE`` refuses while the lock
exists; else it increments the counter and sets the lock, with its expiry, to
``<fence>.<32 random hex digits>``, and returns that value. ``EXTEND`` and ``RELEASE``
compare the value first (compare-and-expire, compare-and-delete). The worker sends
``Fencing-Token: <source>:<lock name>:<value>``; the gateway reads the lock: the same
value is current, and the generation is the fence.

.. code-block:: python

    import redis
    from fencegate_client.redis_lock import RedisLock

    with RedisLock(redis.Redis(), "order-42", ttl_seconds=30) as lock:
        headers = {"Fencing-Token": lock.token, "Idempotency-Key": "charge"}

``AsyncRedisLock`` is the same over ``redis.asyncio``. The scripts below are the
recipe's one copy; docs/lease-sources.md shows them for other languages.
"""

from __future__ import annotations

import re
import secrets
from types import TracebackType
from typing import Any

from .errors import LeaseHeld

try:
    import redis
    import redis.asyncio
except ModuleNotFoundError as error:
    from ._needs import needs

    needs(error, __name__, "redis", install="'fencegate-client[redis]'")
    raise

# KEYS[1] the lock, KEYS[2] its fence counter; ARGV[1] a random part, ARGV[2] the TTL in
# milliseconds. Returns the lock's value "<fence>.<random>", or nil while it is held.
ACQUIRE = """\
if redis.call('EXISTS', KEYS[1]) == 1 then
  return false
end
local fence = redis.call('INCR', KEYS[2])
local value = string.format('%d', fence) .. '.' .. ARGV[1]
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return value
"""

# KEYS[1] the lock; ARGV[1] the holder's value, ARGV[2] the new TTL in milliseconds.
# Returns 1 when the lock was still this value's, else 0.
EXTEND = """\
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1] the lock; ARGV[1] the holder's value. Returns 1 when it was deleted, else 0.
RELEASE = """\
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

VALUE = re.compile(r"([1-9][0-9]{0,18})\.([0-9a-f]{32})")


def lock_keys(name: str) -> tuple[str, str]:
    """The lock's key and its fence counter's key (one hash slot)."""
    return f"fencegate:lock:{{{name}}}", f"fencegate:fence:{{{name}}}"


def fence_of(value: str) -> int | None:
    """The fence a lock value carries; None for anything that is not one."""
    match = VALUE.fullmatch(value)
    return None if match is None else int(match.group(1))


def _check(name: str, ttl_seconds: float) -> int:
    if not name or not name.isprintable():
        raise ValueError("the lock name must be printable and not empty")
    if not 0 < ttl_seconds <= 86_400:
        raise ValueError("ttl_seconds must be above 0 and at most 86400")
    return max(1, round(ttl_seconds * 1000))


class _Lock:
    """What both flavours share: the name, the keys and the held value."""

    def __init__(self, name: str, *, ttl_seconds: float, source: str) -> None:
        self.ttl_ms = _check(name, ttl_seconds)
        self.name, self.source = name, source
        self.key, self.fence_key = lock_keys(name)
        self.value: str | None = None

    @property
    def fence(self) -> int:
        """The generation of this holding (the lock's fence)."""
        assert self.value is not None, "the lock is not held"
        fence = fence_of(self.value)
        assert fence is not None
        return fence

    @property
    def token(self) -> str:
        """``Fencing-Token`` for writes under this holding."""
        assert self.value is not None, "the lock is not held"
        return f"{self.source}:{self.name}:{self.value}"

    def _ms(self, ttl_seconds: float | None) -> int:
        return self.ttl_ms if ttl_seconds is None else _check(self.name, ttl_seconds)

    def _held(self, value: Any) -> bool:
        if value is None:
            return False
        self.value = value.decode() if isinstance(value, bytes) else str(value)
        return True

    def _refused(self) -> LeaseHeld:
        return LeaseHeld(f"the lock {self.name!r} is held by another holder")


class RedisLock(_Lock):
    """The recipe over a synchronous ``redis.Redis``; a context manager that acquires
    (``LeaseHeld`` when the lock is taken) and releases."""

    def __init__(
        self, client: redis.Redis, name: str, *, ttl_seconds: float, source: str = "locks"
    ) -> None:
        super().__init__(name, ttl_seconds=ttl_seconds, source=source)
        self.client = client

    def acquire(self) -> bool:
        """True when the lock is now this object's (``fence``, ``token``)."""
        value = self.client.eval(
            ACQUIRE, 2, self.key, self.fence_key, secrets.token_hex(16), self.ttl_ms
        )
        return self._held(value)

    def extend(self, ttl_seconds: float | None = None) -> bool:
        """A fresh TTL, if the lock is still ours (False: lost)."""
        assert self.value is not None, "the lock is not held"
        return bool(self.client.eval(EXTEND, 1, self.key, self.value, self._ms(ttl_seconds)))

    def release(self) -> bool:
        """Deleted if still ours; the token is refused from then on."""
        if self.value is None:
            return False
        return bool(self.client.eval(RELEASE, 1, self.key, self.value))

    def __enter__(self) -> RedisLock:
        if not self.acquire():
            raise self._refused()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class AsyncRedisLock(_Lock):
    """The recipe over ``redis.asyncio.Redis``; an async context manager."""

    def __init__(
        self, client: redis.asyncio.Redis, name: str, *, ttl_seconds: float, source: str = "locks"
    ) -> None:
        super().__init__(name, ttl_seconds=ttl_seconds, source=source)
        self.client = client

    async def acquire(self) -> bool:
        value = await self.client.eval(
            ACQUIRE, 2, self.key, self.fence_key, secrets.token_hex(16), self.ttl_ms
        )
        return self._held(value)

    async def extend(self, ttl_seconds: float | None = None) -> bool:
        assert self.value is not None, "the lock is not held"
        done = await self.client.eval(EXTEND, 1, self.key, self.value, self._ms(ttl_seconds))
        return bool(done)

    async def release(self) -> bool:
        if self.value is None:
            return False
        return bool(await self.client.eval(RELEASE, 1, self.key, self.value))

    async def __aenter__(self) -> AsyncRedisLock:
        if not await self.acquire():
            raise self._refused()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()
