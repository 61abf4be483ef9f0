"""What ``fencegate serve`` says at start about the upstreams it protects: one line per
upstream (name -> URL, no password), or, with none, a warning that every proxied request
gets ``404 unknown-upstream`` and how to add one; and one line per lease source (its kind
and where it points, no password). Real processes, as a user starts them:
the README's first command (no ``--config``, in a folder without ``fencegate.toml``) and
a config with upstreams."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from tests.support import free_port

FENCEGATE = str(Path(sys.executable).with_name("fencegate"))
LISTENING = re.compile(r"fencegate listening: .*?control=([^\s\",]+).*?proxy=([^\s\",]+)")


@contextmanager
def serving(cwd: Path, *args: str, **env: str) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """``fencegate serve ARGS`` in ``cwd`` (JSON logs, both listeners on free ports) until
    it printed its listening line: (the proxy's URL, the log records so far)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    environment.update(
        FENCEGATE_PROXY_LISTEN="127.0.0.1:0", FENCEGATE_CONTROL_LISTEN="127.0.0.1:0", **env
    )
    out, err = cwd / "serve.out", cwd / "serve.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = subprocess.Popen(
            [FENCEGATE, "serve", *args, "--log-format", "json"],
            cwd=cwd,
            env=environment,
            stdout=stdout,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 30
        # The listening line is the start log's last, so the log is complete then.
        while (match := LISTENING.search(err.read_text(errors="replace"))) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"fencegate serve did not start:\n{err.read_text(errors='replace')}")
            time.sleep(0.05)
        records = [
            json.loads(line) for line in err.read_text().splitlines() if line.startswith("{")
        ]
        yield f"http://{match[2]}", records
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def messages(records: list[dict[str, Any]], level: str | None = None) -> list[str]:
    return [
        r["msg"]
        for r in records
        if r["logger"] == "fencegate.server" and (level is None or r["level"] == level)
    ]


@pytest.mark.timeout(60)
def test_serve_without_a_config_says_there_is_no_upstream_and_how_to_add_one(
    tmp_path: Path,
) -> None:
    assert not (tmp_path / "fencegate.toml").exists()
    with serving(tmp_path) as (proxy, records):
        [warning] = [m for m in messages(records, "warning") if "upstream" in m]
        assert warning.startswith("no upstreams configured")
        assert "404 unknown-upstream" in warning
        assert "--config" in warning and "[[upstreams]]" in warning
        assert "examples/fencegate.toml" in warning
        assert not [m for m in messages(records) if m.startswith("protecting upstream")]
        # What the warning announces.
        request = urllib.request.Request(f"{proxy}/payments/charges", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request, timeout=10)
        with answer.value as error:
            assert error.code == 404
            assert json.loads(error.read())["reason"] == "unknown-upstream"


@pytest.mark.timeout(60)
def test_serve_names_each_protected_upstream_with_its_url(tmp_path: Path) -> None:
    config = tmp_path / "fencegate.toml"
    config.write_text(
        """\
[[upstreams]]
name = "payments"
url = "http://127.0.0.1:9000"
set_headers = { Authorization = "Bearer ${PAYMENTS_API_KEY}" }

[[upstreams]]
name = "mail"
url = "https://mailer:hunter2-secret@mail.example.com/v3"
fenced_methods = ["POST"]
""",
        encoding="utf-8",
    )
    with serving(tmp_path, "--config", str(config), PAYMENTS_API_KEY="sk_test_start_log") as (
        _,
        records,
    ):
        lines = [m for m in messages(records, "info") if m.startswith("protecting upstream")]
        assert lines == [
            "protecting upstream payments -> http://127.0.0.1:9000 "
            "(/payments/... on the proxy listener; fenced: POST, PUT, PATCH, DELETE)",
            "protecting upstream mail -> https://mailer:***@mail.example.com/v3 "
            "(/mail/... on the proxy listener; fenced: POST)",
        ]
        assert not [m for m in messages(records) if "no upstreams" in m]
        everything = json.dumps(records)
        assert "hunter2-secret" not in everything and "sk_test_start_log" not in everything


@pytest.mark.timeout(60)
def test_serve_names_each_lease_source_with_where_it_points(tmp_path: Path) -> None:
    """Each lease source gets a line, its kind and where it points; no password (a Redis
    URL's, in its user part or its query; an etcd endpoint's) and no key ever shows."""
    config = tmp_path / "fencegate.toml"
    pem = (
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    nobody, nobody_tls = free_port(), free_port()
    config.write_text(
        f"""\
[[upstreams]]
name = "payments"
url = "http://127.0.0.1:9000"

[[lease_sources]]
name = "etcd"
kind = "etcd"
endpoints = ["http://127.0.0.1:2379", "https://etcd.example.com:2379"]
username = "root"
password = "etcd-secret"

[[lease_sources]]
name = "zk"
kind = "zookeeper"
hosts = ["127.0.0.1:2181", "zk2.example.com:2181"]

[[lease_sources]]
name = "locks"
kind = "redis"
url = "redis://fencer:redis-secret@127.0.0.1:{nobody}/0"

[[lease_sources]]
name = "cache"
kind = "redis"
url = "rediss://127.0.0.1:{nobody_tls}/1?password=query-secret"

[[lease_sources]]
name = "ddb"
kind = "dynamodb"
table = "locks"
region = "us-east-1"
endpoint_url = "http://127.0.0.1:5000"

[[lease_sources]]
name = "queue"
kind = "jwt"
algorithms = ["EdDSA"]
public_keys = ['''{pem}''']
issuer = "billing-queue"
""",
        encoding="utf-8",
    )
    # serve needs AWS credentials (any) for ddb; the Redis sources point where nobody
    # listens (a Redis that answers and refuses the credentials would stop serve).
    aws = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    with serving(tmp_path, "--config", str(config), **aws) as (_, records):
        lines = [m for m in messages(records, "info") if m.startswith("accepting lease source")]
        assert lines == [
            "accepting lease source etcd: etcd (http://127.0.0.1:2379, "
            "https://etcd.example.com:2379); Fencing-Token etcd:...",
            "accepting lease source zk: zookeeper (127.0.0.1:2181, zk2.example.com:2181); "
            "Fencing-Token zk:...",
            f"accepting lease source locks: redis (redis://fencer:***@127.0.0.1:{nobody}/0); "
            "Fencing-Token locks:...",
            f"accepting lease source cache: redis (rediss://127.0.0.1:{nobody_tls}/1); "
            "Fencing-Token cache:...",
            "accepting lease source ddb: dynamodb (table locks, us-east-1, "
            "http://127.0.0.1:5000); Fencing-Token ddb:...",
            "accepting lease source queue: jwt (issuer 'billing-queue', EdDSA); "
            "Fencing-Token queue:...",
        ]
        # After the upstreams' lines, as the sources' are after them in the config.
        started = messages(records, "info")
        assert started.index(lines[0]) > max(
            i for i, m in enumerate(started) if m.startswith("protecting upstream")
        )
        everything = json.dumps(records)
        for secret in ("etcd-secret", "redis-secret", "query-secret", pem.splitlines()[1]):
            assert secret not in everything


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["json", "text"])
def test_serve_says_it_listens_once_in_the_chosen_format(tmp_path: Path, fmt: str) -> None:
    """One listening line, the start's last, in the log's format (it was printed twice:
    the log's line, and a plain one on stdout); on stdout only when the log level would
    hide it."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    environment.update(FENCEGATE_PROXY_LISTEN="127.0.0.1:0", FENCEGATE_CONTROL_LISTEN="127.0.0.1:0")
    for level, expect_stdout in (("INFO", False), ("WARNING", True)):
        out, err = tmp_path / f"{fmt}-{level}.out", tmp_path / f"{fmt}-{level}.err"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            process = subprocess.Popen(
                [FENCEGATE, "serve", "--log-format", fmt, "--log-level", level],
                cwd=tmp_path,
                env=environment,
                stdout=stdout,
                stderr=stderr,
            )
        try:
            deadline = time.monotonic() + 30
            while not LISTENING.search(out.read_text() + err.read_text()):
                assert process.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.05)
            time.sleep(0.3)  # anything printed right behind it
        finally:
            process.kill()
            process.wait(timeout=30)
        lines = [
            line
            for line in (out.read_text() + err.read_text()).splitlines()
            if "fencegate listening" in line
        ]
        assert len(lines) == 1, lines
        assert (LISTENING.search(out.read_text()) is not None) is expect_stdout
        if not expect_stdout:
            assert lines[0].startswith("{") is (fmt == "json"), lines[0]


@pytest.mark.timeout(60)
def test_a_misspelled_variable_is_named_with_the_one_meant(tmp_path: Path) -> None:
    """``FENCEGATE_DATABSE_URL`` was ignored in silence (pydantic-settings reads only
    the variables it knows) while check-config said the configuration was valid. Both
    name it now, with the nearest valid variable; other FENCEGATE_* variables
    (Kubernetes' service links, the workers') are left alone."""
    env = {
        "FENCEGATE_DATABSE_URL": "sqlite+aiosqlite:///elsewhere.db",
        "FENCEGATE_SERVICE_HOST": "10.0.0.1",
        "FENCEGATE_WORKER_TOKEN": "a-worker-token-of-16-characters",
    }
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    checked = subprocess.run(
        [FENCEGATE, "check-config"],
        cwd=tmp_path,
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stderr
    assert checked.stderr.splitlines() == [
        "fencegate: warning: FENCEGATE_DATABSE_URL: not a setting, ignored; "
        "did you mean FENCEGATE_DATABASE_URL?"
    ]
    assert "elsewhere.db" not in checked.stderr + checked.stdout  # never a value
    with serving(tmp_path, **env) as (_, records):
        [warning] = [m for m in messages(records, "warning") if "FENCEGATE_" in m]
    assert warning.endswith("did you mean FENCEGATE_DATABASE_URL?")
