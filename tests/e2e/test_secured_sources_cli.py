"""``check-config`` and ``serve`` on the lease sources' TLS files, passwords and AWS
credentials, as processes: every problem named at once, none of the secrets shown, and
a DynamoDB source without credentials stops ``serve`` with a sentence, not a traceback."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.test_cli_answers import environment, free_port, run

ZK_PASSWORD = "zk-cli-secret-121212"
REDIS_PASSWORD = "redis-cli-secret-343434"

SOURCES = """\
database_url = "sqlite+aiosqlite:///fencegate.db"
proxy_listen = "127.0.0.1:{proxy}"
control_listen = "127.0.0.1:{control}"

[[lease_sources]]
name = "etcd"
kind = "etcd"
endpoints = ["https://127.0.0.1:2379"]
ca_file = "{folder}/missing-ca.pem"
cert_file = "{folder}/client.crt"
key_file = "{folder}"

[[lease_sources]]
name = "zk"
kind = "zookeeper"
hosts = ["127.0.0.1:2181,127.0.0.1:2182/fencegate"]
username = "gateway"
password = "${{ZK_PASSWORD}}"

[[lease_sources]]
name = "locks"
kind = "redis"
url = "rediss://127.0.0.1:6380/0"
username = "gateway"
password = "{redis_password}"
ca_file = "{folder}/not-a-certificate.pem"
"""

DYNAMODB = """\
database_url = "sqlite+aiosqlite:///fencegate.db"
proxy_listen = "127.0.0.1:{proxy}"
control_listen = "127.0.0.1:{control}"

[[lease_sources]]
name = "ddb"
kind = "dynamodb"
table = "locks"
region = "us-east-1"
endpoint_url = "http://127.0.0.1:9"
"""


def write(tmp_path: Path, template: str) -> Path:
    (tmp_path / "client.crt").write_text("-----BEGIN CERTIFICATE-----\nnot one\n")
    (tmp_path / "not-a-certificate.pem").write_text("hello\n")
    path = tmp_path / "fencegate.toml"
    path.write_text(
        template.format(
            proxy=free_port(),
            control=free_port(),
            folder=tmp_path,
            redis_password=REDIS_PASSWORD,
        )
    )
    return path


def no_aws(tmp_path: Path) -> dict[str, str]:
    """An environment in which botocore's chain finds nothing: no AWS_* variables, empty
    credentials and config files, no instance metadata."""
    (tmp_path / "aws-empty").write_text("")
    env = {k: v for k, v in environment().items() if not k.startswith("AWS_")}
    env |= {
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-empty"),
        "AWS_CONFIG_FILE": str(tmp_path / "aws-empty"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "HOME": str(tmp_path),
    }
    return env


def test_check_config_names_every_missing_file_and_secret_at_once(tmp_path: Path) -> None:
    config = write(tmp_path, SOURCES)
    result = run("check-config", "--config", str(config))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for line in (
        f"lease_sources.0.ca_file: {tmp_path}/missing-ca.pem: no such file",
        f"lease_sources.0.key_file: {tmp_path}: a directory, not a file",
        "lease_sources.1.password: environment variable ZK_PASSWORD is not set (serve needs it",
        f"lease_sources.2.ca_file: {tmp_path}/not-a-certificate.pem: not a PEM CA certificate",
    ):
        assert line in result.stderr, result.stderr
    assert REDIS_PASSWORD not in result.stdout + result.stderr

    # The files fixed and the secret set: valid, the password never printed.
    from tests.certs import Pki

    pki = Pki(tmp_path / "pki")
    client = pki.issue("client", server=False)
    config.write_text(
        config.read_text()
        .replace(f"{tmp_path}/missing-ca.pem", str(pki.ca))
        .replace(f"{tmp_path}/client.crt", str(client.cert))
        .replace(f'key_file = "{tmp_path}"', f'key_file = "{client.key}"')
        .replace(f"{tmp_path}/not-a-certificate.pem", str(pki.ca))
    )
    valid = run("check-config", "--config", str(config), env=environment(ZK_PASSWORD=ZK_PASSWORD))
    assert valid.returncode == 0, valid.stderr
    assert "ZK_PASSWORD (set) for lease_sources.1.password" in valid.stdout
    for secret in (ZK_PASSWORD, REDIS_PASSWORD):
        assert secret not in valid.stdout + valid.stderr


def test_dynamodb_without_credentials_serve_refuses_and_check_config_says_so(
    tmp_path: Path,
) -> None:
    config = write(tmp_path, DYNAMODB)
    checked = run("check-config", "--config", str(config), env=no_aws(tmp_path))
    assert checked.returncode == 0, checked.stderr  # where serve runs may have them
    assert "serve needs     AWS credentials, which this shell lacks" in checked.stdout
    assert "for lease_sources.0" in checked.stdout

    served = run("serve", "--config", str(config), env=no_aws(tmp_path), timeout=60)
    assert served.returncode != 0
    assert "Traceback" not in served.stderr, served.stderr
    assert (
        "fencegate: lease source ddb: botocore found no AWS credentials for DynamoDB"
        in served.stderr
    ), served.stderr

    with_them = no_aws(tmp_path) | {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}
    checked = run("check-config", "--config", str(config), env=with_them)
    assert checked.returncode == 0, checked.stderr
    assert "botocore's chain found them in this shell" in checked.stdout


ETCD_THEN_DYNAMODB = """\
database_url = "sqlite+aiosqlite:///fencegate.db"
proxy_listen = "127.0.0.1:{proxy}"
control_listen = "127.0.0.1:{control}"

[[lease_sources]]
name = "etcd"
kind = "etcd"
endpoints = ["http://127.0.0.1:9"]

[[lease_sources]]
name = "ddb"
kind = "dynamodb"
table = "locks"
region = "us-east-1"
endpoint_url = "http://127.0.0.1:9"
"""


def test_a_start_that_fails_closes_what_it_opened(tmp_path: Path) -> None:
    """etcd (not answering yet: its session opened, serve goes on), then a DynamoDB
    source without credentials stops the start: the etcd session and the forwarder's
    are closed on the way out, so no "Unclosed client session" is logged."""
    config = write(tmp_path, ETCD_THEN_DYNAMODB)
    served = run("serve", "--config", str(config), env=no_aws(tmp_path), timeout=60)
    assert served.returncode != 0
    assert "botocore found no AWS credentials" in served.stderr, served.stderr
    assert "Unclosed" not in served.stderr, served.stderr
    assert "Traceback" not in served.stderr, served.stderr
