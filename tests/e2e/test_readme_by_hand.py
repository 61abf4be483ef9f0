"""README.md's "By hand" walkthrough, run as written: its shell blocks that talk to the
gateway, against a real ``fencegate serve`` with a copy of examples/fencegate.toml (only
the upstreams' URLs changed, pointed at a recording stand-in). The listeners are the
test's own free ports (``localhost:8081`` and ``:8080`` in the text are replaced, nothing
else), and ``.venv/bin/fencegate`` is this environment's command."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_client import FENCEGATE, RecordingUpstream, serving_a_copy

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "fencegate.toml"
API_KEY = "sk_test_example"

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


def by_hand_blocks() -> list[str]:
    """The ``sh`` blocks of README.md's "By hand" section that call the gateway."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## By hand\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```sh\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    return [block for block in blocks if "curl " in block]


@pytest.fixture
def payments_api() -> Iterator[RecordingUpstream]:
    api = RecordingUpstream().start()
    try:
        yield api
    finally:
        api.stop()


def test_by_hand_shows_a_replay_and_a_stale_write_refused(
    tmp_path: Path, payments_api: RecordingUpstream
) -> None:
    blocks = by_hand_blocks()
    assert len(blocks) == 2, "the duplicate, then the stale write"
    replacements = {
        'url = "http://127.0.0.1:9000"': f'url = "{payments_api.url}"',
        'url = "http://127.0.0.1:9001"': f'url = "{payments_api.url}/mail"',
        'url = "http://127.0.0.1:9002"': f'url = "{payments_api.url}/files"',
    }
    with serving_a_copy(CONFIG, tmp_path, replacements, PAYMENTS_API_KEY=API_KEY) as server:
        script = "\n".join(blocks)
        for original, replacement in (
            ("localhost:8081", server.control_url),
            ("localhost:8080", server.proxy_url),
            (".venv/bin/fencegate", FENCEGATE),
            ("--config examples/fencegate.toml", f"--config {server.config}"),
        ):
            assert original in script, original
            script = script.replace(original, replacement)
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            env=server.env,
            capture_output=True,
            text=True,
            timeout=90,
            cwd=ROOT,
            check=False,
        )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    # The duplicate: replayed from the store, the payment API called once for order-42.
    assert "Idempotent-Replayed: true" in out, out
    assert len(payments_api.for_job("order-42")) == 1
    # The stale write: worker-b (generation 2) charged once; worker-a's late charge was
    # refused stale-generation and never reached the payment API.
    assert '"generation": 2, "owner": "worker-b"' in out, out
    assert "HTTP/1.1 409 Conflict" in out, out
    assert '"reason":"stale-generation","job_id":"order-43","generation":1' in out, out
    [charge] = payments_api.for_job("order-43")
    assert charge["headers"]["Fencing-Generation"] == "2"
    assert out.count("stale-generation") >= 2, out  # the answer, and the audit's line
