"""Instructions per fenced write against the bare proxy's per request, counted by
callgrind: ``python -m bench.instructions`` (docs/performance.md, "Instructions per
write").

``bench.run``'s CPU ratio reads each process's CPU seconds, which move by 15 % between
rounds on a shared VM: a cut of 2 % does not show in three rounds. Callgrind counts the
instructions a process executes, which do not depend on what else the machine is doing
(the same count twice for the same code and inputs, up to the event loop's wake-ups):
a measure of the Python path's cost, in user space only (the kernel's work for a
system call is not counted, so the ratio is not the CPU ratio; it tells which of two
trees spends less).

Each target runs under ``valgrind --tool=callgrind --instr-atstart=no``: served
uninstrumented (faster) through ``--warmup`` requests, then instrumented, zeroed, and
dumped after ``--requests`` more, one at a time on one kept-alive connection (the
lone caller's path: no batching, a wake-up of the loop per request). The targets: the
bare proxy (``bench.bare_proxy``) and ``fencegate serve`` on each backend, each write
with a lease's token and a key of its own, so each is admitted and forwarded. Printed:
instructions per request and per fenced write, and their ratio.

It needs valgrind (Debian's ``valgrind`` package: ``callgrind_control`` comes with it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

if __package__ in (None, ""):  # run as a file: python bench/instructions.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.measure import GATEWAY_READY, migrate, write_config
from bench.options import DEFAULT_PG_URL
from bench.processes import READY, BenchError, Child, Children, start_server
from bench.seed import WRITE_PATH
from bench.workers import fresh_database, take_leases

VALGRIND_MISSING = (
    "bench.instructions: valgrind is missing: it counts the instructions. Install "
    "Debian's valgrind package (apt-get install valgrind)."
)
BODY = b'{"amount":1250,"currency":"eur"}'
TOTALS = re.compile(r"^(?:totals|summary):\s+(\d+)", re.MULTILINE)
# Under callgrind a server starts several times slower than alone.
READY_SECONDS = 300.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.instructions",
        description="Instructions per fenced write (fencegate serve) against the bare "
        "proxy's per request, counted by callgrind.",
    )
    p.add_argument("--backends", default="sqlite,postgres", help="comma list of sqlite, postgres")
    p.add_argument("--postgres-url", default=DEFAULT_PG_URL)
    p.add_argument("--requests", type=int, default=300, help="counted requests per target (300)")
    p.add_argument("--warmup", type=int, default=200, help="requests before counting (200)")
    p.add_argument("--jobs", type=int, default=16, help="jobs holding a lease (16)")
    p.add_argument("--rounds", type=int, default=1, help="times each target is counted (1)")
    p.add_argument("--json", help="write every count and the ratios to this file")
    p.add_argument(
        "--dumps",
        help="keep callgrind's dump of each count in this folder (read them with "
        "callgrind_annotate: where in the process the instructions went, by C function)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print(VALGRIND_MISSING, file=sys.stderr)
        return 2
    if args.requests < 1 or args.warmup < 0:
        print(
            "bench.instructions: --requests must be 1 or more, --warmup 0 or more", file=sys.stderr
        )
        return 2
    backends = [b for b in args.backends.split(",") if b]
    workdir = Path(tempfile.mkdtemp(prefix="fencegate-bench-instructions-"))
    children = Children(workdir)
    counts: list[dict[str, Any]] = []
    try:
        _, upstream_url = start_server(
            children, "upstream", [sys.executable, "-m", "bench.upstream"]
        )
        for index in range(args.rounds):
            for target in ["bare", *backends]:
                count = measure(children, args, target, upstream_url, index)
                counts.append(count)
                print(
                    f"  round {index + 1} {target:<8} {count['per_request']:>12,.0f} "
                    f"instructions a request ({count['requests']} counted)",
                    flush=True,
                )
    finally:
        children.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    ratios = report(counts, backends)
    if args.json:
        Path(args.json).write_text(json.dumps({"counts": counts, "ratios": ratios}, indent=2))
    return 0


def measure(
    children: Children, args: argparse.Namespace, target: str, upstream_url: str, index: int
) -> dict[str, Any]:
    """One target counted: started under callgrind, warmed, counted, stopped."""
    name = f"{target}-{index}-{secrets.token_hex(2)}"
    folder = children.workdir / name
    folder.mkdir()
    out = folder / "callgrind.out"
    if target == "bare":
        server = children.start(
            name,
            _under_callgrind(out, ["-m", "bench.bare_proxy", "--upstream", upstream_url]),
        )
        try:
            url = server.wait_for(READY, timeout=READY_SECONDS).group(1)
            tokens = ["bare"]
            return _count(server, out, f"http://{url}{WRITE_PATH}", tokens, args, target)
        finally:
            children.stop(server)
    db = fresh_database(args, target, folder)
    db.create()
    try:
        config = write_config(folder, db.url, upstream_url)
        migrate(children, config)
        serve = ["-c", "import sys; from gateway.service.cli import main; sys.exit(main())"]
        argv = [*serve, "serve", "--config", str(config), "--log-level", "WARNING"]
        server = children.start(name, _under_callgrind(out, argv))
        try:
            match = server.wait_for(GATEWAY_READY, timeout=READY_SECONDS)
            control, proxy = f"http://{match.group(1)}", f"http://{match.group(2)}"
            tokens = take_leases(control, args.jobs)
            return _count(server, out, proxy + WRITE_PATH, tokens, args, target)
        finally:
            children.stop(server)
    finally:
        db.drop()


def _under_callgrind(out: Path, python_args: list[str]) -> list[str]:
    return [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}",
        sys.executable,
        *python_args,
    ]


def _count(
    server: Child,
    out: Path,
    url: str,
    tokens: list[str],
    args: argparse.Namespace,
    target: str,
) -> dict[str, Any]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    prefix = secrets.token_hex(4)
    sent = 0

    def send(n: int) -> None:
        nonlocal sent
        for _ in range(n):
            headers = {
                "Fencing-Token": tokens[sent % len(tokens)],
                "Idempotency-Key": f"{prefix}-{sent}",
                "Content-Type": "application/json",
            }
            connection.request("POST", parts.path, BODY, headers)
            answer = connection.getresponse()
            body = answer.read()
            sent += 1
            if answer.status // 100 != 2:
                raise BenchError(f"{target}: answered {answer.status}: {body[:300]!r}")

    try:
        send(args.warmup)
        _control(server, "--instr=on")
        send(1)  # the first instrumented request pays for nothing more; zeroed after it
        _control(server, "--zero")
        send(args.requests)
        _control(server, "--dump")
    finally:
        connection.close()
    dump, total = _dumped(out)
    if args.dumps:
        Path(args.dumps).mkdir(parents=True, exist_ok=True)
        shutil.copy(dump, Path(args.dumps) / f"callgrind.{out.parent.name}.out")
    return {
        "target": target,
        "requests": args.requests,
        "instructions": total,
        "per_request": total / args.requests,
    }


def _control(server: Child, option: str) -> None:
    done = subprocess.run(
        ["callgrind_control", option, str(server.pid)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise BenchError(f"callgrind_control {option} failed:\n{done.stdout}{done.stderr}")


def _dumped(out: Path) -> tuple[Path, int]:
    """The dump just asked for (``out`` with the dump's number after it; the last one
    first) and its instructions."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for dump in sorted(out.parent.glob(f"{out.name}*"), reverse=True):
            match = TOTALS.search(dump.read_text(errors="replace"))
            if match is not None:
                return dump, int(match.group(1))
        time.sleep(0.2)
    raise BenchError(f"no callgrind dump with totals in {out.parent}")


def report(counts: list[dict[str, Any]], backends: list[str]) -> dict[str, float]:
    """Per backend, the least count of its rounds over the bare proxy's least (the least
    is the one the fewest wake-ups of the loop added to)."""
    least = {
        target: min(c["per_request"] for c in counts if c["target"] == target)
        for target in ["bare", *backends]
    }
    ratios = {}
    print("\ninstructions per fenced write / the bare proxy's per request (least of rounds):")
    for backend in backends:
        ratios[backend] = least[backend] / least["bare"]
        print(
            f"  {backend:<8} {ratios[backend]:.3f}x  ({least[backend]:,.0f} / {least['bare']:,.0f})"
        )
    return ratios


if __name__ == "__main__":
    sys.exit(main())
