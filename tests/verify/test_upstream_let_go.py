"""The verification's upstream tells a write whose sender let go of it gracefully (a FIN
before the answer: the kernel would go on retransmitting what the sender had not got
acknowledged) from one whose sender reset the connection, as the gateway must, or
waited for the answer (``verify.upstream --let-go``, invariant 16).

A real ``verify.upstream`` process, and raw sockets for the three senders."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ANSWER_AFTER = 0.6  # the upstream's answer to each write comes this late (Verify-Fault)


def _write(port: int, key: str, fault: str = f"delay={ANSWER_AFTER}") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    head = (
        "POST /pay HTTP/1.1\r\nHost: upstream\r\nFencing-Job: job-1\r\n"
        f"Fencing-Generation: 1\r\nIdempotency-Key: {key}\r\n"
        f"Verify-Fault: {fault}\r\nContent-Length: 2\r\n\r\n{{}}"
    )
    sock.sendall(head.encode())
    return sock


@contextlib.contextmanager
def _upstream(ledger: Path, let_go: Path) -> Iterator[int]:
    """A real ``verify.upstream`` process writing ``ledger`` and ``let_go``: its port."""
    argv = [sys.executable, "-m", "verify.upstream", "--port", "0"]
    argv += ["--ledger", str(ledger), "--let-go", str(let_go)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline().split()[-1])
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def _reset(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0), not a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _lines(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(60)
def test_a_write_let_go_gracefully_is_told_from_one_reset_or_answered(tmp_path: Path) -> None:
    ledger, let_go = tmp_path / "ledger.jsonl", tmp_path / "let-go.jsonl"
    with _upstream(ledger, let_go) as port:
        fin, reset, waited = _write(port, "fin"), _write(port, "reset"), _write(port, "waited")
        time.sleep(0.2)  # each received and applied, its answer not yet due
        fin.shutdown(socket.SHUT_WR)  # let go gracefully: a FIN, still reading
        _reset(reset)  # let go as the gateway does
        answer = waited.recv(4096)
        assert answer.startswith(b"HTTP/1.1 201"), answer
        waited.close()  # gracefully, after its answer: nothing let go
        time.sleep(ANSWER_AFTER)
        fin.close()
    assert sorted(str(e["key"]) for e in _lines(ledger)) == ["fin", "reset", "waited"]
    seen = _lines(let_go)
    assert [(e["key"], e["generation"], e["job"]) for e in seen] == [("fin", 1, "job-1")]
    assert seen[0]["seen"] in ("applied", "answer")


@pytest.mark.timeout(60)
def test_a_hanging_answer_ends_with_its_connection_and_is_judged_then(tmp_path: Path) -> None:
    """A write the upstream hangs on (``Verify-Fault: hang``, no answer for 60 s) is
    looked at when its sender lets go, not 60 s later: a FIN is reported at once, a reset
    never."""
    ledger, let_go = tmp_path / "ledger.jsonl", tmp_path / "let-go.jsonl"
    with _upstream(ledger, let_go) as port:
        fin, reset = _write(port, "hang-fin", "hang"), _write(port, "hang-reset", "hang")
        time.sleep(0.3)  # each received, applied and hanging
        _reset(reset)
        fin.shutdown(socket.SHUT_WR)
        let_go_by = time.monotonic() + 5  # the hang polls its connection every 0.1 s
        while time.monotonic() < let_go_by and not _lines(let_go):
            time.sleep(0.05)
        time.sleep(0.5)  # time for a wrong report of the reset one
        seen = _lines(let_go)
        fin.close()
    assert sorted(str(e["key"]) for e in _lines(ledger)) == ["hang-fin", "hang-reset"]
    assert [(e["key"], e["seen"]) for e in seen] == [("hang-fin", "answer")]
