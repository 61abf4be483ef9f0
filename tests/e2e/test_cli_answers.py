"""The ``fencegate`` command as a process: it needs no secret it does not use, shows none,
and answers every mistake in one line that says what to change."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

FENCEGATE = str(Path(sys.executable).parent / "fencegate")
URL_PASSWORD = "url-pw-secret-777777"
PAY_KEY = "sk_cli_pay_secret_888888"
ADMIN_TOKEN = "admin-cli-token-secret-999999"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# Both listeners on ports of the system's choosing: a ``fencegate serve`` the developer
# left on 8080/8081 is no matter.
ANY_PORTS = {"FENCEGATE_PROXY_LISTEN": "127.0.0.1:0", "FENCEGATE_CONTROL_LISTEN": "127.0.0.1:0"}


def environment(**extra: str) -> dict[str, str]:
    """No FENCEGATE_* variable and no PAYMENTS_API_KEY from the developer's shell."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("FENCEGATE_") and k != "PAYMENTS_API_KEY"
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FENCEGATE, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else environment(),
        cwd=cwd,
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The whole answer to a mistake: exactly one line on stderr, no traceback."""
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, result.stderr
    return lines[0]


CONFIG = """\
database_url = "{database_url}"
proxy_listen = "127.0.0.1:{proxy}"
control_listen = "127.0.0.1:{control}"

[auth]
admin_tokens = ["{admin}"]

[[upstreams]]
name = "payments"
url = "https://pay-user:{password}@payments.example.com/v1"
set_headers = {{ Authorization = "Bearer ${{PAYMENTS_API_KEY}}" }}
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "fencegate.toml"
    path.write_text(
        CONFIG.format(
            database_url="sqlite+aiosqlite:///fencegate.db",
            proxy=free_port(),
            control=free_port(),
            admin=ADMIN_TOKEN,
            password=URL_PASSWORD,
        ),
        encoding="utf-8",
    )
    return path


# -- secrets: only serve needs them, nothing prints them ---------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["migrate"],
        ["audit"],
        ["jobs"],
        ["outcomes"],
        ["upstreams"],
        ["upstreams", "--json"],
    ],
)
def test_read_only_commands_need_no_upstream_secret(config: Path, command: list[str]) -> None:
    result = run(*command, "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "PAYMENTS_API_KEY" not in result.stderr
    output = result.stdout + result.stderr
    assert URL_PASSWORD not in output
    assert ADMIN_TOKEN not in output


def test_upstreams_shows_the_url_without_its_password(config: Path) -> None:
    result = run("upstreams", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "https://pay-user:***@payments.example.com/v1" in result.stdout


def test_check_config_names_what_serve_will_need(config: Path) -> None:
    unset = run("check-config", "--config", str(config))
    assert unset.returncode == 2
    assert (
        "upstreams.0.set_headers.Authorization: environment variable PAYMENTS_API_KEY "
        "is not set (serve needs it" in unset.stderr
    )
    present = run(
        "check-config", "--config", str(config), env=environment(PAYMENTS_API_KEY=PAY_KEY)
    )
    assert present.returncode == 0, present.stderr
    assert "PAYMENTS_API_KEY (set) for upstreams.0.set_headers.Authorization" in present.stdout
    assert "pay-user:***@payments.example.com" in present.stdout
    for output in (unset.stdout + unset.stderr, present.stdout + present.stderr):
        assert URL_PASSWORD not in output
        assert PAY_KEY not in output
        assert ADMIN_TOKEN not in output


def test_check_config_shows_where_lease_sources_point_without_their_passwords(
    tmp_path: Path,
) -> None:
    config = tmp_path / "sources.toml"
    config.write_text(
        f"""\
database_url = "sqlite+aiosqlite:///{tmp_path / "fencegate.db"}"

[[lease_sources]]
name = "locks"
kind = "redis"
url = "redis://fencer:{URL_PASSWORD}@127.0.0.1:6379/0"

[[lease_sources]]
name = "cache"
kind = "redis"
url = "redis://127.0.0.1:6379/1?password={URL_PASSWORD}"

[[lease_sources]]
name = "ddb"
kind = "dynamodb"
table = "locks"
region = "us-east-1"
endpoint_url = "https://ddb-user:{URL_PASSWORD}@dynamodb.example.com"
""",
        encoding="utf-8",
    )
    result = run("check-config", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert URL_PASSWORD not in result.stdout + result.stderr
    lines = [
        line.split(None, 2)[2] for line in result.stdout.splitlines() if "lease source" in line
    ]
    assert lines == [
        "locks: redis (redis://fencer:***@127.0.0.1:6379/0); tokens locks:...",
        "cache: redis (redis://127.0.0.1:6379/1); tokens cache:...",
        "ddb: dynamodb (table locks, us-east-1, https://ddb-user:***@dynamodb.example.com); "
        "tokens ddb:...",
    ]


def test_check_config_refuses_an_expanded_value_with_a_line_break(config: Path) -> None:
    result = run(
        "check-config", "--config", str(config), env=environment(PAYMENTS_API_KEY="x\r\nX-Evil: 1")
    )
    assert result.returncode == 2
    assert "upstreams.0.set_headers.Authorization" in result.stderr
    assert "X-Evil" not in result.stderr + result.stdout


def test_serve_without_the_secret_exits_2_naming_it(config: Path) -> None:
    result = run("serve", "--config", str(config), timeout=30)
    assert result.returncode == 2
    assert "PAYMENTS_API_KEY" in result.stderr
    assert not (config.parent / "fencegate.db").exists()


@pytest.mark.parametrize("command", ["serve", "check-config"])
def test_an_empty_secret_is_refused_like_a_missing_one(config: Path, command: str) -> None:
    """``PAYMENTS_API_KEY=`` (set, but to nothing) would make the gateway send
    ``Authorization: Bearer `` with nothing after it: refused as an unset one is."""
    result = run(command, "--config", str(config), env=environment(PAYMENTS_API_KEY=""), timeout=30)
    assert result.returncode == 2
    assert (
        "upstreams.0.set_headers.Authorization: environment variable PAYMENTS_API_KEY "
        "is empty, the same as if it is not set"
    ) in result.stderr
    if command == "check-config":
        assert "(serve needs it; the other commands do not)" in result.stderr
    assert "configuration is valid" not in result.stdout
    assert not (config.parent / "fencegate.db").exists()


def test_serve_logs_no_token_at_debug(config: Path) -> None:
    """A malformed Authorization header is refused by aiohttp's parser; the process's
    log (DEBUG, JSON) holds no token, key or password."""
    text = config.read_text(encoding="utf-8")
    control = int(text.split('control_listen = "127.0.0.1:')[1].split('"')[0])
    log = config.parent / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [FENCEGATE, "serve", "--config", str(config), "--log-level", "DEBUG"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment(PAYMENTS_API_KEY=PAY_KEY),
        )
    try:
        deadline = time.monotonic() + 30
        while "fencegate listening" not in log.read_text(errors="replace"):
            assert process.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

        async def send(value: bytes) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", control)
            writer.write(
                b"GET /admin/upstreams HTTP/1.1\r\nHost: x\r\nAuthorization: "
                + value
                + b"\r\nConnection: close\r\n\r\n"
            )
            data = await reader.read()
            writer.close()
            return data

        async def exchange() -> list[bytes]:
            return [
                await send(f"Bearer {ADMIN_TOKEN}\x01".encode()),
                await send(ADMIN_TOKEN.encode()),
                await send(f"Bearer {ADMIN_TOKEN}".encode()),
            ]

        answers = asyncio.run(exchange())
        assert answers[0].startswith(b"HTTP/1.0 400"), answers[0][:80]
        assert answers[1].startswith(b"HTTP/1.1 401"), answers[1][:80]
        assert answers[2].startswith(b"HTTP/1.1 200"), answers[2][:80]
        assert URL_PASSWORD.encode() not in answers[2]
        time.sleep(0.3)
    finally:
        process.terminate()
        process.wait(30)
    output = log.read_text(errors="replace")
    assert "refused a malformed request" in output  # the parser's refusal was logged...
    for secret in (ADMIN_TOKEN, PAY_KEY, URL_PASSWORD):
        assert secret not in output  # ...without the token


# -- clear answers to mistakes -----------------------------------------------------------


def test_audit_reason_that_is_not_one(config: Path) -> None:
    result = run("audit", "--reason", "stale_generation", "--config", str(config))
    assert result.returncode == 2
    line = one_line(result)
    assert "'stale_generation' is not a reason" in line
    assert "stale-generation" in line and "idempotent-replay" in line


def test_audit_upstream_that_is_not_one(config: Path) -> None:
    result = run("audit", "--upstream", "paymnets", "--config", str(config))
    assert result.returncode == 2
    line = one_line(result)
    assert "paymnets" in line and "payments" in line


def test_audit_source_that_is_not_one(config: Path) -> None:
    result = run("audit", "--source", "zk", "--config", str(config))
    assert result.returncode == 2
    line = one_line(result)
    assert "'zk'" in line and "fencegate" in line  # the valid ones: no source configured
    listed = run("audit", "--source", "fencegate", "--json", "--config", str(config))
    assert listed.returncode == 0, listed.stderr
    assert '"items"' in listed.stdout


def test_audit_table_shows_generation_and_highest_as_the_json_does(config: Path) -> None:
    """GEN/HIGHEST is the entry's presented and highest known generation, ``-`` for the
    one not known: a lease source's refusal whose own generation is gone with its lock
    (an etcd key, a ZooKeeper node) still shows the highest one, as the JSON has it."""
    from gateway.records.audit import Audit, AuditEntry
    from lease_core.db import create_engine
    from lease_core.store import LeaseStore

    assert run("migrate", "--config", str(config)).returncode == 0
    entries = [  # oldest first
        AuditEntry("invalid-fencing-token", 403, "POST", "/payments/a"),
        AuditEntry("idempotent-replay", 201, "POST", "/payments/b", "order-42", 2, 2),
        AuditEntry("stale-generation", 409, "POST", "/payments/c", "locks/order-7", 2, 3),
        AuditEntry("stale-generation", 409, "POST", "/payments/d", "zk//locks/o-9", None, 8),
        AuditEntry("lease-ended", 409, "POST", "/payments/e", "etcd/o-5", 4, None),
    ]

    async def write() -> None:
        engine = create_engine(f"sqlite+aiosqlite:///{config.parent / 'fencegate.db'}")
        audit = Audit(LeaseStore(engine))
        for entry in entries:
            audit.record(entry)
        await audit.close()
        await engine.dispose()

    asyncio.run(write())
    as_json = run("audit", "--json", "--config", str(config))
    table = run("audit", "--config", str(config))
    assert as_json.returncode == 0 and table.returncode == 0, as_json.stderr + table.stderr
    items = json.loads(as_json.stdout)["items"]
    assert [(i["generation"], i["highest_generation"]) for i in items] == [
        (4, None),
        (None, 8),
        (2, 3),
        (2, 2),
        (None, None),
    ]
    header, *rows = table.stdout.splitlines()
    start, end = header.index("GEN/HIGHEST"), header.index("UPSTREAM")
    assert [row[start:end].strip() for row in rows] == ["4", "-/8", "2/3", "2/2", "-"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["jobs", "--state", "done"], ["'done'", "pending", "completed"]),
        (["jobs", "frob"], ["'frob'", "list", "purge"]),
        (["outcomes", "clear"], ["'clear'", "resolve"]),
        (["serve", "--log-level", "TRACE"], ["'TRACE'", "DEBUG"]),
    ],
)
def test_enumerated_options_answer_in_one_line(
    config: Path, args: list[str], words: list[str]
) -> None:
    result = run(*args, "--config", str(config))
    assert result.returncode == 2
    line = one_line(result)
    for word in words:
        assert word in line


@pytest.mark.parametrize("which", ["proxy", "control"])
def test_taken_port_names_its_setting_and_leaves_nothing_behind(tmp_path: Path, which: str) -> None:
    proxy, control = free_port(), free_port()
    (tmp_path / "fencegate.toml").write_text(
        f'proxy_listen = "127.0.0.1:{proxy}"\ncontrol_listen = "127.0.0.1:{control}"\n'
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", proxy if which == "proxy" else control))
        taken.listen()
        result = run("serve", cwd=tmp_path, timeout=30)
        assert result.returncode == 1
        line = one_line(result)
        assert f"FENCEGATE_{which.upper()}_LISTEN" in line
        assert f"{which}_listen" in line
        assert "address already in use" in line
    assert not (tmp_path / "fencegate.db").exists()
    # The other port was not left bound.
    with socket.socket() as other:
        other.bind(("127.0.0.1", control if which == "proxy" else proxy))


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("FENCEGATE_AUTH__ADMIN_TOKENS", ADMIN_TOKEN),
        ("FENCEGATE_AUTH__WORKER_TOKENS", f"{ADMIN_TOKEN},{ADMIN_TOKEN}x"),
        ("FENCEGATE_AUTH__ADMIN_TOKENS", f'"{ADMIN_TOKEN}"'),
    ],
)
def test_token_variable_that_is_not_a_json_list(tmp_path: Path, variable: str, value: str) -> None:
    result = run("check-config", cwd=tmp_path, env=environment(**{variable: value}))
    assert result.returncode == 2
    assert variable in result.stderr
    assert "JSON list" in result.stderr
    assert ADMIN_TOKEN not in result.stderr + result.stdout


@pytest.mark.parametrize("command", ["check-config", "migrate", "serve"])
def test_sqlite_database_in_a_missing_folder(tmp_path: Path, command: str) -> None:
    (tmp_path / "fencegate.toml").write_text(
        'database_url = "sqlite+aiosqlite:///no/such/folder/fg.db"\n'
        f'proxy_listen = "127.0.0.1:{free_port()}"\n'
        f'control_listen = "127.0.0.1:{free_port()}"\n'
    )
    result = run(command, cwd=tmp_path, timeout=30)
    assert result.returncode == 2
    line = one_line(result)
    assert str(tmp_path / "no" / "such" / "folder" / "fg.db") in line


@pytest.fixture
def refused_url() -> Iterator[str]:
    port = free_port()  # nobody listens here
    yield f"postgresql+asyncpg://postgres@127.0.0.1:{port}/fencegate"


@pytest.mark.parametrize("command", ["migrate", "audit", "serve"])
def test_database_refusing_connections(tmp_path: Path, refused_url: str, command: str) -> None:
    result = run(
        command,
        cwd=tmp_path,
        env=environment(FENCEGATE_DATABASE_URL=refused_url, **ANY_PORTS),
        timeout=30,
    )
    assert result.returncode == 1
    line = one_line(result)
    port = refused_url.split(":")[-1].split("/")[0]
    assert "database error" in line
    assert f"127.0.0.1:{port}" in line
    assert "connection refused" in line


@pytest.mark.postgres
@pytest.mark.parametrize("command", ["migrate", "audit", "jobs", "serve"])
def test_postgres_database_that_does_not_exist(
    tmp_path: Path, pg_database_url: str, command: str
) -> None:
    """Said as the other database errors are (where, why), with what to run, instead of
    the driver's ``(sqlalchemy.dialects.postgresql.asyncpg.Error) database ... does not
    exist``. ``pg_database_url``: the server is there (else skipped, or failed in CI)."""
    import sqlalchemy as sa

    server = sa.make_url(pg_database_url)
    name = f"fg_nope_{os.getpid()}"
    url = server.set(database=name).render_as_string(hide_password=False)
    result = run(
        command, cwd=tmp_path, env=environment(FENCEGATE_DATABASE_URL=url, **ANY_PORTS), timeout=30
    )
    assert result.returncode == 1
    line = one_line(result)
    where = f"{server.host}:{server.port or 5432}"
    assert line.startswith(f"fencegate: database error: cannot connect to PostgreSQL at {where} (")
    assert f'database "{name}" does not exist' in line
    assert "createdb" in line and name in line and f'CREATE DATABASE "{name}"' in line
    assert "fencegate migrate" in line
    assert "sqlalchemy" not in line and "asyncpg" not in line


@pytest.mark.postgres
def test_postgres_user_that_does_not_exist(tmp_path: Path, pg_database_url: str) -> None:
    import sqlalchemy as sa

    url = sa.make_url(pg_database_url).set(username="fg_nobody", password="pw-secret-4242")
    env = environment(FENCEGATE_DATABASE_URL=url.render_as_string(hide_password=False))
    line = one_line(run("audit", cwd=tmp_path, env=env, timeout=30))
    assert "database error: cannot connect to PostgreSQL at" in line
    assert 'role "fg_nobody" does not exist' in line
    assert "check the user and password in database_url" in line
    assert "pw-secret-4242" not in line and "asyncpg" not in line


@pytest.mark.parametrize("command", ["check-config", "migrate", "serve"])
def test_postgres_url_without_its_driver(tmp_path: Path, command: str) -> None:
    """An install without asyncpg (shadowed here by a package that cannot be imported)
    is refused at configuration time, in one line that names the extra."""
    shadow = tmp_path / "shadow" / "asyncpg"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'asyncpg'\", name='asyncpg')\n"
    )
    env = environment(
        FENCEGATE_DATABASE_URL="postgresql+asyncpg://postgres@127.0.0.1:5432/fencegate",
        PYTHONPATH=str(tmp_path / "shadow"),
    )
    result = run(command, cwd=tmp_path, env=env, timeout=30)
    assert result.returncode == 2
    assert "asyncpg" in result.stderr and "fencegate[postgres]" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr


def test_postgres_driver_is_a_base_dependency() -> None:
    import tomllib

    pyproject = tomllib.loads(
        (Path(__file__).parents[2] / "pyproject.toml").read_text(encoding="utf-8")
    )
    assert any(d.startswith("asyncpg") for d in pyproject["project"]["dependencies"])


# -- migrate on a schema a newer version migrated (a rollback) ----------------------------


def _stamp(path: Path, revision: str, floor: str) -> None:
    """The file as a newer release's ``fencegate migrate`` leaves it."""
    import sqlite3

    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = ?", (revision,))
        conn.execute("UPDATE schema_floor SET revision = ?", (floor,))


def test_migrate_on_a_newer_schema_says_so_and_changes_nothing(tmp_path: Path) -> None:
    """A rolled-back deployment runs the old version's migrate step: with the schema's
    floor at or below this code, there is nothing to do (exit 0), and its serve starts."""
    (tmp_path / "fencegate.toml").write_text('database_url = "sqlite+aiosqlite:///fg.db"\n')
    assert run("migrate", cwd=tmp_path, timeout=60).returncode == 0
    _stamp(tmp_path / "fg.db", "9999_newer", "0008")
    result = run("migrate", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "database at revision 9999_newer, newer than this version's" in result.stdout


def test_migrate_below_the_schemas_floor_refuses_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "fencegate.toml").write_text('database_url = "sqlite+aiosqlite:///fg.db"\n')
    assert run("migrate", cwd=tmp_path, timeout=60).returncode == 0
    _stamp(tmp_path / "fg.db", "9999_newer", "9999_newer")
    result = run("migrate", cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    line = one_line(result)
    assert "serves code from revision 9999_newer on" in line
    assert "replace it with the newer version" in line
