"""``fencegate demo`` as a user runs it: a real process, its output and exit status."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FENCEGATE = str(Path(sys.executable).with_name("fencegate"))


def test_demo_shows_the_stale_write_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [FENCEGATE, "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "worker A's late write was refused (stale-generation)" in out
    assert '"reason": "stale-generation"' in out
    assert "Idempotent-Replayed: true" in out
    assert "[FAILED]" not in out
    assert "demo passed" in out
    # Nothing left behind in the working folder: the demo's database is temporary.
    assert list(tmp_path.iterdir()) == []
