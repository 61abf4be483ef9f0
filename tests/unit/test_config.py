"""``gateway.config``: the TOML file, ``FENCEGATE_*`` variables, and errors that name
the bad key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.config import (
    ConfigError,
    Settings,
    env_references,
    for_serving,
    load_settings,
    resolve_secrets,
)

TOKEN = "w" * 16


def write(folder: Path, text: str, name: str = "fencegate.toml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def problems(excinfo: pytest.ExceptionInfo[ConfigError]) -> str:
    return "\n".join(excinfo.value.problems)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No FENCEGATE_* variable of the developer's shell leaks into these tests, and no
    ./fencegate.toml of the working directory is picked up."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("FENCEGATE_"):
            monkeypatch.delenv(name)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)


# -- the file -----------------------------------------------------------------------------


def test_full_file_is_read(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"""
        database_url = "postgresql+asyncpg://fg:pw@db.internal:5432/fencegate"
        proxy_listen = "0.0.0.0:9080"
        control_listen = "[::]:9081"

        [auth]
        worker_tokens = ["{TOKEN}"]
        admin_tokens = ["{"a" * 20}"]

        [lease]
        default_ttl_seconds = 12.5
        max_ttl_seconds = 90

        [gateway]
        audit_retention_days = 7

        [[upstreams]]
        name = "payments"
        url = "http://127.0.0.1:9000/"
        fenced_methods = ["post", "PUT"]
        unknown_outcome = "retry"
        """,
    )
    settings = load_settings(path, environ={})
    assert settings.database_url == "postgresql+asyncpg://fg:pw@db.internal:5432/fencegate"
    assert settings.proxy_listen == "0.0.0.0:9080"
    assert settings.control_listen == "[::]:9081"
    assert [t.get_secret_value() for t in settings.auth.worker_tokens] == [TOKEN]
    assert settings.lease.default_ttl_seconds == 12.5
    assert settings.lease.max_ttl_seconds == 90
    assert settings.lease.default_max_attempts == 3  # default kept
    assert settings.gateway.audit_retention_days == 7
    upstream = settings.upstream("payments")
    assert upstream is not None
    assert upstream.url == "http://127.0.0.1:9000"  # trailing slash dropped
    assert upstream.fenced_methods == ["POST", "PUT"]
    assert upstream.unknown_outcome == "retry"
    assert settings.upstream("nope") is None


def test_no_file_gives_the_defaults() -> None:
    settings = load_settings(None, environ={})
    assert settings.proxy_listen == "127.0.0.1:8080"
    assert settings.control_listen == "127.0.0.1:8081"
    assert settings.lease.default_ttl_seconds == 30
    assert settings.lease.max_ttl_seconds == 600
    assert not settings.auth.enabled


def test_fencegate_toml_of_the_working_directory_is_used(tmp_path: Path) -> None:
    write(Path.cwd(), "[lease]\nmax_ttl_seconds = 77\n")
    assert load_settings(None, environ={}).lease.max_ttl_seconds == 77


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_settings(tmp_path / "absent.toml", environ={})
    assert "absent.toml" in problems(excinfo)
    assert "no such file" in problems(excinfo)


def test_invalid_toml_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "database_url = \n")
    with pytest.raises(ConfigError) as excinfo:
        load_settings(path, environ={})
    assert "not valid TOML" in problems(excinfo)


# -- errors name the bad key ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "words"),
    [
        ("databse_url = 'x'\n", "databse_url", "unknown setting"),
        ("[lease]\nmax_ttl = 5\n", "lease.max_ttl", "unknown setting"),
        ("[auth]\nworker_token = []\n", "auth.worker_token", "unknown setting"),
        ("[lease]\nmax_ttl_seconds = 'soon'\n", "lease.max_ttl_seconds", "number"),
        ("[lease]\ndefault_ttl_seconds = -1\n", "lease.default_ttl_seconds", "greater than 0"),
        ("[lease]\nmax_ttl_seconds = nan\n", "lease.max_ttl_seconds", "finite"),
        ("[lease]\nmax_ttl_seconds = inf\n", "lease.max_ttl_seconds", "finite"),
        ("[lease]\ndefault_max_attempts = 1.5\n", "lease.default_max_attempts", "integer"),
        ("[lease]\ndefault_ttl_seconds = 700\n", "lease", "must not exceed max_ttl_seconds"),
        ("database_url = 'mysql://u@h/db'\n", "database_url", "sqlite+aiosqlite"),
        ("database_url = 'not a url'\n", "database_url", "not a database URL"),
        ("database_url = 5\n", "database_url", "string"),
        ("proxy_listen = '127.0.0.1'\n", "proxy_listen", "host:port"),
        ("control_listen = '127.0.0.1:99999'\n", "control_listen", "host:port"),
        ("[auth]\nadmin_tokens = ['short']\n", "auth.admin_tokens", "at least 16"),
        ("[auth]\nmetrics_tokens = ['short']\n", "auth.metrics_tokens", "at least 16"),
        (
            "[[upstreams]]\nname = 'p'\nurl = 'ftp://example.com'\n",
            "upstreams.0.url",
            "http",
        ),
        (
            "[[upstreams]]\nname = 'p'\nurl = 'http://127.0.0.1:1'\nretries = 3\n",
            "upstreams.0.retries",
            "unknown setting",
        ),
        (
            "[[upstreams]]\nname = 'p'\nurl = 'http://127.0.0.1:1'\n"
            "[[upstreams]]\nname = 'p'\nurl = 'http://127.0.0.1:2'\n",
            "upstreams",
            "duplicate name",
        ),
        (
            "[[lease_sources]]\nname = 'fencegate'\nkind = 'redis'\nurl = 'redis://127.0.0.1:6379/0'\n",
            "lease_sources",
            "the gateway's own leases",
        ),
        (
            "[[upstreams]]\nname = 'p'\nurl = 'http://127.0.0.1:1'\ntimeout_seconds = 'x'\n",
            "upstreams.0.timeout_seconds",
            "number",
        ),
    ],
)
def test_errors_name_the_bad_key(tmp_path: Path, text: str, key: str, words: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        load_settings(path, environ={})
    message = str(excinfo.value)
    assert any(p.startswith(f"{key}:") or f"{key}:" in p for p in excinfo.value.problems), message
    assert words in message


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "databse_url = 'sqlite+aiosqlite:///x.db'\n",
            "databse_url: unknown setting; did you mean `database_url`?",
        ),
        ("[leese]\nmax_ttl_seconds = 5\n", "leese: unknown setting; did you mean `lease`?"),
        (
            "[lease]\ndeafult_ttl_seconds = 5\n",
            "lease.deafult_ttl_seconds: unknown setting; did you mean `default_ttl_seconds`?",
        ),
        (
            "[auth]\nworker_token = []\n",
            "auth.worker_token: unknown setting; did you mean `worker_tokens`?",
        ),
        (
            "[tls.proxy]\ncert = 'c.pem'\n",
            "tls.proxy.cert: unknown setting; did you mean `cert_file`?",
        ),
        (
            "[[upstreams]]\nname = 'p'\nurl = 'http://127.0.0.1:1'\nfenced_method = []\n",
            "upstreams.0.fenced_method: unknown setting; did you mean `fenced_methods`?",
        ),
        (
            "[[upstreams]]\nname = 'p'\nurl = 'http://127.0.0.1:1'\n"
            "[upstreams.dedup]\nhedaer = 'Idempotency-Key'\n",
            "upstreams.0.dedup.hedaer: unknown setting; did you mean `header`?",
        ),
        (
            "[[lease_sources]]\nname = 'q'\nkind = 'jwt'\nalgorithms = ['EdDSA']\n"
            "public_keys = ['k']\nissuer = 'q'\nisuer = 'q'\n",
            "lease_sources.0.jwt.isuer: unknown setting; did you mean `issuer`?",
        ),
        # Nothing near: no guess.
        ("[lease]\ncolour = 'red'\n", "lease.colour: unknown setting"),
    ],
)
def test_unknown_setting_names_the_nearest_valid_one(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        load_settings(path, environ={})
    assert problem in excinfo.value.problems, excinfo.value.problems


def test_unknown_nested_variable_names_itself_and_the_nearest_valid_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``FENCEGATE_A__B`` variable for a table's setting is refused when the setting is
    unknown; the answer says which variable, and the one that was meant."""
    monkeypatch.setenv("FENCEGATE_LEASE__MAX_TTL_SECOND", "900")
    with pytest.raises(ConfigError) as excinfo:
        load_settings(write(tmp_path, ""))
    assert excinfo.value.problems == [
        "lease.max_ttl_second: unknown setting (from FENCEGATE_LEASE__MAX_TTL_SECOND); "
        "did you mean `max_ttl_seconds` (FENCEGATE_LEASE__MAX_TTL_SECONDS)?"
    ]


# -- the environment ------------------------------------------------------------------------


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(
        tmp_path,
        """
        control_listen = "127.0.0.1:7001"
        [lease]
        default_ttl_seconds = 10
        max_ttl_seconds = 100
        """,
    )
    monkeypatch.setenv("FENCEGATE_LEASE__MAX_TTL_SECONDS", "900")
    monkeypatch.setenv("FENCEGATE_CONTROL_LISTEN", "127.0.0.1:7002")
    settings = load_settings(path)
    assert settings.lease.max_ttl_seconds == 900
    assert settings.control_listen == "127.0.0.1:7002"
    # A nested variable overrides its one key: the file's other keys of the table stay.
    assert settings.lease.default_ttl_seconds == 10


def test_environment_lists_are_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FENCEGATE_AUTH__ADMIN_TOKENS", f'["{TOKEN}"]')
    settings = load_settings(None)
    assert [t.get_secret_value() for t in settings.auth.admin_tokens] == [TOKEN]
    assert settings.auth.enabled


def test_bad_environment_value_names_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FENCEGATE_LEASE__MAX_TTL_SECONDS", "lots")
    with pytest.raises(ConfigError) as excinfo:
        load_settings(None)
    assert "lease.max_ttl_seconds:" in problems(excinfo)


def test_unrelated_fencegate_variables_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    # e.g. the test suite's own FENCEGATE_TEST_POSTGRES_URL
    monkeypatch.setenv("FENCEGATE_TEST_POSTGRES_URL", "postgresql+asyncpg://x@y/z")
    assert load_settings(None).database_url.startswith("sqlite+aiosqlite:///")


# -- SQLite paths -----------------------------------------------------------------------------


def _sqlite_path(settings: Settings) -> Path:
    url = sa.make_url(settings.database_url)
    assert url.drivername == "sqlite+aiosqlite"
    assert url.database is not None
    return Path(url.database)


def test_relative_sqlite_path_is_resolved_against_the_config_folder(tmp_path: Path) -> None:
    folder = tmp_path / "etc" / "fencegate"
    path = write(folder, 'database_url = "sqlite+aiosqlite:///data/fg.db"\n')
    # The working directory (an unrelated folder) must not matter.
    settings = load_settings(path, environ={})
    assert _sqlite_path(settings) == folder.resolve() / "data" / "fg.db"


def test_relative_config_path_is_resolved_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "conf"
    write(folder, 'database_url = "sqlite+aiosqlite:///fg.db"\n')
    monkeypatch.chdir(tmp_path)
    settings = load_settings("conf/fencegate.toml", environ={})
    assert _sqlite_path(settings) == folder.resolve() / "fg.db"


def test_absolute_sqlite_path_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere" / "fg.db"
    path = write(tmp_path / "conf", f'database_url = "sqlite+aiosqlite:///{target}"\n')
    assert _sqlite_path(load_settings(path, environ={})) == target


@pytest.mark.parametrize(
    "url",
    ["sqlite+aiosqlite:///:memory:", "sqlite+aiosqlite://", "sqlite+aiosqlite:///x?mode=memory"],
)
def test_in_memory_sqlite_is_refused(tmp_path: Path, url: str) -> None:
    # Every connection would see its own empty database: refused with the reason.
    path = write(tmp_path, f'database_url = "{url}"\n')
    with pytest.raises(ConfigError, match="SQLite in memory is not supported"):
        load_settings(path, environ={})


def test_postgres_url_is_kept_with_its_password(tmp_path: Path) -> None:
    url = "postgresql+asyncpg://fg:s3cret@db:5432/fencegate"
    path = write(tmp_path, f'database_url = "{url}"\n')
    assert load_settings(path, environ={}).database_url == url


# -- listeners and auth -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "listen"),
    [
        ("control_listen", "0.0.0.0:8081"),
        ("proxy_listen", "0.0.0.0:8080"),
        ("control_listen", "[::]:8081"),
        ("proxy_listen", "192.168.1.10:8080"),
        ("control_listen", "example.com:8081"),
    ],
)
def test_non_loopback_listener_without_tokens_is_refused(
    tmp_path: Path, key: str, listen: str
) -> None:
    path = write(tmp_path, f'{key} = "{listen}"\n')
    settings = load_settings(path, environ={})  # migrate and the others need no tokens
    with pytest.raises(ConfigError) as excinfo:
        for_serving(settings, environ={})  # serve and check-config refuse it
    assert key in problems(excinfo)
    assert "loopback" in problems(excinfo)


@pytest.mark.parametrize("tokens", ["worker_tokens", "admin_tokens"])
def test_non_loopback_listener_with_tokens_is_allowed(tmp_path: Path, tokens: str) -> None:
    path = write(
        tmp_path,
        f'control_listen = "0.0.0.0:8081"\nproxy_listen = "0.0.0.0:8080"\n'
        f'[auth]\n{tokens} = ["{TOKEN}"]\n',
    )
    settings = load_settings(path, environ={})
    assert settings.control_listen == "0.0.0.0:8081"
    assert settings.auth.enabled


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "localhost:8081", "[::1]:8081", "127.0.0.2:1"])
def test_loopback_listeners_need_no_tokens(tmp_path: Path, listen: str) -> None:
    path = write(tmp_path, f'control_listen = "{listen}"\n')
    assert load_settings(path, environ={}).control_listen == listen


def test_tokens_are_secret(tmp_path: Path) -> None:
    path = write(tmp_path, f'[auth]\nadmin_tokens = ["{TOKEN}"]\n')
    settings = load_settings(path, environ={})
    assert TOKEN not in repr(settings)
    assert TOKEN not in str(settings)


# -- ${ENV} in upstream headers ---------------------------------------------------------------

UPSTREAM = """
[[upstreams]]
name = "payments"
url = "http://127.0.0.1:9000"
set_headers = {{ Authorization = "Bearer ${{PAYMENTS_API_KEY}}", X-Team = "{team}" }}
"""


def test_env_references_in_set_headers_are_expanded(tmp_path: Path) -> None:
    path = write(tmp_path, UPSTREAM.format(team="core-${TEAM}"))
    settings = resolve_secrets(
        load_settings(path, environ={}), environ={"PAYMENTS_API_KEY": "sk_live_123", "TEAM": "7"}
    )
    upstream = settings.upstream("payments")
    assert upstream is not None
    headers = {k: v.get_secret_value() for k, v in upstream.set_headers.items()}
    assert headers == {"Authorization": "Bearer sk_live_123", "X-Team": "core-7"}
    assert "sk_live_123" not in repr(settings)


def test_env_references_are_not_needed_to_load(tmp_path: Path) -> None:
    """Read-only commands load the configuration without the upstreams' secrets; the
    references stay as written and say what ``serve`` will need."""
    path = write(tmp_path, UPSTREAM.format(team="core-${TEAM}"))
    settings = load_settings(path, environ={})
    upstream = settings.upstream("payments")
    assert upstream is not None
    assert upstream.set_headers["Authorization"].get_secret_value() == "Bearer ${PAYMENTS_API_KEY}"
    assert env_references(settings, {"TEAM": "7"}) == [
        ("upstreams.0.set_headers.Authorization", "PAYMENTS_API_KEY", False),
        ("upstreams.0.set_headers.X-Team", "TEAM", True),
    ]


def test_missing_env_reference_is_named_in_the_error(tmp_path: Path) -> None:
    path = write(tmp_path, UPSTREAM.format(team="t"))
    with pytest.raises(ConfigError) as excinfo:
        resolve_secrets(load_settings(path, environ={}), environ={"OTHER": "x"})
    message = problems(excinfo)
    assert "PAYMENTS_API_KEY" in message
    assert "upstreams.0.set_headers.Authorization" in message


def test_empty_env_reference_is_refused_like_a_missing_one(tmp_path: Path) -> None:
    """Set to the empty string counts as not set, in every place ``${NAME}`` is read:
    the check-config listing says not set, and serve refuses to start."""
    path = write(tmp_path, UPSTREAM.format(team="core-${TEAM}"))
    settings = load_settings(path, environ={})
    environ = {"PAYMENTS_API_KEY": "", "TEAM": "7"}
    assert env_references(settings, environ) == [
        ("upstreams.0.set_headers.Authorization", "PAYMENTS_API_KEY", False),
        ("upstreams.0.set_headers.X-Team", "TEAM", True),
    ]
    with pytest.raises(ConfigError) as excinfo:
        resolve_secrets(settings, environ=environ)
    assert excinfo.value.problems == [
        "upstreams.0.set_headers.Authorization: environment variable PAYMENTS_API_KEY "
        "is empty, the same as if it is not set"
    ]
    with pytest.raises(ConfigError, match="TEAM is empty"):
        resolve_secrets(settings, environ={"PAYMENTS_API_KEY": "sk", "TEAM": ""})


def test_env_reference_reads_the_process_environment_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAYMENTS_API_KEY", "from-os")
    path = write(tmp_path, UPSTREAM.format(team="t"))
    upstream = resolve_secrets(load_settings(path)).upstream("payments")
    assert upstream is not None
    assert upstream.set_headers["Authorization"].get_secret_value() == "Bearer from-os"


def test_header_value_with_a_line_break_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, UPSTREAM.format(team="t"))
    with pytest.raises(ConfigError) as excinfo:
        resolve_secrets(
            load_settings(path, environ={}), environ={"PAYMENTS_API_KEY": "x\r\nX-Evil: 1"}
        )
    assert "upstreams.0.set_headers" in problems(excinfo)
    assert "x\r\nX-Evil" not in str(excinfo.value)


def test_metrics_tokens_are_secrets_of_the_configuration() -> None:
    """Kept out of every log line like the other tokens (``Settings.secret_values``)."""
    settings = Settings(auth={"metrics_tokens": ["scrape-token-0123456789"]})
    assert "scrape-token-0123456789" in settings.secret_values()
    assert "scrape-token-0123456789" not in repr(settings)
    assert settings.auth.enabled


# -- the replica's name ---------------------------------------------------------------------


def test_the_replica_name_is_set_or_the_hostname(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.config.gateway import hostname_replica

    path = write(tmp_path, '[gateway]\nreplica_name = "gw-1.eu:a"\n')
    assert load_settings(path).gateway.replica == "gw-1.eu:a"
    monkeypatch.setenv("FENCEGATE_GATEWAY__REPLICA_NAME", "gw-2")
    assert load_settings(path).gateway.replica == "gw-2"
    monkeypatch.delenv("FENCEGATE_GATEWAY__REPLICA_NAME")
    for bad in ('""', '"-gw"', '"gw 1"', f'"{"g" * 101}"'):
        with pytest.raises(ConfigError, match=r"gateway\.replica_name"):
            load_settings(write(tmp_path, f"[gateway]\nreplica_name = {bad}\n"))
    # Unset: the hostname, made into a name the column and the filter accept.
    assert hostname_replica("pod-7d9f.svc") == "pod-7d9f.svc"
    assert hostname_replica("_büro host") == "b-ro-host"
    assert hostname_replica("x" * 300) == "x" * 100
    assert hostname_replica("__") == "fencegate"
