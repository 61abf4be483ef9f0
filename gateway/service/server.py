"""The ``fencegate serve`` process: one database engine, two listeners.

The engine belongs to the process, not to either app, because both listeners share it;
it is opened before the apps start and disposed after both have stopped. Under
``fencegate serve --workers N`` each worker is such a process, on the sockets its parent
bound (``Inherited``; the parent is ``gateway.service.workers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import signal
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.config import ConfigError, Settings, parse_listen
from gateway.observe import logs, tracing
from gateway.observe.logs import request_id_middleware
from gateway.observe.metrics import scrape_registry
from gateway.proxy.body import body_deadline_check
from gateway.proxy.gateway import Gateway, create_proxy_app
from gateway.proxy.held import OWED_INTERVAL_SECONDS
from gateway.records import migrate, replication
from gateway.service import admin, dashboard, openapi, tasks, tls
from gateway.service.auth import auth_check
from gateway.service.describe import source_target
from gateway.service.parse_errors import ProblemRunner
from gateway.sources.secured import SourceRefused
from lease_core import api as lease_api
from lease_core import exceptions as exc
from lease_core.db import Clock, Engine, create_engine
from lease_core.problems import problem_middleware
from lease_core.store import LeaseStore

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger("fencegate.server")

SETTINGS = web.AppKey("settings", Settings)
# What ``/metrics`` reads: the process's registry, or every worker's files.
SCRAPE = web.AppKey("scrape", CollectorRegistry)
CONTROL_MAX_BODY = 1024 * 1024
# How often a replica looks whether the schema has been migrated past its code beyond
# the schema's floor (check_schema): one read of the schema's revision.
SCHEMA_CHECK_INTERVAL_SECONDS = 5.0
# How often the gateway vacuums writes_in_flight (PostgreSQL): at 3,000 writes a second,
# 30,000 dead rows at most, a few milliseconds of vacuum.
VACUUM_INTERVAL_SECONDS = 10.0


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@dataclass(frozen=True)
class Inherited:
    """What a worker of ``fencegate serve --workers N`` gets from its parent
    (``gateway.service.workers``): the listening sockets the parent bound, by listener
    (``control``, ``proxy``), and the folder of every worker's metrics (its
    ``PROMETHEUS_MULTIPROC_DIR``)."""

    sockets: dict[str, list[socket.socket]]
    metrics_dir: str


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[SCRAPE]
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def readyz(request: web.Request) -> web.Response:
    """Ready when the database answers at a compatible schema, and on PostgreSQL is the
    primary: which one, and how its standbys replicate."""
    store = request.app[lease_api.STORE]
    settings = request.app[SETTINGS]
    try:
        schema = await migrate.schema_state(store.backend.engine)
        seen = None if settings.sqlite else await replication.replication(store.backend.engine)
    except Exception as error:
        raise exc.StoreUnavailable(
            f"The database is not reachable ({type(error).__name__})."
        ) from error
    refused = schema.refusal()
    if refused is not None:
        raise exc.StoreUnavailable(refused)
    answer: dict[str, object] = {"status": "ready", "schema": schema.revision}
    if seen is not None:
        if seen.in_recovery:
            raise exc.StoreUnavailable(f"The database server {seen.server} is a standby.")
        database = seen.to_json()
        if settings.database.allow_async_failover:
            database |= {"allow_async_failover": True, "can_lose_commits": seen.problems()}
        answer["database"] = database
    return web.json_response(answer)


def create_control_app(
    settings: Settings,
    store: LeaseStore,
    gateway: Gateway | None = None,
    *,
    scrape: CollectorRegistry | None = None,
) -> web.Application:
    """The control listener: lease API, admin API, health; and the background upkeep
    (expired last attempts, retention). ``/metrics`` reads ``scrape`` (default: the
    store's registry; a worker of ``serve --workers`` passes every worker's files)."""
    logs.protect(settings.secret_values())
    gateway = gateway or Gateway(settings, store)
    app = web.Application(
        middlewares=[
            request_id_middleware,
            problem_middleware(
                auth_check(settings.auth),
                body_deadline_check(settings.gateway),
                not_found=(
                    "Nothing lives at this path on the control listener (the lease, admin "
                    "and health APIs). Fenced writes go to the proxy listener, "
                    f"{settings.proxy_listen}: /<upstream>/<path>."
                ),
            ),
        ],
        client_max_size=CONTROL_MAX_BODY,
    )
    app[SETTINGS] = settings
    app[SCRAPE] = scrape or store.metrics.registry
    app[lease_api.STORE] = store
    app[lease_api.SETTINGS] = settings.lease
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    lease_api.add_routes(app)
    admin.add_routes(app, gateway)
    dashboard.add_routes(app, gateway)
    openapi.add_routes(app)
    _background(app, settings, store, gateway)
    return app


def _background(
    app: web.Application, settings: Settings, store: LeaseStore, gateway: Gateway
) -> None:
    """The loops of the control app's lifetime. Every process runs them: each replica,
    and each worker of ``serve --workers N``, N of them on one machine. That is safe,
    each for its reason:

    - ``upkeep``: each step is one conditional statement (on SQLite, batches of one,
      each under the write lock) that fails jobs whose last lease expired or deletes
      rows past their cutoff; another process running it at once finds those rows
      changed or gone (PostgreSQL re-checks a row it waited for) or skips them
      (``SKIP LOCKED``), so no row is counted twice in ``fencegate_purged_rows_total``.
    - ``schema``: a read; each process must turn itself away.
    - ``vacuum``: ``VACUUM (SKIP_LOCKED)`` skips a table another process vacuums.
    - ``resolve``: each record is claimed by one conditional statement (PostgreSQL
      skips a record another process holds; SQLite holds the write lock): no two
      processes re-send one.
    - ``owed-releases``: this process's own claims, kept in its memory; each release
      is conditional on the claim's attempt.

    Lease sources run no loop: each process asks them itself (a ZooKeeper session, an
    etcd cache per process), and the fence in the database decides."""
    tasks.every(
        app,
        "upkeep",
        settings.gateway.purge_interval_seconds,
        lambda: upkeep(settings, store, gateway),
    )
    tasks.every(app, "schema", SCHEMA_CHECK_INTERVAL_SECONDS, lambda: check_schema(store))
    # writes_in_flight has a row inserted and deleted per write: on PostgreSQL the
    # gateway vacuums it itself, so it stays as small as the writes in flight whether
    # autovacuum runs or not (a no-op on SQLite).
    tasks.every(app, "vacuum", VACUUM_INTERVAL_SECONDS, gateway.store.vacuum_writing)
    # Unknown outcomes the gateway resolves itself (unknown_outcome = "resolve"); a round
    # with no such upstream does nothing.
    tasks.every(
        app, "resolve", settings.gateway.resolve_interval_seconds, gateway.resolver.run_once
    )
    # Claims of writes never sent whose release the database refused, given back once it
    # answers again (a round with none owed does nothing).
    tasks.every(app, "owed-releases", OWED_INTERVAL_SECONDS, gateway.releases.pay)


async def check_schema(store: LeaseStore) -> None:
    """A migration that this code cannot run beside (one that raised the schema's floor
    past it) turns this replica away from the database: every operation is refused
    ``store-unavailable`` and ``/readyz`` says why, until the schema serves this code
    again. A database that cannot be read now changes nothing."""
    try:
        schema = await migrate.schema_state(store.backend.engine)
    except Exception:  # unreachable now: the operations will say so
        return
    below = schema.below_floor()
    if below is not None and store.backend.refused is None:
        log.error("%s Refusing every write until then.", below)
    elif below is None and store.backend.refused is not None:
        log.warning("the database schema serves this code again (%s)", schema.revision)
    store.backend.refuse(below)


async def upkeep(settings: Settings, store: LeaseStore, gateway: Gateway) -> None:
    """Expired last attempts become failed; records and audit past retention go."""
    failed = await store.fail_exhausted()
    records = await gateway.store.purge_records(settings.gateway.idempotency_retention_seconds)
    audit_seconds = settings.gateway.audit_retention_days * 86400
    entries = await gateway.audit.purge(
        audit_seconds, settings.gateway.audit_unauthenticated_retention_days * 86400
    )
    grants = await store.purge_grants(audit_seconds)
    for what, count in (
        ("idempotency_records", records),
        ("audit_log", entries),
        ("leases", grants),
    ):
        store.metrics.purged.labels(what).inc(count)
    if failed or records or entries or grants:
        log.info(
            "upkeep: %d job(s) failed after their last lease expired; purged %d "
            "idempotency record(s), %d audit entr(ies), %d old grant(s)",
            failed,
            records,
            entries,
            grants,
        )


async def prepare_database(settings: Settings, store: LeaseStore) -> None:
    """SQLite migrates itself so the quickstart is one command; PostgreSQL is migrated by
    ``fencegate migrate`` (a deploy step), and a server on an old schema refuses to start.
    Either refuses a schema migrated past its code beyond the schema's floor."""
    try:
        schema = await migrate.schema_state(store.backend.engine)
    except Exception as error:
        message = migrate.database_error(error, settings.database_url)
        raise SystemExit(f"fencegate: {message}") from error
    if settings.sqlite and not schema.ahead:  # one migrated ahead is served as it is
        await asyncio.to_thread(migrate.upgrade, settings.database_url)
        return
    refused = schema.refusal()
    if refused is not None:
        raise SystemExit(f"fencegate: {refused}")


async def check_replication(settings: Settings, store: LeaseStore) -> None:
    """Refuse (SystemExit) a PostgreSQL that a failover could make lose an acknowledged
    commit, unless ``database.allow_async_failover``; say what was found either way.

    A standby that rejoins after a failover streams asynchronously for a moment, until
    the failover manager makes it synchronous: before refusing, the check is made again
    every second for ``replication.SETTLE_SECONDS``."""
    if settings.sqlite:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + replication.SETTLE_SECONDS
    warned = False
    while True:
        try:
            seen = await replication.replication(store.backend.engine)
        except Exception as error:
            message = migrate.database_error(error, settings.database_url)
            raise SystemExit(f"fencegate: {message}") from error
        if seen.in_recovery:
            raise SystemExit(
                f"fencegate: the database server {seen.server} is a standby and takes no "
                "writes: point database_url at the primary, or list every host with "
                "target_session_attrs=read-write"
            )
        refused = seen.refusal(settings.database.allow_async_failover)
        if refused is None or loop.time() >= deadline:
            break
        if not warned:
            warned = True
            log.warning(
                "%s; checking again for up to %g s (a standby rejoining after a failover "
                "is synchronous within seconds)",
                "; ".join(seen.problems()),
                replication.SETTLE_SECONDS,
            )
        await asyncio.sleep(1.0)
    if refused is not None:
        raise SystemExit(f"fencegate: {refused}")
    found = seen.problems()  # accepted: database.allow_async_failover
    if found:
        log.warning(
            "database.allow_async_failover = true: starting although a failover can lose "
            "an acknowledged commit and move a fence back (%s)",
            "; ".join(found),
        )
    log.info("database: %s", seen.summary())


async def serve(
    settings: Settings,
    *,
    clock: Clock | None = None,
    on_ready: Callable[[list[str]], Awaitable[None] | None] | None = None,
    stop: asyncio.Event | None = None,
    announce: bool = True,
    reload_settings: Callable[[], Settings] | None = None,
    freeze_gc: bool = False,
    inherited: Inherited | None = None,
) -> None:
    """Run both listeners until SIGTERM / SIGINT (or ``stop`` is set). SIGTERM stops
    accepting, lets requests in progress finish (``shutdown_timeout_seconds``) and
    records their answers. SIGHUP re-reads the upstreams with ``reload_settings``.
    ``settings`` (and what ``reload_settings`` returns) carry the upstreams' headers
    expanded (``config.for_serving``).

    ``freeze_gc`` (``fencegate serve`` sets it): once listening, move every object that
    exists then (modules, the app, the engine) out of the garbage collector's sight.
    They live as long as the process anyway, and scanning them in every full collection
    stalled the event loop (docs/performance-history.md, "How the hot path got here").

    ``inherited``: a worker of ``serve --workers`` (``Inherited``, ``_ready``)."""
    # The certificates first, then both ports: a bad file or a taken port is named
    # before anything else exists (no database file, no migration, no listener bound).
    contexts = tls_contexts(settings)
    provider = tracing.configure(settings.tracing)
    sockets = bind_listeners(settings) if inherited is None else inherited.sockets
    engine = create_engine(settings.database_url)
    store = LeaseStore(engine, clock=clock)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    runners: list[web.AppRunner] = []
    try:
        await prepare_database(settings, store)
        await check_replication(settings, store)
        gateway = Gateway(settings, store)
        if reload_settings is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(
                    signal.SIGHUP, lambda: _reload(gateway, contexts, reload_settings)
                )
        await _set_up_apps(settings, store, gateway, runners, inherited)
        # Both apps set up before either listens: /healthz and /readyz never answer while
        # the proxy is still starting (its lease sources wait for their stores).
        addresses = await _listen(runners, sockets, contexts)
        _log_what_is_served(settings, contexts)
        if freeze_gc:
            gc.collect()
            gc.freeze()
        await _ready(addresses, on_ready, announce=announce, worker=inherited is not None)
        await stop.wait()
        log.info("fencegate stopping")
    finally:
        await _shut_down(runners, sockets, engine, provider)


async def _ready(
    addresses: list[str],
    on_ready: Callable[[list[str]], Awaitable[None] | None] | None,
    *,
    announce: bool,
    worker: bool,
) -> None:
    """Listening: said (by a single process; a worker's parent says it once every
    worker is ready), then ``on_ready`` (a worker's tells its parent)."""
    if not worker:
        announce_listening(addresses, announce=announce)
    if on_ready is not None:
        result = on_ready(addresses)
        if result is not None:
            await result


def tls_contexts(settings: Settings) -> dict[str, ssl.SSLContext]:
    """The listeners' TLS contexts, their files loaded; ``SystemExit`` for a listener
    exposed without auth tokens or a certificate that does not load."""
    exposed = settings.exposed_without_auth()
    if exposed:  # as for_serving says; here too for whoever calls serve() directly
        raise SystemExit(f"fencegate: {ConfigError(exposed)}")
    try:
        return tls.contexts(settings)
    except ConfigError as error:
        raise SystemExit(f"fencegate: {error}") from error


def bind_listeners(settings: Settings) -> dict[str, list[socket.socket]]:
    """Both listeners' sockets, the control listener's first; none left open when the
    proxy's port cannot be bound."""
    sockets = {"control": bind("control_listen", settings.control_listen)}
    try:
        sockets["proxy"] = bind("proxy_listen", settings.proxy_listen)
    except BaseException:
        for sock in sockets["control"]:
            sock.close()
        raise
    return sockets


async def _set_up_apps(
    settings: Settings,
    store: LeaseStore,
    gateway: Gateway,
    runners: list[web.AppRunner],
    inherited: Inherited | None,
) -> None:
    """The control app's runner, then the proxy's, each set up (the proxy's starts the
    lease sources) and appended to ``runners`` once it is, for ``serve`` to clean up.
    A worker's ``/metrics`` sums every worker's (``scrape_registry``)."""
    metrics_dir = None if inherited is None else inherited.metrics_dir
    scrape = scrape_registry(store.metrics.registry, metrics_dir)
    for name, app in (
        ("control", create_control_app(settings, store, gateway, scrape=scrape)),
        ("proxy", create_proxy_app(gateway)),
    ):
        limits = settings.gateway
        runner: web.AppRunner = ProblemRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=limits.shutdown_timeout_seconds,
            max_line_size=limits.max_request_line_bytes,
            max_field_size=limits.max_header_field_bytes,
            max_headers=limits.max_headers,
            keepalive_timeout=limits.keepalive_timeout_seconds,
            # The proxy forwards bodies verbatim: a gzip body is never inflated.
            auto_decompress=name != "proxy",
        )
        tracing.instrument(app, name)
        try:
            await runner.setup()  # the proxy's: the lease sources start
        except SourceRefused as error:
            raise SystemExit(f"fencegate: {error}") from None
        runners.append(runner)


async def _listen(
    runners: list[web.AppRunner],
    sockets: dict[str, list[socket.socket]],
    contexts: dict[str, ssl.SSLContext],
) -> list[str]:
    """Each runner served on its listener's sockets: ``name=host:port`` of each."""
    addresses: list[str] = []
    for name, runner in zip(("control", "proxy"), runners, strict=True):
        for sock in sockets[name]:
            await web.SockSite(runner, sock, backlog=1024, ssl_context=contexts.get(name)).start()
        addresses.extend(f"{name}={addr}" for addr in address_texts(runner.addresses))
    return addresses


def _log_what_is_served(settings: Settings, contexts: dict[str, ssl.SSLContext]) -> None:
    """The upstreams, the lease sources and the listeners that speak TLS."""
    log_upstreams(settings)
    log_lease_sources(settings)
    if contexts:
        log.info("TLS on the %s listener(s)", " and ".join(sorted(contexts)))


def announce_listening(addresses: list[str], *, announce: bool) -> None:
    """One line, the last of the start, in the log's format; on stdout only when the log
    would not show it (``--log-level warning``), so a script can still wait for it."""
    listening = "fencegate listening: " + " ".join(addresses)
    if log.isEnabledFor(logging.INFO):
        log.info("%s", listening)
    elif announce:
        print(listening, flush=True)


async def _shut_down(
    runners: list[web.AppRunner],
    sockets: dict[str, list[socket.socket]],
    engine: Engine,
    provider: TracerProvider | None,
) -> None:
    """The apps cleaned up in reverse (requests in progress finish), the sockets closed,
    the engine disposed, the spans still queued exported."""
    for runner in reversed(runners):
        await runner.cleanup()
    for bound in sockets.values():
        for sock in bound:
            sock.close()
    await engine.dispose()
    if provider is not None:
        # The spans still queued are exported (bounded by the exporter's timeout).
        await asyncio.to_thread(provider.shutdown)
        tracing.disable()


def log_upstreams(settings: Settings) -> None:
    """Say at start what the proxy listener protects: one line per upstream, or a warning
    that there is none (every proxied request would get ``404 unknown-upstream``) and how
    to add one."""
    for upstream in settings.upstreams:
        log.info(
            "protecting upstream %s -> %s (/%s/... on the proxy listener; fenced: %s)",
            upstream.name,
            upstream.display_url,
            upstream.name,
            ", ".join(upstream.fenced_methods) or "none",
        )
    if not settings.upstreams:
        log.warning(
            "no upstreams configured: every proxied request is answered 404 "
            "unknown-upstream. Add an [[upstreams]] table (name, url) to a config file and "
            "start with `fencegate serve --config FILE`; examples/fencegate.toml is a "
            "commented example"
        )


def log_lease_sources(settings: Settings) -> None:
    """Say at start which lease sources' tokens the gateway accepts: one line per source,
    its kind and where it points (no password, no key)."""
    for source in settings.lease_sources:
        log.info(
            "accepting lease source %s: %s (%s); Fencing-Token %s:...",
            source.name,
            source.kind,
            source_target(source),
            source.name,
        )


def bind(setting: str, listen: str) -> list[socket.socket]:
    """The listening sockets of ``listen`` (every address its host resolves to), or
    ``SystemExit`` naming the setting that moves it."""
    host, port = parse_listen(listen)
    bound: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.setblocking(False)
    except OSError as error:
        for sock in bound:
            sock.close()
        reason = (
            "address already in use"
            if error.errno == errno.EADDRINUSE
            else (error.strerror or str(error)).lower()
        )
        raise SystemExit(
            f"fencegate: cannot listen on {listen} ({reason}): {setting} sets it; move it "
            f"with FENCEGATE_{setting.upper()} or {setting} in the config file"
        ) from error
    return bound


def _reload(
    gateway: Gateway,
    contexts: dict[str, ssl.SSLContext],
    reload_settings: Callable[[], Settings],
) -> None:
    """SIGHUP: new upstreams take effect for the next request, new certificates for the
    next handshake; connections stay open."""
    try:
        new = reload_settings()
    except ConfigError as error:
        log.error("reload refused, keeping the running configuration: %s", error)
        return
    logs.protect(new.secret_values())
    gateway.reload(new)
    tls.reload(contexts, new)


def address_texts(addresses: Iterable[object]) -> list[str]:
    """``host:port`` (``[host]:port`` for IPv6) of each socket address."""
    out = []
    for address in addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            host = address[0]
            out.append(f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}")
    return out
