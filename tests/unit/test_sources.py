"""Lease sources without I/O: the configuration, the token shapes, signed-token
verification, the verdict order and the namespacing of jobs."""

from __future__ import annotations

from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from fencegate_client.signed import claims, mint_token
from gateway.config import (
    ConfigError,
    EtcdSourceSettings,
    JwtSourceSettings,
    Settings,
    env_references,
    resolve_secrets,
)
from gateway.fencing.fence import Lost, Reason, external_reason, source_of
from gateway.sources import EtcdSource, JwtSource, build, namespaced, split_token


def pem_pair() -> tuple[str, str]:
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    public = (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    return private, public


PRIVATE, PUBLIC = pem_pair()


def jwt_source(**extra: Any) -> dict[str, Any]:
    return {
        "name": "queue",
        "kind": "jwt",
        "algorithms": ["EdDSA"],
        "public_keys": [PUBLIC],
        "issuer": "billing",
        **extra,
    }


def settings(*sources: dict[str, Any]) -> Settings:
    return Settings(database_url="sqlite+aiosqlite:////tmp/x.db", lease_sources=list(sources))


def test_sources_are_told_apart_by_kind() -> None:
    s = settings(jwt_source(), {"name": "etcd", "kind": "etcd", "endpoints": ["http://e:2379/"]})
    assert isinstance(s.lease_sources[0], JwtSourceSettings)
    etcd = s.lease_sources[1]
    assert isinstance(etcd, EtcdSourceSettings)
    assert etcd.endpoints == ["http://e:2379"] and etcd.cache_seconds == 0.5


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (jwt_source(algorithms=["HS256"]), "algorithms"),
        (jwt_source(algorithms=["none"]), "algorithms"),
        (jwt_source(algorithms=[]), "algorithms"),
        (jwt_source(public_keys=["not a key"]), "PEM public key"),
        (jwt_source(public_keys=[PRIVATE]), "PEM public key"),
        (jwt_source(name="Queue:"), "name"),
        (jwt_source(kind="consul"), "kind"),
        ({"name": "e", "kind": "etcd", "endpoints": ["etcd:2379"]}, "endpoints"),
        ({"name": "e", "kind": "etcd", "endpoints": []}, "endpoints"),
        ({"name": "e", "kind": "etcd", "endpoints": ["http://e"], "cache_seconds": 60}, "cache"),
    ],
)
def test_bad_sources_are_named(source: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings(source)


def test_duplicate_source_names_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        settings(jwt_source(), jwt_source())


def test_public_keys_from_the_environment() -> None:
    s = settings(jwt_source(public_keys=["${QUEUE_KEY}"]))
    assert env_references(s, {}) == [("lease_sources.0.public_keys.0", "QUEUE_KEY", False)]
    with pytest.raises(ConfigError, match="QUEUE_KEY is not set"):
        resolve_secrets(s, {})
    with pytest.raises(ConfigError, match=r"public_keys\.0: not a PEM"):
        resolve_secrets(s, {"QUEUE_KEY": "garbage"})
    resolved = resolve_secrets(s, {"QUEUE_KEY": PUBLIC}).lease_sources[0]
    assert isinstance(resolved, JwtSourceSettings) and resolved.public_keys == [PUBLIC]


def test_tokens_name_their_source() -> None:
    sources = build(settings(jwt_source()).lease_sources)
    found = split_token("queue:a.b.c", sources)
    assert found is not None and found[0].name == "queue" and found[1] == "a.b.c"
    assert split_token("fgl_" + "x" * 32, sources) is None
    assert split_token("other:a.b.c", sources) is None


def test_jobs_are_namespaced_apart_from_lease_core_ids() -> None:
    assert namespaced("etcd", "order-42") == "etcd/order-42"
    assert namespaced("etcd", "") is None
    assert namespaced("etcd", "x" * 200) is None
    assert namespaced("etcd", "a\nb") is None
    assert source_of("etcd//locks/a") == "etcd"
    assert source_of("etcd:order-42") == "fencegate"  # a lease_core id may hold ":", never "/"


def test_etcd_token_shapes() -> None:
    source = EtcdSource(EtcdSourceSettings(name="etcd", kind="etcd", endpoints=["http://e"]))
    assert source.well_formed("/locks/order-42/694da23c2bd1d005")
    assert source.well_formed("order-42/1f")
    for bad in ("order-42", "order-42/", "/1f", "order-42/xyz", "a/" + "1" * 17, "a\n/1f"):
        assert not source.well_formed(bad), bad


def test_signed_tokens_are_verified() -> None:
    source = JwtSource(JwtSourceSettings(**jwt_source()))
    good = mint_token(PRIVATE, issuer="billing", job="j", generation=3, ttl_seconds=30, now=100)
    assert source.well_formed(good)
    verified = source.verify(good)
    assert verified is not None and (verified["sub"], verified["gen"], verified["exp"]) == (
        "j",
        3,
        130,
    )
    # Expiry is not judged here (the admission judges it by the database's clock).
    assert source.verify(good) is not None
    other, _ = pem_pair()
    forged = mint_token(other, issuer="billing", job="j", generation=3, ttl_seconds=30)
    assert source.verify(forged) is None
    foreign = mint_token(PRIVATE, issuer="elsewhere", job="j", generation=3, ttl_seconds=30)
    assert source.verify(foreign) is None
    assert not source.well_formed("a.b") and not source.well_formed("a.b.c.d")


def test_the_helper_refuses_claims_the_gateway_would_refuse() -> None:
    with pytest.raises(ValueError, match="generation"):
        claims(issuer="i", job="j", generation=-1, ttl_seconds=1)
    with pytest.raises(ValueError, match="generation"):
        claims(issuer="i", job="j", generation=True, ttl_seconds=1)
    with pytest.raises(ValueError, match="job"):
        claims(issuer="i", job="", generation=1, ttl_seconds=1)
    with pytest.raises(ValueError, match="algorithm"):
        mint_token(PRIVATE, issuer="i", job="j", generation=1, ttl_seconds=1, algorithm="HS256")
    token = mint_token(PRIVATE, source="queue", issuer="i", job="j", generation=1, ttl_seconds=1)
    assert token.startswith("queue:")


@pytest.mark.parametrize(
    ("refused", "expected"),
    [
        (None, None),
        (Lost.NEWER_HOLDER, Reason.STALE_GENERATION),
        (Lost.RELEASED, Reason.LEASE_ENDED),
        (Lost.EXPIRED, Reason.LEASE_EXPIRED),
        (Lost.OUT_OF_RANGE, Reason.INVALID_FENCING_TOKEN),
    ],
)
def test_a_sources_finding_names_its_reason(refused: Lost | None, expected: Reason | None) -> None:
    """The source's own finding; its order among the fence's and the expiry's is the
    SQL's (``tests/integration/test_sql_verdicts.py``)."""
    assert external_reason(refused) is expected
