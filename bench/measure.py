"""What one run measures on each database: ``fencegate serve`` on it, from a generated
config after ``fencegate migrate``; the fenced writes per seeding level, then the lease
core's claims and renewals against their raw SQL floors, HTTP alone and (PostgreSQL)
HTTP with the store's batched statement."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.commit_floor import SAMPLES, two_commits
from bench.open_loop import body_of
from bench.options import Options
from bench.pgadmin import Database, _sa_url, pg_dsn, set_autovacuum
from bench.processes import (
    BenchError,
    Child,
    Children,
    child_env,
    fencegate_command,
    run_driver,
    start_server,
)
from bench.report import LEAN_PATH, LEASE_TARGET, write_row
from bench.sampling import Maintenance, Readings, SqliteFiles, Watch
from bench.seed import (
    CLAIM_QUEUE,
    UPSTREAM_NAME,
    WRITE_PATH,
    add_pending,
    seed_job_records,
    seed_jobs,
    seed_records,
)
from bench.xacts import count_transactions

GATEWAY_READY = re.compile(r"fencegate listening: .*?control=([^\s\",]+).*?proxy=([^\s\",]+)")


def write_config(
    folder: Path, database_url: str, upstream_url: str, *, server_timing: bool = False
) -> Path:
    """``server_timing``: the open loop's breakdown of its slowest writes reads each
    answer's ``Server-Timing`` (``gateway.server_timing``)."""
    path = folder / "fencegate.toml"
    path.write_text(
        f'database_url = "{database_url}"\n'
        'proxy_listen = "127.0.0.1:0"\n'
        'control_listen = "127.0.0.1:0"\n'
        "\n[lease]\ndefault_ttl_seconds = 30\nmax_ttl_seconds = 86400\n"
        + (f"\n[gateway]\nserver_timing = {str(server_timing).lower()}\n")
        + f'\n[[upstreams]]\nname = "{UPSTREAM_NAME}"\nurl = "{upstream_url}"\n',
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


def new_database(children: Children, opts: Options, backend: str) -> tuple[Path, Database]:
    """A folder for ``backend`` and its database's handle (not created yet): a file there
    on SQLite, a fresh database of the benchmark's own on PostgreSQL."""
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
    return folder, db


def start_gateway(
    children: Children, opts: Options, backend: str, config: Path
) -> tuple[Child, str, str]:
    """``fencegate serve`` from ``config``, as shipped; its control and proxy URLs."""
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
    return gateway, f"http://{match.group(1)}", f"http://{match.group(2)}"


def run_backend(
    children: Children,
    opts: Options,
    backend: str,
    upstream_url: str,
    upstream_pid: int,
    rows: list[dict[str, Any]],
    check_url: str | None = None,
) -> None:
    folder, db = new_database(children, opts, backend)
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
        gateway, control, proxy = start_gateway(children, opts, backend, config)
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


# -- the open loop (--open-loop) ---------------------------------------------------------


def run_open_loop(
    children: Children,
    opts: Options,
    backend: str,
    upstream: tuple[str, int],
    bare: tuple[str, int],
    rows: list[dict[str, Any]],
) -> None:
    """``fencegate serve`` on ``backend`` and the bare proxy at each rate in turn
    (``bench.open_loop``), then, on PostgreSQL, the transactions per first write, replay
    and refusal (``bench.xacts``), the gateway alone by then. ``upstream``, ``bare``:
    their URL and pid; every process's CPU is sampled, so each rate also says how busy
    the machine was with other work meanwhile."""
    upstream_url, bare_url = upstream[0], bare[0]
    folder, db = new_database(children, opts, backend)
    db.create()
    gateway: Child | None = None
    try:
        config = write_config(folder, db.url, upstream_url, server_timing=True)
        migrate(children, config)
        seed_records(db, opts.seed_records[0])
        db.vacuum("jobs", "leases", "idempotency_records", "audit_log")
        gateway, control, proxy = start_gateway(children, opts, backend, config)
        floor = None
        if backend == "postgres":
            print("  measuring the floor: two durable commits, one client ...", flush=True)
            floor = asyncio.run(two_commits(db.dsn, 30 if opts.quick else SAMPLES))
        tag = f"o{secrets.token_hex(2)}"
        out = children.workdir / f"open-loop-{backend}.json"
        argv = [
            sys.executable,
            "-m",
            "bench.open_loop",
            "--gateway",
            proxy + WRITE_PATH,
            "--bare",
            bare_url + WRITE_PATH,
            "--control",
            control,
            "--rates",
            ",".join(f"{r:g}" for r in opts.rates),
            "--seconds",
            str(opts.duration),
            "--slice",
            str(opts.slice),
            "--jobs",
            str(opts.jobs),
            "--client",
            opts.client,
            "--tag",
            tag,
            "--out",
            str(out),
        ]
        print(f"  running the open loop on {backend} ...", flush=True)
        driver = children.start(f"open-loop-{backend}", argv)
        watch = Watch(
            {
                "driver": driver.pid,
                "server": gateway.pid,
                "bare": bare[1],
                "upstream": upstream[1],
                "orchestrator": os.getpid(),
            },
            postgres_db=db.name,
        )
        # Each rate: two warm-up slices and 2 x --duration counted, plus the drains.
        deadline = time.monotonic() + len(opts.rates) * (4 * opts.duration + 120) + 120
        try:
            while driver.process.poll() is None:
                watch.sample()
                for child in children.started:
                    if child is not driver and not child.alive():
                        raise BenchError(f"{child.name} died during the open loop")
                if time.monotonic() > deadline:
                    raise BenchError(f"open loop on {backend}: the driver did not finish")
                time.sleep(0.25)
        finally:
            children.stop(driver)
        if driver.process.returncode != 0 or not out.exists():
            raise BenchError(f"open loop on {backend}: driver failed:\n{driver.output()}")
        result: dict[str, Any] = json.loads(out.read_text())
        for rate in result["rates"]:
            rate.update(watch.summary(rate["start_epoch"], rate["end_epoch"]))
        if backend == "postgres" and opts.xact_writes:
            print("  counting PostgreSQL's transactions per write ...", flush=True)
            assert db.admin_dsn is not None and db.name is not None
            result["transactions"] = asyncio.run(
                count_transactions(
                    db.admin_dsn,
                    db.name,
                    proxy + WRITE_PATH,
                    control,
                    body_of(1024),
                    opts.xact_writes,
                    f"x{secrets.token_hex(2)}",
                )
            )
        result["autovacuum"] = db.setting("autovacuum")
        result["floor"] = floor
        rows.append({"section": "open-loop", "backend": backend, **result})
    finally:
        if gateway is not None:
            children.stop(gateway)
        try:
            db.drop()
        except Exception as error:
            print(f"bench: dropping the database {db.name}: {error}", file=sys.stderr)
