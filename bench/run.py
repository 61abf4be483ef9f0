"""Fencegate's benchmark, one command: ``python -m bench.run`` (``--quick`` for a smoke run).

Every target is its own process, started here and killed in ``finally``:

- the upstream (``bench.upstream``): answers 201 with a small JSON body;
- the bare pass-through proxy (``bench.bare_proxy``): the floor for any aiohttp gateway;
- ``fencegate serve`` on SQLite (a file in a temp folder) and on PostgreSQL (a fresh
  database, ``fencegate migrate``, dropped at the end), from generated TOML configs;
- the load driver (``bench.driver``), one process per measurement.

Measured in the same run with the same driver: fenced writes through the gateway against
the bare proxy (requests/s, p50 / p99, ratios), and the lease core: claims/s and
renewals/s through the HTTP API against the raw SQL statement sent straight to the
database. See docs/performance.md for the results and how to read them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import re
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: python bench/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import READY_PREFIX, proc_status_kib
from bench.driver import CLIENTS, LEASES_TAKEN, LOAD_STARTED, load_generator

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PG_URL = os.environ.get(
    "FENCEGATE_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
GATEWAY_READY = re.compile(r"fencegate listening: .*?control=([^\s\",]+).*?proxy=([^\s\",]+)")
CLAIM_QUEUE = "bench"
UPSTREAM_NAME = "bench"
WRITE_PATH = "/bench/charge"

# Targets, as ratios measured in the same run (issue 15's numbers): fenced writes at
# least 0.6 of the bare proxy with a p99 at most 1.5 times its p99, on both databases;
# claims and renewals through the API at least 0.8 of their raw SQL floors.
WRITE_RPS_TARGET = {"sqlite": 0.6, "postgres": 0.6}
P99_TARGET = 1.5
LEASE_TARGET = 0.8
# The renewals' third comparison on PostgreSQL: HTTP and the store's batched statement
# with nothing else (bench.lean_lease).
LEAN_PATH = "HTTP + batched SQL"

ALL_TARGETS = ("direct", "bare", "writes", "lease")


# -- options ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="Benchmark fenced writes and the lease core against their floors "
        "(bare aiohttp proxy, raw SQL), every target in its own process.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (CI): a few seconds per target, small tables; checks that it "
        "works, not its speed",
    )
    parser.add_argument("--duration", type=float, help="timed seconds per target (20; quick 1)")
    parser.add_argument("--warmup", type=float, help="warm-up seconds, not counted (3; quick 0.3)")
    parser.add_argument("--concurrency", type=int, help="concurrent loops (32; quick 8)")
    parser.add_argument("--jobs", type=int, help="jobs holding a live lease (256; quick 16)")
    parser.add_argument(
        "--backends", default="sqlite,postgres", help="comma list of sqlite, postgres"
    )
    parser.add_argument(
        "--targets",
        default=",".join(ALL_TARGETS),
        help="comma list of direct (driver to upstream, for reference), bare (the bare "
        "proxy), writes (fenced writes through fencegate), lease (claims and renewals)",
    )
    parser.add_argument(
        "--postgres-url",
        default=DEFAULT_PG_URL,
        help="a PostgreSQL server to create the benchmark's own database on (dropped at "
        "the end); default $FENCEGATE_TEST_POSTGRES_URL or the local server",
    )
    parser.add_argument(
        "--seed-records",
        help="idempotency records and audit rows present before the fenced-write runs; a "
        "comma list runs the writes once per level on the same database, topping up "
        "between levels, e.g. 1000,1000000 (default 1000; quick 100)",
    )
    parser.add_argument(
        "--seed-jobs",
        type=int,
        help="finished and leased jobs in the claim queue (100000; quick 2000)",
    )
    parser.add_argument(
        "--claim-jobs",
        type=int,
        help="pending jobs added to the claim queue before each claim run (200000; quick "
        "20000); a run that empties the queue is measured up to that point",
    )
    parser.add_argument(
        "--gateway-log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="fencegate serve --log-level (default INFO, as shipped: one JSON access line "
        "per request, written to a file)",
    )
    parser.add_argument(
        "--records-per-job",
        type=int,
        default=0,
        help="settled idempotency records of each job the writes will lease, added before "
        "each writes run (what an admission's cost can depend on; default 0)",
    )
    parser.add_argument(
        "--stats",
        choices=["fresh", "stale", "none"],
        default="fresh",
        help="PostgreSQL statistics: fresh (VACUUM ANALYZE after seeding, the default), "
        "stale (ANALYZE of the empty tables only, then VACUUM without it) or none (never "
        "ANALYZE); the hot statements' plans must not depend on them",
    )
    parser.add_argument(
        "--autovacuum",
        choices=["server", "on", "off"],
        default="server",
        help="PostgreSQL's autovacuum during the run: as the server has it (the default), "
        "or on / off (ALTER SYSTEM and a reload, restored at the end; needs a superuser)",
    )
    parser.add_argument(
        "--soak",
        type=float,
        metavar="SECONDS",
        help="soak mode: fenced writes only, for SECONDS on each database (600 or more for "
        "the real check), throughput and p99 per --soak-interval; the last interval must "
        "be within 10%% of the first",
    )
    parser.add_argument(
        "--soak-interval",
        type=float,
        metavar="SECONDS",
        help="the soak's interval (60; quick 1)",
    )
    parser.add_argument(
        "--soak-bare",
        action="store_true",
        help="soak the bare proxy too, for the same length, before the databases: the "
        "machine's own drift over a soak, beside which the gateway's is read (not judged)",
    )
    parser.add_argument(
        "--client",
        choices=CLIENTS,
        default="lean",
        help="the load driver's HTTP client: lean (the default: the gateway's own httptools "
        "client, about half aiohttp's CPU per request, so more of the two cores is left to "
        "what is measured, as wrk would) or aiohttp (its ClientSession, as runs before "
        "2026-12-04 were driven)",
    )
    parser.add_argument(
        "--soak-check",
        type=float,
        metavar="SECONDS",
        help="soak mode: the driver writes to the bare proxy instead during the last SECONDS "
        "of each interval (5 is plenty), so each interval has the machine's speed beside "
        "the gateway's, and their ratio per interval (shown, not judged: the verdict stays "
        "on the gateway's own numbers)",
    )
    parser.add_argument(
        "--soak-png",
        metavar="FILE",
        help="also draw the soak's curve (throughput and p99 per interval, per database) "
        "as a PNG; needs matplotlib (pip install matplotlib)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument(
        "--check-targets",
        action="store_true",
        help="exit 1 when a target is missed (never in --quick mode)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (logs)")
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="record each server (bare proxy, fencegate) with py-spy during its timed "
        "phase: folded stacks and a top-functions summary in DIR (py-spy must be "
        "installed; profiled runs are slower, do not compare their numbers)",
    )
    return parser


@dataclass(frozen=True)
class Options:
    quick: bool
    duration: float
    warmup: float
    concurrency: int
    jobs: int
    backends: list[str]
    targets: list[str]
    postgres_url: str
    seed_records: list[int]
    seed_jobs: int
    claim_jobs: int
    gateway_log_level: str
    json: str | None
    check_targets: bool
    keep: bool
    profile: str | None
    soak_interval: float = 0.0  # > 0: the soak mode's interval
    soak_bare: bool = False  # the soak also soaks the bare proxy (the machine's drift)
    records_per_job: int = 0
    stats: str = "fresh"
    autovacuum: str = "server"
    soak_png: str | None = None
    soak_check: float = 0.0  # > 0: seconds of each soak interval spent on the bare proxy
    client: str = "lean"  # the driver's HTTP client (bench.driver.CLIENTS)


def _int_list(text: str) -> list[int]:
    return [int(part.replace("_", "")) for part in text.split(",") if part.strip()]


def options_from(args: argparse.Namespace) -> Options:
    quick = bool(args.quick)

    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else (small if quick else full)

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for backend in backends:
        if backend not in ("sqlite", "postgres"):
            raise SystemExit(f"--backends: unknown backend {backend!r}")
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for target in targets:
        if target not in ALL_TARGETS:
            raise SystemExit(f"--targets: unknown target {target!r}")
    seed_records = sorted(_int_list(pick(args.seed_records, "1000", "100")))
    soak_interval = 0.0
    if args.soak is not None:
        if args.soak <= 0:
            raise SystemExit("--soak: must be above zero (seconds)")
        soak_interval = pick(args.soak_interval, 60.0, 1.0)
        if not 0 < soak_interval <= args.soak:
            raise SystemExit("--soak-interval: must be above zero and at most --soak")
        if args.duration is not None:
            raise SystemExit("--soak and --duration: the soak's length is --soak")
        targets = ["bare", "writes"] if args.soak_bare else ["writes"]
    if args.soak_bare and args.soak is None:
        raise SystemExit("--soak-bare: only with --soak")
    if args.records_per_job < 0:
        raise SystemExit("--records-per-job: must be 0 or more")
    if args.soak_png and args.soak is None:
        raise SystemExit("--soak-png: only with --soak")
    soak_check = 0.0
    if args.soak_check is not None:
        if args.soak is None:
            raise SystemExit("--soak-check: only with --soak")
        soak_check = args.soak_check
        if not 0 < soak_check <= soak_interval / 2:
            raise SystemExit("--soak-check: above zero and at most half of --soak-interval")
    return Options(
        quick=quick,
        duration=args.soak if args.soak is not None else pick(args.duration, 20.0, 1.0),
        warmup=pick(args.warmup, 3.0, 0.3),
        concurrency=pick(args.concurrency, 32, 8),
        jobs=pick(args.jobs, 256, 16),
        backends=backends,
        targets=targets,
        postgres_url=args.postgres_url,
        seed_records=seed_records or [0],
        seed_jobs=pick(args.seed_jobs, 100_000, 2_000),
        claim_jobs=pick(args.claim_jobs, 200_000, 20_000),
        gateway_log_level=args.gateway_log_level,
        json=args.json,
        check_targets=args.check_targets and not quick,
        keep=args.keep,
        profile=args.profile,
        soak_interval=soak_interval,
        soak_png=args.soak_png,
        soak_bare=args.soak_bare,
        soak_check=soak_check,
        client=args.client,
        records_per_job=args.records_per_job,
        stats=args.stats,
        autovacuum=args.autovacuum,
    )


# -- processes -------------------------------------------------------------------------


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
    return [sys.executable, "-c", "import sys; from gateway.cli import main; sys.exit(main())"]


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


# -- CPU and memory sampling --------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, ValueError, IndexError):
        return None


POSTGRES_SHARED = ("walwriter", "background writer", "checkpointer", "autovacuum")


def postgres_cpu_seconds(database: str) -> dict[int, float]:
    """CPU time, by pid, of PostgreSQL's backends serving ``database`` and of the server's
    shared helpers (WAL writer, background writer, checkpointer, autovacuum); backends
    of other databases (someone else's workload on the same server) are left out."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/comm", encoding="ascii") as comm:
                if comm.read().strip() != "postgres":
                    continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                title = cmdline.read().decode(errors="replace")
        except OSError:
            continue
        if f" {database} " not in title and not any(name in title for name in POSTGRES_SHARED):
            continue
        seconds = cpu_seconds(int(entry.name))
        if seconds is not None:
            out[int(entry.name)] = seconds
    return out


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine (iowait counts as idle)."""
    with open("/proc/stat", encoding="ascii") as stat:
        parts = [int(x) for x in stat.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])
    return total - idle, total


def background_busy(seconds: float = 2.0) -> float:
    """How busy the machine is before we start (another workload skews every number)."""
    a = machine_busy()
    time.sleep(seconds)
    b = machine_busy()
    return round(100 * (b[0] - a[0]) / max(b[1] - a[1], 1), 1)


@dataclass
class Sample:
    at: float
    rss_kib: int | None
    cpu: dict[str, float | None]
    postgres: dict[int, float]
    busy: tuple[int, int]


@dataclass
class Watch:
    """Samples of the processes under test while a driver runs: CPU time of each (and of
    PostgreSQL's backends), the machine's busy time, the server's RSS."""

    pids: dict[str, int]
    postgres_db: str | None
    samples: list[Sample] = field(default_factory=list)
    rss_pid: int | None = None

    def sample(self) -> None:
        cpu: dict[str, float | None] = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        postgres = postgres_cpu_seconds(self.postgres_db) if self.postgres_db else {}
        rss = proc_status_kib(self.rss_pid, "VmRSS") if self.rss_pid else None
        self.samples.append(Sample(time.time(), rss, cpu, postgres, machine_busy()))

    def _nearest(self, at: float) -> int:
        return min(range(len(self.samples)), key=lambda i: abs(self.samples[i].at - at))

    def summary(self, start: float, end: float) -> dict[str, Any]:
        if not self.samples:
            return {}
        i0, i1 = self._nearest(start), self._nearest(end)
        window = self.samples[i0 : i1 + 1]
        first, last = window[0], window[-1]
        span = max(last.at - first.at, 1e-9)
        names = set().union(*(s.cpu for s in window))
        used = dict.fromkeys(names, 0.0)
        postgres = 0.0
        for a, b in itertools.pairwise(window):
            for name in names:
                before, after = a.cpu.get(name), b.cpu.get(name)
                if before is not None and after is not None:
                    used[name] += after - before
            postgres += sum(
                max(0.0, after - a.postgres[pid])
                for pid, after in b.postgres.items()
                if pid in a.postgres
            )
        cpu: dict[str, float | None] = {n: round(100 * v / span, 1) for n, v in used.items()}
        if self.postgres_db:
            cpu["postgres"] = round(100 * postgres / span, 1)
        busy = last.busy[0] - first.busy[0]
        total = max(last.busy[1] - first.busy[1], 1)
        cores = os.cpu_count() or 1
        ours = sum(v for v in cpu.values() if v is not None)
        cpu["other"] = round(max(0.0, 100 * cores * busy / total - ours), 1)
        cpu.pop("orchestrator", None)
        out: dict[str, Any] = {
            "cpu_percent": cpu,
            "machine_busy_percent": round(100 * busy / total, 1),
        }
        if self.rss_pid is not None:
            inside = [s.rss_kib for s in window if s.rss_kib]
            out["rss_start_mib"] = _mib(first.rss_kib)
            out["rss_end_mib"] = _mib(last.rss_kib)
            out["rss_max_in_window_mib"] = _mib(max(inside)) if inside else None
            out["rss_peak_mib"] = _mib(proc_status_kib(self.rss_pid, "VmHWM"))
            timeline, last_at = [], -1e9
            for sample in window:  # one reading per 10 s, for the memory-flat check
                if sample.rss_kib and sample.at - last_at >= 10:
                    timeline.append([round(sample.at - first.at), _mib(sample.rss_kib)])
                    last_at = sample.at
            out["rss_timeline_mib"] = timeline
        return out


def _mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


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


# -- databases ---------------------------------------------------------------------------


def _sa_url(url: str) -> Any:
    import sqlalchemy as sa

    parsed = sa.make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+asyncpg")
    return parsed


def pg_dsn(url: str) -> str:
    return str(_sa_url(url).set(drivername="postgresql").render_as_string(hide_password=False))


async def pg_execute(dsn: str, *statements: str) -> None:
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncio.wait_for(asyncpg.connect(dsn), 10)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


# What a long run may change under the hot statements, read from PostgreSQL's own
# statistics: the records table's live and dead rows, autovacuum passes over it, its size
# (indexes included), whether a vacuum of it is running now; buffers the checkpointer and
# the backends wrote (the latter when the background writer fell behind), checkpoints
# and WAL. ``Database.server_state`` reads it before and after a run, ``Maintenance``
# once a second during a soak.
PG_STATE = """
    SELECT extract(epoch FROM clock_timestamp())::float8 AS at,
           t.n_live_tup AS live_rows, t.n_dead_tup AS dead_rows,
           t.autovacuum_count AS autovacuums,
           pg_total_relation_size('idempotency_records')::float8 AS records_bytes,
           EXISTS (SELECT 1 FROM pg_stat_progress_vacuum AS p
                   WHERE p.relid = 'idempotency_records'::regclass) AS vacuuming,
           b.buffers_checkpoint, b.buffers_backend,
           b.checkpoints_timed + b.checkpoints_req AS checkpoints,
           pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8 AS wal_bytes
    FROM pg_stat_user_tables AS t, pg_stat_bgwriter AS b
    WHERE t.relname = 'idempotency_records'
"""
# The readings that are counters or levels (what ``server_state`` compares).
PG_STATE_COUNTS = (
    "live_rows",
    "dead_rows",
    "autovacuums",
    "records_bytes",
    "buffers_checkpoint",
    "buffers_backend",
    "checkpoints",
    "wal_bytes",
)


class Readings:
    """What a soak reads once a second beside the load, on a thread of its own; per
    interval of the soak, what moved in it (the soak's last minute can then be told
    apart from a vacuum pass, a checkpoint or a log grown large)."""

    EVERY = 1.0

    def __init__(self) -> None:
        self.readings: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="readings", daemon=True)

    def __enter__(self) -> Readings:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            self.poll()
        except BaseException as error:  # reported with the intervals, never fatal
            self.error = error

    def poll(self) -> None:
        """Append a reading (with its epoch ``at``) every ``EVERY`` seconds until told
        to stop."""
        raise NotImplementedError

    def seen(self, around: list[dict[str, Any]]) -> dict[str, float]:
        """One interval's readings, from the last one at or before its start."""
        raise NotImplementedError

    def per_interval(
        self, start_epoch: float, interval: float, count: int
    ) -> list[dict[str, float]]:
        out = []
        for slot in range(count):
            begin, end = start_epoch + slot * interval, start_epoch + (slot + 1) * interval
            # From the last reading at or before the interval's start to the last one
            # inside it (none inside: nothing moved that could be seen).
            inside = [r for r in self.readings if begin < r["at"] <= end]
            around = [r for r in self.readings if r["at"] <= begin][-1:] + inside
            out.append(self.seen(around) if around else {})
        return out


class Maintenance(Readings):
    """PostgreSQL's own background work, read on one connection of its own: whether a
    vacuum of the records table is running, the buffers the checkpointer and the
    backends wrote, WAL, checkpoints and autovacuum passes."""

    def __init__(self, dsn: str) -> None:
        super().__init__()
        self.dsn = dsn

    def poll(self) -> None:
        asyncio.run(self._poll())

    async def _poll(self) -> None:
        import asyncpg

        conn = await asyncpg.connect(self.dsn)
        try:
            while not self._stop.is_set():
                self.readings.append(dict(await conn.fetchrow(PG_STATE)))
                await asyncio.to_thread(self._stop.wait, self.EVERY)
        finally:
            await conn.close()

    def seen(self, around: list[dict[str, Any]]) -> dict[str, float]:
        first, last = around[0], around[-1]
        return {
            "vacuum_seconds": sum(
                b["at"] - a["at"] for a, b in itertools.pairwise(around) if b["vacuuming"]
            ),
            "autovacuums": last["autovacuums"] - first["autovacuums"],
            "checkpoints": last["checkpoints"] - first["checkpoints"],
            "buffers_checkpoint": last["buffers_checkpoint"] - first["buffers_checkpoint"],
            "buffers_backend": last["buffers_backend"] - first["buffers_backend"],
            "wal_bytes": last["wal_bytes"] - first["wal_bytes"],
            "dead_rows": last["dead_rows"],
        }


class SqliteFiles(Readings):
    """SQLite's files: the write-ahead log (its largest size in the interval: bounded,
    or a log that never restarts) and the database file."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def poll(self) -> None:
        while not self._stop.is_set():
            self.readings.append(
                {
                    "at": time.time(),
                    "log_bytes": file_size(f"{self.path}-wal"),
                    "file_bytes": file_size(self.path),
                }
            )
            self._stop.wait(self.EVERY)

    def seen(self, around: list[dict[str, Any]]) -> dict[str, float]:
        return {
            "log_bytes_max": max(r["log_bytes"] for r in around),
            "file_bytes": around[-1]["file_bytes"],
        }


def file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


async def pg_fetchval(dsn: str, query: str) -> Any:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


async def pg_fetchrow(dsn: str, query: str) -> dict[str, Any]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return dict(await conn.fetchrow(query))
    finally:
        await conn.close()


@dataclass
class Database:
    backend: str
    url: str  # the gateway's database_url
    admin_dsn: str | None = None  # PostgreSQL: where CREATE / DROP DATABASE run
    name: str | None = None

    @property
    def dsn(self) -> str:
        return pg_dsn(self.url)

    @property
    def sqlite_path(self) -> str:
        return self.url.split(":///", 1)[1]

    def create(self) -> None:
        if self.backend == "postgres":
            assert self.admin_dsn and self.name
            asyncio.run(pg_execute(self.admin_dsn, f'CREATE DATABASE "{self.name}"'))

    def drop(self) -> None:
        if self.backend == "postgres":
            assert self.admin_dsn and self.name
            asyncio.run(
                pg_execute(self.admin_dsn, f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
            )

    stats = "fresh"  # see --stats

    def vacuum(self, *tables: str) -> None:
        """PostgreSQL: VACUUM, so runs start from the same state (autovacuum would get
        there too, at a time of its choosing), with ANALYZE when statistics are fresh."""
        if self.backend == "postgres":
            verb = "VACUUM ANALYZE" if self.stats == "fresh" else "VACUUM"
            asyncio.run(pg_execute(self.dsn, *(f"{verb} {t}" for t in tables)))

    def gather_stats(self, *tables: str) -> dict[str, Any]:
        """``vacuum`` of ``tables`` (with ANALYZE when statistics are fresh); what the
        planner then believes of each: its row estimate (``pg_class.reltuples``, -1:
        never analyzed)."""
        if self.backend != "postgres":
            return {}
        self.vacuum(*tables)
        query = "SELECT reltuples FROM pg_class WHERE relname = '{}'"
        believed = {
            table: float(asyncio.run(pg_fetchval(self.dsn, query.format(table))))
            for table in tables
        }
        return {"planner_rows": believed}

    def server_state(self) -> dict[str, float]:
        """PostgreSQL: what a long run may change under the hot statements (``PG_STATE``)."""
        if self.backend != "postgres":
            return {}
        row = asyncio.run(pg_fetchrow(self.dsn, PG_STATE))
        return {k: float(row[k]) for k in PG_STATE_COUNTS}

    def analyze(self) -> None:
        if self.backend == "postgres":
            asyncio.run(pg_execute(self.dsn, "ANALYZE"))

    def setting(self, name: str) -> str | None:
        if self.backend != "postgres":
            return None
        return str(asyncio.run(pg_fetchval(self.dsn, f"SHOW {name}")))

    def count(self, table: str) -> int:
        if self.backend == "postgres":
            return int(asyncio.run(pg_fetchval(self.dsn, f"SELECT count(*) FROM {table}")))
        with contextlib.closing(sqlite3.connect(self.sqlite_path, timeout=30)) as conn:
            return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])

    def insert(self, table: str, columns: Sequence[str], rows: Iterable[tuple[Any, ...]]) -> int:
        """Bulk insert: COPY on PostgreSQL, executemany in one transaction on SQLite."""
        if self.backend == "postgres":
            return asyncio.run(_pg_copy(self.dsn, table, columns, rows))
        marks = ", ".join("?" for _ in columns)
        sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})"
        count = 0
        with contextlib.closing(sqlite3.connect(self.sqlite_path, timeout=60)) as conn:
            conn.execute("PRAGMA busy_timeout = 60000")
            for chunk in _chunks(rows, 50_000):
                with conn:
                    conn.executemany(sql, chunk)
                count += len(chunk)
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return count


async def _pg_copy(
    dsn: str, table: str, columns: Sequence[str], rows: Iterable[tuple[Any, ...]]
) -> int:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    count = 0
    try:
        for chunk in _chunks(rows, 50_000):
            await conn.copy_records_to_table(table, records=chunk, columns=list(columns))
            count += len(chunk)
    finally:
        await conn.close()
    return count


def _chunks(rows: Iterable[tuple[Any, ...]], size: int) -> Iterator[list[tuple[Any, ...]]]:
    chunk: list[tuple[Any, ...]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


RECORD_COLUMNS = (
    "job_id",
    "key",
    "fingerprint",
    "state",
    "generation",
    "attempt",
    "upstream",
    "method",
    "path",
    "deadline",
    "status",
    "headers",
    "body",
    "created_at",
    "updated_at",
)
AUDIT_COLUMNS = (
    "at",
    "reason",
    "status",
    "job_id",
    "generation",
    "highest_generation",
    "owner",
    "upstream",
    "method",
    "path",
    "idempotency_key",
    "client",
    "fingerprint",
)
JOB_COLUMNS = (
    "job_id",
    "queue",
    "state",
    "generation",
    "owner",
    "lease_token_hash",
    "lease_ttl_seconds",
    "lease_expires_at",
    "claimable_at",
    "attempts",
    "max_attempts",
    "payload",
    "result",
    "created_at",
    "updated_at",
)
LEASE_COLUMNS = ("token_hash", "job_id", "generation", "owner", "granted_at", "expires_at")
SEED_JOBS_SPREAD = 10_000  # seeded records belong to this many (made-up) jobs


def seed_records(db: Database, target: int) -> dict[str, int]:
    """Top idempotency_records and audit_log up to ``target`` rows each (settled records
    and rejections within retention, as a busy gateway accumulates them)."""
    now = time.time()
    tag = secrets.token_hex(3)
    added = {}
    have = db.count("idempotency_records")
    missing = max(0, target - have)
    headers = json.dumps([["Content-Type", "application/json"]])
    body = b'{"id":"ch_seed","status":"succeeded"}'
    added["idempotency_records"] = db.insert(
        "idempotency_records",
        RECORD_COLUMNS,
        (
            (
                f"seed-{i % SEED_JOBS_SPREAD:05d}",
                f"seed-{tag}-{i}",
                f"{i:064x}",
                "completed",
                1,
                f"{i:032x}",
                UPSTREAM_NAME,
                "POST",
                "charge",
                now - 3600 + 30,
                201,
                headers,
                body,
                now - 3600 * (i / max(missing, 1)),
                now - 3600 * (i / max(missing, 1)),
            )
            for i in range(missing)
        ),
    )
    have = db.count("audit_log")
    missing = max(0, target - have)
    added["audit_log"] = db.insert(
        "audit_log",
        AUDIT_COLUMNS,
        (
            (
                now - 86400 * (i / max(missing, 1)),
                "stale-generation",
                409,
                f"seed-{i % SEED_JOBS_SPREAD:05d}",
                1,
                2,
                "worker-seed",
                UPSTREAM_NAME,
                "POST",
                WRITE_PATH,
                f"seed-{tag}-{i}",
                "127.0.0.1",
                f"{i:064x}",
            )
            for i in range(missing)
        ),
    )
    return added


def seed_job_records(db: Database, tag: str, jobs: int, per_job: int) -> int:
    """``per_job`` settled records for each job the writes run with ``tag`` will lease
    (the driver's job ids: ``{tag}-w{i}``), as a job that has written that often has."""
    now = time.time()
    headers = json.dumps([["Content-Type", "application/json"]])
    body = b'{"id":"ch_seed","status":"succeeded"}'
    return db.insert(
        "idempotency_records",
        RECORD_COLUMNS,
        (
            (
                f"{tag}-w{i % jobs}",
                f"seed-{i}",
                f"{i:064x}",
                "completed",
                1,
                f"{i:032x}",
                UPSTREAM_NAME,
                "POST",
                "charge",
                now - 3600 + 30,
                201,
                headers,
                body,
                now - 3600,
                now - 3600,
            )
            for i in range(jobs * per_job)
        ),
    )


def seed_jobs(db: Database, count: int) -> None:
    """Jobs in the claim queue that must not slow a claim down: half completed, half
    leased far into the future (each with its grant in ``leases``)."""
    now = time.time()
    tag = secrets.token_hex(3)
    payload = json.dumps({"order": 1})

    def jobs() -> Iterator[tuple[Any, ...]]:
        for i in range(count):
            done = bool(i % 2)
            yield (
                f"seed-{'done' if done else 'held'}-{tag}-{i}",
                CLAIM_QUEUE,
                "completed" if done else "leased",
                1,
                "worker-seed",
                None if done else _seed_hash(tag, i),
                86400.0,
                None if done else now + 86400,
                None if done else now + 86400,
                1,
                3,
                payload,
                json.dumps({"ok": True}) if done else None,
                now - 7200,
                now - 3600 if done else now,
            )

    def grants() -> Iterator[tuple[Any, ...]]:
        for i in range(count):
            done = bool(i % 2)
            yield (
                _seed_hash(tag, i),
                f"seed-{'done' if done else 'held'}-{tag}-{i}",
                1,
                "worker-seed",
                now - 7000,
                now - 6000 if done else now + 86400,
            )

    db.insert("jobs", JOB_COLUMNS, jobs())
    db.insert("leases", LEASE_COLUMNS, grants())


def _seed_hash(tag: str, i: int) -> str:
    return f"{tag}{i:058x}"


def add_pending(db: Database, count: int) -> None:
    """``count`` pending jobs, due now, in the claim queue."""
    now = time.time()
    tag = secrets.token_hex(3)
    payload = json.dumps({"order": 1})
    db.insert(
        "jobs",
        JOB_COLUMNS,
        (
            (
                f"pending-{tag}-{i}",
                CLAIM_QUEUE,
                "pending",
                0,
                None,
                None,
                None,
                None,
                now - 600 + i * 1e-4,
                0,
                3,
                payload,
                None,
                now - 600,
                now - 600,
            )
            for i in range(count)
        ),
    )


# -- the gateway -------------------------------------------------------------------------


def write_config(folder: Path, database_url: str, upstream_url: str) -> Path:
    path = folder / "fencegate.toml"
    path.write_text(
        f'database_url = "{database_url}"\n'
        'proxy_listen = "127.0.0.1:0"\n'
        'control_listen = "127.0.0.1:0"\n'
        "\n[lease]\ndefault_ttl_seconds = 30\nmax_ttl_seconds = 86400\n"
        f'\n[[upstreams]]\nname = "{UPSTREAM_NAME}"\nurl = "{upstream_url}"\n',
        encoding="utf-8",
    )
    return path


def migrate(children: Children, config: Path) -> None:
    result = subprocess.run(
        [*fencegate_command(), "migrate", "--config", str(config)],
        env=child_env(),
        cwd=children.workdir,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise BenchError(f"fencegate migrate failed:\n{result.stdout}{result.stderr}")


def start_server(children: Children, name: str, argv: Sequence[str]) -> tuple[Child, str]:
    child = children.start(name, argv)
    address = child.wait_for(READY).group(1)
    return child, f"http://{address}"


# -- rows and the report -------------------------------------------------------------------


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("PASS" if ok else "MISS")


def write_row(
    label: str, backend: str | None, records: int | None, result: dict[str, Any]
) -> dict[str, Any]:
    return {
        "section": "writes",
        "target": label,
        "backend": backend,
        "records_at_start": records,
        **result,
    }


def judge_writes(rows: list[dict[str, Any]], bare: dict[str, Any] | None) -> None:
    for row in rows:
        if row["section"] != "writes" or row["backend"] is None:
            continue
        if bare is None or not bare["rps"]:
            row["rps_ratio"] = row["p99_ratio"] = None
            row["rps_ok"] = row["p99_ok"] = None
            continue
        row["rps_ratio"] = row["rps"] / bare["rps"]
        row["p99_ratio"] = row["p99_ms"] / bare["p99_ms"] if bare["p99_ms"] else None
        row["rps_target"] = WRITE_RPS_TARGET[row["backend"]]
        row["rps_ok"] = row["rps_ratio"] >= row["rps_target"]
        row["p99_ok"] = row["p99_ratio"] is not None and row["p99_ratio"] <= P99_TARGET


def fmt_int(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for n, row in enumerate([header, *rows]):
        cells = [
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def own_work_lines(lease: list[dict[str, Any]]) -> list[str]:
    """Per backend: the gateway's CPU per renewal against aiohttp's alone (HTTP alone),
    and what is left, the lease API's own work."""
    out = []
    for backend in dict.fromkeys(r["backend"] for r in lease):
        found = {
            r["path"]: r.get("server_cpu_ms_per_request")
            for r in lease
            if r["backend"] == backend and r["operation"] == "renewals"
        }
        api, alone = found.get("HTTP API"), found.get("HTTP alone")
        if api and alone:
            out.append(
                f"renewals on {backend}: the gateway's CPU {api:.3f} ms a renewal, HTTP alone "
                f"{alone:.3f} ms; the lease API's own work {api - alone:.3f} ms"
            )
        lean = found.get(LEAN_PATH)
        if api and lean:
            out.append(
                f"renewals on {backend}: {LEAN_PATH} {lean:.3f} ms a renewal; the gateway's "
                f"handling beyond it {api - lean:.3f} ms"
            )
    return out


def cpu_text(row: dict[str, Any], names: Sequence[str]) -> str:
    cpu = row.get("cpu_percent") or {}
    return "/".join("-" if cpu.get(n) is None else f"{cpu[n]:.0f}" for n in names)


def report(rows: list[dict[str, Any]], opts: Options) -> str:
    out = []
    writes = [r for r in rows if r["section"] == "writes"]
    if writes:
        out.append(
            f"Fenced writes: POST {WRITE_PATH}, fresh Idempotency-Key each, "
            f"{opts.concurrency} concurrent loops over {max(opts.jobs, opts.concurrency)} "
            f"leased jobs, {opts.duration:g} s per target after {opts.warmup:g} s warm-up"
        )
        pg = next((r for r in writes if r.get("autovacuum") is not None), None)
        out.append(
            f"Load generator: {load_generator(opts.client)}. PostgreSQL statistics: {opts.stats} "
            "(gathered after the leases are taken)"
            + (f", autovacuum = {pg['autovacuum']}" if pg is not None else "")
        )
        body = []
        for r in writes:
            targets = ""
            if r.get("rps_target") is not None:
                targets = f">={r['rps_target']:.2f} / <={P99_TARGET:.1f}x"
            body.append(
                [
                    r["target"],
                    fmt_int(r["records_at_start"]),
                    fmt_int(r["rps"]),
                    fmt(r["p50_ms"]),
                    fmt(r["p99_ms"]),
                    fmt(r.get("rps_ratio")),
                    fmt(r.get("p99_ratio")),
                    targets,
                    f"{verdict(r.get('rps_ok'))}/{verdict(r.get('p99_ok'))}"
                    if r.get("rps_target") is not None
                    else "",
                    str(r["errors"]),
                    "/".join(
                        fmt(r.get(k), 0) for k in ("rss_start_mib", "rss_end_mib", "rss_peak_mib")
                    )
                    if r.get("rss_start_mib") is not None
                    else "-",
                    cpu_text(r, ("driver", "server", "upstream", "postgres", "other")),
                    fmt(r.get("machine_busy_percent"), 0),
                    fmt(r.get("server_cpu_ms_per_request")),
                ]
            )
        out.append(
            table(
                [
                    "target",
                    "records",
                    "req/s",
                    "p50 ms",
                    "p99 ms",
                    "rps/bare",
                    "p99/bare",
                    "targets",
                    "result",
                    "errors",
                    "RSS MiB start/end/peak",
                    "CPU% drv/srv/up/pg/other",
                    "busy%",
                    "srv CPU ms/req",
                ],
                body,
            )
        )
    bares = [r for r in writes if r["target"].startswith("bare")]
    if len(bares) > 1:
        out.append(f"(ratios are to the mean of the {len(bares)} bare proxy runs)")
    lease = [r for r in rows if r["section"] == "lease"]
    if lease:
        out.append("")
        out.append(
            f"Lease core: {opts.concurrency} concurrent loops, {opts.seed_jobs:,} finished and "
            f"leased jobs in the claim queue, {opts.duration:g} s per run"
        )
        body = []
        for r in lease:
            body.append(
                [
                    r["operation"],
                    r["backend"],
                    r["path"],
                    fmt_int(r["rps"]),
                    fmt(r["p50_ms"]),
                    fmt(r["p99_ms"]),
                    fmt(r.get("ratio")),
                    f">={r['ratio_target']:.2f}" if r.get("ratio_target") is not None else "",
                    verdict(r.get("ratio_ok")) if r.get("ratio_target") is not None else "",
                    str(r["errors"]) + (" (queue emptied)" if r.get("exhausted") else ""),
                    cpu_text(r, ("driver", "server", "postgres", "other")),
                    fmt(r.get("machine_busy_percent"), 0),
                    fmt(r.get("server_cpu_ms_per_request")),
                ]
            )
        out.append(
            table(
                [
                    "operation",
                    "backend",
                    "path",
                    "per s",
                    "p50 ms",
                    "p99 ms",
                    "HTTP/raw",
                    "target",
                    "result",
                    "errors",
                    "CPU% drv/srv/pg/other",
                    "busy%",
                    "srv CPU ms/req",
                ],
                body,
            )
        )
        out.extend(own_work_lines(lease))
    if opts.quick:
        out.append("\n(--quick: a smoke run; the numbers are not judged)")
    return "\n".join(out)


# -- the run -----------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        info["memory_mib"] = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    with contextlib.suppress(ImportError):
        import aiohttp

        info["aiohttp"] = aiohttp.__version__
    return info


def set_autovacuum(db: Database, value: str) -> Callable[[], None]:
    """Turn the server's autovacuum on or off for the run (ALTER SYSTEM, reload); the
    function returned puts back what postgresql.auto.conf said before."""
    assert db.admin_dsn is not None
    admin = db.admin_dsn
    before = asyncio.run(
        pg_fetchval(
            admin,
            "SELECT setting FROM pg_file_settings WHERE name = 'autovacuum' "
            "AND sourcefile LIKE '%postgresql.auto.conf' ORDER BY seqno DESC LIMIT 1",
        )
    )
    asyncio.run(
        pg_execute(admin, f"ALTER SYSTEM SET autovacuum = {value}", "SELECT pg_reload_conf()")
    )
    print(f"postgres: autovacuum = {value} for this run", flush=True)

    def restore() -> None:
        undo = (
            "ALTER SYSTEM RESET autovacuum"
            if before is None
            else (f"ALTER SYSTEM SET autovacuum = {before}")
        )
        asyncio.run(pg_execute(admin, undo, "SELECT pg_reload_conf()"))
        print("postgres: autovacuum restored", flush=True)

    return restore


def run_backend(
    children: Children,
    opts: Options,
    backend: str,
    upstream_url: str,
    upstream_pid: int,
    rows: list[dict[str, Any]],
    check_url: str | None = None,
) -> None:
    folder = children.workdir / backend
    folder.mkdir()
    if backend == "sqlite":
        db = Database("sqlite", f"sqlite+aiosqlite:///{folder / 'fencegate.db'}")
    else:
        name = f"fencegate_bench_{os.getpid()}_{secrets.token_hex(3)}"
        admin = _sa_url(opts.postgres_url)
        db = Database(
            "postgres",
            admin.set(database=name).render_as_string(hide_password=False),
            admin_dsn=pg_dsn(opts.postgres_url),
            name=name,
        )
    print(f"{backend}: preparing the database", flush=True)
    db.create()
    gateway: Child | None = None
    restore_autovacuum = None
    try:
        if backend == "postgres" and opts.autovacuum != "server":
            restore_autovacuum = set_autovacuum(db, opts.autovacuum)
        config = write_config(folder, db.url, upstream_url)
        migrate(children, config)
        db.stats = opts.stats
        if opts.stats == "stale":
            db.analyze()  # of the empty tables: what a database analyzed once at set-up has
        started = time.monotonic()
        seed_records(db, opts.seed_records[0])
        if "lease" in opts.targets:
            seed_jobs(db, opts.seed_jobs)
        db.vacuum("jobs", "leases", "idempotency_records", "audit_log")
        print(f"{backend}: seeded in {time.monotonic() - started:.1f} s", flush=True)
        argv = [
            *fencegate_command(),
            "serve",
            "--config",
            str(config),
            "--log-level",
            opts.gateway_log_level,
            "--log-format",
            "json",
        ]
        gateway = children.start(f"fencegate-{backend}", argv)
        match = gateway.wait_for(GATEWAY_READY)
        control, proxy = f"http://{match.group(1)}", f"http://{match.group(2)}"
        watch = Watch(
            {"server": gateway.pid, "upstream": upstream_pid, "orchestrator": os.getpid()},
            postgres_db=db.name,
            rss_pid=gateway.pid,
        )
        label = f"fencegate {backend}"
        for level_index, level in enumerate(opts.seed_records):
            if "writes" in opts.targets:
                if level_index:
                    started = time.monotonic()
                    seed_records(db, level)
                    db.vacuum("idempotency_records", "audit_log")
                    print(
                        f"{backend}: topped up to {level:,} records in "
                        f"{time.monotonic() - started:.1f} s",
                        flush=True,
                    )
                tag = f"w{level_index}{secrets.token_hex(2)}"
                if opts.records_per_job:
                    started = time.monotonic()
                    seed_job_records(db, tag, opts.jobs, opts.records_per_job)
                    db.vacuum("idempotency_records")
                    print(
                        f"{backend}: {opts.records_per_job:,} records for each of the "
                        f"{opts.jobs} jobs to lease in {time.monotonic() - started:.1f} s",
                        flush=True,
                    )
                records = db.count("idempotency_records")
                before = db.server_state()
                readings: Readings | None = None
                if opts.soak_interval:
                    readings = (
                        Maintenance(db.dsn)
                        if backend == "postgres"
                        else SqliteFiles(db.sqlite_path)
                    )
                with readings or contextlib.nullcontext():
                    result = run_driver(
                        children,
                        opts,
                        f"writes-{backend}-{level}",
                        "writes",
                        [
                            "--target",
                            proxy + WRITE_PATH,
                            "--control",
                            control,
                            "--tag",
                            tag,
                        ],
                        watch,
                        profile_pid=gateway.pid,
                        # Fresh statistics describe the tables as the writes find them: with
                        # the leases taken and their fences absent (the stats of the seeding
                        # alone once said job_id was unique).
                        leases_taken=lambda: db.gather_stats("jobs", "leases", "fences"),
                        check_url=check_url,
                    )
                after = db.server_state()
                if readings is not None and result.get("intervals"):
                    if readings.error is not None:
                        print(f"    no {backend} readings: {readings.error!r}", flush=True)
                    per = readings.per_interval(
                        result["window_start_epoch"], opts.soak_interval, len(result["intervals"])
                    )
                    for interval, seen in zip(result["intervals"], per, strict=True):
                        interval[backend] = seen
                if before and after:
                    result["postgres_after"] = after
                    result["postgres_change"] = {k: after[k] - before[k] for k in after}
                result["records_per_job"] = opts.records_per_job
                result["stats"] = opts.stats
                result["autovacuum"] = db.setting("autovacuum")
                rows.append(write_row(label, backend, records, result))
            if level_index == 0 and "lease" in opts.targets:
                run_lease(children, opts, db, control, watch, rows)
    finally:
        if gateway is not None:
            children.stop(gateway)
        if restore_autovacuum is not None:
            restore_autovacuum()
        try:
            db.drop()
        except Exception as error:
            print(f"bench: dropping the database {db.name}: {error}", file=sys.stderr)


def run_lease(
    children: Children,
    opts: Options,
    db: Database,
    control: str,
    watch: Watch,
    rows: list[dict[str, Any]],
) -> None:
    backend = db.backend
    # The claim runs share one queue; each starts from a vacuumed table (PostgreSQL).
    results: dict[str, dict[str, Any]] = {}
    add_pending(db, opts.claim_jobs)
    db.vacuum("jobs")
    results["claims-raw"] = run_driver(
        children,
        opts,
        f"floor-claims-{backend}",
        "floor-claims",
        ["--database-url", db.url, "--queue", CLAIM_QUEUE],
        watch,
    )
    add_pending(db, opts.claim_jobs)
    db.vacuum("jobs", "leases")
    results["claims-http"] = run_driver(
        children,
        opts,
        f"claims-{backend}",
        "claims",
        ["--control", control, "--queue", CLAIM_QUEUE],
        watch,
        profile_pid=watch.rss_pid,
    )
    tag = f"r{secrets.token_hex(2)}"
    results["renewals-http"] = run_driver(
        children,
        opts,
        f"renewals-{backend}",
        "renewals",
        ["--control", control, "--tag", tag],
        watch,
        profile_pid=watch.rss_pid,
    )
    results["renewals-raw"] = run_driver(
        children,
        opts,
        f"floor-renewals-{backend}",
        "floor-renewals",
        ["--database-url", db.url, "--job-prefix", f"{tag}-r"],
        watch,
    )
    results["renewals-bare"] = measure_bare_renewals(children, opts, backend)
    if backend == "postgres":
        results["renewals-lean"] = measure_lean_renewals(children, opts, db, control)
    for operation in ("claims", "renewals"):
        http, raw = results[f"{operation}-http"], results[f"{operation}-raw"]
        ratio = rps_ratio(http, raw)
        target = LEASE_TARGET
        for path, result in (("HTTP API", http), ("raw SQL", raw)):
            row: dict[str, Any] = {
                "section": "lease",
                "operation": operation,
                "backend": backend,
                "path": path,
            }
            row.update(result)
            if path == "HTTP API":
                row["ratio"] = ratio
                row["ratio_target"] = target
                row["ratio_ok"] = None if ratio is None else ratio >= target
            rows.append(row)
    rows.append(
        {"section": "lease", "operation": "renewals", "backend": backend, "path": "HTTP alone"}
        | results["renewals-bare"]
    )
    if "renewals-lean" in results:
        lean, raw = results["renewals-lean"], results["renewals-raw"]
        rows.append(
            {"section": "lease", "operation": "renewals", "backend": backend, "path": LEAN_PATH}
            | lean
            | {"ratio": rps_ratio(lean, raw)}
        )


def rps_ratio(path: dict[str, Any], floor: dict[str, Any]) -> float | None:
    """A path's throughput as a share of its floor's, measured in the same run."""
    return path["rps"] / floor["rps"] if floor["rps"] else None


def measure_bare_renewals(children: Children, opts: Options, backend: str) -> dict[str, Any]:
    """Renewals against ``bench.bare_lease`` (aiohttp answering a lease document, no
    database): aiohttp's and the loop's CPU per renewal, measured beside the gateway's."""
    return renewals_against(children, opts, f"bare-{backend}", ["bench.bare_lease"], None)


def measure_lean_renewals(
    children: Children, opts: Options, db: Database, control: str
) -> dict[str, Any]:
    """Renewals against ``bench.lean_lease`` (PostgreSQL): HTTP and the store's batched
    statement with nothing else, the least a lease API over HTTP can cost here."""
    server = ["bench.lean_lease", "--database-url", db.dsn, "--leases-from", control]
    return renewals_against(children, opts, "lean-postgres", server, db.name)


def renewals_against(
    children: Children,
    opts: Options,
    name: str,
    server_argv: list[str],
    postgres_db: str | None,
) -> dict[str, Any]:
    """The driver's renewals against a benchmark server (``python -m`` ``server_argv``)
    started for them, its CPU watched (and PostgreSQL's, given ``postgres_db``)."""
    server, url = start_server(children, f"{name}-lease", [sys.executable, "-m", *server_argv])
    try:
        watch = Watch({"server": server.pid, "orchestrator": os.getpid()}, postgres_db=postgres_db)
        return run_driver(
            children,
            opts,
            f"renewals-{name}",
            "renewals",
            ["--control", url, "--tag", f"x{secrets.token_hex(2)}"],
            watch,
            profile_pid=server.pid,
        )
    finally:
        children.stop(server)


def run(opts: Options) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="fencegate-bench-"))
    children = Children(workdir)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    started = time.monotonic()
    print(f"bench: working in {workdir}", flush=True)
    background = background_busy(0.5 if opts.quick else 3.0)
    print(f"bench: the machine is {background:.0f}% busy before we start", flush=True)
    if background > 15:
        print(
            "bench: WARNING: something else is using the CPU; every number below is skewed",
            flush=True,
        )
    try:
        upstream, upstream_url = start_server(
            children, "upstream", [sys.executable, "-m", "bench.upstream"]
        )
        idle = Watch({"upstream": upstream.pid, "orchestrator": os.getpid()}, postgres_db=None)
        if "direct" in opts.targets:
            result = run_driver(
                children,
                opts,
                "direct",
                "writes",
                ["--target", upstream_url + WRITE_PATH],
                idle,
            )
            rows.append(write_row("upstream direct (reference)", None, None, result))
        bare_runs: list[dict[str, Any]] = []
        bare_proxy: Child | None = None
        check_url: str | None = None  # the soak's checks write here (--soak-check)
        if "bare" in opts.targets or opts.soak_check:
            bare_proxy, bare_url = start_server(
                children,
                "bare-proxy",
                [sys.executable, "-m", "bench.bare_proxy", "--upstream", upstream_url],
            )
            bare_watch = Watch(
                {"server": bare_proxy.pid, "upstream": upstream.pid, "orchestrator": os.getpid()},
                postgres_db=None,
                rss_pid=bare_proxy.pid,
            )

            bare_target = bare_url + WRITE_PATH
            if opts.soak_check:
                check_url = bare_target

            def measure_bare(name: str, label: str) -> None:
                result = run_driver(
                    children,
                    opts,
                    name,
                    "writes",
                    ["--target", bare_target],
                    bare_watch,
                    profile_pid=bare_proxy.pid if bare_proxy else None,
                )
                bare_runs.append(result)
                rows.append(write_row(label, None, None, result))

            if "bare" in opts.targets:
                measure_bare("bare", "bare aiohttp proxy (floor)")
        if "writes" in opts.targets or "lease" in opts.targets:
            for backend in opts.backends:
                try:
                    run_backend(
                        children, opts, backend, upstream_url, upstream.pid, rows, check_url
                    )
                except (BenchError, RuntimeError, OSError) as error:
                    failures.append(f"{backend}: {error}")
                    print(f"bench: {backend} failed: {error}", file=sys.stderr, flush=True)
        if (
            bare_proxy is not None
            and not opts.quick
            and not opts.soak_interval
            and "writes" in opts.targets
        ):
            # Measured again at the end: the ratios use the mean of both, so a machine that
            # got busier or quieter during the run shows (and skews nothing one-sidedly).
            measure_bare("bare-again", "bare aiohttp proxy (again, at the end)")
        bare = None
        if bare_runs:
            bare = {
                key: sum(r[key] for r in bare_runs) / len(bare_runs) for key in ("rps", "p99_ms")
            }
        judge_writes(rows, bare)
    except (BenchError, RuntimeError) as error:
        failures.append(str(error))
        print(f"bench: {error}", file=sys.stderr, flush=True)
    finally:
        children.stop_all()
        if not opts.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(report(rows, opts))
    if opts.soak_interval:
        print()
        print(soak_report(rows, opts, failures))
    for row in rows:
        if row["errors"] or not row["rps"]:
            name = row.get("target") or f"{row['operation']} {row['backend']} {row['path']}"
            failures.append(f"{name}: {row['errors']} error(s), {row['rps']:.0f}/s")
    missed = [
        r
        for r in rows
        if r.get("rps_ok") is False or r.get("p99_ok") is False or r.get("ratio_ok") is False
    ]
    if opts.json:
        doc = {
            "machine": {**machine(), "busy_before_percent": background},
            "options": {k: getattr(opts, k) for k in Options.__dataclass_fields__},
            "seconds": round(time.monotonic() - started, 1),
            "rows": rows,
            "failures": failures,
        }
        Path(opts.json).write_text(json.dumps(doc, indent=2), encoding="utf-8")
    print(f"\nbench: finished in {time.monotonic() - started:.0f} s", flush=True)
    if failures:
        print("bench: FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    if missed and opts.check_targets:
        print(f"bench: {len(missed)} target(s) missed", file=sys.stderr)
        return 1
    return 0


SOAK_FLAT = 0.10  # the last interval's throughput and p99 within 10 % of the first's


def soak_report(rows: list[dict[str, Any]], opts: Options, failures: list[str]) -> str:
    """Throughput and p99 per interval of each database's soak, and whether the last
    interval is within 10 % of the first (a regression is a failure of the run)."""
    lines = [f"Soak: fenced writes, {opts.duration:g} s per database, per {opts.soak_interval:g} s"]
    curves = {}
    for row in rows:
        intervals = row.get("intervals") or []
        if row.get("section") != "writes" or not intervals:
            continue
        bare = row.get("backend") is None  # the bare proxy: the machine's drift, not judged
        name = "bare proxy" if bare else row["backend"]
        curves[name] = intervals
        checked = "check_rps" in intervals[0]
        if checked:
            for i in intervals:
                i["rps_ratio"] = i["rps"] / i["check_rps"] if i["check_rps"] else 0.0
                i["p99_ratio"] = i["p99_ms"] / i["check_p99_ms"] if i["check_p99_ms"] else 0.0
        # The verdict is on the gateway's own numbers. The checks' ratios are shown
        # beside them: five seconds of the bare proxy turned out to vary more than a
        # minute of the gateway on this VM (docs/performance.md, the soak), so they
        # read the machine, they do not judge.
        first, last = intervals[0], intervals[-1]
        rps_change = last["rps"] / first["rps"] - 1 if first["rps"] else None
        p99_change = last["p99_ms"] / first["p99_ms"] - 1 if first["p99_ms"] else None
        flat = (
            rps_change is not None
            and rps_change >= -SOAK_FLAT
            and p99_change is not None
            and p99_change <= SOAK_FLAT
        )
        row["soak_rps_change"], row["soak_p99_change"] = rps_change, p99_change
        if not bare:
            row["soak_flat"] = flat
        head = ["from (s)", "writes/s", "p50 ms", "p99 ms"]
        body = [
            [f"{i['start_seconds']:g}", fmt_int(i["rps"]), fmt(i["p50_ms"]), fmt(i["p99_ms"])]
            for i in intervals
        ]
        if checked:
            head += ["bare req/s", "bare p99 ms", "÷ bare", "p99 ÷ bare"]
            for line, i in zip(body, intervals, strict=True):
                line += [
                    fmt_int(i["check_rps"]),
                    fmt(i["check_p99_ms"]),
                    fmt(i["rps_ratio"], 3),
                    fmt(i["p99_ratio"]),
                ]
        for key, more, cells in (
            ("postgres", MAINTENANCE_HEAD, maintenance_cells),
            ("sqlite", FILES_HEAD, files_cells),
        ):
            if any(i.get(key) for i in intervals):
                head += more
                for line, interval in zip(body, intervals, strict=True):
                    line += cells(interval.get(key) or {})
        trend = row["soak_trend"] = soak_trend([i["rps"] for i in intervals])
        lines.append("")
        lines.append(f"{name}:" if not bare else f"{name} (the machine's own drift, not judged):")
        lines.append(table(head, body))
        lines.append(
            f"last vs first: throughput {fmt(100 * (rps_change or 0), 1)} %, "
            f"p99 {fmt(100 * (p99_change or 0), 1)} %"
            + ("" if bare else f" -> {verdict(flat)}")
            + f"; fitted trend over the soak {fmt(100 * trend, 1)} %"
        )
        if checked:
            ratio_rps = last["rps_ratio"] / first["rps_ratio"] - 1 if first["rps_ratio"] else 0
            ratio_p99 = last["p99_ratio"] / first["p99_ratio"] - 1 if first["p99_ratio"] else 0
            bare_rps = last["check_rps"] / first["check_rps"] - 1 if first["check_rps"] else 0
            row["soak_ratio_rps_change"], row["soak_ratio_p99_change"] = ratio_rps, ratio_p99
            row["soak_bare_rps_change"] = bare_rps
            lines.append(
                f"beside it, the bare proxy's last check vs its first: {fmt(100 * bare_rps, 1)} % "
                f"(the machine's drift); as ratios to it, throughput {fmt(100 * ratio_rps, 1)} "
                f"%, p99 {fmt(100 * ratio_p99, 1)} %; fitted trend of the ratio "
                f"{fmt(100 * soak_trend([i['rps_ratio'] for i in intervals]), 1)} % (not judged)"
            )
        if bare:
            continue
        change = row.get("postgres_change")
        if change and row.get("ok"):
            after = row["postgres_after"]
            lines.append(
                f"PostgreSQL over the run: WAL {change['wal_bytes'] / row['ok']:,.0f} bytes "
                f"per write, {change['checkpoints']:.0f} checkpoint(s), "
                f"{change['buffers_backend']:,.0f} buffers written by backends; the records "
                f"table {after['live_rows']:,.0f} live and {after['dead_rows']:,.0f} dead rows "
                f"(autovacuum = {row.get('autovacuum')}, {change['autovacuums']:.0f} autovacuum "
                f"pass(es) over it), {after['records_bytes'] / 2**20:,.0f} MiB with its indexes"
            )
        if not flat and not opts.quick:
            failures.append(f"soak {row['backend']}: the last interval is not within 10 %")
    if opts.soak_png and curves:
        lines.append(draw_soak(curves, opts, opts.soak_png))
    return "\n".join(lines)


def soak_trend(values: Sequence[float]) -> float:
    """The least-squares line through the intervals' throughput: its change from the
    first interval to the last, relative to the mean (one noisy minute moves it little,
    unlike last against first)."""
    n = len(values)
    mean = sum(values) / n if n else 0.0
    if n < 2 or not mean:
        return 0.0
    mid = (n - 1) / 2
    slope = sum((i - mid) * (v - mean) for i, v in enumerate(values)) / sum(
        (i - mid) ** 2 for i in range(n)
    )
    return slope * (n - 1) / mean


MAINTENANCE_HEAD = [
    "vacuum s",
    "autovacuums",
    "checkpoints",
    "ckpt buffers",
    "backend buffers",
    "WAL MiB",
    "dead rows",
]


def maintenance_cells(seen: dict[str, float]) -> list[str]:
    """A soak interval's PostgreSQL background work (``Maintenance``), as table cells."""
    if not seen:
        return ["-"] * len(MAINTENANCE_HEAD)
    return [
        fmt(seen["vacuum_seconds"], 0),
        fmt_int(seen["autovacuums"]),
        fmt_int(seen["checkpoints"]),
        fmt_int(seen["buffers_checkpoint"]),
        fmt_int(seen["buffers_backend"]),
        fmt(seen["wal_bytes"] / 2**20, 0),
        fmt_int(seen["dead_rows"]),
    ]


FILES_HEAD = ["log MiB (largest)", "file MiB"]


def files_cells(seen: dict[str, float]) -> list[str]:
    """A soak interval's SQLite files (``SqliteFiles``), as table cells."""
    if not seen:
        return ["-"] * len(FILES_HEAD)
    return [fmt(seen["log_bytes_max"] / 2**20, 0), fmt(seen["file_bytes"] / 2**20, 0)]


def draw_soak(curves: dict[str, list[dict[str, Any]]], opts: Options, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "soak: no picture (--soak-png needs matplotlib: pip install matplotlib)"
    checked = any("rps_ratio" in i for intervals in curves.values() for i in intervals)
    figure, axes = plt.subplots(
        3 if checked else 2, 1, sharex=True, figsize=(8, 9 if checked else 6)
    )
    top, bottom = axes[0], axes[-1]
    for backend, intervals in curves.items():
        minutes = [i["start_seconds"] / 60 for i in intervals]
        top.plot(minutes, [i["rps"] for i in intervals], marker="o", label=backend)
        axes[1].plot(minutes, [i["p99_ms"] for i in intervals], marker="o", label=backend)
        if checked and "rps_ratio" in intervals[0]:
            bottom.plot(minutes, [i["rps_ratio"] for i in intervals], marker="o", label=backend)
    top.set_ylabel("fenced writes / s")
    axes[1].set_ylabel("p99 (ms)")
    if checked:
        bottom.set_ylabel("writes ÷ bare proxy (same minute)")
    bottom.set_xlabel("minutes into the soak")
    for axis in axes:
        axis.set_ylim(bottom=0)
    top.legend()
    top.set_title(f"Fencegate soak: {opts.concurrency} connections, {opts.jobs} leases")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return f"soak: picture in {path}"


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through the finally blocks that stop the children


def main(argv: Sequence[str] | None = None) -> int:
    opts = options_from(build_parser().parse_args(argv))
    signal.signal(signal.SIGTERM, _terminate)
    return run(opts)


if __name__ == "__main__":
    sys.exit(main())
