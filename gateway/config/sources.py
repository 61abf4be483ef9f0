"""``[[lease_sources]]``: the other services whose leases the gateway accepts (one
settings class per ``kind``; ``LeaseSourceSettings`` is their tagged union). The
adapters that read them are in ``gateway.sources``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from yarl import URL

from gateway.config.env import ENV_REF

SOURCE_NAME = r"^[a-z][a-z0-9_-]{0,31}$"
# A user name sent to a store (etcd, ZooKeeper, Redis ACL); the password goes with it.
USER_NAME = r"^[^\s:]+$"
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
    # TLS to https:// endpoints: the CA that signed etcd's certificate (none: the
    # system's), and the gateway's client certificate when etcd asks for one
    # (--client-cert-auth).
    ca_file: str | None = Field(None, min_length=1, max_length=4096)
    cert_file: str | None = Field(None, min_length=1, max_length=4096)
    key_file: str | None = Field(None, min_length=1, max_length=4096)
    # etcd's own users (auth enable): /v3/auth/authenticate gives the token that every
    # call carries; the gateway's user needs read permission on the locks' keys.
    username: str | None = Field(None, min_length=1, max_length=200, pattern=USER_NAME)
    password: SecretStr | None = Field(None, min_length=1, max_length=1000)

    @field_validator("endpoints")
    @classmethod
    def _http_urls(cls, value: list[str]) -> list[str]:
        for endpoint in value:
            url = URL(endpoint)
            if url.scheme not in ("http", "https") or not url.host or url.path not in ("", "/"):
                raise ValueError(f"{endpoint!r}: must be http(s)://host:port")
            if url.user is not None or url.password is not None:
                raise ValueError(f"{url.host}: credentials go in username and password")
        return [endpoint.rstrip("/") for endpoint in value]

    @model_validator(mode="after")
    def _secured(self) -> EtcdSourceSettings:
        tls_files(self, https=all(e.startswith("https://") for e in self.endpoints))
        both_or_neither(self.username, self.password, "username", "password")
        return self

    def secrets(self) -> dict[str, SecretStr]:
        return {} if self.password is None else {"password": self.password}


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
    # Redis ACL (AUTH username password): they take the place of the URL's.
    username: str | None = Field(None, min_length=1, max_length=200, pattern=USER_NAME)
    password: SecretStr | None = Field(None, min_length=1, max_length=1000)
    # TLS (rediss:// only): the CA that signed the server's certificate (none: the
    # system's), and the gateway's client certificate (tls-auth-clients yes).
    ca_file: str | None = Field(None, min_length=1, max_length=4096)
    cert_file: str | None = Field(None, min_length=1, max_length=4096)
    key_file: str | None = Field(None, min_length=1, max_length=4096)

    @field_validator("url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        url = URL(value)
        if "sentinel" in url.scheme:
            raise ValueError(REDIS_SENTINEL)
        if url.scheme not in ("redis", "rediss", "unix") or not (url.host or url.path):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return value

    @model_validator(mode="after")
    def _secured(self) -> RedisSourceSettings:
        tls_files(self, https=self.url.startswith("rediss://"), scheme="rediss://")
        if self.username is not None and self.password is None:
            raise ValueError("username: needs a password (Redis ACL: AUTH username password)")
        return self

    def secrets(self) -> dict[str, SecretStr]:
        found = {} if self.password is None else {"password": self.password}
        in_url = URL(self.url).password
        if in_url:
            found["url"] = SecretStr(in_url)
        return found


class DynamoDbSourceSettings(BaseModel):
    """Lock items of a DynamoDB table with a fence counter
    (``<name>:<table>/<lock key>:<fence>.<record version>``;
    ``fencegate_client.dynamodb_lock``). The
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
    # Credentials: ZooKeeper's digest scheme (addauth digest user:password; the locks'
    # ACLs name the user), or SASL when sasl_mechanism is set (DIGEST-MD5 with them;
    # GSSAPI with the process's Kerberos ticket, no password). SASL needs pure-sasl.
    username: str | None = Field(None, min_length=1, max_length=200, pattern=USER_NAME)
    password: SecretStr | None = Field(None, min_length=1, max_length=1000)
    sasl_mechanism: Literal["DIGEST-MD5", "GSSAPI"] | None = None
    # TLS to the servers' secureClientPort: on with use_tls; the CA that signed their
    # certificates (none: the system's) and the gateway's client certificate
    # (ssl.clientAuth=need, ZooKeeper's default).
    use_tls: bool = False
    ca_file: str | None = Field(None, min_length=1, max_length=4096)
    cert_file: str | None = Field(None, min_length=1, max_length=4096)
    key_file: str | None = Field(None, min_length=1, max_length=4096)

    @field_validator("hosts")
    @classmethod
    def _host_ports(cls, value: list[str]) -> list[str]:
        """``host:port`` each; the last may end in a chroot (``zk3:2181/fencegate``), as
        may a list written as one connection string (``zk1:2181,zk2:2181/fencegate``)."""
        hosts = [part.strip() for entry in value for part in entry.split(",")]
        if len(hosts) > 16:
            raise ValueError("at most 16 hosts")
        for number, host in enumerate(hosts):
            address, slash, chroot = host.partition("/")
            if slash and (number < len(hosts) - 1 or not valid_chroot("/" + chroot)):
                raise ValueError(
                    f"{host!r}: must be host:port; only the last may end in a chroot "
                    "(/fencegate: no empty, . or .. parts, no trailing /)"
                )
            name, colon, port = address.rpartition(":")
            if (
                not colon
                or not name
                or not port.isdigit()
                or not 0 < int(port) < 65536
                or any(c in name for c in "/, ")
            ):
                raise ValueError(f"{host!r}: must be host:port")
        return hosts

    @model_validator(mode="after")
    def _secured(self) -> ZooKeeperSourceSettings:
        tls_files(self, https=self.use_tls, scheme="use_tls = true")
        if self.sasl_mechanism == "GSSAPI":
            if self.password is not None:
                raise ValueError("password: GSSAPI takes the Kerberos ticket, not a password")
        else:
            both_or_neither(self.username, self.password, "username", "password")
        if self.sasl_mechanism == "DIGEST-MD5" and self.username is None:
            raise ValueError("sasl_mechanism: DIGEST-MD5 needs username and password")
        return self

    def secrets(self) -> dict[str, SecretStr]:
        return {} if self.password is None else {"password": self.password}


LeaseSourceSettings = Annotated[
    JwtSourceSettings
    | EtcdSourceSettings
    | ZooKeeperSourceSettings
    | RedisSourceSettings
    | DynamoDbSourceSettings,
    Field(discriminator="kind"),
]


REDIS_SENTINEL = (
    "Redis Sentinel is not supported: a failover promotes a replica that may not have "
    "received the latest fence (Redis replicates asynchronously), and the fence would go "
    "backwards; point url at the primary (redis:// or rediss://)"
)
REDIS_CLUSTER = (
    "Redis Cluster is not supported: a failover promotes a replica that may not have "
    "received the latest fence (Redis replicates asynchronously), and a node answers only "
    "for its own slots; point url at a standalone Redis (its primary)"
)


def tls_files(settings: Any, *, https: bool, scheme: str = "https:// endpoints") -> None:
    """``ca_file``, ``cert_file`` and ``key_file`` of a source: only with TLS on, and
    a client certificate with its key."""
    named = [k for k in ("ca_file", "cert_file", "key_file") if getattr(settings, k)]
    if named and not https:
        raise ValueError(f"{', '.join(named)}: TLS settings need {scheme}")
    both_or_neither(settings.cert_file, settings.key_file, "cert_file", "key_file")


def both_or_neither(first: object, second: object, first_key: str, second_key: str) -> None:
    if (first is None) != (second is None):
        have, lack = (first_key, second_key) if second is None else (second_key, first_key)
        raise ValueError(f"{have}: needs {lack} too")


def valid_chroot(path: str) -> bool:
    return (
        path.startswith("/")
        and not path.endswith("/")
        and all(part not in ("", ".", "..") for part in path.split("/")[1:])
        and path.isprintable()
        and " " not in path
    )


SecuredSource = EtcdSourceSettings | ZooKeeperSourceSettings | RedisSourceSettings


def source_files(source: object) -> dict[str, str]:
    """The files a source reads at start, by key (``ca_file``, ``cert_file``,
    ``key_file``)."""
    return {
        key: value
        for key in ("ca_file", "cert_file", "key_file")
        if isinstance(value := getattr(source, key, None), str)
    }


def check_public_key(pem: str) -> None:
    """A PEM public key that ``cryptography`` can load, or ValueError."""
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        load_pem_public_key(pem.encode("utf-8"))
    except (ValueError, TypeError) as error:
        raise ValueError("not a PEM public key (-----BEGIN PUBLIC KEY-----)") from error
