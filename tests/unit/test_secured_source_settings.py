"""The settings of secured lease sources without a server: TLS files only with TLS,
a certificate with its key, a user with a password, Sentinel refused, a chroot in
ZooKeeper's hosts; passwords from ``${NAME}``, counted among the configuration's
secrets; the files ``check-config`` and ``serve`` read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.config import ConfigError, Settings, resolve_secrets
from gateway.config.secrets import env_references
from gateway.config.source_files import file_problems
from gateway.sources.redis_lock import RedisSource
from gateway.sources.zookeeper import ZooKeeperSource


def settings(*sources: dict[str, Any]) -> Settings:
    return Settings(database_url="sqlite+aiosqlite:////tmp/x.db", lease_sources=list(sources))


def etcd(**extra: Any) -> dict[str, Any]:
    return {"name": "etcd", "kind": "etcd", "endpoints": ["https://127.0.0.1:2379"], **extra}


def redis(**extra: Any) -> dict[str, Any]:
    return {"name": "locks", "kind": "redis", "url": "rediss://127.0.0.1:6380/0", **extra}


def zk(**extra: Any) -> dict[str, Any]:
    return {"name": "zk", "kind": "zookeeper", "hosts": ["127.0.0.1:2181"], **extra}


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (etcd(endpoints=["http://127.0.0.1:2379"], ca_file="/ca"), "need https:// endpoints"),
        (etcd(cert_file="/c"), "cert_file: needs key_file too"),
        (etcd(key_file="/k"), "key_file: needs cert_file too"),
        (etcd(username="u"), "username: needs password too"),
        (etcd(password="p"), "password: needs username too"),
        (etcd(username="a b", password="p"), "username"),
        (etcd(endpoints=["https://u:p@127.0.0.1:2379"]), "credentials go in username"),
        (redis(url="redis://127.0.0.1:6379", ca_file="/ca"), "need rediss://"),
        (redis(username="u"), "username: needs a password"),
        (redis(url="redis+sentinel://127.0.0.1:26379/mymaster"), "Sentinel is not supported"),
        (redis(cert_file="/c"), "cert_file: needs key_file too"),
        (zk(ca_file="/ca"), "need use_tls = true"),
        (zk(use_tls=True, cert_file="/c"), "cert_file: needs key_file too"),
        (zk(username="u"), "username: needs password too"),
        (zk(sasl_mechanism="DIGEST-MD5"), "DIGEST-MD5 needs username"),
        (zk(sasl_mechanism="GSSAPI", username="u", password="p"), "GSSAPI takes"),
        (zk(sasl_mechanism="PLAIN"), "sasl_mechanism"),
        (zk(hosts=["a:1/x", "b:2"]), "only the last"),
        (zk(hosts=["a:1/x/"]), "chroot"),
        (zk(hosts=["a:1/x/../y"]), "chroot"),
        (zk(hosts=["a:1,b"]), "host:port"),
    ],
)
def test_bad_settings_are_named(source: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings(source)


def test_a_chroot_and_a_connection_string_are_hosts() -> None:
    (one,) = settings(zk(hosts=["zk1:2181,zk2:2181/fencegate"])).lease_sources
    (two,) = settings(zk(hosts=["zk1:2181", "zk2:2181/fencegate/app"])).lease_sources
    assert one.hosts == ["zk1:2181", "zk2:2181/fencegate"]  # type: ignore[union-attr]
    assert two.hosts == ["zk1:2181", "zk2:2181/fencegate/app"]  # type: ignore[union-attr]
    source = ZooKeeperSource(one)  # type: ignore[arg-type]
    assert source.client_options()["hosts"] == "zk1:2181,zk2:2181/fencegate"


def test_passwords_come_from_the_environment_and_are_secrets() -> None:
    config = settings(
        etcd(username="gw", password="${ETCD_PW}"),
        redis(url="rediss://gw:in-url-secret@127.0.0.1:6380/0"),
        zk(username="gw", password="pre-${ZK_PW}"),
    )
    assert [(key, name) for key, name, _ in env_references(config, {})] == [
        ("lease_sources.0.password", "ETCD_PW"),
        ("lease_sources.2.password", "ZK_PW"),
    ]
    with pytest.raises(ConfigError, match="ETCD_PW is not set"):
        resolve_secrets(config, {"ZK_PW": "z"})
    resolved = resolve_secrets(config, {"ETCD_PW": "etcd-secret", "ZK_PW": "zk-secret"})
    etcd_source, redis_source, zk_source = resolved.lease_sources
    assert etcd_source.password.get_secret_value() == "etcd-secret"  # type: ignore[union-attr]
    assert zk_source.password.get_secret_value() == "pre-zk-secret"  # type: ignore[union-attr]
    assert {"etcd-secret", "pre-zk-secret", "in-url-secret"} <= set(resolved.secret_values())
    assert "etcd-secret" not in repr(resolved) and "zk-secret" not in repr(resolved)
    assert ZooKeeperSource(zk_source).client_options()["auth_data"] == [  # type: ignore[arg-type]
        ("digest", "gw:pre-zk-secret")
    ]
    del redis_source


def test_redis_settings_take_the_place_of_the_urls_credentials() -> None:
    (source,) = settings(
        redis(url="rediss://old:old-pw@127.0.0.1:6380/0", username="gw", password="pw")
    ).lease_sources
    options = RedisSource(source).client_options()  # type: ignore[arg-type]
    assert options["url"] == "rediss://127.0.0.1:6380/0"
    assert (options["username"], options["password"]) == ("gw", "pw")
    assert options["ssl_cert_reqs"] == "required" and options["ssl_check_hostname"] is True


def test_the_files_are_checked_all_at_once(tmp_path: Path) -> None:
    from tests.certs import Pki

    pki = Pki(tmp_path / "pki")
    client = pki.issue("client", server=False)
    other = pki.issue("other", server=False)
    (tmp_path / "junk.pem").write_text("junk")
    good = etcd(ca_file=str(pki.ca), cert_file=str(client.cert), key_file=str(client.key))
    assert file_problems(settings(good)) == []
    problems = file_problems(
        settings(
            etcd(ca_file=str(tmp_path / "none.pem")),
            redis(ca_file=str(tmp_path / "junk.pem")),
            zk(use_tls=True, cert_file=str(client.cert), key_file=str(other.key)),
            etcd(name="e2", cert_file=str(tmp_path), key_file=str(client.key)),
        )
    )
    assert problems[0] == f"lease_sources.0.ca_file: {tmp_path}/none.pem: no such file"
    assert problems[1].startswith(f"lease_sources.1.ca_file: {tmp_path}/junk.pem: not a PEM CA")
    assert problems[2].startswith(f"lease_sources.2.cert_file: {client.cert} with key_file")
    assert problems[3] == f"lease_sources.3.cert_file: {tmp_path}: a directory, not a file"
    assert len(problems) == 4
