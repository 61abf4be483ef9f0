"""One worker of ``fencegate serve --workers N``: ``python -m gateway.service.worker``,
started by the parent (``gateway.service.workers``), never by hand.

It runs ``serve`` as a single process does, on the listening sockets it inherited
(``--socket control=FD``, ``--socket proxy=FD``), with its metrics in the parent's
folder (``--metrics-dir``, also its ``PROMETHEUS_MULTIPROC_DIR``, which prometheus_client
read at import). It loads the configuration from the same file and environment as the
parent. Its end of a channel to the parent (``--channel FD``) carries one message,
``ready``, once both listeners serve; when the parent's end closes (the parent is gone,
even killed), the worker stops as on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Sequence

from gateway.config import ConfigError, Settings, for_serving, load_settings
from gateway.observe.logs import configure
from gateway.service.cli_common import EXIT_USAGE, run_loop
from gateway.service.server import Inherited, serve
from gateway.service.workers import READY
from lease_core.metrics import multiprocess

log = logging.getLogger("fencegate.workers")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gateway.service.worker",
        description="A worker of `fencegate serve --workers N` (started by it).",
    )
    p.add_argument("--config")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", default="auto")
    p.add_argument("--access-log", action="store_true")
    p.add_argument("--metrics-dir", required=True)
    p.add_argument("--channel", type=int, required=True)
    p.add_argument("--socket", action="append", default=[], metavar="LISTENER=FD")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    # Until serve's own handlers are set: SIGHUP (forwarded to every worker) must not
    # end one still starting (it reads the file now anyway), and SIGINT (a terminal's
    # Ctrl-C reaches the whole group) is the parent's to turn into SIGTERM.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = parser().parse_args(argv)
    channel = socket.socket(fileno=args.channel)
    inherited = Inherited(_sockets(args.socket), args.metrics_dir)
    try:
        settings = for_serving(load_settings(args.config))
    except ConfigError as error:
        print(f"fencegate: {error}", file=sys.stderr)
        return EXIT_USAGE
    configure(args.log_level, args.log_format, access_log=args.access_log, pid=True)
    if not multiprocess():
        print("fencegate: a worker needs PROMETHEUS_MULTIPROC_DIR set", file=sys.stderr)
        return EXIT_USAGE
    from gateway.service.cli import reported

    return reported(lambda: _run(settings, args.config, inherited, channel), settings)


def _run(
    settings: Settings, config: str | None, inherited: Inherited, channel: socket.socket
) -> int:
    run_loop(_serve(settings, config, inherited, channel))
    return 0


async def _serve(
    settings: Settings, config: str | None, inherited: Inherited, channel: socket.socket
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    channel.setblocking(False)
    loop.add_reader(channel.fileno(), _parent_gone, channel, stop)

    def ready(addresses: list[str]) -> None:
        channel.send(READY)

    try:
        await serve(
            settings,
            on_ready=ready,
            stop=stop,
            reload_settings=lambda: for_serving(load_settings(config)),
            freeze_gc=True,
            inherited=inherited,
        )
    finally:
        loop.remove_reader(channel.fileno())
        channel.close()


def _parent_gone(channel: socket.socket, stop: asyncio.Event) -> None:
    """The channel is readable: the parent's end closed (it sends nothing else)."""
    try:
        said = channel.recv(64)
    except BlockingIOError:
        return
    except OSError:
        said = b""
    if said:
        return
    asyncio.get_running_loop().remove_reader(channel.fileno())
    if not stop.is_set():
        log.warning("the parent process is gone: stopping")
        stop.set()


def _sockets(specs: Sequence[str]) -> dict[str, list[socket.socket]]:
    """``LISTENER=FD`` each: the inherited listening sockets by listener."""
    sockets: dict[str, list[socket.socket]] = {}
    for spec in specs:
        name, _, fd = spec.partition("=")
        sock = socket.socket(fileno=int(fd))
        sock.setblocking(False)
        sockets.setdefault(name, []).append(sock)
    return sockets


if __name__ == "__main__":
    sys.exit(main())
