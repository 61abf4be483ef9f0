"""The benchmark's child processes: each started with its output in a log file, waited
for, watched and stopped in ``finally``; a measurement is one driver process
(``run_driver``), with py-spy beside the server under test on request (``--profile``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common import READY_PREFIX
from bench.driver import LEASES_TAKEN
from bench.loops import LOAD_STARTED
from bench.options import Options
from bench.sampling import Watch

ROOT = Path(__file__).resolve().parent.parent


def child_env() -> dict[str, str]:
    """Our environment without FENCEGATE_* (the generated config decides), with the repo
    on the path so ``-m bench.*`` works from any folder."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("FENCEGATE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def fencegate_command() -> list[str]:
    script = Path(sys.executable).with_name("fencegate")
    if script.is_file():
        return [str(script)]
    return [
        sys.executable,
        "-c",
        "import sys; from gateway.service.cli import main; sys.exit(main())",
    ]


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM when this process dies, even by SIGKILL, so no
    server outlives a killed benchmark."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Child:
    """A child process whose output goes to a log file; stopped in ``finally``."""

    def __init__(self, name: str, argv: Sequence[str], workdir: Path) -> None:
        self.name = name
        self.log = workdir / f"{name}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=child_env(),
                cwd=workdir,
                start_new_session=True,  # Ctrl-C reaches us; we stop the children
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self, tail: int = 3000) -> str:
        try:
            with self.log.open("rb") as log:
                log.seek(0, os.SEEK_END)
                size = log.tell()
                log.seek(max(0, size - tail))
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def wait_for(self, pattern: re.Pattern[str], timeout: float = 60.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.log.open("rb") as log:
                    head = log.read(256 * 1024).decode(errors="replace")
            except OSError:
                head = ""
            match = pattern.search(head)
            if match:
                return match
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.output()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} never got ready:\n{self.output()}")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                self.process.wait(timeout=10)


class Children:
    """Every child started, stopped in reverse order."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[Child] = []

    def start(self, name: str, argv: Sequence[str]) -> Child:
        child = Child(name, argv, self.workdir)
        self.started.append(child)
        return child

    def stop(self, child: Child) -> None:
        child.stop()
        if child in self.started:
            self.started.remove(child)

    def stop_all(self) -> None:
        for child in reversed(self.started):
            try:
                child.stop()
            except Exception as error:  # keep stopping the others
                print(f"bench: stopping {child.name}: {error}", file=sys.stderr)
        self.started.clear()


READY = re.compile(re.escape(READY_PREFIX) + r" (\S+)")


def start_server(children: Children, name: str, argv: Sequence[str]) -> tuple[Child, str]:
    child = children.start(name, argv)
    address = child.wait_for(READY).group(1)
    return child, f"http://{address}"


# -- the driver --------------------------------------------------------------------------


class BenchError(Exception):
    pass


def run_driver(
    children: Children,
    opts: Options,
    name: str,
    mode: str,
    extra: Sequence[str],
    watch: Watch,
    *,
    profile_pid: int | None = None,
    leases_taken: Callable[[], dict[str, Any]] | None = None,
    check_url: str | None = None,
) -> dict[str, Any]:
    """Run one measurement in a driver process; sample the servers meanwhile.
    ``leases_taken``: run once the writes' leases are taken, before the load starts
    (statistics of a database that holds them). ``check_url``: in a soak with
    ``--soak-check``, the bare proxy's URL the driver writes to at the end of each
    interval."""
    out = children.workdir / f"{name}.json"
    soak_args: list[str] = []
    if opts.soak_interval and mode == "writes":
        soak_args = ["--interval", str(opts.soak_interval)]
        if opts.soak_check and check_url:
            soak_args += ["--check-target", check_url, "--check-seconds", str(opts.soak_check)]
    go_file = children.workdir / f"{name}.go"
    if leases_taken is not None:
        soak_args += ["--go-file", str(go_file)]
    argv = [
        sys.executable,
        "-m",
        "bench.driver",
        mode,
        "--concurrency",
        str(opts.concurrency),
        "--client",
        opts.client,
        "--jobs",
        str(opts.jobs),
        "--duration",
        str(opts.duration),
        "--warmup",
        str(opts.warmup),
        "--out",
        str(out),
        *soak_args,
        *extra,
    ]
    print(f"  running {name} ...", flush=True)
    driver = children.start(f"driver-{name}", argv)
    watch.pids["driver"] = driver.pid
    if leases_taken is not None:
        driver.wait_for(LEASES_TAKEN_RE, timeout=300)
        when_taken = leases_taken()
        go_file.touch()
    else:
        when_taken = {}
    deadline = time.monotonic() + opts.duration + opts.warmup + 300
    profiler: Child | None = None
    try:
        while driver.process.poll() is None:
            watch.sample()
            for child in children.started:
                if child is not driver and child is not profiler and not child.alive():
                    raise BenchError(f"{child.name} died during {name}:\n{child.output()}")
            if time.monotonic() > deadline:
                raise BenchError(f"{name}: the driver did not finish in time")
            if opts.profile and profile_pid and profiler is None:
                profiler = start_profiler(children, opts, driver, name, profile_pid)
            time.sleep(0.25)
        watch.sample()
    finally:
        children.stop(driver)
        watch.pids.pop("driver", None)
        if profiler is not None:
            finish_profiler(children, profiler, opts, name)
    if driver.process.returncode != 0 or not out.exists():
        raise BenchError(f"{name}: driver failed:\n{driver.output()}")
    result: dict[str, Any] = json.loads(out.read_text())
    result.update(when_taken)
    result.update(watch.summary(result["window_start_epoch"], result["window_end_epoch"]))
    server_cpu = (result.get("cpu_percent") or {}).get("server")
    # In a soak with checks the server is idle for their share of the window.
    share = 1 - result.get("check_seconds", 0.0) / opts.soak_interval if opts.soak_interval else 1
    result["server_cpu_ms_per_request"] = (
        10 * server_cpu / (result["rps"] * share) if server_cpu and result["rps"] else None
    )
    watch.samples.clear()
    if result["errors"]:
        print(f"    {result['errors']} error(s), e.g. {result['error_samples'][:2]}", flush=True)
    return result


# -- profiles ----------------------------------------------------------------------------

LOAD_STARTED_RE = re.compile(re.escape(LOAD_STARTED) + r" ([0-9.]+)")
LEASES_TAKEN_RE = re.compile(re.escape(LEASES_TAKEN))


def py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def start_profiler(
    children: Children, opts: Options, driver: Child, name: str, pid: int
) -> Child | None:
    """Once the driver's warm-up is over: py-spy on the server for the timed phase."""
    match = LOAD_STARTED_RE.search(driver.output(tail=4096))
    if match is None or time.time() < float(match.group(1)) + opts.warmup:
        return None
    executable = py_spy()
    if executable is None:
        raise BenchError("--profile needs py-spy (pip install py-spy)")
    assert opts.profile is not None
    folder = Path(opts.profile)
    folder.mkdir(parents=True, exist_ok=True)
    return children.start(
        f"py-spy-{name}",
        [
            executable,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(max(1, int(opts.duration) - 1)),
            "--rate",
            "100",
            "--format",
            "raw",
            "--output",
            str(folder.resolve() / f"{name}.folded"),
        ],
    )


def finish_profiler(children: Children, profiler: Child, opts: Options, name: str) -> None:
    try:
        profiler.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    children.stop(profiler)
    assert opts.profile is not None
    folded = Path(opts.profile) / f"{name}.folded"
    if folded.exists():
        (Path(opts.profile) / f"{name}.top.txt").write_text(
            summarize_folded(folded.read_text()), encoding="utf-8"
        )


def summarize_folded(text: str, top: int = 40) -> str:
    """Self and inclusive share of the busiest functions in py-spy's folded stacks."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    if not total:
        return "no samples\n"
    lines = [f"{total} samples", "", "self:"]
    lines += [f"{100 * n / total:6.1f}%  {f}" for f, n in own.most_common(top)]
    lines += ["", "inclusive:"]
    lines += [f"{100 * n / total:6.1f}%  {f}" for f, n in inclusive.most_common(top * 2)]
    return "\n".join(lines) + "\n"
