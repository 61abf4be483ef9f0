"""The background loops (``gateway.service.tasks.every``) on a real aiohttp app: a step
that fails goes on at the next round; a database that is unavailable (down, failing over,
or turned away by the schema's floor) is one warning line a round, any other failure a
traceback."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiohttp import web

from gateway.service import tasks
from lease_core import exceptions as lease_exc


async def test_a_failing_step_is_logged_and_the_loop_goes_on(
    aiohttp_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rounds: list[int] = []

    async def step() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise lease_exc.StoreUnavailable("The database schema moved on.")
        if len(rounds) == 2:
            raise RuntimeError("a bug")

    app = web.Application()
    tasks.every(app, "probe", 0.05, step)
    with caplog.at_level(logging.WARNING, logger="fencegate.tasks"):
        await aiohttp_client(app)
        for _ in range(100):
            if len(rounds) >= 3:
                break
            await asyncio.sleep(0.02)
    assert len(rounds) >= 3
    unavailable, bug = caplog.records[0], caplog.records[1]
    assert unavailable.levelno == logging.WARNING
    assert unavailable.getMessage().startswith(
        "background task probe: The database schema moved on. Retrying in"
    )
    assert unavailable.exc_info is None  # one line, no traceback
    assert bug.levelno == logging.ERROR and bug.exc_info is not None
