"""What the benchmark reads beside the load: the CPU time of each process under test
(and of PostgreSQL's backends), the machine's busy time and the server's memory while a
driver runs (``Watch``); during a soak, once a second, PostgreSQL's background work
(``Maintenance``) or SQLite's files (``SqliteFiles``)."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from bench.common import proc_status_kib
from bench.pgadmin import PG_STATE

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


# -- a soak's readings, once a second -----------------------------------------------------


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
        import asyncpg  # type: ignore[import-untyped]

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
