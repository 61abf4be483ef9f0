"""``verify.procs.Child.stop``: a graceful stop is one only when every process of the
child's group has ended by itself.

Found with ``verify run --db sqlite --nemesis all --resolving --seed 17807807``: the clock
nemesis ran a replica under ``faketime -f``, which forks the command and dies of the
SIGTERM at once; ``stop`` saw its child end, sent SIGKILL to what was left of the group
(the replica, in the middle of its graceful shutdown) and called the stop graceful, so
the checker did not excuse what the kill lost (invariant 13)."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

from verify.procs import Children

# A wrapper that dies of the SIGTERM at once, and a command under it that takes half a
# second to shut down, then says it did.
WRAPPED = textwrap.dedent(
    """
    import os, signal, sys, time
    if os.fork() == 0:
        def down(*_):
            time.sleep(0.5)
            open(sys.argv[1], "w").write("stopped gracefully")
            os._exit(0)
        signal.signal(signal.SIGTERM, down)
        open(sys.argv[1] + ".ready", "w").close()
        while True:
            time.sleep(0.05)
    else:
        while True:
            time.sleep(0.05)
    """
)


def _spawn(tmp_path: Path, script: str) -> tuple[Children, Path]:
    children = Children(tmp_path)
    said = tmp_path / "said"
    child = children.spawn("wrapped", [sys.executable, "-c", script, str(said)])
    deadline = time.monotonic() + 10
    while not Path(str(said) + ".ready").exists():
        assert time.monotonic() < deadline, child.output()
        time.sleep(0.02)
    return children, said


def test_a_wrapper_that_dies_first_does_not_cut_the_graceful_stop(tmp_path: Path) -> None:
    children, said = _spawn(tmp_path, WRAPPED)
    try:
        assert children.all[0].stop(timeout=5.0) is True
        assert said.read_text() == "stopped gracefully"
    finally:
        children.kill_all()


def test_a_command_that_outlives_the_timeout_is_killed_and_said_so(tmp_path: Path) -> None:
    slow = WRAPPED.replace("time.sleep(0.5)", "time.sleep(30)")
    children, said = _spawn(tmp_path, slow)
    try:
        started = time.monotonic()
        assert children.all[0].stop(timeout=1.0) is False
        assert time.monotonic() - started < 5
        assert not said.exists()
    finally:
        children.kill_all()
