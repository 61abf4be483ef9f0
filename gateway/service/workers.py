"""``fencegate serve --workers N`` (N > 1): N processes serve one proxy port and one
control port.

As gunicorn and uvicorn do it: this process, the parent, binds both listeners' sockets
(so port 0 works, the address it prints is the one served, and a taken port is named
before anything starts), then starts N workers, each a fresh interpreter
(``python -m gateway.service.worker``) that inherits the sockets and serves them with
aiohttp's ``SockSite`` as a single ``fencegate serve`` serves its own: the kernel hands
each new connection to whichever worker accepts it first. Why inherited sockets and not
``SO_REUSEPORT``: docs/operations.md, "Several workers".

The parent serves no request. It
- prepares the database once (SQLite migrates here, not N times at once; a database
  that cannot be used is named once, before any worker starts);
- gives the workers a fresh ``PROMETHEUS_MULTIPROC_DIR``, so that ``/metrics`` on any
  of them sums them all (``gateway.observe.metrics.scrape_registry``), drops a dead
  worker's live gauges (``mark_process_dead``) and removes the folder at the end;
- says "fencegate listening" once every worker is ready;
- forwards SIGTERM and SIGINT (each worker drains as a single process does, then the
  parent exits 0) and SIGHUP (each worker reloads);
- starts a new worker in place of one that dies while serving, with a log line;
- stops every worker and exits 1 when one cannot start (it exits before it is ready),
  whether at the start or as a replacement: what stops one worker's start (the
  configuration, the database, a lease source) stops the next one's too, and restarting
  it in a loop would hide that (gunicorn halts the same way). It is never worse than a
  single process, which that failure would have stopped too.

A worker whose parent dies (even by SIGKILL) sees its end of their channel close and
stops as on SIGTERM (``gateway.service.worker``): no worker outlives its parent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass

from prometheus_client.multiprocess import mark_process_dead

from gateway.config import Settings
from gateway.service.cli_common import open_store, run_loop
from gateway.service.server import (
    address_texts,
    announce_listening,
    bind_listeners,
    tls_contexts,
)
from gateway.service.tasks import STOP_TIMEOUT_SECONDS

log = logging.getLogger("fencegate.workers")

WORKER_MODULE = "gateway.service.worker"
# What a worker sends its parent once both of its listeners serve.
READY = b"ready\n"
# Beyond a worker's own worst-case stop (both listeners' shutdown timeouts and a
# background step's), how long the parent waits before it kills the worker.
STOP_MARGIN_SECONDS = 10.0


def serve_workers(args: argparse.Namespace, settings: Settings, count: int) -> int:
    """Run ``count`` workers until SIGTERM / SIGINT; the exit code. ``settings`` as
    ``serve`` runs them (``for_serving``); the workers load them again from the same
    file and environment, as a single process started now would."""
    tls_contexts(settings)  # a certificate that does not load is named once, first
    sockets = bind_listeners(settings)
    folder = tempfile.mkdtemp(prefix="fencegate-metrics-")
    try:
        run_loop(_prepare(settings))
        supervisor = Supervisor(args, settings, count, sockets, folder)
        return asyncio.run(supervisor.run())
    finally:
        for bound in sockets.values():
            for sock in bound:
                sock.close()
        shutil.rmtree(folder, ignore_errors=True)


async def _prepare(settings: Settings) -> None:
    """The database at this code's schema (SQLite migrates; PostgreSQL must be
    migrated already), or ``SystemExit`` saying why not."""
    async with open_store(settings):
        pass


@dataclass
class Worker:
    """One worker process and the parent's end of their channel."""

    number: int  # 1 to N: the slot a replacement takes over
    process: asyncio.subprocess.Process
    channel: socket.socket

    @property
    def pid(self) -> int:
        return self.process.pid


class Supervisor:
    """Starts the workers, replaces a dead one, stops them all."""

    def __init__(
        self,
        args: argparse.Namespace,
        settings: Settings,
        count: int,
        sockets: dict[str, list[socket.socket]],
        folder: str,
    ) -> None:
        self.count = count
        self.sockets = sockets
        self.folder = folder
        self.argv = worker_argv(args, sockets, folder)
        self.env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=folder)
        limits = settings.gateway
        self.stop_grace_seconds = (
            2 * limits.shutdown_timeout_seconds + STOP_TIMEOUT_SECONDS + STOP_MARGIN_SECONDS
        )
        self.workers: dict[int, Worker] = {}
        # Set by SIGTERM / SIGINT, and by a worker that could not start.
        self.stopping = asyncio.Event()
        self.failed = False  # a worker could not start: the exit code is 1

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
        try:
            if await self._start_all():
                log.info(
                    "%d workers ready (pids %s)",
                    self.count,
                    ", ".join(str(pid) for pid in self._pids()),
                    extra={"fields": {"workers": self.count, "worker_pids": self._pids()}},
                )
                announce_listening(self._addresses(), announce=True)
                await self._supervise()
            return await self._stop_all()
        finally:
            self._kill_all()  # left only by an error of the parent's own: none outlives it

    async def _start_all(self) -> bool:
        """Every worker started at once, until each is ready (True). The first that
        cannot start, or a stop, ends the others' starts (False): each start also waits
        for ``stopping``, which a failed one sets."""
        started = await asyncio.gather(*(self._start(n) for n in range(1, self.count + 1)))
        return all(started) and not self.stopping.is_set()

    async def _supervise(self) -> None:
        """Until a stop: a worker that exits is replaced; one that cannot start ends the
        supervision (``failed``)."""
        while not self.stopping.is_set():
            exited = await self._next_exit()
            if exited is None:
                return
            code = exited.process.returncode
            log.error(
                "worker %d (pid %d) exited unexpectedly (%s); starting another in its place",
                exited.number,
                exited.pid,
                describe_exit(code),
                extra={"fields": {"worker": exited.number, "worker_pid": exited.pid, "exit": code}},
            )
            self._bury(exited)
            if not await self._start(exited.number):
                return

    async def _start(self, number: int) -> bool:
        """Worker ``number`` started, until it says it is ready (True), exits first
        (False: ``failed``, and every other worker is stopped) or a stop comes
        (False)."""
        ours, theirs = socket.socketpair()
        try:
            process = await asyncio.create_subprocess_exec(
                *self.argv,
                "--channel",
                str(theirs.fileno()),
                pass_fds=[*self._fds(), theirs.fileno()],
                env=self.env,
                stdin=asyncio.subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        worker = self.workers[number] = Worker(number, process, ours)
        loop = asyncio.get_running_loop()
        said = asyncio.ensure_future(loop.sock_recv(ours, len(READY)))
        exited = asyncio.ensure_future(process.wait())
        stopped = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait((said, exited, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in (said, exited, stopped):
                waiting.cancel()
        if said.done() and not said.cancelled() and said.exception() is None:
            if said.result() == READY:
                log.info(
                    "worker %d ready (pid %d)",
                    number,
                    worker.pid,
                    extra={"fields": {"worker": number, "worker_pid": worker.pid}},
                )
                return True
        if self.stopping.is_set():
            return False
        code = await process.wait()
        log.error(
            "worker %d (pid %d) exited before it was ready (%s): stopping every worker",
            number,
            worker.pid,
            describe_exit(code),
            extra={"fields": {"worker": number, "worker_pid": worker.pid, "exit": code}},
        )
        self._bury(worker)
        self.failed = True
        self.stopping.set()
        return False

    async def _next_exit(self) -> Worker | None:
        """The first worker to exit, or None once a stop comes."""
        waits = {asyncio.ensure_future(w.process.wait()): w for w in self.workers.values()}
        stopped = asyncio.ensure_future(self.stopping.wait())
        try:
            done, _ = await asyncio.wait((*waits, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in (*waits, stopped):
                waiting.cancel()
        for waited, worker in waits.items():
            if waited in done:
                return worker
        return None

    async def _stop_all(self) -> int:
        """SIGTERM to every worker, each drained as a single process drains; a worker
        still running after ``stop_grace_seconds`` is killed. The exit code: 0 when
        every worker stopped by itself and none failed to start."""
        workers = list(self.workers.values())
        # The parent's copies of the listening sockets go first: once the workers have
        # closed theirs too, a new connection is refused at once, as a single process
        # refuses it while it drains, instead of waiting in the backlog for nobody.
        self._close_sockets()
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*(self._stopped(w) for w in workers))
        for worker in workers:
            self._bury(worker)
        clean = all(results) and not self.failed
        log.info("fencegate stopped")
        return 0 if clean else 1

    async def _stopped(self, worker: Worker) -> bool:
        """Until ``worker`` has exited: whether by itself, with 0 (or by the signal
        that stopped it before it could take it: a worker still starting)."""
        try:
            code = await asyncio.wait_for(worker.process.wait(), self.stop_grace_seconds)
        except TimeoutError:
            log.error(
                "worker %d (pid %d) still running %.0f s after SIGTERM: killed",
                worker.number,
                worker.pid,
                self.stop_grace_seconds,
            )
            with contextlib.suppress(ProcessLookupError):
                worker.process.kill()
            await worker.process.wait()
            return False
        return code in (0, -signal.SIGTERM, -signal.SIGINT)

    def _bury(self, worker: Worker) -> None:
        """A worker that has exited: its live gauges leave the sums, its channel closes.
        Its counters and histograms stay in the folder: totals never go back."""
        if self.workers.get(worker.number) is worker:
            del self.workers[worker.number]
        mark_process_dead(worker.pid, self.folder)  # type: ignore[no-untyped-call]
        worker.channel.close()

    def _kill_all(self) -> None:
        for worker in list(self.workers.values()):
            if worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
            worker.channel.close()

    def _forward(self, sig: signal.Signals) -> None:
        log.info("forwarding %s to %d worker(s)", sig.name, len(self.workers))
        for worker in self.workers.values():
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(sig)

    def _close_sockets(self) -> None:
        for bound in self.sockets.values():
            for sock in bound:
                sock.close()

    def _fds(self) -> list[int]:
        return [sock.fileno() for bound in self.sockets.values() for sock in bound]

    def _pids(self) -> list[int]:
        return [self.workers[n].pid for n in sorted(self.workers)]

    def _addresses(self) -> list[str]:
        """``name=host:port`` of every listening socket, as a single process says them."""
        return [
            f"{name}={text}"
            for name in ("control", "proxy")
            for sock in self.sockets[name]
            for text in address_texts([sock.getsockname()])
        ]


def worker_argv(
    args: argparse.Namespace, sockets: dict[str, list[socket.socket]], folder: str
) -> list[str]:
    """A worker's command line (its channel is added per worker): ``serve``'s own
    options, the inherited sockets by listener, the metrics folder."""
    argv = [sys.executable, "-m", WORKER_MODULE, "--metrics-dir", folder]
    if args.config is not None:
        argv += ["--config", str(args.config)]
    argv += ["--log-level", args.log_level, "--log-format", args.log_format]
    if args.access_log:
        argv.append("--access-log")
    for name, bound in sockets.items():
        for sock in bound:
            argv += ["--socket", f"{name}={sock.fileno()}"]
    return argv


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"
