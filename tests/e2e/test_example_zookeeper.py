"""examples/zookeeper_lock_worker.py runs as examples/README.md says: against ``fencegate
serve`` with examples/lease_sources.toml (in a copy, the upstream's URL and ZooKeeper's
hosts point at the test's own) and a real ZooKeeper; then ``fencegate audit --source``
shows the refusals of that source."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator

import pytest

from tests.e2e.test_client import (
    FENCEGATE,
    FencegateProcess,
    RecordingUpstream,
    clean_env,
    control_call,
    serving_a_copy,
)
from tests.e2e.test_examples import AWS_CREDENTIALS, EXAMPLES, ROOT, SOURCES_CONFIG, run

ZOOKEEPER_WORKER = EXAMPLES / "zookeeper_lock_worker.py"


@pytest.fixture(scope="module")
def upstream_api() -> Iterator[RecordingUpstream]:
    api = RecordingUpstream().start()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture(scope="module")
def zk_server(
    tmp_path_factory: pytest.TempPathFactory, upstream_api: RecordingUpstream, zookeeper_hosts: str
) -> Iterator[FencegateProcess]:
    replacements = {
        'url = "http://127.0.0.1:9000"': f'url = "{upstream_api.url}"',
        'hosts = ["127.0.0.1:2181"]': f'hosts = ["{zookeeper_hosts}"]',
    }
    folder = tmp_path_factory.mktemp("fencegate-zookeeper")
    # The ddb source's AWS credentials (any: the file's endpoint is moto's); serve
    # refuses to start without them.
    with serving_a_copy(SOURCES_CONFIG, folder, replacements, **AWS_CREDENTIALS) as process:
        yield process


def test_zookeeper_example_defaults_to_the_example_config() -> None:
    config = tomllib.loads(SOURCES_CONFIG.read_text(encoding="utf-8"))
    (zk,) = (s for s in config["lease_sources"] if s["kind"] == "zookeeper")
    text = ZOOKEEPER_WORKER.read_text(encoding="utf-8")
    assert f'default="http://{config["proxy_listen"]}"' in text
    assert f'default="{zk["hosts"][0]}"' in text
    assert f'SOURCE = "{zk["name"]}"' in text


def test_zookeeper_worker_two_workers_in_turn(
    zk_server: FencegateProcess, upstream_api: RecordingUpstream, zookeeper_hosts: str
) -> None:
    done = run(
        [sys.executable, str(ZOOKEEPER_WORKER), zookeeper_hosts, zk_server.proxy_url],
        env=clean_env(),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    locked = re.findall(
        r"^([AB]) locked (/locks/order-[0-9a-f]{8}) \(generation (\d+)\): "
        r"Fencing-Token zk:(\S+)$",
        done.stdout,
        re.MULTILINE,
    )
    assert [worker for worker, *_ in locked] == ["A", "B"], done.stdout
    (_, path, gen_a, node_a), (_, _, gen_b, node_b) = locked
    assert node_a.startswith(f"{path}/") and node_b.startswith(f"{path}/")
    assert int(gen_b) > int(gen_a)
    lines = [line for line in done.stdout.splitlines() if "POST" in line]
    assert lines == [
        "A: POST /payments/charges -> 201",
        "B: POST /payments/charges -> 201 (replayed)",
        "B: POST /payments/receipts -> 201",
        "A: POST /payments/receipts -> 409 stale-generation",
        "B: POST /payments/refunds -> 409 lease-ended",
    ]
    # The upstream saw each step once, in generation order, under the namespaced job.
    job = f"zk/{path}"
    calls = upstream_api.for_job(job)
    assert [(c["path"], c["generation"], c["key"]) for c in calls] == [
        ("/charges", gen_a, "charge"),
        ("/receipts", gen_b, "receipt"),
    ]
    assert all("Fencing-Token" not in c["headers"] for c in calls)

    # The audit names the source; the admin API and the CLI filter by it.
    status, page = control_call(zk_server, "GET", "/admin/rejections?source=zk", token=None)
    assert status == 200
    assert [(e["source"], e["reason"]) for e in page["items"]] == [
        ("zk", "lease-ended"),
        ("zk", "stale-generation"),
        ("zk", "idempotent-replay"),
    ]
    listed = subprocess.run(
        [FENCEGATE, "audit", "--source", "zk", "--json", "--config", str(zk_server.config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=zk_server.env,
        cwd=ROOT,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert [e["job_id"] for e in json.loads(listed.stdout)["items"]] == [job] * 3
    # The table shows the generations as the JSON has them: the refused tokens' nodes are
    # gone, and their generations with them; the highest known is B's.
    assert [
        (e["generation"], e["highest_generation"]) for e in json.loads(listed.stdout)["items"]
    ] == [(None, int(gen_b)), (None, int(gen_b)), (int(gen_b), int(gen_b))]
    table = subprocess.run(
        [FENCEGATE, "audit", "--source", "zk", "--config", str(zk_server.config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=zk_server.env,
        cwd=ROOT,
        check=False,
    )
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    start, end = header.index("GEN/HIGHEST"), header.index("UPSTREAM")
    assert [row[start:end].strip() for row in rows] == [
        f"-/{gen_b}",
        f"-/{gen_b}",
        f"{gen_b}/{gen_b}",
    ]
