"""``python -m verify mutants``: can the verification fail? Each mutant of
``verify.mutations`` (a small, plausible bug in the fencing rules) is applied to a copy of
this tree, and a short ``verify run --stop-on-violation`` is made against the copy; a
mutant the run finds a violation for is *killed*, one it does not *survives*. The
unmutated tree is run the same way first, with the same seeds (the baseline): it must
have no violation, or the kills mean nothing.

It prints a row per run (mutant, database, seed, seconds from the fault window's opening
to the first violation, killed or survived, the invariants broken) and writes
``mutants.json`` in ``--out``, where each run's files stay (``<mutant>-<db>-<seed>/``).
Exit 0: every mutant killed on every seed and the baseline clean; 1: a mutant survived or
the baseline had a violation; 2: a mutant no longer applies or a run could not start.
A mutant with ``run_args`` runs with those ``verify run`` arguments (``--resolving``: a
workload that masks other mutants; ``--nemesis shutdown``: the one nemesis that reaches
it, in place of ``--nemesis``'s), and so does a baseline of its own (``none+resolving``,
``none+nemesis+shutdown``).
A mutant that names no database is one the verification cannot reach (the workload does
not exercise its layer, or another layer masks it): it is listed, not run.

The copy is the working tree's files that git knows or would add (tracked and untracked,
not ignored), so uncommitted changes are tested too. Its processes import the copy:
``PYTHONPATH`` names it, ahead of the editable install.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from verify.mutations import MUTANTS, Mutant, MutationError, apply, by_name

REPO = Path(__file__).resolve().parents[1]
DATABASES = ("sqlite", "pg")
BASELINE = "none"


@dataclass
class Outcome:
    """One verification run against one mutant (or the baseline), one database, one seed."""

    mutant: str
    rule: str
    db: str
    seed: int
    verdict: str  # "killed", "survived", "clean" (baseline), "violated" (baseline), "error"
    seconds: float | None = None  # from the window's opening to the first violation
    invariants: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    out: str = ""
    error: str = ""

    @property
    def failed(self) -> bool:
        return self.verdict in ("survived", "violated", "error")


def copy_tree(source: Path, dest: Path) -> int:
    """The files git knows or would add under ``source``, copied to ``dest``; how many."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=source,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    count = 0
    for raw in listed:
        if not raw:
            continue
        relative = raw.decode()
        path = source / relative
        if not path.is_file():  # deleted in the working tree, not yet in git
            continue
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        count += 1
    return count


def verify_argv(
    options: argparse.Namespace, db: str, seed: int, out: Path, extra: tuple[str, ...] = ()
) -> list[str]:
    return [*_argv(options, db, seed, out), *extra]


def _argv(options: argparse.Namespace, db: str, seed: int, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "verify", "run",
        "--db", db,
        "--seconds", f"{options.seconds:g}",
        "--tail", f"{options.tail:g}",
        "--nemesis", options.nemesis,
        "--seed", str(seed),
        "--out", str(out),
        "--stop-on-violation",
    ]  # fmt: skip


def baseline_name(extra: tuple[str, ...]) -> str:
    """The unmutated tree's name in the rows: ``none``, or with the run arguments some
    mutants need (``none+resolving``)."""
    return BASELINE + "".join(f"+{arg.lstrip('-')}" for arg in extra)


def run_one(
    options: argparse.Namespace,
    mutant: Mutant | None,
    db: str,
    seed: int,
    out: Path,
    extra: tuple[str, ...] = (),
) -> Outcome:
    """A verification of the tree with ``mutant`` applied (None: the baseline), with the
    ``verify run`` arguments ``extra`` (the mutant's ``run_args``)."""
    name = mutant.name if mutant else baseline_name(extra)
    outcome = Outcome(name, mutant.rule if mutant else "-", db, seed, "error", out=str(out))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"fencegate-mutant-{name}-") as tmp:
        tree = Path(tmp)
        copy_tree(REPO, tree)
        if mutant is not None:
            apply(mutant, tree)
        env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "verify.log", "w", encoding="utf-8") as log:
            try:
                code = subprocess.run(
                    verify_argv(options, db, seed, out, extra),
                    cwd=tree,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=options.seconds + options.tail + 600,
                    check=False,
                ).returncode
            except subprocess.TimeoutExpired:
                code = -1
    outcome.elapsed = round(time.monotonic() - started, 1)
    try:
        summary = json.loads((out / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = None
    if code not in (0, 1) or summary is None or summary.get("violations") is None:
        tail = (out / "verify.log").read_text(encoding="utf-8", errors="replace")[-1500:]
        outcome.error = f"verify run exited {code}: {tail}"
        return outcome
    safety = [v for v in summary["violations"] if v["name"] != "liveness"]
    outcome.invariants = sorted({v["name"] for v in summary["violations"]})
    outcome.seconds = summary.get("first_violation_seconds")
    if mutant is None:
        outcome.verdict = "violated" if safety else "clean"
    else:
        outcome.verdict = "killed" if safety else "survived"
    return outcome


def render(outcome: Outcome) -> str:
    seconds = "-" if outcome.seconds is None else f"{outcome.seconds:.1f}"
    broken = ", ".join(outcome.invariants) or "-"
    return (
        f"{outcome.mutant:<28} {outcome.rule:<17} {outcome.db:<7} {outcome.seed:>10} "
        f"{seconds:>8} {outcome.verdict:<9} {broken}"
    )


HEADER = (
    f"{'mutant':<28} {'rule':<17} {'db':<7} {'seed':>10} {'first (s)':>8} "
    f"{'verdict':<9} invariants broken"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m verify mutants",
        description="Apply each mutant of verify/mutations.py to a copy of the tree and run "
        "a short verification against it: every mutant must be killed, the unmutated tree "
        "must stay clean (docs/verification.md).",
    )
    parser.add_argument("--db", default="sqlite", help="comma list of sqlite, pg (default sqlite)")
    parser.add_argument("--seconds", type=float, default=60.0, help="fault window (default 60)")
    parser.add_argument("--tail", type=float, default=10.0, help="settling seconds (default 10)")
    parser.add_argument("--nemesis", default="all", help="as verify run's (default all)")
    parser.add_argument(
        "--seeds", default="1", help="comma list of seeds, each mutant run once per seed"
    )
    parser.add_argument("--fast", action="store_true", help="only the mutants marked fast")
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="NAME",
        help="only these mutants (names, or comma lists of names; --list shows them)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated tree's runs")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--out", type=Path, default=None, help="default verify-runs/mutants-<time>")
    return parser


def chosen(options: argparse.Namespace) -> list[Mutant]:
    names = [n.strip() for word in options.only for n in word.split(",") if n.strip()]
    mutants = by_name(names) if names else list(MUTANTS)
    mutants = [m for m in mutants if not m.pending]
    if options.fast:
        mutants = [m for m in mutants if m.fast]
    return mutants


def main(argv: Sequence[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    try:
        mutants = chosen(options)
    except MutationError as error:
        print(f"verify mutants: {error}")
        return 2
    if options.list:
        for m in MUTANTS:
            dbs = ",".join(sorted(m.databases))
            dbs = "pending" if m.pending else dbs or "unreached"
            needs = f"(verify run {' '.join(m.run_args)}) " if m.run_args else ""
            print(
                f"{m.name:<28} {m.rule:<17} {dbs:<10} {'fast' if m.fast else '':<5} {needs}{m.why}"
            )
        return 0
    databases = [d.strip() for d in options.db.split(",") if d.strip()]
    try:
        seeds = [int(s) for s in options.seeds.split(",") if s.strip()]
    except ValueError:
        print(f"verify mutants: --seeds is a comma list of integers, not {options.seeds!r}")
        return 2
    unknown = [d for d in databases if d not in DATABASES]
    if unknown or not databases or not seeds or options.seconds <= 0 or options.tail < 0:
        print("verify mutants: --db of sqlite, pg; --seeds given; --seconds above 0")
        return 2
    out = options.out or Path("verify-runs") / f"mutants-{time.strftime('%Y%m%d-%H%M%S')}"
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    blind = [m for m in mutants if not m.databases]
    plan: list[tuple[Mutant | None, str, int, tuple[str, ...]]] = []
    for db in databases:
        running = [m for m in mutants if db in m.databases]
        # One baseline per set of run arguments the mutants run with (the workload
        # differs: each mutant is judged against the unmutated tree under its own).
        extras = sorted({m.run_args for m in running}) or [()]
        if not options.no_baseline:
            plan += [(None, db, seed, extra) for extra in extras for seed in seeds]
        plan += [(m, db, seed, m.run_args) for m in running for seed in seeds]
    print(
        f"mutants: {len(mutants)} mutant(s), {len(plan)} run(s) of --seconds "
        f"{options.seconds:g} --nemesis {options.nemesis} (a mutant's run_args after it) on "
        f"{', '.join(databases)}, seeds "
        f"{', '.join(map(str, seeds))}; files in {out}",
        flush=True,
    )
    print(HEADER, flush=True)
    outcomes: list[Outcome] = []
    for index, (mutant, db, seed, extra) in enumerate(plan, start=1):
        name = mutant.name if mutant else baseline_name(extra)
        try:
            outcome = run_one(options, mutant, db, seed, out / f"{name}-{db}-{seed}", extra)
        except MutationError as error:
            print(f"verify mutants: {name} no longer applies: {error}")
            return 2
        outcomes.append(outcome)
        print(f"{render(outcome)}   [{index}/{len(plan)}, {outcome.elapsed:.0f} s]", flush=True)
        if outcome.verdict == "error":
            print(f"  {outcome.error}", flush=True)
    (out / "mutants.json").write_text(
        json.dumps([asdict(o) for o in outcomes], indent=2) + "\n", encoding="utf-8"
    )
    killed = sum(o.verdict == "killed" for o in outcomes)
    runs = sum(o.rule != "-" for o in outcomes)
    survived = [f"{o.mutant} ({o.db}, seed {o.seed})" for o in outcomes if o.verdict == "survived"]
    violated = [f"{o.db}, seed {o.seed}" for o in outcomes if o.verdict == "violated"]
    print(f"summary: {killed} of {runs} mutant run(s) killed")
    if blind:
        print(
            "not run, the verification cannot reach them (their unit tests kill them): "
            + "; ".join(f"{m.name} ({m.killed_by or 'no test named'})" for m in blind)
        )
    if survived:
        print(f"survived: {'; '.join(survived)}")
    if violated:
        print(f"the unmutated tree broke an invariant: {'; '.join(violated)}")
    pending = [m for m in MUTANTS if m.pending]
    if pending:
        print(
            "pending, their text is not in the tree yet: "
            + "; ".join(f"{m.name} ({m.pending})" for m in pending)
        )
    if any(o.verdict == "error" for o in outcomes):
        return 2
    return 1 if survived or violated else 0
