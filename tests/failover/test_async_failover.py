"""Why ``serve`` refuses a primary whose standbys replicate asynchronously: the sequence
that loses a fence, shown on a real primary and standby (``pg_basebackup``), a real
``fencegate serve`` and a recording upstream, and the same sequence held back when the
standby is synchronous.

The leases are signed tokens of a ``jwt`` lease source: the queue that grants them is
right about which generation is newest, and the gateway's fence is the only thing that
stops the older one. (A gateway lease loses its grant in the same commit, and the old
worker's expired lease refuses it; a fence cannot count on that.)
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from fencegate_client import step_key
from fencegate_client.signed import mint_token
from tests.faults.harness import (
    FENCEGATE,
    PAY,
    Answer,
    ProcessGroup,
    UpstreamProc,
    child_env,
    http,
    migrate,
    start_replica,
    start_upstream,
    write_config,
)
from tests.support import IN_CI
from verify.cluster import ClusterError, PgCluster

pytestmark = pytest.mark.postgres

JOB = "order-7"
ISSUER = "billing-queue"
_PRIVATE = ed25519.Ed25519PrivateKey.generate()
PRIVATE = _PRIVATE.private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
).decode()
PUBLIC = (
    _PRIVATE.public_key()
    .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    .decode()
)


def token(generation: int) -> str:
    return mint_token(
        PRIVATE, source="queue", issuer=ISSUER, job=JOB, generation=generation, ttl_seconds=600
    )


class Pair:
    """A primary, its streaming standby, and a database URL naming both."""

    def __init__(self, primary: PgCluster, standby: PgCluster) -> None:
        self.primary, self.standby = primary, standby
        self.url = (
            f"postgresql+asyncpg://postgres@/fence?host=127.0.0.1:{primary.port}"
            f"&host=127.0.0.1:{standby.port}&target_session_attrs=read-write"
        )

    async def caught_up(self) -> None:
        """Wait until the standby has replayed everything the primary has written."""
        lsn = (await self.primary.execute("SELECT pg_current_wal_lsn()::text"))[0][0]
        for _ in range(300):
            rows = await self.standby.execute(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn")
            if rows[0][0]:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the standby did not catch up")

    async def fail_over(self) -> None:
        """The primary is lost (immediate stop: a crash) and the standby, started again
        if it was stopped, is promoted."""
        await asyncio.to_thread(self.primary.stop, "immediate")
        await asyncio.to_thread(self.standby.ensure_running)
        await asyncio.to_thread(self.standby.promote)


async def streaming(primary: PgCluster) -> None:
    """Wait until the primary sees its standby streaming (pg_stat_replication has it)."""
    for _ in range(300):
        rows = await primary.execute(
            "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
        )
        if rows[0][0]:
            return
        await asyncio.sleep(0.05)
    raise ClusterError("the standby never started streaming")


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Pair]:
    primary = PgCluster()
    standby: PgCluster | None = None
    try:
        try:
            await asyncio.to_thread(primary.up)
            await primary.execute('CREATE DATABASE "fence"')
            await asyncio.to_thread(migrate, primary.url("fence"), tmp_path)
            standby = await asyncio.to_thread(primary.standby)
            await streaming(primary)
        except (ClusterError, OSError) as error:
            message = f"cannot run a primary and a standby of our own: {error}"
            if IN_CI:
                pytest.fail(message, pytrace=False)
            pytest.skip(message)
        yield Pair(primary, standby)
    finally:
        for cluster in (standby, primary):
            if cluster is not None:
                await asyncio.to_thread(cluster.destroy)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[ProcessGroup]:
    processes = ProcessGroup(tmp_path)
    yield processes
    processes.cleanup()


def config(folder: Path, url: str, upstream: str, *, allow: bool) -> Path:
    public = json.dumps(PUBLIC)
    extra = (
        f"[database]\nallow_async_failover = {'true' if allow else 'false'}\n"
        "[[lease_sources]]\n"
        f'name = "queue"\nkind = "jwt"\nalgorithms = ["EdDSA"]\nissuer = "{ISSUER}"\n'
        f"public_keys = [{public}]\n"
    )
    return write_config(folder, url, upstream, (PAY,), extra=extra)


async def write(session: aiohttp.ClientSession, proxy: str, generation: int, step: str) -> Answer:
    return await http(
        session,
        "POST",
        f"{proxy}/pay/charges",
        json_body={"job": JOB, "step": step, "generation": generation},
        headers={"Fencing-Token": token(generation), "Idempotency-Key": step_key(JOB, step)},
        timeout=15,
    )


async def write_once_reconnected(
    session: aiohttp.ClientSession, proxy: str, generation: int, step: str
) -> Answer:
    """The write's first answer other than store-unavailable (the gateway connecting to
    the promoted standby)."""
    for _ in range(100):
        answer = await write(session, proxy, generation, step)
        if answer.reason != "store-unavailable":
            return answer
        await asyncio.sleep(0.2)
    raise AssertionError("the gateway never reached the promoted standby")


def applied(upstream: UpstreamProc) -> list[tuple[int, str]]:
    """(generation, step) of every write the upstream applied, in order."""
    steps = {step_key(JOB, step): step for step in ("first", "second", "late")}
    return [
        (int(e["generation"]), steps.get(str(e["key"]), str(e["key"])))
        for e in upstream.events()
        if e["event"] == "applied"
    ]


async def test_serve_and_check_config_refuse_asynchronous_standbys(
    pair: Pair, tmp_path: Path
) -> None:
    path = config(tmp_path, pair.url, "http://127.0.0.1:9", allow=False)
    for command in (["check-config"], ["serve"]):
        result = await asyncio.to_thread(
            subprocess.run,
            [FENCEGATE, *command, "--config", str(path)],
            env=child_env(),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 1, (command, result.stdout, result.stderr)
        assert "can lose an acknowledged commit at a failover" in result.stderr, result.stderr
        assert "replicates asynchronously (sync_state async)" in result.stderr
        assert "database.allow_async_failover = true" in result.stderr


async def test_serve_waits_for_a_standby_that_becomes_synchronous(
    pair: Pair, group: ProcessGroup, tmp_path: Path
) -> None:
    """A standby rejoining after a failover streams asynchronously for a moment: serve
    looks again for a while instead of refusing at once, and starts once it is
    synchronous."""
    upstream = await start_upstream(group)
    path = config(tmp_path, pair.url, upstream.url, allow=False)
    starting = asyncio.ensure_future(start_replica(group, path, "gateway"))
    # Until serve has looked once and is looking again (a loaded machine may take seconds
    # to start the process at all: a fixed sleep let the standby turn synchronous first).
    log = tmp_path / "gateway.log"
    deadline = asyncio.get_running_loop().time() + 30
    while "checking again for up to 15 s" not in (log.read_text() if log.exists() else ""):
        assert not starting.done(), "serve started or stopped without looking again"
        assert asyncio.get_running_loop().time() < deadline, "serve never looked again"
        await asyncio.sleep(0.1)
    await asyncio.sleep(1)
    assert not starting.done()  # still looking, not refused
    await pair.primary.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
    await pair.primary.execute("SELECT pg_reload_conf()")
    replica = await starting
    async with aiohttp.ClientSession() as session:
        answer = await http(session, "GET", f"{replica.control}/readyz")
        assert set(json.loads(answer.body)["database"]["standbys"].values()) == {"sync"}
    assert "checking again for up to 15 s" in replica.proc.output()


async def test_an_asynchronous_failover_moves_the_fence_back(
    pair: Pair, group: ProcessGroup, tmp_path: Path
) -> None:
    """The failing case: generation 2's write reached the upstream and raised the fence,
    the commit that raised it is lost with the primary, and generation 1's write is
    admitted afterwards."""
    upstream = await start_upstream(group)
    replica = await start_replica(
        group, config(tmp_path, pair.url, upstream.url, allow=True), "gateway"
    )
    async with aiohttp.ClientSession() as session:
        answer = await http(session, "GET", f"{replica.control}/readyz")
        assert json.loads(answer.body)["database"]["allow_async_failover"] is True
        assert (await write(session, replica.proxy, 1, "first")).status == 201
        await pair.caught_up()
        # The standby goes away: the primary goes on acknowledging commits alone.
        await asyncio.to_thread(pair.standby.stop)
        assert (await write(session, replica.proxy, 2, "second")).status == 201
        stale = await write(session, replica.proxy, 1, "late")
        assert (stale.status, stale.reason) == (409, "stale-generation"), stale
        await pair.fail_over()
        # The same gateway, reconnected to the promoted standby: the fence is back at 1.
        late = await write_once_reconnected(session, replica.proxy, 1, "late")
        assert late.status == 201, late
    # What the upstream applied: generation 1 after generation 2, the stale write that
    # fencing exists to stop.
    assert applied(upstream) == [(1, "first"), (2, "second"), (1, "late")]


async def test_a_synchronous_standby_holds_the_fence(
    pair: Pair, group: ProcessGroup, tmp_path: Path
) -> None:
    """The same sequence with the standby synchronous: while it is away, generation 2's
    admission is not acknowledged, so its write is never forwarded; after the failover
    the upstream has applied nothing out of order."""
    await pair.primary.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
    await pair.primary.execute("SELECT pg_reload_conf()")
    upstream = await start_upstream(group)
    replica = await start_replica(
        group, config(tmp_path, pair.url, upstream.url, allow=False), "gateway"
    )
    async with aiohttp.ClientSession() as session:
        answer = await http(session, "GET", f"{replica.control}/readyz")
        database: dict[str, Any] = json.loads(answer.body)["database"]
        assert set(database["standbys"].values()) == {"sync"}, database
        assert (await write(session, replica.proxy, 1, "first")).status == 201
        await asyncio.to_thread(pair.standby.stop)
        second = asyncio.ensure_future(write(session, replica.proxy, 2, "second"))
        await asyncio.sleep(2)
        assert not second.done(), second.result()  # its commit waits for the standby
        await pair.fail_over()
        try:
            answer = await second
        except (aiohttp.ClientError, TimeoutError):
            pass
        else:
            assert answer.status == 503, answer  # store-unavailable, never a 2xx
        late = await write_once_reconnected(session, replica.proxy, 1, "late")
        assert late.status == 201, late
    # Generation 2 never reached the upstream, so generation 1's write is not stale there.
    assert applied(upstream) == [(1, "first"), (1, "late")]
