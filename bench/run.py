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

This module is the command and the run's order; the parts are modules of their own:
``bench.options`` (the command line), ``bench.processes`` (the children, the driver
runs, py-spy), ``bench.sampling`` (CPU, memory, a soak's readings), ``bench.pgadmin``
(the databases), ``bench.seed`` (the rows a run starts from), ``bench.measure`` (what
is measured on each database), ``bench.report`` and ``bench.charts`` (tables, verdicts,
the soak's picture).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import sqlite3
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: python bench/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.measure import run_backend, run_open_loop
from bench.options import Options, build_parser, options_from
from bench.processes import BenchError, Child, Children, run_driver, start_server
from bench.report import (
    judge_writes,
    open_loop_failures,
    open_loop_report,
    report,
    soak_report,
    write_row,
)
from bench.sampling import Watch, background_busy
from bench.seed import WRITE_PATH


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
        if opts.open_loop:
            run_open(children, opts, upstream_url, upstream.pid, rows, failures)
        else:
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
                    {
                        "server": bare_proxy.pid,
                        "upstream": upstream.pid,
                        "orchestrator": os.getpid(),
                    },
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
                # Every number the verdicts and the CPU budget read, where each run has it.
                keys = ("rps", "p99_ms", "machine_busy_percent", "server_cpu_ms_per_request")
                bare = {
                    key: sum(r[key] for r in bare_runs) / len(bare_runs)
                    for key in keys
                    if all(r.get(key) is not None for r in bare_runs)
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
    print(open_loop_report(rows, opts) if opts.open_loop else report(rows, opts))
    if opts.soak_interval:
        print()
        print(soak_report(rows, opts, failures))
    for row in rows:
        if row["section"] == "open-loop":
            failures += open_loop_failures(row)
            continue
        if row["errors"] or not row["rps"]:
            name = row.get("target") or f"{row['operation']} {row['backend']} {row['path']}"
            failures.append(f"{name}: {row['errors']} error(s), {row['rps']:.0f}/s")
    missed = [
        r
        for r in rows
        if r.get("rps_ok") is False
        or r.get("p99_ok") is False
        or r.get("ratio_ok") is False
        or r.get("latency_ok") is False
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


def run_open(
    children: Children,
    opts: Options,
    upstream_url: str,
    upstream_pid: int,
    rows: list[dict[str, Any]],
    failures: list[str],
) -> None:
    """--open-loop: the bare proxy beside the gateway on each database, at each rate."""
    bare, bare_url = start_server(
        children,
        "bare-proxy",
        [sys.executable, "-m", "bench.bare_proxy", "--upstream", upstream_url],
    )
    for backend in opts.backends:
        try:
            run_open_loop(
                children, opts, backend, (upstream_url, upstream_pid), (bare_url, bare.pid), rows
            )
        except (BenchError, RuntimeError, OSError) as error:
            failures.append(f"{backend}: {error}")
            print(f"bench: {backend} failed: {error}", file=sys.stderr, flush=True)


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through the finally blocks that stop the children


def main(argv: Sequence[str] | None = None) -> int:
    opts = options_from(build_parser().parse_args(argv))
    signal.signal(signal.SIGTERM, _terminate)
    return run(opts)


if __name__ == "__main__":
    sys.exit(main())
