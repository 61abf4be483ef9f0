"""Child processes of a run: each in a session (process group) of its own, its output in a
log file of the run's folder, ended by its group (``faketime`` and ``ip netns exec`` put a
parent in front of the real process, so killing one pid is not enough).

``Children`` keeps every process a run started; ``kill_all`` (the run's ``finally``) ends
them all, each by its own group id, after a SIGCONT in case one was paused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

FENCEGATE = str(Path(sys.executable).with_name("fencegate"))


class StartError(Exception):
    """A child process did not start; the message has the tail of its log."""


def child_env(**extra: str) -> dict[str, str]:
    """Our environment without FENCEGATE_* settings (the config file decides)."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("FENCEGATE_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class Child:
    """One process (and its group)."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.popen = popen
        self.log = log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        """``sig`` to the whole group (pgid == pid: ``start_new_session``)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def kill(self, timeout: float = 10.0) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def stop(self, timeout: float = 5.0) -> bool:
        """SIGTERM to the group, then SIGKILL after ``timeout``; whether every process of
        the group ended before the SIGKILL. The group, not only the process started: a
        wrapper may die of the SIGTERM at once while the command it forked still shuts
        down (``faketime`` does), and a SIGKILL then would cut that shutdown short."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return False
        while self.group_alive():
            if time.monotonic() > deadline:
                self.kill()
                return False
            time.sleep(0.02)
        return True

    def group_alive(self) -> bool:
        """Whether a process of its group still runs (a zombie does not: nobody may reap
        an orphan's)."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rpartition(")")[2].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[2]) == self.pid and fields[0] != "Z":
                return True
        return False

    def until(self, ready: Callable[[], bool], timeout: float, every: float = 0.05) -> None:
        """Block until ``ready()`` (a service started: it answers); ``StartError`` with
        its output's tail when it exits first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not ready():
            if not self.alive() or time.monotonic() > deadline:
                raise StartError(f"{self.name} did not start:\n{self.tail()}")
            time.sleep(every)

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, chars: int = 3000) -> str:
        return self.output()[-chars:]


class Service:
    """A store of the run's own that the nemesis kills and starts again (the lock stores:
    Redis, etcd, ZooKeeper): its one process, started by ``spawn`` until it answers.
    Blocking methods: the nemesis calls them in a thread. What a kill loses is the
    store's own (said by each subclass)."""

    def __init__(self, children: Children) -> None:
        self.children = children
        self.child: Child | None = None

    def spawn(
        self, name: str, argv: list[str], ready: Callable[[], bool], timeout: float, every: float
    ) -> None:
        self.child = self.children.spawn(name, argv)
        self.child.until(ready, timeout, every=every)

    def kill(self) -> None:
        """kill -9."""
        if self.child is not None:
            self.child.kill()

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 5 s."""
        if self.child is not None:
            self.child.stop(timeout=5.0)


class Children:
    """Every process of a run, by name (a restarted one replaces its predecessor)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.all: list[Child] = []

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        log: str | None = None,
    ) -> Child:
        path = self.folder / f"{log or name}.log"
        with path.open("ab") as out:
            out.write(f"--- {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
            out.flush()
            popen = subprocess.Popen(
                list(argv),
                cwd=self.folder,
                env=env or child_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        child = Child(name, popen, path)
        self.all.append(child)
        return child

    def kill_all(self) -> None:
        for child in self.all:
            child.signal(signal.SIGCONT)
            child.signal(signal.SIGKILL)
        for child in self.all:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(10)


async def wait_for_line(
    child: Child, pattern: re.Pattern[str], timeout: float, since: int = 0
) -> re.Match[str]:
    """The first match of ``pattern`` in the child's log after offset ``since``."""
    deadline = time.monotonic() + timeout
    while True:
        match = pattern.search(child.output(), since)
        if match is not None:
            return match
        if not child.alive():
            raise StartError(
                f"{child.name} exited with {child.popen.returncode}; "
                f"the end of {child.log}:\n{child.tail()}"
            )
        if time.monotonic() > deadline:
            raise StartError(
                f"{child.name} did not start in {timeout:g} s; the end of {child.log}:\n"
                f"{child.tail()}"
            )
        await asyncio.sleep(0.05)


def log_size(child_log: Path) -> int:
    try:
        return len(child_log.read_text(errors="replace"))
    except OSError:
        return 0
