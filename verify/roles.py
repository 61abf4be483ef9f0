"""The people around the system during a run: a feeder that keeps jobs waiting, an
operator who settles unknown outcomes from the upstream's ledger, and an observer that
reads the workers' histories as they grow (the progress lines).

The operator does what ``tests/faults/harness.resolve_unknowns`` does, carefully: it only
resolves keys the gateway lists as ``unknown`` (never one being forwarded or re-sent), and
it says "applied" (with the upstream's answer) as soon as the ledger has the key, but "not
applied" only once the key has been unknown for a while *and* no partition has healed
recently: a request whose packets were dropped can still arrive at the upstream after the
gateway gave up on it (TCP retransmits it once the path is back), so "not in the ledger"
is only true once the network has been whole for longer than a retransmission takes.
Every key it sees held unknown goes to ``unknowns.jsonl`` (once per generation, with the
time of the listing) before it settles any: invariant 13 judges them.

The keys of the upstream whose unknown outcomes the gateway resolves itself
(``verify.worker.RESOLVING``) that the gateway may still re-send (``resolvable``) are
the gateway's: the operator leaves each alone for ``RESOLVER_HANDS_OFF`` seconds from
when it first saw it, until the upstream has forgotten the key and a re-send begun
before then has ended (the upstream's window, its timeout and twice the resolver's
margin). An operator who settled them at once would leave the resolver nothing to
re-send, and a resolver that re-sends outside the window (applying a write twice) would
go unseen.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from gateway.fencing.deadlines import RESOLVE_MARGIN
from verify.events import JsonlWriter
from verify.stack import DEDUP_WINDOW, UPSTREAM_TIMEOUT, Replica
from verify.worker import RESOLVING

QUEUE = "verify"
UNKNOWN_MIN_AGE = 3.0  # seconds a key stays unknown before "not applied" is said
NETWORK_QUIET = 12.0  # seconds since the last partition healed before "not applied"
RESOLVER_HANDS_OFF = DEDUP_WINDOW + UPSTREAM_TIMEOUT + 2 * RESOLVE_MARGIN


class Tail:
    """New complete lines of a JSON lines file, each call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


class Control:
    """Admin calls to whichever replica answers."""

    def __init__(self, replicas: list[Replica], token: str) -> None:
        self.replicas = replicas
        self.headers = {"Authorization": f"Bearer {token}"}
        self.turn = 0

    async def call(
        self, session: aiohttp.ClientSession, method: str, path: str, body: Any = None
    ) -> tuple[int, Any]:
        last: Exception | None = None
        for _ in range(len(self.replicas)):
            replica = self.replicas[self.turn % len(self.replicas)]
            self.turn += 1
            if not replica.alive():
                continue
            try:
                async with session.request(
                    method,
                    replica.control + path,
                    json=body,
                    headers=self.headers,
                    timeout=aiohttp.ClientTimeout(total=3),
                ) as resp:
                    raw = await resp.read()
                    return resp.status, json.loads(raw) if raw else None
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                last = error
        raise ConnectionError(f"no replica answered {method} {path}: {last}")


class Feeder:
    """Keeps about ``target`` jobs waiting on the queue.

    The lease API's pending jobs are not all claimable: on SQLite a job enqueued while the
    replica's clock ran minutes ahead becomes claimable only when the real clock gets
    there. So a pending job counts as waiting only while it is young (``FRESH`` seconds)
    and no worker has claimed it (``claimed``, kept by the observer); older unclaimed ones
    no longer hold new jobs back.
    """

    FRESH = 10.0

    def __init__(self, control: Control, target: int, claimed: set[str] | None = None) -> None:
        self.control = control
        self.target = target
        self.created = 0
        self.claimed = claimed if claimed is not None else set()
        self.born: dict[str, float] = {}

    def waiting(self, pending: list[str]) -> int:
        now = time.monotonic()
        young = [job for job in pending if now - self.born.get(job, now) < self.FRESH]
        return len([job for job in young if job not in self.claimed])

    async def fill(self, session: aiohttp.ClientSession) -> None:
        status, doc = await self.control.call(
            session, "GET", f"/v1/jobs?queue={QUEUE}&state=pending&limit={self.target}"
        )
        if status != 200:
            return
        pending = [item["job_id"] for item in doc["items"]]
        for _ in range(self.target - self.waiting(pending)):
            job = f"job-{self.created:05d}"
            body = {"queue": QUEUE, "job_id": job, "max_attempts": 1000}
            status, _ = await self.control.call(session, "POST", "/v1/jobs", body)
            if status in (201, 409):  # 409: created, its answer was lost
                self.created += 1
                self.born[job] = time.monotonic()

    async def fill_until_ready(self, timeout: float = 30.0) -> None:
        """The first jobs, before the workers start (the replicas may still be warming)."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    await self.fill(session)
                    if self.created:
                        return
                except (ConnectionError, aiohttp.ClientError, TimeoutError, KeyError) as error:
                    if time.monotonic() > deadline:
                        raise ConnectionError(f"could not enqueue jobs: {error}") from error
                if time.monotonic() > deadline:
                    raise ConnectionError("could not enqueue jobs: the lease API refused")
                await asyncio.sleep(0.2)

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                try:
                    await self.fill(session)
                except (ConnectionError, aiohttp.ClientError, TimeoutError, KeyError):
                    pass
                await _pause(stop, 0.5)


def resolution(job: str, key: str, entry: dict[str, Any] | None) -> dict[str, Any]:
    """The body of ``POST /admin/unknown-outcomes/resolve`` for a key: applied, with the
    upstream's answer, when ``entry`` (its ledger line) is there; else not applied."""
    body: dict[str, Any] = {"job_id": job, "key": key, "applied": entry is not None}
    if entry is not None:
        body |= {
            "status": entry["status"],
            "body": entry["answer"],
            "headers": {"Content-Type": "application/json; charset=utf-8"},
        }
    return body


def gateways(item: dict[str, Any]) -> bool:
    """Whether a listed unknown outcome is one the gateway may re-send itself."""
    return item.get("upstream") == RESOLVING and bool(item.get("resolvable"))


class Operator:
    """Settles unknown outcomes from the ledger, every second."""

    def __init__(
        self,
        control: Control,
        ledger: Path,
        network_quiet_for: Callable[[], float],
        unknowns: Path | None = None,
    ) -> None:
        self.control = control
        self.ledger = Tail(ledger)
        # Each key seen held unknown, once per generation, with when it was listed
        # (``unknowns.jsonl``, invariant 13): before the operator settles it.
        self.held = JsonlWriter(unknowns) if unknowns is not None else None
        self.seen_held: set[tuple[str, str, int]] = set()
        self.applied: dict[tuple[str, str], dict[str, Any]] = {}
        self.network_quiet_for = network_quiet_for
        self.first_seen: dict[tuple[str, str], float] = {}
        self.resolved: Counter[str] = Counter()

    async def sweep(self, session: aiohttp.ClientSession) -> None:
        listed_at = time.time()  # held then: no attempt invoked after it caused it
        status, doc = await self.control.call(session, "GET", "/admin/unknown-outcomes?limit=500")
        if status != 200:
            return
        self.note_held(listed_at, doc["items"])
        # The ledger is read after the listing: whatever the upstream applied before the
        # keys were listed is in it.
        for line in self.ledger.read():
            self.applied.setdefault((line["job"], line["key"]), line)
        now = time.monotonic()
        for item in doc["items"]:
            if item["state"] != "unknown":
                continue  # being re-sent: not ours to judge
            step = (item["job_id"], item["key"])
            seen = self.first_seen.setdefault(step, now)
            if gateways(item) and now - seen < RESOLVER_HANDS_OFF:
                continue  # the gateway's to re-send for now
            entry = self.applied.get(step)
            body = resolution(step[0], step[1], entry)
            if entry is None and (
                now - seen < UNKNOWN_MIN_AGE or self.network_quiet_for() < NETWORK_QUIET
            ):
                continue
            status, _ = await self.control.call(
                session, "POST", "/admin/unknown-outcomes/resolve", body
            )
            if status == 200:
                self.resolved["applied" if entry is not None else "not-applied"] += 1

    def note_held(self, listed_at: float, items: list[dict[str, Any]]) -> None:
        if self.held is None:
            return
        for item in items:
            if item["state"] != "unknown":
                continue
            write = (item["job_id"], item["key"], int(item["generation"]))
            if write in self.seen_held:
                continue
            self.seen_held.add(write)
            self.held.write(
                {
                    "time": listed_at,
                    "job": write[0],
                    "key": write[1],
                    "generation": write[2],
                    "note": item.get("note"),
                    "updated_at": item.get("updated_at"),
                }
            )

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self._run(stop)
        finally:
            if self.held is not None:
                self.held.close()

    async def _run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                try:
                    await self.sweep(session)
                except (ConnectionError, aiohttp.ClientError, TimeoutError, KeyError):
                    pass
                await _pause(stop, 1.0)


class Observer:
    """Counts from the workers' history files as they grow."""

    def __init__(self, paths: list[Path]) -> None:
        self.tails = [Tail(path) for path in paths]
        self.ops = 0
        self.writes: Counter[str] = Counter()  # ok, refused (fail), unknown (info)
        self.completed: set[str] = set()
        self.claimed: set[str] = set()

    def update(self) -> None:
        for tail in self.tails:
            for event in tail.read():
                if event["type"] == "invoke":
                    continue
                self.ops += 1
                if event["f"] == "write":
                    name = {"ok": "ok", "fail": "refused", "info": "unknown"}[event["type"]]
                    self.writes[name] += 1
                elif event["f"] == "complete" and event["type"] == "ok":
                    self.completed.add(event["job"])
                elif event["f"] == "claim" and event["type"] == "ok":
                    self.claimed.add(event["job"])


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass
