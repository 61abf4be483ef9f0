"""One ``fencegate serve`` process and one recording upstream per test module; after
every test both are checked to be alive and answering, and the server's log to hold no
error from fencegate's own code (an unhandled exception would be one)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ._support import Stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    srv = Stack(Path(tmp_path_factory.mktemp("security")))
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(autouse=True)
def stays_up(stack: Stack) -> Iterator[None]:
    start = len(stack.output())
    yield
    stack.assert_alive()
    errors = [
        line
        for line in stack.log_lines(start)
        if line.get("level") in ("error", "critical")
        and str(line.get("logger", "")).startswith("fencegate")
    ]
    assert not errors, f"fencegate logged errors: {errors[:3]}"
