"""``fencegate serve --workers 2`` against ``--workers 1`` on the same machine, closed
loop: ``python -m bench.workers`` (docs/performance.md, "Several workers").

The load generator is ``wrk`` (Debian's ``wrk`` package), the cheapest there is: one
thread in C, so the Python server's processes get what is left of the machine's cores.
Each run starts from nothing: a fresh database (a new SQLite file; a PostgreSQL database
of its own, migrated, dropped at the end), ``fencegate serve --workers N``, leases on
``--jobs`` jobs taken through the control port. Then wrk keeps ``--connections``
connections busy with fenced writes through the proxy port (each request one of the
leases' tokens, in turn, and an ``Idempotency-Key`` of its own, so every write is
admitted and forwarded to the upstream, ``bench.upstream``), a warm-up first, then the
timed ``--duration``. Reported per run: requests a second, p50 / p99, answers that were
not 2xx, the server's CPU (the parent and its workers) per request, how it fell to the
workers (their shares of it: how evenly the kernel spread the connections) and how busy
the whole machine was; and per database the ratio of the two workers' requests a second
to one worker's (medians over ``--rounds``, run in turns 1, 2, 2, 1, ... so a drift of
the machine weighs on both alike).

Every process is started here and stopped in ``finally`` (SIGTERM as well).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: python bench/workers.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.measure import GATEWAY_READY, migrate, write_config
from bench.options import DEFAULT_PG_URL
from bench.pgadmin import Database, _sa_url, pg_dsn
from bench.processes import BenchError, Children, fencegate_command, start_server
from bench.sampling import background_busy, cpu_seconds, machine_busy
from bench.seed import WRITE_PATH

# wrk's script: the leases' tokens in turn, a key of its own per request, and one line
# of JSON at the end (``done``), which ``run_wrk`` reads.
WRK_SCRIPT = """\
local threads = 0
local tokens = {}
local counter = 0
local prefix = ""

function setup(thread)
  threads = threads + 1
  thread:set("id", threads)
end

function init(args)
  for line in io.lines(args[1]) do
    tokens[#tokens + 1] = line
  end
  prefix = args[2] .. "-" .. id
end

function request()
  counter = counter + 1
  local headers = {}
  headers["Fencing-Token"] = tokens[(counter % #tokens) + 1]
  headers["Idempotency-Key"] = prefix .. "-" .. counter
  headers["Content-Type"] = "application/json"
  return wrk.format("POST", wrk.path, headers, '{"amount":1250,"currency":"eur"}')
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_RESULT {"requests": %d, "duration_us": %d, "non_2xx": %d, "connect": %d, '
    .. '"read": %d, "write": %d, "timeout": %d, "p50_us": %d, "p99_us": %d}\\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""
WRK_RESULT = re.compile(r"^WRK_RESULT (\{.*\})$", re.MULTILINE)
WRK_MISSING = (
    "bench.workers: wrk is missing: it is the load generator of this benchmark. Install "
    "Debian's wrk package (apt-get install wrk) or put a wrk binary on PATH."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.workers",
        description="Closed-loop throughput of fenced writes: fencegate serve --workers 2 "
        "against --workers 1, driven by wrk.",
    )
    p.add_argument("--backends", default="sqlite,postgres", help="comma list of sqlite, postgres")
    p.add_argument("--postgres-url", default=DEFAULT_PG_URL)
    p.add_argument("--workers", default="1,2", help="comma list of --workers values (1,2)")
    p.add_argument("--duration", type=float, default=10.0, help="timed seconds per run (10)")
    p.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per run (3)")
    p.add_argument("--connections", type=int, default=32, help="wrk's connections (32)")
    p.add_argument("--jobs", type=int, default=64, help="jobs holding a lease (64)")
    p.add_argument("--rounds", type=int, default=1, help="runs per --workers value (1)")
    p.add_argument("--json", help="write every run and the ratios to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    wrk = shutil.which("wrk")
    if wrk is None:
        print(WRK_MISSING, file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    workdir = Path(tempfile.mkdtemp(prefix="fencegate-bench-workers-"))
    children = Children(workdir)
    backends = [b for b in args.backends.split(",") if b]
    counts = [int(n) for n in args.workers.split(",") if n]
    busy_before = background_busy(2.0)
    print(f"bench.workers: {os.cpu_count()} CPUs, {busy_before:.0f}% busy before the start")
    if busy_before > 15:
        print("bench.workers: WARNING: the machine is not quiet; the numbers are skewed")
    runs: list[dict[str, Any]] = []
    try:
        _, upstream_url = start_server(
            children, "upstream", [sys.executable, "-m", "bench.upstream"]
        )
        for backend in backends:
            for index in range(args.rounds):
                order = counts if index % 2 == 0 else list(reversed(counts))
                for workers in order:
                    run = measure(children, args, wrk, backend, workers, upstream_url)
                    runs.append(run)
                    print(row(run), flush=True)
    finally:
        children.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    ratios = report(runs, backends, counts)
    if args.json:
        doc = {"busy_before_percent": busy_before, "runs": runs, "ratios": ratios}
        Path(args.json).write_text(json.dumps(doc, indent=2), encoding="utf-8")
    failed = [r for r in runs if r["non_2xx"] or r["socket_errors"]]
    return 1 if failed else 0


def measure(
    children: Children,
    args: argparse.Namespace,
    wrk: str,
    backend: str,
    workers: int,
    upstream_url: str,
) -> dict[str, Any]:
    """One run: a fresh database, ``serve --workers N``, leases, warm-up, timed load."""
    name = f"{backend}-w{workers}-{secrets.token_hex(2)}"
    folder = children.workdir / name
    folder.mkdir()
    db = fresh_database(args, backend, folder)
    db.create()
    try:
        config = write_config(folder, db.url, upstream_url)
        migrate(children, config)
        argv = [*fencegate_command(), "serve", "--config", str(config), "--workers", str(workers)]
        server = children.start(f"serve-{name}", [*argv, "--log-level", "WARNING"])
        try:
            match = server.wait_for(GATEWAY_READY, timeout=120)
            control, proxy = f"http://{match.group(1)}", f"http://{match.group(2)}"
            tokens = folder / "tokens.txt"
            tokens.write_text("\n".join(take_leases(control, args.jobs)) + "\n")
            script = folder / "writes.lua"
            script.write_text(WRK_SCRIPT, encoding="utf-8")
            target = proxy + WRITE_PATH
            if args.warmup > 0:
                run_wrk(wrk, args, script, tokens, target, args.warmup, "warm")
            pids = [server.pid, *children_of(server.pid)]
            cpu_before, busy_before = cpu_by_pid(pids), machine_busy()
            result = run_wrk(wrk, args, script, tokens, target, args.duration, "timed")
            cpu_after, busy_after = cpu_by_pid(pids), machine_busy()
        finally:
            children.stop(server)
    finally:
        db.drop()
    requests = result["requests"]
    seconds = result["duration_us"] / 1e6
    busy = (busy_after[0] - busy_before[0]) / max(busy_after[1] - busy_before[1], 1)
    used = {pid: cpu_after[pid] - cpu_before[pid] for pid in pids}
    # How the work fell to the workers (the parent's own is next to nothing).
    serving = [used[pid] for pid in pids[1:]] if workers > 1 else [used[pids[0]]]
    return {
        "backend": backend,
        "workers": workers,
        "requests": requests,
        "rps": requests / seconds if seconds else 0.0,
        "p50_ms": result["p50_us"] / 1000,
        "p99_ms": result["p99_us"] / 1000,
        "non_2xx": result["non_2xx"],
        "socket_errors": sum(result[k] for k in ("connect", "read", "write", "timeout")),
        "server_cpu_ms_per_request": 1000 * sum(used.values()) / requests if requests else None,
        "worker_cpu_shares": [round(100 * u / (sum(serving) or 1)) for u in sorted(serving)],
        "machine_busy_percent": round(100 * busy, 1),
    }


def fresh_database(args: argparse.Namespace, backend: str, folder: Path) -> Database:
    if backend == "sqlite":
        return Database("sqlite", f"sqlite+aiosqlite:///{folder / 'fencegate.db'}")
    if backend != "postgres":
        raise BenchError(f"unknown backend {backend!r}: sqlite or postgres")
    name = f"fencegate_bench_workers_{os.getpid()}_{secrets.token_hex(3)}"
    admin = _sa_url(args.postgres_url)
    return Database(
        "postgres",
        admin.set(database=name).render_as_string(hide_password=False),
        admin_dsn=pg_dsn(args.postgres_url),
        name=name,
    )


def take_leases(control: str, jobs: int) -> list[str]:
    """A lease on each of ``jobs`` jobs (an hour long): their tokens."""
    tokens = []
    for i in range(jobs):
        request = urllib.request.Request(
            f"{control}/v1/jobs/bench-workers-{i}/lease",
            data=json.dumps({"owner": "bench", "ttl_seconds": 3600}).encode(),
            headers={"Content-Type": "application/json"},
            method="PUT",
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            tokens.append(json.loads(answer.read())["lease_token"])
    return tokens


def run_wrk(
    wrk: str,
    args: argparse.Namespace,
    script: Path,
    tokens: Path,
    target: str,
    seconds: float,
    prefix: str,
) -> dict[str, int]:
    argv = [
        wrk,
        "--threads",
        "1",
        "--connections",
        str(args.connections),
        "--duration",
        f"{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "--script",
        str(script),
        target,
        "--",
        str(tokens),
        f"{prefix}-{secrets.token_hex(3)}",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=False)
    match = WRK_RESULT.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise BenchError(f"wrk failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    result: dict[str, int] = json.loads(match.group(1))
    return result


def children_of(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (a ``serve --workers`` parent's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                if int(fields[1]) == pid:
                    found.append(int(entry.name))
    return found


def cpu_by_pid(pids: Sequence[int]) -> dict[int, float]:
    return {pid: cpu_seconds(pid) or 0.0 for pid in pids}


def row(run: dict[str, Any]) -> str:
    cpu = run["server_cpu_ms_per_request"]
    return (
        f"  {run['backend']:<8} --workers {run['workers']}: {run['rps']:8.0f} req/s  "
        f"p50 {run['p50_ms']:6.2f} ms  p99 {run['p99_ms']:7.2f} ms  "
        f"non-2xx {run['non_2xx']}  socket errors {run['socket_errors']}  "
        f"server CPU {cpu if cpu is None else round(cpu, 3)} ms/req "
        f"(workers' shares {'/'.join(str(s) for s in run['worker_cpu_shares'])} %)  "
        f"machine {run['machine_busy_percent']:.0f}% busy"
    )


def report(
    runs: list[dict[str, Any]], backends: list[str], counts: list[int]
) -> dict[str, float | None]:
    """Per database, each --workers value's median requests a second against the
    first's (``--workers 1`` by default); printed and returned."""
    ratios: dict[str, float | None] = {}
    print("\nthroughput against the first --workers value (median requests/s):")
    for backend in backends:
        medians = {
            n: statistics.median(
                [r["rps"] for r in runs if r["backend"] == backend and r["workers"] == n]
            )
            for n in counts
        }
        base = medians[counts[0]]
        for n in counts[1:]:
            ratio = medians[n] / base if base else None
            ratios[f"{backend} workers {n}/{counts[0]}"] = ratio
            shown = "n/a" if ratio is None else f"{ratio:.2f}"
            print(
                f"  {backend:<8} --workers {n} / --workers {counts[0]}: {shown} "
                f"({medians[n]:.0f} / {base:.0f} req/s)"
            )
    return ratios


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through the finally blocks that stop the children


if __name__ == "__main__":
    sys.exit(main())
