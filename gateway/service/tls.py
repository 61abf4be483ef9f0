"""TLS of the listeners: one ``ssl.SSLContext`` per listener, built at start and
reloaded in place on SIGHUP.

A reload loads the certificate chain (and the client CA) into the *same* context the
listening socket was started with, so the socket stays open and every handshake after
the reload presents the new certificate; connections already open keep the one they
negotiated. The files are first loaded into a scratch context, so a bad or half-written
file (a key that does not match its certificate, a rotation caught mid-copy) is refused
with the running certificate kept, instead of leaving the live context half changed.
"""

from __future__ import annotations

import logging
import ssl

from gateway.config import LISTENERS, ConfigError, ListenerTls, Settings

log = logging.getLogger("fencegate.tls")

VERIFY_MODES = {
    "none": ssl.CERT_NONE,
    "optional": ssl.CERT_OPTIONAL,
    "required": ssl.CERT_REQUIRED,
}


def _fresh() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # HTTP/1.1 only (docs/limits.md): no h2 is offered.
    context.set_alpn_protocols(["http/1.1"])
    return context


def _load(context: ssl.SSLContext, settings: ListenerTls) -> None:
    key = f"tls.{settings.listener}"
    try:
        context.load_cert_chain(settings.cert_file, settings.key_file)
    except FileNotFoundError as error:
        raise ConfigError(
            [f"{key}: {error.filename or settings.cert_file}: no such file"]
        ) from error
    except (ssl.SSLError, OSError) as error:
        raise ConfigError(
            [
                f"{key}: cannot load cert_file {settings.cert_file} with key_file "
                f"{settings.key_file} ({error})"
            ]
        ) from error
    if settings.client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=settings.client_ca_file)
        except FileNotFoundError as error:
            raise ConfigError([f"{key}: {settings.client_ca_file}: no such file"]) from error
        except (ssl.SSLError, OSError) as error:
            raise ConfigError(
                [f"{key}: cannot load client_ca_file {settings.client_ca_file} ({error})"]
            ) from error
    context.verify_mode = VERIFY_MODES[settings.client_certs]


def server_context(settings: ListenerTls) -> ssl.SSLContext:
    """A server context for one listener, or ``ConfigError`` naming the key."""
    context = _fresh()
    _load(context, settings)
    return context


def contexts(settings: Settings) -> dict[str, ssl.SSLContext]:
    """The contexts of the listeners that speak TLS, by listener name."""
    return {name: server_context(listener) for name, listener in settings.tls.listeners.items()}


def reload(live: dict[str, ssl.SSLContext], settings: Settings) -> list[str]:
    """Load the certificates of ``settings`` into the running contexts; the listeners
    that were reloaded. A listener whose TLS was switched on or off needs a restart (its
    socket was started with or without TLS): logged, and left as it is. A file that does
    not load is logged and the listener keeps its certificate."""
    reloaded: list[str] = []
    for name in LISTENERS:
        listener = settings.tls.listener(name)
        context = live.get(name)
        if (listener is None) != (context is None):
            log.warning(
                "tls.%s: TLS switched %s in the configuration; it takes effect after a restart",
                name,
                "off" if listener is None else "on",
            )
            continue
        if listener is None or context is None:
            continue
        try:
            server_context(listener)  # every file loads, and the key fits the certificate
            _load(context, listener)
        except ConfigError as error:
            log.error("TLS reload refused, keeping the running certificate: %s", error)
            continue
        reloaded.append(name)
    if reloaded:
        log.info("TLS certificates reloaded: %s", ", ".join(reloaded))
    return reloaded
