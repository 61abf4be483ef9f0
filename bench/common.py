"""Small helpers shared by the benchmark's processes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from aiohttp import web

READY_PREFIX = "bench listening:"

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop where it is installed, as ``fencegate serve`` does: the floors and
    the driver get the same event loop as the gateway they are compared with."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of already sorted values (0 when there are none)."""
    if not sorted_values:
        return 0.0
    rank = max(1, min(len(sorted_values), round(fraction * len(sorted_values) + 0.5)))
    return float(sorted_values[rank - 1])


def proc_status_kib(pid: int, field: str) -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` (VmRSS, VmHWM), or None when unreadable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


async def serve_app(app: web.Application, host: str, port: int) -> None:
    """Run ``app`` until SIGTERM / SIGINT; print ``bench listening: host:port`` when ready
    (the orchestrator waits for that line)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=1024)
        await site.start()
        address = runner.addresses[0]
        print(f"{READY_PREFIX} {address[0]}:{address[1]}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def serve_main(
    doc: str | None, create_app: Callable[[], web.Application], argv: Sequence[str] | None
) -> None:
    """The command line of a benchmark server with no options of its own: ``--host``,
    ``--port``, then ``create_app()`` served until stopped."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    run(serve_app(create_app(), args.host, args.port))
