"""The floor that the open loop's added latency is read beside on PostgreSQL (issue 55):
two durable commits measured on a real server, and the report's lines and verdict."""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

from bench.commit_floor import two_commits
from bench.pgadmin import pg_dsn
from bench.report import floor_lines
from tests.support import pg_admin, pg_url_of, postgres_unavailable


def _rate(rate: float, added_p50: float, added_p99: float, saturated: bool = False) -> dict:
    return {
        "rate": rate,
        "added_p50_ms": added_p50,
        "added_p99_ms": added_p99,
        "saturated": saturated,
    }


def _row(*rates: dict[str, Any]) -> dict[str, Any]:
    floor = {"p50_ms": 1.0, "p99_ms": 2.0, "samples": 300, "synchronous_commit": "on",
             "fsync": "on"}  # fmt: skip
    return {"floor": floor, "rates": list(rates)}


def test_the_targets_are_the_floor_plus_half_a_millisecond_and_four_times_it() -> None:
    [_, line] = floor_lines(_row(_rate(150, 1.5, 4.0)))
    assert "= floor +0.50 ms" in line and line.endswith(": met")
    [_, line] = floor_lines(_row(_rate(150, 1.51, 4.0)))
    assert line.endswith(": MISSED")
    [_, line] = floor_lines(_row(_rate(150, 1.2, 4.01)))
    assert line.endswith(": MISSED")
    [_, line] = floor_lines(_row(_rate(150, 1.2, 3.0, saturated=True)))
    assert line.endswith(": MISSED")


def test_other_rates_are_shown_beside_the_floor_without_a_verdict() -> None:
    head, line = floor_lines(_row(_rate(300, 3.0, 9.0)))
    assert head.startswith("floor: two durable commits") and "p50 1.00 ms" in head
    assert "3.00x the floor" in line and "target" not in line
    assert floor_lines({"floor": None, "rates": []}) == []


def test_two_durable_commits_are_measured_on_a_real_server() -> None:
    name = f"fencegate_floor_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        asyncio.run(asyncio.wait_for(pg_admin(f'CREATE DATABASE "{name}"'), 10))
    except Exception as error:  # any failure to reach the server
        postgres_unavailable(f"{type(error).__name__}: {error}")
    try:
        found = asyncio.run(two_commits(pg_dsn(pg_url_of(name)), samples=20))
    finally:
        asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    assert 0 < found["p50_ms"] <= found["p99_ms"]
    assert found["samples"] == 20 and found["synchronous_commit"] and found["fsync"]
