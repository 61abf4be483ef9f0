"""The CPU budget the benchmark prints beside the fenced writes' throughput target: what
0.6 of the bare proxy's rate leaves the gateway, from the CPU each process spent."""

from __future__ import annotations

from typing import Any

import pytest

from bench.report import budget_line, cpu_budget, judge_writes


def _row(**overrides: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "section": "writes",
        "target": "fencegate postgres",
        "backend": "postgres",
        "rps": 2000.0,
        "p99_ms": 26.0,
        # driver 0.06, upstream 0.10, PostgreSQL 0.18 ms a write at 2,000 writes/s
        "cpu_percent": {"driver": 12.0, "server": 88.0, "upstream": 20.0, "postgres": 36.0},
        "server_cpu_ms_per_request": 0.44,
    }
    row.update(overrides)
    return row


BARE = {
    "rps": 5000.0,
    "p99_ms": 12.0,
    "machine_busy_percent": 87.0,
    "server_cpu_ms_per_request": 0.2,
}


def test_the_budget_is_what_the_machine_leaves_after_the_other_processes() -> None:
    row = _row()
    judge_writes([row], BARE)
    assert row["rps_target"] == 0.6 and row["cpu_budget"] is not None
    budget = cpu_budget(row, BARE, cores=2)  # this row measured on two cores
    assert budget is not None
    assert budget["target_rps"] == pytest.approx(3000.0)  # 0.6 of 5,000
    assert budget["one_core_ms"] == pytest.approx(1000 / 3000)
    assert budget["machine_cores"] == pytest.approx(1.74)  # 87 % of two cores
    assert budget["machine_ms"] == pytest.approx(1000 * 1.74 / 3000)
    assert budget["beside_ms"] == pytest.approx(0.06 + 0.10 + 0.18)
    assert budget["budget_ms"] == pytest.approx(0.58 - 0.34)  # under the one core's 0.33
    assert (budget["spent_ms"], budget["bare_ms"]) == (0.44, 0.2)
    line = budget_line(row["target"], budget)
    assert "3,000 writes/s" in line and "may spend 0.24 ms" in line and "spent 0.44" in line


def test_a_gateway_alone_on_the_machine_is_bound_by_its_one_event_loop() -> None:
    # SQLite: nothing beside the gateway but the driver and the upstream, cheap ones.
    row = _row(backend="sqlite", cpu_percent={"driver": 2.0, "server": 100.0, "upstream": 2.0})
    budget = cpu_budget({**row, "rps_target": 0.6}, BARE, cores=2)
    assert budget is not None
    assert budget["budget_ms"] == pytest.approx(1000 / 3000)


def test_no_budget_without_the_numbers_it_is_made_of() -> None:
    row = _row(rps_target=0.6)
    assert cpu_budget(row, {"rps": 5000.0, "p99_ms": 12.0}, cores=2) is None
    assert cpu_budget({**row, "server_cpu_ms_per_request": None}, BARE, cores=2) is None
