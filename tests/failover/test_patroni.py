"""The gateway across failovers of a Patroni cluster (verify/patroni.py: etcd and three
PostgreSQL instances, every standby synchronous), with no restart of the gateway: a
``patronictl switchover`` and a kill -9 of the primary's postmaster. The same
``fencegate serve`` process answers writes again within seconds, refuses the stale one
across the failover (the fence survived it), names the new primary on ``/readyz`` and
counts the change in its metrics.

``python -m verify run --db patroni`` is the long form of this (docs/verification.md).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.faults.harness import (
    PAY,
    Answer,
    ProcessGroup,
    Replica,
    acquire,
    http,
    migrate,
    raw_write,
    start_replica,
    start_upstream,
    write_config,
)
from tests.support import IN_CI
from verify.cluster import ClusterError, execute
from verify.patroni import PatroniCluster

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]

# The first write answered after the new primary takes writes: "within a few seconds".
RECOVERY = 15.0


@pytest.fixture(scope="module")
def patroni(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PatroniCluster]:
    cluster = PatroniCluster(3)
    try:
        try:
            cluster.up()
            primary = cluster.wait_primary()
            asyncio.run(execute(cluster.member_url(primary.name), 'CREATE DATABASE "fence"'))
            migrate(cluster.url("fence"), tmp_path_factory.mktemp("migrate"))
        except (ClusterError, OSError, AssertionError) as error:
            message = f"cannot run a Patroni cluster of our own: {error}"
            if IN_CI:
                pytest.fail(message, pytrace=False)
            pytest.skip(message)
        yield cluster
    finally:
        cluster.down()


@pytest.fixture
async def group(tmp_path: Path) -> AsyncIterator[ProcessGroup]:
    processes = ProcessGroup(tmp_path)
    yield processes
    processes.cleanup()


async def readyz(session: aiohttp.ClientSession, replica: Replica) -> dict[str, Any]:
    answer = await http(session, "GET", f"{replica.control}/readyz")
    assert answer.status == 200, answer
    doc: dict[str, Any] = json.loads(answer.body)
    return doc


async def metric(session: aiohttp.ClientSession, replica: Replica, name: str) -> float:
    answer = await http(session, "GET", f"{replica.control}/metrics")
    for line in answer.body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


async def first_answered(
    session: aiohttp.ClientSession, replica: Replica, lease: dict[str, Any], step: str
) -> tuple[float, list[str]]:
    """Write until the gateway answers 2xx: seconds it took, and the refusals before."""
    started = time.monotonic()
    refusals: list[str] = []
    while True:
        attempt = await raw_write(session, "w", lease, replica, "pay", step, timeout=10)
        if attempt.status is not None and attempt.status < 300:
            return time.monotonic() - started, refusals
        refusals.append(attempt.reason or attempt.error or str(attempt.status))
        assert time.monotonic() - started < RECOVERY, refusals
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("how", ["switchover", "kill"])
async def test_the_gateway_keeps_its_fences_across_a_failover(
    patroni: PatroniCluster, group: ProcessGroup, tmp_path: Path, how: str
) -> None:
    # The previous test's failover over: its old primary synchronous again.
    await asyncio.to_thread(patroni.wait_healthy, 90)
    upstream = await start_upstream(group)
    config = write_config(tmp_path, patroni.url("fence"), upstream.url, (PAY,))
    replica = await start_replica(group, config, "gateway")
    job = f"order-{how}"
    async with aiohttp.ClientSession() as session:
        before = await readyz(session, replica)
        assert set(before["database"]["standbys"].values()) == {"sync"}, before
        old = await acquire(session, replica, job, "worker-a", ttl=0.5)
        assert (await raw_write(session, "a", old, replica, "pay", "one")).status == 201
        await asyncio.sleep(0.7)
        new = await acquire(session, replica, job, "worker-b", ttl=60)
        assert (await raw_write(session, "b", new, replica, "pay", "two")).status == 201

        move = patroni.switchover if how == "switchover" else patroni.kill_primary
        gone = await asyncio.to_thread(move)
        primary = await asyncio.to_thread(patroni.wait_primary, 60, other_than=gone)
        took, refusals = await first_answered(session, replica, new, "three")
        # Refused as retryable (503) while the primary moved, and not sent: the database
        # was away (store-unavailable), or a write admitted just before the switch could
        # not be checked once more before its claim's deadline (ordering-timeout).
        assert set(refusals) <= {"store-unavailable", "ordering-timeout"}, refusals

        # The fence survived: generation 1's late write is still refused.
        stale = await raw_write(session, "a", old, replica, "pay", "late")
        assert (stale.status, stale.reason) in ((409, "stale-generation"), (409, "lease-expired"))
        after = await readyz(session, replica)
        assert after["database"]["primary"].endswith(f":{patroni.member_port(primary.name)}")
        assert await metric(session, replica, "fencegate_db_primary_changes_total") >= 1
        # The same process all along.
        assert replica.proc.alive()
        health: Answer = await http(session, "GET", f"{replica.control}/healthz")
        assert health.status == 200
    applied = [e for e in upstream.events() if e["event"] == "applied"]
    assert [int(e["generation"]) for e in applied] == [1, 2, 2], applied
    print(f"{how}: first write answered {took:.1f} s after the new primary; {refusals}")
