"""A request cancelled while its admission is in the database (a SIGTERM whose grace ends
first) leaves no claim behind: the claim the admission still commits is given back.

Found while reading a failure of CI's ``verify run --db sqlite --seconds 60 --nemesis all
--resolving`` (seed 17807807, invariant 13, ``never-sent-held-unknown``), whose cause was
in verify itself (a replica's graceful stop that was a SIGKILL): three replicas share one
SQLite file, so an admission often waits on the database thread for another replica's
write lock, and a shutdown whose grace ends then cancels the request. The worker is
disconnected, and the thread still commits the claim, which nobody knows of: the write,
never sent, is left to turn into an unknown outcome at its deadline. The same holds for
any cancellation of an admission that still commits, on PostgreSQL too (a statement whose
commit is on its way).

Real processes: ``fencegate serve`` on a SQLite file and ``verify.upstream``; the test
holds the file's write lock with its own connection, as another replica would.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
from pathlib import Path

import aiohttp
import pytest

from .harness import PAY, ProcessGroup, acquire, http, start_replica, start_upstream, write_config

GRACE_SECONDS = 0.2
# How long the test holds the write lock after the SIGTERM: past the grace (the request is
# cancelled), well within the database thread's 10 s wait for the lock (the admission
# then commits its claim).
HELD_AFTER_SIGTERM_SECONDS = 1.5


def claims(path: Path) -> list[tuple[str, str, str]]:
    """Every idempotency record: (job, key, state)."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT job_id, key, state FROM idempotency_records").fetchall()
    finally:
        conn.close()
    return [(str(a), str(b), str(c)) for a, b, c in rows]


@pytest.mark.timeout(90)
async def test_an_admission_cancelled_by_shutdown_gives_its_claim_back(
    group: ProcessGroup,
) -> None:
    upstream = await start_upstream(group)
    db = group.folder / "fencegate.db"
    config = write_config(
        group.folder,
        f"sqlite+aiosqlite:///{db}",
        f"http://127.0.0.1:{upstream.port}",
        (PAY,),
        shutdown_timeout=GRACE_SECONDS,
    )
    replica = await start_replica(group, config, "replica")
    async with aiohttp.ClientSession() as session:
        lease = await acquire(session, replica, "order-1", "w1", ttl=60)
        headers = {
            "Fencing-Token": lease["lease_token"],
            "Content-Type": "application/json",
            "Idempotency-Key": "charge-1",
        }
        lock = sqlite3.connect(db, isolation_level=None, timeout=30)
        try:
            lock.execute("BEGIN IMMEDIATE")  # another replica's write, taking its time
            write = asyncio.ensure_future(
                http(
                    session,
                    "POST",
                    f"{replica.proxy}/{PAY.name}/charges",
                    data=b'{"amount": 1}',
                    headers=headers,
                    timeout=30,
                )
            )
            # the lease read, and the admission waiting for the lock (a loaded machine too)
            await asyncio.sleep(2.0)
            assert not write.done(), await write
            replica.signal(signal.SIGTERM)
            await asyncio.sleep(HELD_AFTER_SIGTERM_SECONDS)
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        with pytest.raises(aiohttp.ClientError):  # cancelled past its grace: no answer
            await write
        assert await asyncio.to_thread(replica.proc.popen.wait, 30) == 0, replica.proc.output()
    assert "gave back the claim of a request cancelled during its admission" in (
        replica.proc.output()
    )
    assert upstream.events() == [], "the write was sent"
    assert claims(db) == [], "a claim of a write never sent was left behind"
