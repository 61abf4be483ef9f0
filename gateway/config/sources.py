"""``[[lease_sources]]``: the other services whose leases the gateway accepts (one
settings class per ``kind``; ``LeaseSourceSettings`` is their tagged union). The
adapters that read them are in ``gateway.sources``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from yarl import URL

from gateway.config.env import ENV_REF

SOURCE_NAME = r"^[a-z][a-z0-9_-]{0,31}$"
# Signatures with a public key only: a shared secret (HS256) would let every service that
# verifies tokens mint them too, and "none" is no signature.
JwtAlgorithm = Literal[
    "EdDSA", "ES256", "ES384", "ES512", "RS256", "RS384", "RS512", "PS256", "PS384", "PS512"
]


class JwtSourceSettings(BaseModel):
    """Signed fencing tokens (``<name>:<compact JWS>``): claims ``sub`` (the job),
    ``gen`` (its generation), ``exp`` and ``iss`` (see docs/lease-sources.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=SOURCE_NAME)
    kind: Literal["jwt"]
    algorithms: list[JwtAlgorithm] = Field(min_length=1)
    # PEM public keys; ``${NAME}`` is expanded by ``resolve_secrets``. A token verified
    # by any of them is accepted (several during a key rotation).
    public_keys: list[str] = Field(min_length=1, max_length=16)
    issuer: str = Field(min_length=1, max_length=200)
    audience: str | None = Field(None, min_length=1, max_length=200)
    # Added to ``exp``; the expiry is judged by the database's clock, as leases are.
    leeway_seconds: float = Field(0.0, ge=0, le=300, allow_inf_nan=False)

    @field_validator("public_keys")
    @classmethod
    def _pem(cls, value: list[str]) -> list[str]:
        for key in value:
            if not ENV_REF.search(key):
                check_public_key(key)
        return value


class EtcdSourceSettings(BaseModel):
    """Locks held through etcd's lock API (``<name>:<the lock key>``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=SOURCE_NAME)
    kind: Literal["etcd"]
    endpoints: list[str] = Field(min_length=1, max_length=16)
    # How long a lock key read as held is believed without asking etcd again. The fence
    # in the database still decides: a cached answer can never admit a generation below
    # one that has written (docs/lease-sources.md says what it can and cannot do).
    cache_seconds: float = Field(0.5, ge=0, le=10, allow_inf_nan=False)
    timeout_seconds: float = Field(2.0, gt=0, le=60, allow_inf_nan=False)

    @field_validator("endpoints")
    @classmethod
    def _http_urls(cls, value: list[str]) -> list[str]:
        for endpoint in value:
            url = URL(endpoint)
            if url.scheme not in ("http", "https") or not url.host or url.path not in ("", "/"):
                raise ValueError(f"{endpoint!r}: must be http(s)://host:port")
        return [endpoint.rstrip("/") for endpoint in value]


class RedisSourceSettings(BaseModel):
    """Locks taken with Fencegate's Redis recipe (``<name>:<lock name>:<value>``): one Lua
    script raises the lock's fence counter and sets the lock to ``<fence>.<random>``
    (``fencegate_client.redis_lock``; docs/lease-sources.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=SOURCE_NAME)
    kind: Literal["redis"]
    # redis://[user:password@]host:port/db, rediss:// (TLS) or unix:///path.sock
    url: str = Field(min_length=1, max_length=2000)
    timeout_seconds: float = Field(2.0, gt=0, le=60, allow_inf_nan=False)

    @field_validator("url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        url = URL(value)
        if url.scheme not in ("redis", "rediss", "unix") or not (url.host or url.path):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return value


class DynamoDbSourceSettings(BaseModel):
    """Lock items of a DynamoDB table with a fence counter
    (``<name>:<table>/<lock key>:<fence>``; ``fencegate_client.dynamodb_lock``). The
    gateway reads them with its own AWS credentials (botocore's default chain)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=SOURCE_NAME)
    kind: Literal["dynamodb"]
    table: str = Field(pattern=r"^[A-Za-z0-9_.-]{3,255}$")
    region: str = Field(pattern=r"^[a-z0-9-]{1,40}$")
    # A local or private endpoint (DynamoDB Local, moto, a VPC endpoint); none: AWS's.
    endpoint_url: str | None = Field(None, max_length=2000)
    timeout_seconds: float = Field(2.0, gt=0, le=60, allow_inf_nan=False)

    @field_validator("endpoint_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None:
            url = URL(value)
            if url.scheme not in ("http", "https") or not url.host:
                raise ValueError(f"{value!r}: must be http(s)://host[:port]")
        return value


class ZooKeeperSourceSettings(BaseModel):
    """Locks held with ZooKeeper's lock recipe (``<name>:<the lock node's path>``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=SOURCE_NAME)
    kind: Literal["zookeeper"]
    hosts: list[str] = Field(min_length=1, max_length=16)
    # One read (sync, children, stat) waits at most this long; then 503, nothing forwarded.
    timeout_seconds: float = Field(2.0, gt=0, le=60, allow_inf_nan=False)
    # The gateway's own ZooKeeper session (it holds nothing in it; reads only).
    session_timeout_seconds: float = Field(10.0, ge=4, le=60, allow_inf_nan=False)

    @field_validator("hosts")
    @classmethod
    def _host_ports(cls, value: list[str]) -> list[str]:
        for host in value:
            name, colon, port = host.rpartition(":")
            if (
                not colon
                or not name
                or not port.isdigit()
                or not 0 < int(port) < 65536
                or any(c in name for c in "/, ")
            ):
                raise ValueError(f"{host!r}: must be host:port")
        return value


LeaseSourceSettings = Annotated[
    JwtSourceSettings
    | EtcdSourceSettings
    | ZooKeeperSourceSettings
    | RedisSourceSettings
    | DynamoDbSourceSettings,
    Field(discriminator="kind"),
]


def check_public_key(pem: str) -> None:
    """A PEM public key that ``cryptography`` can load, or ValueError."""
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        load_pem_public_key(pem.encode("utf-8"))
    except (ValueError, TypeError) as error:
        raise ValueError("not a PEM public key (-----BEGIN PUBLIC KEY-----)") from error
