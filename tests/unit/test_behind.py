"""``Behind``: the settles a replica writes behind answers already given."""

from __future__ import annotations

import asyncio

import pytest

from gateway.proxy.held import Behind


async def test_it_counts_its_settles_by_key_until_each_is_written() -> None:
    behind = Behind(limit=2)
    gates = {"k1": asyncio.Event(), "k2": asyncio.Event()}

    async def settle(key: str) -> None:
        await gates[key].wait()

    behind.start("k1", settle("k1"))
    assert behind.has_key("k1") and not behind.has_key("k2") and not behind.full()
    behind.start("k2", settle("k2"))
    assert behind.full()
    gates["k1"].set()
    await asyncio.sleep(0.01)
    assert not behind.has_key("k1") and behind.has_key("k2") and not behind.full()
    flushed = asyncio.ensure_future(behind.flush())
    await asyncio.sleep(0.01)
    assert not flushed.done()  # k2 is still being written
    gates["k2"].set()
    await asyncio.wait_for(flushed, 1)
    assert not behind.has_key("k2")


async def test_a_settle_that_fails_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    behind = Behind(limit=4)

    async def fails() -> None:
        raise ConnectionError("the database went away")

    with caplog.at_level("ERROR", logger="fencegate.proxy"):
        behind.start("k", fails())
        await behind.flush()
    assert not behind.has_key("k")
    assert any("could not store the answer" in r.getMessage() for r in caplog.records)
