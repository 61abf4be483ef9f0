"""The proxy's ``Gateway``: its settings, stores, slots, forwarder, resolver and lease
sources, started and closed with the proxy listener's app (``create_proxy_app``). Its
request path is its ``driver`` (``handler.Driver``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway import sources
from gateway.config import Settings
from gateway.observe.logs import request_id_middleware
from gateway.observe.metrics import GatewayMetrics
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

# At shutdown, how long the claims of writes never sent get for a last try: those owed
# a release, and those of admissions still running for a request cancelled.
OWED_LAST_TRY_SECONDS = 2.0


class Gateway:
    """The proxy's state: settings, stores, the forwarder (with the one client session),
    the gateway's own answers, the resolver and the lease sources; its request path is
    ``driver`` (``handler.Driver``), made with what it shares."""

    def __init__(self, settings: Settings, lease_store: LeaseStore) -> None:
        self.settings = settings
        self.store = GatewayStore(lease_store)
        self.audit = Audit(lease_store, settings.gateway)
        self.metrics = GatewayMetrics.of(lease_store.metrics.registry)
        self.answers = Answers(self.audit, self.metrics, audit_bodies=settings.gateway.audit_bodies)
        self.forwarder = Forwarder(settings.gateway, self.metrics)
        self.upstreams = {u.name: u for u in settings.upstreams}
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
        self.driver = Driver(
            settings.gateway,
            settings.control_listen,
            self.store,
            self.metrics,
            self.answers,
            self.forwarder,
            self.sources,
            self.settles,
            self.behind,
            self.draining,
            self.releases,
        )
        self.driver.route(self.upstreams)

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
        self.driver.route(self.upstreams)
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
        # The claims of writes never sent, a last try (lost with the process, they turn
        # unknown): those of admissions whose request was cancelled, once they end, and
        # those owed; one budget for both, so the shutdown's worst case stays as it was.
        try:
            async with asyncio.timeout(OWED_LAST_TRY_SECONDS):
                await self.releases.finish()
                if self.releases.owed:
                    await self.releases.pay()
        except (TimeoutError, lease_exc.StoreUnavailable):
            log.warning(
                "%d unsent claim(s) could not be given back",
                self.releases.owed + self.releases.orphans,
            )
        await self.audit.close()
        for source in self.sources.values():
            await source.close()


# The proxy app's gateway (its state: slots, waits, claims owed a release).
GATEWAY = web.AppKey("gateway", Gateway)


def create_proxy_app(gateway: Gateway) -> web.Application:
    """The proxy listener's app; it owns the gateway's client session."""

    @web.middleware
    async def unrouted(request: web.Request, handler: Handler) -> web.StreamResponse:
        # CONNECT and ``OPTIONS *`` match no route; they still get the gateway's answer
        # (a problem document, audited) instead of aiohttp's plain 404.
        if request.match_info.http_exception is not None:
            return await gateway.driver.handle(request)
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
    driver = gateway.driver
    app.router.add_route("*", "/{tail:.*}", driver.handle, expect_handler=driver.expect)
    return app
