"""examples/redis_lock_worker.py and examples/dynamodb_lock_worker.py, run as a user runs
them: against ``fencegate serve`` with examples/lease_sources.toml (in a copy, the
upstream, Redis and DynamoDB point at the test's own: a private redis-server and moto's
server mode)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_client import FencegateProcess, RecordingUpstream, clean_env, serving_a_copy
from tests.support import MotoServer, RedisServer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CONFIG = EXAMPLES / "lease_sources.toml"
REDIS_WORKER = EXAMPLES / "redis_lock_worker.py"
DYNAMODB_WORKER = EXAMPLES / "dynamodb_lock_worker.py"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
EXPECTED = [
    "A (fence 1): POST /payments/charges -> 201",
    "B (fence 2): POST /payments/charges -> 201 (replayed)",
    "B (fence 2): POST /payments/receipts -> 201",
    "A (fence 1): POST /payments/receipts -> 409 stale-generation",
    "B (fence 2): POST /payments/refunds -> 409 lease-ended",
]


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        moto = MotoServer(tmp_path_factory.mktemp("moto"))
    except BaseException:
        redis.stop()
        raise
    yield f"{redis.url}/0", moto.url
    moto.stop()
    redis.stop()


@pytest.fixture(scope="module")
def payments_api() -> Iterator[RecordingUpstream]:
    api = RecordingUpstream().start()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory,
    payments_api: RecordingUpstream,
    services: tuple[str, str],
) -> Iterator[FencegateProcess]:
    redis_url, dynamodb_url = services
    replacements = {
        'url = "http://127.0.0.1:9000"': f'url = "{payments_api.url}"',
        'url = "redis://127.0.0.1:6379/0"': f'url = "{redis_url}"',
        'endpoint_url = "http://127.0.0.1:5000"': f'endpoint_url = "{dynamodb_url}"',
    }
    folder = tmp_path_factory.mktemp("fencegate-locks")
    with serving_a_copy(CONFIG, folder, replacements, **CREDENTIALS) as process:
        yield process


def run(example: Path, *args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, str(example), *args],
        env=clean_env(AWS_DEFAULT_REGION="us-east-1", **CREDENTIALS),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def test_the_examples_default_to_the_example_config() -> None:
    config = tomllib.loads(CONFIG.read_text(encoding="utf-8"))
    sources = {s["kind"]: s for s in config["lease_sources"]}
    gateway = f'default="http://{config["proxy_listen"]}"'
    redis_text = REDIS_WORKER.read_text(encoding="utf-8")
    assert gateway in redis_text and f'default="{sources["redis"]["url"]}"' in redis_text
    ddb_text = DYNAMODB_WORKER.read_text(encoding="utf-8")
    assert gateway in ddb_text and f'default="{sources["dynamodb"]["endpoint_url"]}"' in ddb_text


def test_redis_lock_worker(
    gateway: FencegateProcess, payments_api: RecordingUpstream, services: tuple[str, str]
) -> None:
    lines = run(REDIS_WORKER, services[0], gateway.proxy_url)
    assert lines[0].startswith("lock order-") and lines[1:] == EXPECTED, lines
    calls = payments_api.for_job(f"locks/{lines[0].removeprefix('lock ')}")
    assert [(c["path"], c["generation"]) for c in calls] == [("/charges", "1"), ("/receipts", "2")]
    assert all("Fencing-Token" not in c["headers"] for c in calls)


def test_dynamodb_lock_worker(
    gateway: FencegateProcess, payments_api: RecordingUpstream, services: tuple[str, str]
) -> None:
    lines = run(DYNAMODB_WORKER, services[1], gateway.proxy_url)
    assert lines[0].startswith("lock locks/order-") and lines[1:] == EXPECTED, lines
    calls = payments_api.for_job(f"ddb/{lines[0].removeprefix('lock ')}")
    assert [(c["path"], c["generation"]) for c in calls] == [("/charges", "1"), ("/receipts", "2")]
