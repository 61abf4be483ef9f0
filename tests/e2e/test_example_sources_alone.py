"""Each source of examples/lease_sources.toml can be tried alone: its own file in
examples/lease_sources/ (the same settings, one source; tests/docs/test_examples_readme.py
keeps them the same) serves without what the other sources need. etcd alone starts
without AWS credentials; ZooKeeper alone, unreachable, says so without flooding the log."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.e2e.test_client import FencegateProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
ALONE = ROOT / "examples" / "lease_sources"


def serving(kind: str, folder: Path, replacements: dict[str, str]) -> FencegateProcess:
    """``fencegate serve`` with a copy of examples/lease_sources/KIND.toml (each key of
    ``replacements`` found once and replaced), its own database and listeners, and no
    AWS credentials anywhere botocore looks."""
    text = (ALONE / f"{kind}.toml").read_text(encoding="utf-8")
    for original, replacement in replacements.items():
        assert text.count(original) == 1, original
        text = text.replace(original, replacement)
    config = folder / f"{kind}.toml"
    config.write_text(text, encoding="utf-8")
    (folder / "aws-empty").write_text("")
    control_port, proxy_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FENCEGATE_", "AWS_"))} | {
        "FENCEGATE_DATABASE_URL": f"sqlite+aiosqlite:///{folder / 'fencegate.db'}",
        "FENCEGATE_PROXY_LISTEN": f"127.0.0.1:{proxy_port}",
        "FENCEGATE_CONTROL_LISTEN": f"127.0.0.1:{control_port}",
        "AWS_SHARED_CREDENTIALS_FILE": str(folder / "aws-empty"),
        "AWS_CONFIG_FILE": str(folder / "aws-empty"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "HOME": str(folder),
    }
    return FencegateProcess(config, control_port=control_port, proxy_port=proxy_port, env=env)


def test_etcd_alone_serves_without_aws_credentials(tmp_path: Path) -> None:
    # etcd not answering (a closed port) does not stop serve: its checks answer 503.
    process = serving(
        "etcd", tmp_path, {"http://127.0.0.1:2379": f"http://127.0.0.1:{free_port()}"}
    )
    try:
        process.start(timeout=60)
    finally:
        process.stop()
    assert "AWS" not in process.log(), process.log()


def test_an_unreachable_zookeeper_is_said_once_not_every_retry(tmp_path: Path) -> None:
    process = serving("zookeeper", tmp_path, {"127.0.0.1:2181": f"127.0.0.1:{free_port()}"})
    try:
        process.start(timeout=60)
        time.sleep(6)  # kazoo retries about every 2 s (up to 5 s apart): a few tries
    finally:
        process.stop()
    log = process.log()
    assert "not connected to ZooKeeper" in log, log  # the source's own warning, once
    assert log.count("not connected to ZooKeeper") == 1, log
    assert log.count("Connection dropped") <= 1, log
    assert "Unclosed" not in log, log
