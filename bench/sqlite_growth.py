"""What a fenced write costs SQLite as the records table grows: the gateway's own
``admit`` and ``settle`` (``gateway.records.store``, the real catalogue and backend) in process,
without HTTP, on a fresh migrated database, with a fresh random key per write as the
benchmark's writes have (or, with ``--keys ordered``, keys that sort by time, as UUIDv7
and ULIDs do).

Each step prints how many records the table holds and the cost per write over the
step: wall-clock seconds and the process's CPU seconds, divided by the step's writes
(``--concurrency`` writes at a time on one event loop, so wall-clock per write is the
inverse of throughput), and, on Linux, the process's read and write system calls per
write (``/proc/self/io``): SQLite reads a page it does not hold in its cache with one
``pread`` and writes each page of a commit with one ``pwrite``, so these count pages
(plus a constant few reads of the event loop's wakeups) and do not depend on the
machine's speed. What grows here grows in the soak too; what
stays flat here and grows in the soak is not SQLite's.

    .venv/bin/python -m bench.sqlite_growth [--writes 1000000] [--step 50000]
        [--keys random|ordered]

Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from gateway.fencing.fence import RecordState
from gateway.records import migrate
from gateway.records.store import GatewayStore, WriteRequest
from lease_core import tokens
from lease_core.db import create_engine
from lease_core.store import LeaseStore


def random_key() -> str:
    return str(uuid.uuid4())


def ordered_key() -> str:
    """A UUIDv7's layout: 48 bits of milliseconds first, then random bits."""
    random_part = uuid.uuid4().hex
    return f"{time.time_ns() // 1_000_000:012x}-{random_part[:4]}-7{random_part[5:20]}"


KEYS = {"random": random_key, "ordered": ordered_key}
PROC_IO = Path("/proc/self/io")


def syscalls() -> tuple[int, int] | None:
    """The process's read and write system calls so far (Linux), else None."""
    try:
        fields = dict(line.split(": ") for line in PROC_IO.read_text().splitlines())
    except OSError:
        return None
    return int(fields["syscr"]), int(fields["syscw"])


async def grow(
    path: Path, *, writes: int, step: int, jobs: int, concurrency: int, keys: str
) -> None:
    new_key = KEYS[keys]
    url = f"sqlite+aiosqlite:///{path}"
    await asyncio.to_thread(migrate.upgrade, url)
    engine = create_engine(url)
    leases = LeaseStore(engine)
    store = GatewayStore(leases)
    hashes = []
    for i in range(jobs):
        lease = await leases.acquire(job_id=f"job-{i:05d}", owner="w", ttl=86400, queue="q")
        assert lease.lease_token is not None
        hashes.append(tokens.hash_token(lease.lease_token))

    async def one(n: int) -> None:
        write = WriteRequest(
            token_hash=hashes[n % jobs],
            key=new_key(),
            fingerprint="f" * 64,
            upstream="api",
            method="POST",
            path="/v1/charges",
            deadline_in=30.0,
        )
        admission = await store.admit(write)
        assert admission.claimed and admission.attempt is not None and admission.presented
        await store.settle(
            admission.presented.job_id,
            write.key,
            admission.attempt,
            state=RecordState.COMPLETED,
            status=201,
            headers=[("content-type", "application/json")],
            body=b'{"id": "ch_1", "amount": 1000}',
        )

    async def worker(start: int, count: int) -> None:
        for n in range(start, start + count * concurrency, concurrency):
            await one(n)

    done = 0
    try:
        while done < writes:
            count = -(-min(step, writes - done) // concurrency)  # rounded up
            wall, cpu, calls = time.perf_counter(), time.process_time(), syscalls()
            await asyncio.gather(*(worker(done + c, count) for c in range(concurrency)))
            n = count * concurrency
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            after = syscalls()
            done += n
            print(
                json.dumps(
                    {
                        "keys": keys,
                        "records": done,
                        "us_per_write": round(wall / n * 1e6, 1),
                        "cpu_us_per_write": round(cpu / n * 1e6, 1),
                        "file_mib": round(path.stat().st_size / 2**20, 1),
                        **(
                            {
                                "reads_per_write": round((after[0] - calls[0]) / n, 2),
                                "writes_per_write": round((after[1] - calls[1]) / n, 2),
                            }
                            if calls and after
                            else {}
                        ),
                    }
                ),
                flush=True,
            )
    finally:
        await engine.dispose()  # the driver-level connections too


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--writes", type=int, default=1_000_000)
    parser.add_argument("--step", type=int, default=50_000)
    parser.add_argument("--jobs", type=int, default=256, help="leased jobs (256)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--keys",
        choices=sorted(KEYS),
        default="random",
        help="idempotency keys: random (UUIDv4, the default) or ordered by time (UUIDv7)",
    )
    args = parser.parse_args(argv)
    if min(args.writes, args.step, args.jobs, args.concurrency) < 1:
        parser.error("--writes, --step, --jobs and --concurrency must be at least 1")
    with tempfile.TemporaryDirectory(prefix="fencegate-growth-") as tmp:
        asyncio.run(
            grow(
                Path(tmp) / "growth.db",
                writes=args.writes,
                step=args.step,
                jobs=args.jobs,
                concurrency=args.concurrency,
                keys=args.keys,
            )
        )


if __name__ == "__main__":
    main()
