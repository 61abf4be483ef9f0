"""``redis``: a lock taken with Fencegate's Redis recipe (``fencegate_client.redis_lock``:
one Lua script raises the lock's fence counter and sets the lock to ``<fence>.<random>``).
The token is ``<lock name>:<value>``; the job is the lock's name, the generation the
fence. The gateway reads the lock and its counter (one ``MGET``, both keys in one hash
slot) through ``redis.asyncio``; nothing is cached.

A secured Redis: an ACL user and password (``username``, ``password``, or in the URL),
TLS with ``rediss://`` (``ca_file``; ``cert_file`` and ``key_file`` when the server asks
for a client certificate). Sentinel and Cluster are refused (``REDIS_SENTINEL`` in the
settings, ``REDIS_CLUSTER`` at start): a failover to a replica can lose the fence."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any

import redis.asyncio
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    NoPermissionError,
    RedisError,
    ResponseError,
)
from yarl import URL

from fencegate_client.redis_lock import fence_of, lock_keys
from gateway.config import RedisSourceSettings
from gateway.config.sources import REDIS_CLUSTER
from gateway.fencing.fence import Lost
from gateway.sources.base import ExternalLease, log, namespaced
from gateway.sources.secured import SourceRefused, client_context, tls_advice
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
        """The client; then, when Redis answers, its verdict on the certificate, the
        credentials and the gateway's read (the same ``MGET`` a check makes): a refusal,
        or a Redis Cluster, stops ``serve`` (``SourceRefused``); a Redis that does not
        answer yet does not."""
        self.client = redis.asyncio.Redis.from_url(**self.client_options())
        try:
            await self._probe()
        except SourceRefused:
            await self.close()
            raise

    def client_options(self) -> dict[str, Any]:
        """``Redis.from_url``'s arguments: the settings' credentials take the place of the
        URL's; TLS verifies the server's certificate and its host name."""
        settings = self.settings
        timeout = settings.timeout_seconds
        options: dict[str, Any] = {
            "url": settings.url,
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
        }
        if settings.password is not None:
            options["url"] = str(URL(settings.url).with_user(None))
            options["username"] = settings.username
            options["password"] = settings.password.get_secret_value()
        if settings.url.startswith("rediss://"):
            options.update(ssl_cert_reqs="required", ssl_check_hostname=True)
            options.update(ssl_ca_certs=settings.ca_file)
            options.update(ssl_certfile=settings.cert_file, ssl_keyfile=settings.key_file)
        return options

    async def _probe(self) -> None:
        assert self.client is not None
        try:
            await self.client.mget(lock_keys("fencegate-start"))
        except (AuthenticationError, AuthorizationError) as error:
            raise SourceRefused(
                f"lease source {self.name}: Redis refused the credentials ({error}); set "
                "username and password (or the URL's) to an ACL user's"
            ) from error
        except NoPermissionError as error:
            raise SourceRefused(
                f"lease source {self.name}: Redis denied the gateway's read ({error}); its "
                "ACL user needs +mget on the keys fencegate:lock:* and fencegate:fence:*"
            ) from error
        except ResponseError as error:
            if "NOAUTH" in str(error) or "AUTH" in str(error).split()[:1]:
                raise SourceRefused(
                    f"lease source {self.name}: Redis asks for credentials ({error}); set "
                    "username and password"
                ) from error
            # CLUSTERDOWN, MOVED: a cluster node; anything else is said, and checks say it
            log.warning("%s: Redis refused the start's read: %s", self.name, error)
        except (RedisError, OSError) as error:
            cause = error.__cause__ or error.__context__
            if _tls_failure(error) or _tls_failure(cause):
                raise SourceRefused(tls_advice(self.name, cause or error)) from error
            refused = await self._handshake_refusal()
            if refused is not None:
                raise SourceRefused(tls_advice(self.name, refused)) from error
            log.warning("%s: Redis did not answer at start: %s", self.name, error)
            return
        try:
            cluster = await self.client.info("cluster")
        except RedisError:  # INFO denied to a user that may only read the locks
            return
        if cluster.get("cluster_enabled") in (1, "1"):
            raise SourceRefused(f"lease source {self.name}: {REDIS_CLUSTER}")

    async def _handshake_refusal(self) -> ssl.SSLError | None:
        """Whether the server refuses the TLS handshake (rediss:// only). With TLS 1.3 a
        server that wants a client certificate says so after the client has finished
        its handshake; a client that has already sent a command then often reads a
        connection reset instead of the alert. Connecting again and sending nothing
        reads the alert itself."""
        settings = self.settings
        url = URL(settings.url)
        if url.scheme != "rediss" or url.host is None:
            return None
        context = client_context(settings.ca_file, settings.cert_file, settings.key_file)
        wait = min(1.0, settings.timeout_seconds)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(url.host, url.port or 6379, ssl=context),
                settings.timeout_seconds,
            )
        except ssl.SSLError as error:
            return error
        except (OSError, TimeoutError):
            return None
        try:
            await asyncio.wait_for(reader.read(1), wait)
        except ssl.SSLError as error:
            return error
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()
        return None

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.aclose()

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


def _tls_failure(error: BaseException | None) -> bool:
    text = str(error)
    return isinstance(error, ssl.SSLError) or any(
        word in text for word in ("CERTIFICATE_VERIFY_FAILED", "SSL", "certificate")
    )
