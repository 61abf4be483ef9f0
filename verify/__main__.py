"""``python -m verify run ...``, ``python -m verify check HISTORY LEDGER`` and
``python -m verify mutants ...``."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from verify import check
from verify.etcd_locks import etcd_binary
from verify.locks import redis_binary
from verify.nemesis import ETCD_NEMESES, KINDS, LOCK_NEMESES, ZK_NEMESES
from verify.run import TAIL_SECONDS, Options, SetupError, choose_nemeses, run
from verify.zk_locks import zk_binary

DEFAULT_LOCK_WORKERS = 3
DEFAULT_SIGNED_WORKERS = 1


def _store_lock_workers(
    given: int | None,
    option: str,
    its_nemeses: frozenset[str],
    nemeses: list[str],
    direct: bool,
    binary: Callable[[], str | None],
    needs: str,
) -> int | None:
    """How many lock workers of a store of the run's own (etcd, ZooKeeper) to run: as
    ``--{option}-lock-workers`` says, or 3 when one of ``its_nemeses`` runs; None (after
    saying why) when the number is out of range, given with ``--direct``, or the store
    is not installed."""
    workers = given
    if workers is None:
        workers = DEFAULT_LOCK_WORKERS if its_nemeses & set(nemeses) else 0
    if not 0 <= workers <= 64 or (direct and workers):
        print(
            f"verify: --{option}-lock-workers 0..64, and none with --direct (they need the gateway)"
        )
        return None
    if workers and binary() is None:
        print(f"verify: {needs}")
        return None
    return workers


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a share between 0 and 1, not {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m verify",
        description="Jepsen-style verification of Fencegate (docs/verification.md).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    r = sub.add_parser(
        "run",
        help="start a real system, drive it under faults, check the result",
        description="Start gateway replicas, a recording upstream and workers, inject "
        "faults for --seconds, then check history.jsonl against ledger.jsonl. Exit 0: no "
        "violation, 1: a violation, 2: the run could not start or its files are unreadable.",
        epilog="nemeses: "
        + "; ".join(
            f"{k.name}: {k.describe}"
            + (f" (--db {', '.join(sorted(k.databases))})" if len(k.databases) == 1 else "")
            for k in KINDS.values()
        ),
    )
    r.add_argument(
        "--db",
        choices=["sqlite", "pg", "patroni"],
        default="sqlite",
        help="pg: one PostgreSQL; patroni: three, replicated synchronously, failing over",
    )
    r.add_argument("--seconds", type=float, default=60.0, help="fault window (default 60)")
    r.add_argument(
        "--nemesis",
        default="all",
        help=f"comma list of {', '.join(KINDS)}; or all (every one the database allows; "
        "lock-loss where redis-server is installed) or none (default all); each is "
        "described below",
    )
    r.add_argument(
        "--direct",
        action="store_true",
        help="workers write straight to the upstream, no gateway (the baseline)",
    )
    r.add_argument("--seed", type=int, default=None, help="repeat a run's fault plan")
    r.add_argument("--out", type=Path, default=None, help="default ./verify-runs/<timestamp>")
    r.add_argument(
        "--tail",
        type=float,
        default=TAIL_SECONDS,
        help=f"seconds to settle after the faults (default {TAIL_SECONDS:g})",
    )
    r.add_argument("--workers", type=int, default=8)
    r.add_argument(
        "--lock-workers",
        type=int,
        default=None,
        help="workers of Redis locks (verify/locks.py), besides --workers (default "
        f"{DEFAULT_LOCK_WORKERS} with lock-loss, else 0)",
    )
    r.add_argument(
        "--etcd-lock-workers",
        type=int,
        default=None,
        help="workers of etcd locks (verify/etcd_locks.py), besides --workers (default "
        f"{DEFAULT_LOCK_WORKERS} with etcd-loss, else 0)",
    )
    r.add_argument(
        "--zk-lock-workers",
        type=int,
        default=None,
        help="workers of ZooKeeper locks (verify/zk_locks.py), besides --workers (default "
        f"{DEFAULT_LOCK_WORKERS} with zk-loss, else 0)",
    )
    r.add_argument(
        "--signed-workers",
        type=int,
        default=None,
        help="workers of signed tokens (verify/signed.py), besides --workers (default "
        f"{DEFAULT_SIGNED_WORKERS}; 0 with --direct)",
    )
    r.add_argument(
        "--resolving",
        action="store_true",
        help="give the replicas a second upstream, dedup, whose unknown outcomes the gateway "
        "resolves itself (a key kept 4 s), and send a quarter of the jobs there",
    )
    r.add_argument("--replicas", type=int, default=None, help="default 1 (sqlite), 3 (pg, patroni)")
    r.add_argument(
        "--min-completed",
        type=_share,
        default=0.0,
        metavar="SHARE",
        help="fail when fewer claimed jobs completed (0-1; default 0: only on none)",
    )
    r.add_argument(
        "--stop-on-violation",
        action="store_true",
        help="check the files every few seconds and stop at the first safety violation "
        "(python -m verify mutants runs so)",
    )
    sub.add_parser("check", help="check a history against a ledger", add_help=False)
    sub.add_parser(
        "mutants", help="run the verification against each mutant: can it fail?", add_help=False
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["check"]:
        return check.main(args_list[1:])
    if args_list[:1] == ["mutants"]:
        from verify import mutants  # the catalogue is read only for this command

        return mutants.main(args_list[1:])
    args = build_parser().parse_args(args_list)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**9)
    print(f"seed: {seed}", flush=True)
    replicas = args.replicas or (1 if args.db == "sqlite" else 3)
    if args.db == "sqlite" and replicas != 1:
        print("verify: SQLite runs one replica (use --db pg for several)")
        return 2
    if not 1 <= args.workers <= 64 or not 1 <= replicas <= 8 or args.seconds <= 0 or args.tail < 0:
        print("verify: --workers 1..64, --replicas 1..8, --seconds above 0, --tail 0 or more")
        return 2
    try:
        nemeses, notes = choose_nemeses(args.nemesis, args.db)
    except SetupError as error:
        print(f"verify: {error}")
        return 2
    lock_workers = args.lock_workers
    if lock_workers is None:
        lock_workers = DEFAULT_LOCK_WORKERS if LOCK_NEMESES & set(nemeses) else 0
    if args.direct and lock_workers:
        if args.lock_workers or args.nemesis != "all":
            print("verify: the lock workers and lock-loss need the gateway (not --direct)")
            return 2
        nemeses = [n for n in nemeses if n not in LOCK_NEMESES]
        lock_workers = 0
    if not 0 <= lock_workers <= 64:
        print("verify: --lock-workers 0..64")
        return 2
    etcd_workers = _store_lock_workers(
        args.etcd_lock_workers, "etcd", ETCD_NEMESES, nemeses, args.direct,
        etcd_binary, "the etcd lock workers need etcd: apt-get install etcd-server",
    )  # fmt: skip
    zk_workers = _store_lock_workers(
        args.zk_lock_workers, "zk", ZK_NEMESES, nemeses, args.direct,
        zk_binary, "the ZooKeeper lock workers need ZooKeeper: apt-get install zookeeper",
    )  # fmt: skip
    if etcd_workers is None or zk_workers is None:
        return 2
    signed_workers = args.signed_workers
    if signed_workers is None:
        signed_workers = 0 if args.direct else DEFAULT_SIGNED_WORKERS
    if args.direct and args.resolving:
        print("verify: --resolving needs the gateway (not --direct)")
        return 2
    if not 0 <= signed_workers <= 64 or (args.direct and signed_workers):
        print("verify: --signed-workers 0..64, and none with --direct (they need the gateway)")
        return 2
    if lock_workers and not args.direct and redis_binary() is None:
        print("verify: the lock workers need redis-server: apt-get install redis-server")
        return 2
    for note in notes:
        print(note)
    out = args.out or Path("verify-runs") / time.strftime("%Y%m%d-%H%M%S")
    if any((out / name).exists() for name in ("history.jsonl", "ledger.jsonl")):
        print(f"verify: {out} holds an earlier run: give a new --out")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    options = Options(
        db=args.db,
        seconds=args.seconds,
        nemesis=nemeses,
        direct=args.direct,
        seed=seed,
        out=out.resolve(),
        workers=args.workers,
        replicas=replicas,
        min_completed=args.min_completed,
        tail=args.tail,
        stop_on_violation=args.stop_on_violation,
        lock_workers=lock_workers,
        etcd_lock_workers=etcd_workers,
        zk_lock_workers=zk_workers,
        signed_workers=signed_workers,
        resolving=args.resolving,
    )
    print(
        f"run: --db {args.db} --seconds {args.seconds:g} --nemesis {','.join(nemeses) or 'none'}"
        f"{' --direct' if args.direct else ''} --workers {args.workers}"
        f"{f' --lock-workers {lock_workers}' if lock_workers else ''}"
        f"{f' --etcd-lock-workers {etcd_workers}' if etcd_workers else ''}"
        f"{f' --zk-lock-workers {zk_workers}' if zk_workers else ''}"
        f"{f' --signed-workers {signed_workers}' if signed_workers else ''}"
        f"{' --resolving' if args.resolving else ''} --replicas {replicas}"
        f" --out {options.out}",
        flush=True,
    )
    try:
        return asyncio.run(run(options))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("verify: interrupted (everything it started has been stopped)")
        return 2


if __name__ == "__main__":
    sys.exit(main())
