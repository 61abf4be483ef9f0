"""``zookeeper``: the node of a lock held with ZooKeeper's lock recipe (kazoo's ``Lock``:
an ephemeral sequential node ``<lock path>/<guid>__lock__<sequence>``); the job is the
lock's path, the generation the node's ``czxid`` (the transaction that created it).

The gateway reads the lock's children (after a ``sync``, so a follower that lags does
not answer for the leader) and the node (its ``czxid``, and the lock's identifier as the
owner) through kazoo's asynchronous calls, each bridged to an asyncio future: nothing
blocks the event loop. Nothing is cached.

A secured ensemble: ``hosts`` may end in a chroot (``zk1:2181,zk2:2181/fencegate``, the
lock paths then below it); digest credentials (``addauth digest user:password``) or SASL
(``sasl_mechanism``, through pure-sasl); TLS to the secure client port (``use_tls``,
``ca_file``, ``cert_file``, ``key_file``; host names checked).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoAuthError, NoNodeError
from kazoo.retry import KazooRetry

from gateway.config import ZooKeeperSourceSettings
from gateway.fencing.fence import Lost
from gateway.sources.base import ExternalLease, log, namespaced
from gateway.sources.secured import SourceRefused
from lease_core import exceptions as lease_exc

COUNTER_LOST = (
    "ZooKeeper says this node holds the lock under this czxid, but a higher generation of "
    "this job has already written, or another lock node already wrote under this czxid: "
    "ZooKeeper's transaction ids went backwards (its data directory was lost or restored "
    "from an older snapshot). Restore ZooKeeper's newest data, or move the job to a new "
    "lock path."
)

# A lock node's name: kazoo's ``<32 hex>__lock__`` (``__rlock__`` for a ReadLock, which
# the gateway does not accept) and ZooKeeper's ten-digit sequence number.
NODE = re.compile(r"[0-9a-f]{32}__lock__(\d{10})")
# Any contender under the lock's path (write and read locks, kazoo's and Curator's
# shapes): its sequence number is what orders it.
SEQUENCE = re.compile(r"(\d{10})$")


def split_node(token: str) -> tuple[str, str, int] | None:
    """(lock path, node name, sequence number) of a well-formed lock node path."""
    path, slash, node = token.rpartition("/")
    match = NODE.fullmatch(node)
    if not slash or not path.startswith("/") or match is None:
        return None
    if any(part in ("", ".", "..") for part in path.split("/")[1:]):
        return None
    return path, node, int(match.group(1))


# kazoo's reconnect chatter: while ZooKeeper is unreachable its connection thread logs
# these at every try (about 30 warnings a minute, and as many "Connecting to" lines).
RECONNECT_CHATTER = frozenset(
    {
        "Connection dropped: %s",
        "Connection time-out: %s",
        "Transition to CONNECTING",
        "Cannot resolve %s: %s",
        "Connecting to %s(%s):%s, use_ssl: %r",
    }
)
# At most one line of each per source per this many seconds; the rest are dropped.
CHATTER_EVERY_SECONDS = 300.0


class ReconnectChatter(logging.Filter):
    """Lets the first of each of kazoo's reconnect lines through, then one per
    ``every_seconds`` (with how many were held back), so an unreachable ZooKeeper is
    said, not repeated 30 times a minute. kazoo's other lines pass untouched."""

    def __init__(self, every_seconds: float = CHATTER_EVERY_SECONDS) -> None:
        super().__init__()
        self.every_seconds = every_seconds
        self.next_at: dict[str, float] = {}  # message -> monotonic
        self.held_back: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg
        if not isinstance(message, str) or message not in RECONNECT_CHATTER:
            return True
        now = time.monotonic()
        if now < self.next_at.get(message, 0.0):
            self.held_back[message] = self.held_back.get(message, 0) + 1
            return False
        self.next_at[message] = now + self.every_seconds
        held = self.held_back.pop(message, 0)
        note = f" ({held} more held back)" if held else ""
        record.msg = (
            f"{message}{note}; kazoo keeps reconnecting, said at most every "
            f"{self.every_seconds:.0f} s"
        )
        return True


def kazoo_logger(source: str) -> logging.Logger:
    """The logger a source's kazoo client writes to (``fencegate.sources.<name>.kazoo``),
    its reconnect chatter rate-limited (``ReconnectChatter``)."""
    logger = logging.getLogger(f"{log.name}.{source}.kazoo")
    if not any(isinstance(f, ReconnectChatter) for f in logger.filters):
        logger.addFilter(ReconnectChatter())
    return logger


def owner(data: bytes, node: str) -> str:
    """The holder's name for the audit: the lock's identifier (kazoo writes it as the
    node's data), else the node's name."""
    text = data[:200].decode("utf-8", "replace")
    return text if text and text.isprintable() else node


def sequence(node: str) -> int | None:
    match = SEQUENCE.search(node)
    return None if match is None else int(match.group(1))


class ZooKeeperSource:
    """Locks of ZooKeeper's lock recipe, read through one kazoo client (its own
    connection thread; sessions re-established in the background)."""

    def __init__(self, settings: ZooKeeperSourceSettings) -> None:
        self.name = settings.name
        self.settings = settings
        self.client: KazooClient | None = None

    def well_formed(self, token: str) -> bool:
        return len(token) <= 1024 and token.isprintable() and split_node(token) is not None

    async def start(self) -> None:
        # Connecting happens in kazoo's thread and never ends while the source lives:
        # until ZooKeeper answers, a check waits timeout_seconds and answers 503.
        self.client = KazooClient(**self.client_options())
        connected = self.client.start_async()
        if not await asyncio.to_thread(connected.wait, self.settings.timeout_seconds):
            log.warning(
                "%s: not connected to ZooKeeper (%s) yet%s; checks answer 503 until it is",
                self.name,
                ",".join(self.settings.hosts),
                " (use_tls: is this the secureClientPort, its certificate signed by "
                "ca_file, the gateway's cert_file accepted?)"
                if self.settings.use_tls
                else "",
            )

    def client_options(self) -> dict[str, Any]:
        """``KazooClient``'s arguments from the settings."""
        settings = self.settings
        options: dict[str, Any] = {
            "hosts": ",".join(settings.hosts),
            "timeout": settings.session_timeout_seconds,
            "connection_retry": KazooRetry(max_tries=-1, max_delay=5),
            "read_only": False,
            "logger": kazoo_logger(self.name),
        }
        password = None if settings.password is None else settings.password.get_secret_value()
        if settings.sasl_mechanism is not None:
            if importlib.util.find_spec("puresasl") is None:
                raise SourceRefused(
                    f"lease source {self.name}: sasl_mechanism needs the pure-sasl package "
                    "(pip install pure-sasl; GSSAPI also needs kerberos)"
                )
            sasl: dict[str, Any] = {"mechanism": settings.sasl_mechanism}
            if settings.username is not None:
                sasl.update(username=settings.username, password=password)
            options["sasl_options"] = sasl
        elif settings.username is not None:
            options["auth_data"] = [("digest", f"{settings.username}:{password}")]
        if settings.use_tls:
            options.update(use_ssl=True, verify_certs=True, check_hostname=True)
            options.update(ca=settings.ca_file, certfile=settings.cert_file)
            options.update(keyfile=settings.key_file)
        return options

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await asyncio.to_thread(_stop, client)

    async def check(self, token: str) -> ExternalLease | None:
        parts = split_node(token)
        if parts is None:
            return None
        path, node, mine = parts
        job_id = namespaced(self.name, path)
        if job_id is None:
            return None
        try:
            await self._call("sync_async", path)
            children, parent = await self._call("get_children_async", path, None, True)
        except NoNodeError:
            return None  # no such lock (never was, or its path was removed)
        if mine >= int(parent.cversion):
            # ZooKeeper numbers a parent's sequential children by its child version
            # (every create and delete raises it): this node was never created.
            return None
        contenders = sorted(
            (seq, child) for child in children if (seq := sequence(child)) is not None
        )
        if node in children:
            try:
                data, stat = await self._call("get_async", token)
            except NoNodeError:  # released between the two reads
                return ExternalLease(self.name, job_id, None, node, Lost.RELEASED)
            if contenders[0][1] == node:
                # The lowest sequence number: it holds the lock (no lower number can
                # appear later under the same parent).
                # Its holder: the node and the session that created it (a ZooKeeper
                # that lost its data can hand the same czxid to another node).
                return ExternalLease(
                    self.name,
                    job_id,
                    int(stat.czxid),
                    owner(data, node),
                    holder=f"{node}/{int(stat.ephemeralOwner):x}",
                    counter_lost=COUNTER_LOST,
                    reissued=COUNTER_LOST,
                )
            # Present, not the lowest: a contender still waiting; it never held the lock.
            return None
        if contenders and contenders[0][0] > mine:
            # Gone, and a newer node holds the lock now.
            stat = await self._call("exists_async", f"{path}/{contenders[0][1]}")
            newer = None if stat is None else int(stat.czxid)
            return ExternalLease(self.name, job_id, None, node, Lost.NEWER_HOLDER, newer=newer)
        # Gone (released, or its session ended) and nobody newer holds the lock.
        return ExternalLease(self.name, job_id, None, node, Lost.RELEASED)

    async def _call(self, method: str, *args: Any) -> Any:
        """One kazoo call (``*_async``: an IAsyncResult settled by kazoo's thread), its
        answer handed to the event loop; no answer within timeout_seconds, or no
        connection: the store is unavailable (503, nothing forwarded)."""
        assert self.client is not None, "the source was not started"
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any) -> None:
            if future.done():
                return
            try:
                future.set_result(result.get_nowait())
            except Exception as error:
                future.set_exception(error)

        def done(result: Any) -> None:  # in kazoo's thread
            try:
                loop.call_soon_threadsafe(settle, result)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        try:
            getattr(self.client, method)(*args).rawlink(done)
            return await asyncio.wait_for(future, self.settings.timeout_seconds)
        except NoNodeError:
            raise
        except NoAuthError as error:
            who = self.settings.username
            log.warning(
                "%s: ZooKeeper refused the read (NoAuth): the lock's ACL does not admit %s",
                self.name,
                f"user {who!r} with this password" if who else "the gateway (no username)",
            )
            raise lease_exc.StoreUnavailable(
                f"lease source {self.name}: ZooKeeper's ACL refused the gateway's read"
            ) from error
        except (KazooException, TimeoutError) as error:
            log.warning("%s: ZooKeeper did not answer: %r", self.name, error)
            raise lease_exc.StoreUnavailable(
                f"lease source {self.name}: ZooKeeper did not answer"
            ) from error


def _stop(client: KazooClient) -> None:
    stop: Callable[[], Any]
    for stop in (client.stop, client.close):
        try:
            stop()
        except KazooException:  # pragma: no cover - already closed
            pass
