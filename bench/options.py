"""The benchmark's command line (``python -m bench.run``): its options, their defaults
(full and ``--quick``) and the checks between them."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from bench.driver import CLIENTS

DEFAULT_PG_URL = os.environ.get(
    "FENCEGATE_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)

ALL_TARGETS = ("direct", "bare", "writes", "lease")


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
    parser.add_argument(
        "--duration",
        "--seconds",
        type=float,
        help="timed seconds per target (20; quick 1); --open-loop: per rate and target (10; "
        "quick 1)",
    )
    parser.add_argument("--warmup", type=float, help="warm-up seconds, not counted (3; quick 0.3)")
    parser.add_argument("--concurrency", type=int, help="concurrent loops (32; quick 8)")
    parser.add_argument(
        "--jobs", type=int, help="jobs holding a live lease (256; --open-loop 64; quick 16)"
    )
    parser.add_argument(
        "--backends", "--db", default="sqlite,postgres", help="comma list of sqlite, postgres"
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
        help="fencegate serve --log-level (default INFO, as shipped: JSON lines written to "
        "a file; no access line per request, which serve writes only with --access-log)",
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
    parser.add_argument(
        "--open-loop",
        action="store_true",
        help="open-loop mode: fenced writes at fixed rates (--rates), each request sent at "
        "its scheduled time whatever the answers before it, the gateway and the bare proxy "
        "in interleaved slices; the gateway's added p50 / p99 per rate, and on PostgreSQL "
        "the transactions per first write, replay and refusal",
    )
    parser.add_argument(
        "--rates",
        metavar="LIST",
        help="--open-loop: writes a second, a comma list, run in order up to the first the "
        "gateway cannot keep up with (50,100,300,1000; quick 20,40)",
    )
    parser.add_argument(
        "--slice",
        type=float,
        metavar="SECONDS",
        help="--open-loop: the length of each interleaved slice of one target (1; quick 0.5)",
    )
    parser.add_argument(
        "--xact-writes",
        type=int,
        metavar="N",
        help="--open-loop on PostgreSQL: writes in each batch whose transactions are counted "
        "(200; quick 20; 0: none counted)",
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
    open_loop: bool = False  # --open-loop: fixed rates, added latency, transactions per write
    rates: tuple[float, ...] = ()  # --open-loop: writes a second, in order
    slice: float = 1.0  # --open-loop: seconds of each interleaved slice
    xact_writes: int = 0  # --open-loop, PostgreSQL: writes per counted batch


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
    if args.open_loop and args.soak is not None:
        raise SystemExit("--open-loop and --soak: one mode at a time")
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
    rates: tuple[float, ...] = ()
    if args.open_loop:
        try:
            rates = tuple(float(r) for r in pick(args.rates, "50,100,300,1000", "20,40").split(","))
        except ValueError:
            raise SystemExit("--rates: a comma list of writes a second, e.g. 50,100,300") from None
        if not rates or min(rates) <= 0:
            raise SystemExit("--rates: every rate must be above zero")
        if args.slice is not None and args.slice <= 0:
            raise SystemExit("--slice: must be above zero (seconds)")
        if args.xact_writes is not None and args.xact_writes < 0:
            raise SystemExit("--xact-writes: must be 0 or more")
        targets = ["bare", "writes"]
    else:
        for name in ("rates", "slice", "xact_writes"):
            if getattr(args, name) is not None:
                raise SystemExit(f"--{name.replace('_', '-')}: only with --open-loop")
    if args.duration is not None and args.duration <= 0:
        raise SystemExit("--duration: must be above zero (seconds)")
    full_duration = 10.0 if args.open_loop else 20.0
    return Options(
        quick=quick,
        duration=args.soak if args.soak is not None else pick(args.duration, full_duration, 1.0),
        warmup=pick(args.warmup, 3.0, 0.3),
        concurrency=pick(args.concurrency, 32, 8),
        jobs=pick(args.jobs, 64 if args.open_loop else 256, 16),
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
        open_loop=bool(args.open_loop),
        rates=rates,
        slice=pick(args.slice, 1.0, 0.5),
        xact_writes=pick(args.xact_writes, 200, 20) if args.open_loop else 0,
    )
