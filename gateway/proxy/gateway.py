"""The proxy's ``Gateway``: its settings, stores, slots, forwarder, resolver and lease
sources, started and closed with the proxy listener's app (``create_proxy_app``). Its
request path is the driver's (``handler.Driver``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway import sources
from gateway.config import Settings, UpstreamSettings
from gateway.fencing.request import Act
from gateway.observe.logs import request_id_middleware
from gateway.observe.metrics import GatewayMetrics, StepTimer
from gateway.proxy.answers import Answers
from gateway.proxy.duplicates import Settles
from gateway.proxy.handler import MACHINE, Driver
from gateway.proxy.held import Behind, Releases
from gateway.proxy.resolve import Resolver
from gateway.records.audit import Audit
from gateway.records.store import GatewayStore
from gateway.upstream.forwarding import Forwarder
from lease_core import exceptions as lease_exc
from lease_core.store import LeaseStore

log = logging.getLogger("fencegate.proxy")

# At shutdown, how long the claims still owed a release get for a last try.
OWED_LAST_TRY_SECONDS = 2.0


class Gateway(Driver):
    """The proxy's state: settings, stores, the slots, the forwarder (with the one
    client session) and the gateway's own answers."""

    def __init__(self, settings: Settings, lease_store: LeaseStore) -> None:
        self.settings = settings
        self.store = GatewayStore(lease_store)
        self.audit = Audit(lease_store, settings.gateway)
        self.metrics = GatewayMetrics.of(lease_store.metrics.registry)
        self.answers = Answers(self.audit, self.metrics, audit_bodies=settings.gateway.audit_bodies)
        self.forwarder = Forwarder(settings.gateway, self.metrics)
        self.upstreams = {u.name: u for u in settings.upstreams}
        self.resolving = _resolving(self.upstreams)
        # Unknown outcomes re-sent by ``fencegate serve``'s resolver (gateway.proxy.resolve).
        self.resolver = Resolver(
            settings.gateway,
            self.store,
            self.forwarder,
            self.audit,
            self.metrics,
            lambda: self.upstreams,
        )
        # Lease sources other than the gateway's own (``[[lease_sources]]``), by name.
        self.sources = sources.build(settings.lease_sources)
        # Slots in use per pool: fenced writes past the lease check (up to
        # max_concurrent_requests) and unfenced requests (max_concurrent_unfenced_requests).
        self.slots = {"fenced": 0, "unfenced": 0}
        # Duplicates waiting (``Prefer: wait``) for a key this replica may settle.
        self.settles = Settles()
        # Final answers given, their records still being settled.
        self.behind = Behind.of(settings.gateway)
        # Set as the proxy's listener shuts down: the waits end, answered "not sent".
        self.draining = asyncio.Event()
        # Claims of writes never sent, given back (or owed until the database answers).
        self.releases = Releases(
            self.store, self.settles.notify, limit=4 * settings.gateway.max_concurrent_requests
        )
        # The step the machine asks for, and who performs it.
        self.steps = {
            Act.CHECK_LEASE: self._check_lease,
            Act.TAKE_SLOT: self._take_slot,
            Act.READ_BODY: self._read,
            Act.ADMIT: self._admit,
            Act.WAIT_FIRST: self._wait_for_first,
            Act.WAIT_OLDER: self._wait_in_order,
            Act.READ_CLAIM: self._read_claim,
            Act.RELEASE: self._release_step,
        }
        # Each step of a fenced write timed (``Server-Timing`` with gateway.server_timing).
        self.timer = StepTimer(self.metrics, per_request=settings.gateway.server_timing)

    def reload(self, settings: Settings) -> None:
        """Take new upstreams (SIGHUP). Settings that need a restart are reported."""
        for key in (
            "database_url",
            "proxy_listen",
            "control_listen",
            "auth",
            "lease",
            "gateway",
            "lease_sources",
        ):
            if getattr(settings, key) != getattr(self.settings, key):
                log.warning("reload: %s changed; it takes effect after a restart", key)
        self.upstreams = {u.name: u for u in settings.upstreams}
        self.resolving = _resolving(self.upstreams)
        self.settings = self.settings.model_copy(update={"upstreams": settings.upstreams})
        log.info("reload: %d upstream(s): %s", len(self.upstreams), ", ".join(self.upstreams))

    async def start(self) -> None:
        """The forwarder's session, then each lease source. A start that raises (a
        source refused, the process told to stop) closes what it opened first: the
        proxy app's cleanup never runs for a start that failed."""
        await self.forwarder.start()
        started: list[sources.Source] = []
        try:
            for source in self.sources.values():
                started.append(source)  # closed even when its own start raises
                await source.start()
        except BaseException:
            for source in reversed(started):
                with contextlib.suppress(Exception):
                    await source.close()
            await self.forwarder.close()
            raise

    async def close(self) -> None:
        await self.forwarder.close()
        await self.behind.flush()
        if self.releases.owed:  # a last try: lost with the process, they turn unknown
            try:
                await asyncio.wait_for(self.releases.pay(), OWED_LAST_TRY_SECONDS)
            except (TimeoutError, lease_exc.StoreUnavailable):
                log.warning("%d unsent claim(s) could not be given back", self.releases.owed)
        await self.audit.close()
        for source in self.sources.values():
            await source.close()


def _resolving(upstreams: Mapping[str, UpstreamSettings]) -> bool:
    """Some upstream's unknown outcomes are re-sent by the gateway's resolver."""
    return any(u.unknown_outcome == "resolve" for u in upstreams.values())


# The proxy app's gateway (its state: slots, waits, claims owed a release).
GATEWAY = web.AppKey("gateway", Gateway)


def create_proxy_app(gateway: Gateway) -> web.Application:
    """The proxy listener's app; it owns the gateway's client session."""

    @web.middleware
    async def unrouted(request: web.Request, handler: Handler) -> web.StreamResponse:
        # CONNECT and ``OPTIONS *`` match no route; they still get the gateway's answer
        # (a problem document, audited) instead of aiohttp's plain 404.
        if request.match_info.http_exception is not None:
            return await gateway.handle(request)
        return await handler(request)

    app = web.Application(middlewares=[request_id_middleware, unrouted])
    app[GATEWAY] = gateway

    async def preference_applied(request: web.Request, response: web.StreamResponse) -> None:
        # RFC 7240: say that the request waited as ``Prefer: wait`` asked, whatever the
        # answer after the wait (a replay, a forward, ``request-in-progress``).
        machine = request.get(MACHINE)
        wait = None if machine is None else machine.wait
        if wait is not None and wait.waited and wait.asked:
            response.headers["Preference-Applied"] = wait.applied

    app.on_response_prepare.append(preference_applied)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.close()

    async def drain(app: web.Application) -> None:
        # The listener has stopped accepting; before the requests in progress are waited
        # for (``shutdown_timeout_seconds``) and then cancelled, every wait ends, so its
        # worker is told "not sent" and its claim given back while there is time.
        gateway.draining.set()

    app.on_shutdown.append(drain)
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", gateway.handle, expect_handler=gateway.expect)
    return app
