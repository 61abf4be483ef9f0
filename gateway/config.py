"""Configuration: one TOML file plus ``FENCEGATE_*`` variables, validated once at start.

Environment variables win over the file; nested keys use ``__``
(``FENCEGATE_LEASE__MAX_TTL_SECONDS=900``), lists and tables are JSON
(``FENCEGATE_AUTH__ADMIN_TOKENS='["s3cret"]'``). This module is the only reader of
``os.environ``: ``${NAME}`` in an upstream's ``set_headers`` and in a lease source's
``public_keys`` is expanded here, by ``resolve_secrets``, for ``serve`` only.
"""

from __future__ import annotations

import difflib
import importlib
import ipaddress
import json
import os
import re
import tomllib
import types
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import sqlalchemy as sa
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)
from yarl import URL

from gateway.fencing.profiles import PROFILES, Answer, Profile, answer_of, statuses
from lease_core.config import LeaseSettings
from lease_core.direct import IN_MEMORY, is_in_memory

DEFAULT_CONFIG_FILE = "fencegate.toml"
TOKEN_CHARS = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ConfigError(Exception):
    """The configuration is not valid."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  {p}" for p in problems))


def _listen(value: str) -> str:
    parse_listen(value)
    return value


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` into its parts."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"must be host:port, got {value!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


Listen = Annotated[str, AfterValidator(_listen)]


def mask_url(value: str) -> str:
    """``https://user:pw@host/x`` as ``https://user:***@host/x``; ``https://key@host`` as
    ``https://***@host``."""
    url = URL(value)
    if url.password is not None:
        return str(url.with_password("***"))
    if url.user is not None:
        return str(url.with_user("***"))
    return value


class AuthSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    worker_tokens: list[SecretStr] = Field(default_factory=list)
    admin_tokens: list[SecretStr] = Field(default_factory=list)
    # Scrape credentials: they may read /metrics and nothing else.
    metrics_tokens: list[SecretStr] = Field(default_factory=list)

    @field_validator("worker_tokens", "admin_tokens", "metrics_tokens")
    @classmethod
    def _long_enough(cls, tokens: list[SecretStr]) -> list[SecretStr]:
        for token in tokens:
            if len(token.get_secret_value()) < 16:
                raise ValueError("each token must be at least 16 characters")
        return tokens

    @property
    def enabled(self) -> bool:
        return bool(self.worker_tokens or self.admin_tokens or self.metrics_tokens)


class DedupSettings(BaseModel):
    """What the upstream guarantees by itself (``[upstreams.dedup]``; a profile fills
    the defaults, ``gateway.fencing.profiles``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The header in which the upstream reads an idempotency key; the gateway sends its
    # own key there (``profiles.upstream_key``). None: the upstream reads no key.
    header: str | None = None
    # How long the upstream remembers a key: a held write is re-sent only inside it.
    window_seconds: float = Field(86400.0, gt=0, le=90 * 86400, allow_inf_nan=False)
    # The upstream's answer that a key was used before with other parameters: this
    # status, and (when set) this text in its body.
    mismatch_status: int | None = Field(None, ge=100, le=599)
    mismatch_contains: str | None = Field(None, min_length=1, max_length=200)
    # The answers the upstream keeps as the key's (statuses, or classes such as "2xx");
    # any other answer leaves the key free, as ``not_processed_statuses`` do. None:
    # every whole answer is final but those. 502 and 504 stay unknown outcomes.
    final_statuses: list[int | str] | None = Field(None, max_length=600)

    @field_validator("final_statuses")
    @classmethod
    def _final(cls, value: list[int | str] | None) -> list[int | str] | None:
        if value is not None:
            statuses(value)
        return value

    @cached_property
    def final(self) -> frozenset[int] | None:
        return None if self.final_statuses is None else statuses(self.final_statuses)

    @field_validator("header")
    @classmethod
    def _header(cls, value: str | None) -> str | None:
        if value is not None and not TOKEN_CHARS.fullmatch(value):
            raise ValueError(f"{value!r} is not a header name")
        if value is not None and value.lower() in _GATEWAY_HEADERS:
            raise ValueError(f"{value} is set by the gateway itself")
        return value


class SigningSettings(BaseModel):
    """The gateway's own AWS credentials for ``profile = "s3"``: it signs every request
    it forwards there with AWS Signature Version 4 (botocore's signer). ``${NAME}`` is
    expanded from the environment by ``resolve_secrets``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    access_key_id: SecretStr
    secret_access_key: SecretStr
    session_token: SecretStr | None = None
    region: str = Field("us-east-1", pattern=r"^[a-z0-9-]{1,40}$")

    def secrets(self) -> dict[str, SecretStr]:
        found = {"access_key_id": self.access_key_id, "secret_access_key": self.secret_access_key}
        if self.session_token is not None:
            found["session_token"] = self.session_token
        return found


# Headers the gateway sets on every fenced write; no dedup header may be one of them.
_GATEWAY_HEADERS = frozenset({"fencing-token", "fencing-job", "fencing-generation", "host"})


class UpstreamSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    url: str
    fenced_methods: list[str] = Field(default_factory=lambda: ["POST", "PUT", "PATCH", "DELETE"])
    require_idempotency_key: bool = True
    timeout_seconds: float = Field(10.0, gt=0, le=3600, allow_inf_nan=False)
    connect_timeout_seconds: float = Field(5.0, gt=0, le=600, allow_inf_nan=False)
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=0, le=2**34)
    set_headers: dict[str, SecretStr] = Field(default_factory=dict)
    # "resolve": the gateway re-sends a held write itself (docs/profiles.md); only
    # where the upstream deduplicates by key or a precondition makes it safe.
    unknown_outcome: Literal["hold", "retry", "resolve"] = "hold"
    profile: Profile = "generic"
    dedup: DedupSettings | None = None
    # profile = "s3" only, and required there: the credentials the gateway signs with.
    signing: SigningSettings | None = None
    # Answers that mean "not processed, try later": the worker gets them, but they are
    # not the key's answer, so the key stays free for the next attempt.
    not_processed_statuses: list[Annotated[int, Field(ge=100, le=599)]] = Field(
        default_factory=lambda: [429, 503]
    )
    # Query parameters that may appear in this upstream's audit entries; every other one
    # is left out (a query can carry credentials: ``?api_key=``).
    audit_query_params: list[str] = Field(default_factory=list, max_length=100)

    def summary(self) -> dict[str, Any]:
        """What operators may see of this upstream (header names, never their values)."""
        return {
            "name": self.name,
            "url": self.display_url,
            "fenced_methods": self.fenced_methods,
            "require_idempotency_key": self.require_idempotency_key,
            "timeout_seconds": self.timeout_seconds,
            "max_body_bytes": self.max_body_bytes,
            "unknown_outcome": self.unknown_outcome,
            "profile": self.profile,
            "dedup": None if self.dedup is None else self.dedup.model_dump(),
            # Where it signs, never with what.
            "signing": None if self.signing is None else {"region": self.signing.region},
            "not_processed_statuses": self.not_processed_statuses,
            "audit_query_params": self.audit_query_params,
            "set_headers": sorted(self.set_headers),
        }

    @cached_property
    def set_header_names(self) -> frozenset[str]:
        """Headers the gateway sets itself for this upstream (a client's are dropped)."""
        names = {name.lower() for name in self.set_headers}
        if self.dedup_header is not None:
            names.add(self.dedup_header.lower())
        return frozenset(names)

    @property
    def dedup_header(self) -> str | None:
        return None if self.dedup is None else self.dedup.header

    @model_validator(mode="before")
    @classmethod
    def _profile_defaults(cls, data: Any) -> Any:
        """The profile's ``[upstreams.dedup]`` defaults under what the file says."""
        if not isinstance(data, dict):
            return data
        defaults = PROFILES.get(str(data.get("profile", "generic")))
        given = data.get("dedup")
        if defaults is None or (given is not None and not isinstance(given, dict)):
            return data
        return {**data, "dedup": {**defaults, **(given or {})}}

    @model_validator(mode="after")
    def _signing(self) -> UpstreamSettings:
        if self.profile == "s3" and self.signing is None:
            raise ValueError(
                'profile = "s3" needs [upstreams.signing] access_key_id and secret_access_key '
                "(the gateway signs every request with them; workers hold no credentials)"
            )
        if self.profile != "s3" and self.signing is not None:
            raise ValueError('[upstreams.signing] is for profile = "s3" only')
        return self

    @model_validator(mode="after")
    def _resolvable(self) -> UpstreamSettings:
        if self.unknown_outcome == "resolve" and (
            self.dedup is None or (self.dedup.header is None and self.profile != "s3")
        ):
            raise ValueError(
                'unknown_outcome = "resolve" needs an upstream that deduplicates by key '
                "([upstreams.dedup] header, or a profile that sets it), or profile = s3"
            )
        return self

    @cached_property
    def not_processed(self) -> frozenset[int]:
        return frozenset(self.not_processed_statuses)

    def answer_of(self, status: int, *, whole: bool = True, precondition: bool = False) -> Answer:
        """What this upstream's answer (``whole``: read to its end) does to the key.
        ``precondition``: the request carried ``If-None-Match`` or ``If-Match``; only an
        S3 upstream's 412 to one is taken as "not applied" (docs/profiles.md)."""
        return answer_of(
            status,
            whole=whole,
            not_processed=self.not_processed,
            final=None if self.dedup is None else self.dedup.final,
            precondition=precondition and self.profile == "s3",
        )

    @property
    def display_url(self) -> str:
        """The URL as it may be shown: a password (or a lone user name, which services
        such as Stripe use as the key) becomes ``***``."""
        return mask_url(self.url)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        url = URL(value)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError("must be an absolute http:// or https:// URL")
        if url.query_string or url.fragment:
            raise ValueError("must not carry a query or a fragment")
        return value.rstrip("/")

    @field_validator("fenced_methods")
    @classmethod
    def _methods(cls, value: list[str]) -> list[str]:
        methods = [m.upper() for m in value]
        for method in methods:
            if not TOKEN_CHARS.fullmatch(method):
                raise ValueError(f"{method!r} is not an HTTP method")
        # HEAD follows GET: most frameworks answer HEAD with the GET handler.
        if "GET" in methods and "HEAD" not in methods:
            methods.append("HEAD")
        return methods

    @field_validator("audit_query_params")
    @classmethod
    def _param_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not 1 <= len(name) <= 200 or any(c in name for c in "&=#\r\n\0"):
                raise ValueError(f"{name[:50]!r} is not a query parameter name")
        return value

    @field_validator("set_headers")
    @classmethod
    def _header_names(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for name, header in value.items():
            if not TOKEN_CHARS.fullmatch(name):
                raise ValueError(f"{name!r} is not a header name")
            if any(c in header.get_secret_value() for c in "\r\n\0"):
                raise ValueError(f"the value of {name} contains a line break or NUL")
        return value


class DatabaseSettings(BaseModel):
    """How the database is used beyond its URL (``database_url``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # serve refuses a PostgreSQL primary whose standbys replicate asynchronously (or that
    # acknowledges commits locally): a failover could lose the commit that raised a fence
    # (gateway/records/replication.py). True starts anyway, logged at every start and on /readyz.
    allow_async_failover: bool = False


class GatewaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ordering_wait_seconds: float = Field(5.0, ge=0, le=300, allow_inf_nan=False)
    idempotency_retention_seconds: float = Field(86400.0, gt=0, allow_inf_nan=False)
    audit_retention_days: float = Field(30.0, gt=0, allow_inf_nan=False)
    audit_bodies: bool = False
    # Requests refused without a lease behind them (no token, a made-up one, an unknown
    # upstream, ...) are counted in grouped rows: per bucket, at most ``groups`` rows
    # per replica (then one overflow row per reason), kept a shorter time.
    audit_unauthenticated_retention_days: float = Field(1.0, gt=0, allow_inf_nan=False)
    audit_unauthenticated_bucket_seconds: float = Field(60.0, gt=0, le=86400, allow_inf_nan=False)
    audit_unauthenticated_groups: int = Field(100, ge=1, le=100_000)
    purge_interval_seconds: float = Field(60.0, gt=0, allow_inf_nan=False)
    max_idempotency_key_length: int = Field(255, ge=1, le=255)
    # Limits of the HTTP servers (both listeners) and of the gateway's own resources.
    max_request_line_bytes: int = Field(8190, ge=256, le=65536)
    max_header_field_bytes: int = Field(8190, ge=256, le=65536)
    max_headers: int = Field(128, ge=8, le=1024)
    # Fenced writes whose lease was found current (or whose body had all arrived), and,
    # separately, unfenced requests: neither kind can take the other's slots, and a
    # request with an unknown token takes none while its body is still arriving.
    max_concurrent_requests: int = Field(1024, ge=1, le=100_000)
    max_concurrent_unfenced_requests: int = Field(1024, ge=1, le=100_000)
    # A proxied request's body must arrive within body_timeout_seconds of its head, and
    # no read of it may wait longer than body_idle_timeout_seconds (408 body-timeout).
    body_timeout_seconds: float = Field(60.0, gt=0, le=3600, allow_inf_nan=False)
    body_idle_timeout_seconds: float = Field(15.0, gt=0, le=3600, allow_inf_nan=False)
    upstream_connections_per_host: int = Field(256, ge=1, le=10_000)
    keepalive_timeout_seconds: float = Field(75.0, gt=0, le=3600, allow_inf_nan=False)
    # How long an idle connection to an upstream is kept for reuse. Keep it below the
    # upstream's own idle timeout: a write sent on a connection that the upstream closed
    # meanwhile is never re-sent, so its outcome is unknown.
    upstream_keepalive_seconds: float = Field(4.0, gt=0, le=3600, allow_inf_nan=False)
    # The largest answer head read from an upstream (status line and headers, with those
    # of 1xx answers before it); a larger one is not read: no answer, an unknown outcome.
    max_upstream_head_bytes: int = Field(65536, ge=1024, le=1024 * 1024)
    shutdown_timeout_seconds: float = Field(15.0, ge=0, le=600, allow_inf_nan=False)
    # Answers up to this size are stored for replay; a duplicate of a larger one gets
    # 409 replay-unavailable (the write was applied; its body was not kept).
    max_replay_body_bytes: int = Field(1024 * 1024, ge=0, le=64 * 1024 * 1024)
    # Unknown outcomes of upstreams with ``unknown_outcome = "resolve"``: how often the
    # background task looks for them, and how many re-sends one gets before it is left to
    # an operator. Their requests are kept up to ``max_replay_body_bytes``.
    resolve_interval_seconds: float = Field(2.0, gt=0, le=3600, allow_inf_nan=False)
    resolve_max_attempts: int = Field(5, ge=1, le=100)
    # ``Prefer: wait=N`` on a fenced write whose key is in flight: the longest wait for
    # the first attempt to settle before ``request-in-progress`` (0: never wait).
    max_prefer_wait_seconds: int = Field(10, ge=0, le=300)


ClientCerts = Literal["none", "optional", "required"]


class ListenerTlsSettings(BaseModel):
    """``[tls.proxy]`` / ``[tls.control]``: what differs for one listener; a key left
    empty is taken from ``[tls]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""
    client_certs: Literal["", "none", "optional", "required"] = ""


class ListenerTls(BaseModel):
    """The TLS of one listener, ``[tls]`` and its ``[tls.<listener>]`` merged."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    listener: Literal["proxy", "control"]
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None
    client_certs: ClientCerts


class TlsSettings(BaseModel):
    """TLS of the listeners: ``[tls]`` for both, ``[tls.proxy]`` / ``[tls.control]`` for
    one. A listener with a certificate speaks only TLS; one without speaks plain HTTP.
    ``client_certs``: ``"none"`` asks for no client certificate, ``"optional"`` verifies
    one when the client sends it, ``"required"`` refuses a handshake without a
    certificate signed by ``client_ca_file``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""
    client_certs: ClientCerts = "none"
    proxy: ListenerTlsSettings = Field(default_factory=ListenerTlsSettings)
    control: ListenerTlsSettings = Field(default_factory=ListenerTlsSettings)

    def listener(self, name: Literal["proxy", "control"]) -> ListenerTls | None:
        """The merged settings of ``name``, or None when it speaks plain HTTP."""
        own: ListenerTlsSettings = getattr(self, name)
        cert = own.cert_file or self.cert_file
        key = own.key_file or self.key_file
        if not cert and not key:
            return None
        if not cert or not key:
            raise ValueError(f"tls.{name}: cert_file and key_file go together; one is missing")
        client_ca = own.client_ca_file or self.client_ca_file
        client_certs = own.client_certs or self.client_certs
        if client_certs != "none" and not client_ca:
            raise ValueError(
                f"tls.{name}: client_certs = {client_certs!r} needs client_ca_file (the CA "
                "that signs the workers' certificates)"
            )
        return ListenerTls(
            listener=name,
            cert_file=Path(cert),
            key_file=Path(key),
            client_ca_file=Path(client_ca) if client_ca else None,
            client_certs=client_certs,
        )

    @property
    def listeners(self) -> dict[str, ListenerTls]:
        """The listeners that speak TLS, by name."""
        out: dict[str, ListenerTls] = {}
        for name in LISTENERS:
            listener = self.listener(name)
            if listener is not None:
                out[name] = listener
        return out

    @model_validator(mode="after")
    def _complete(self) -> TlsSettings:
        for name in LISTENERS:
            self.listener(name)
        return self

    def resolved(self, base: Path) -> TlsSettings:
        """Relative file names resolved against ``base`` (the config file's folder)."""

        def fix(model: BaseModel) -> dict[str, str]:
            return {
                key: str(base / value)
                for key in ("cert_file", "key_file", "client_ca_file")
                if (value := getattr(model, key)) and not Path(value).is_absolute()
            }

        return self.model_copy(
            update={
                **fix(self),
                "proxy": self.proxy.model_copy(update=fix(self.proxy)),
                "control": self.control.model_copy(update=fix(self.control)),
            }
        )


class TracingSettings(BaseModel):
    """OpenTelemetry spans (``gateway.observe.tracing``), exported over OTLP/HTTP; needs the
    ``otel`` extra."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    # Empty: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT, as the
    # exporter reads them, else http://localhost:4318/v1/traces.
    otlp_endpoint: str = ""
    service_name: str = Field("fencegate", min_length=1, max_length=200)
    # Traces started here (no sampled parent) kept at this ratio; a worker's sampled
    # traceparent is followed.
    sample_ratio: float = Field(1.0, ge=0, le=1, allow_inf_nan=False)

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        if value:
            url = URL(value)
            if url.scheme not in ("http", "https") or not url.host:
                raise ValueError("must be an http:// or https:// URL (the OTLP/HTTP traces URL)")
        return value


LISTENERS: tuple[Literal["proxy"], Literal["control"]] = ("proxy", "control")


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


# target_session_attrs that connect only to the server that takes writes.
WRITABLE_SESSIONS = ("read-write", "primary")
_HAS_PORT = re.compile(r":\d+$")
_SEVERAL_HOSTS = re.compile(r"^(?P<head>[a-z0-9+]+://(?:[^@/]*@)?)(?P<hosts>[^/?#]*,[^/?#]*)")


def several_hosts(url: str) -> str:
    """libpq's spelling of several hosts, ``postgresql+asyncpg://user@h1:5432,h2:5432/db``,
    in SQLAlchemy's (``.../db?host=h1:5432&host=h2:5432``), which asyncpg connects with:
    the first that accepts (and, with ``target_session_attrs=read-write``, takes writes)."""
    match = _SEVERAL_HOSTS.match(url)
    if match is None:
        return url
    hosts = [h.strip() for h in match["hosts"].split(",")]
    if not all(hosts):
        raise ValueError("an empty host in the list of hosts")
    # asyncpg needs every host's port once there are several; libpq's default is 5432.
    hosts = [h if _HAS_PORT.search(h) else f"{h}:5432" for h in hosts]
    rest = url[match.end() :]
    path, _, query = rest.partition("?")
    pairs = "&".join(f"host={h}" for h in hosts)
    return f"{match['head']}{path}?{pairs}{'&' + query if query else ''}"


def check_public_key(pem: str) -> None:
    """A PEM public key that ``cryptography`` can load, or ValueError."""
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        load_pem_public_key(pem.encode("utf-8"))
    except (ValueError, TypeError) as error:
        raise ValueError("not a PEM public key (-----BEGIN PUBLIC KEY-----)") from error


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="FENCEGATE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    database_url: str = "sqlite+aiosqlite:///fencegate.db"
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    proxy_listen: Listen = "127.0.0.1:8080"
    control_listen: Listen = "127.0.0.1:8081"
    auth: AuthSettings = Field(default_factory=AuthSettings)
    lease: LeaseSettings = Field(default_factory=LeaseSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    tls: TlsSettings = Field(default_factory=TlsSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    upstreams: list[UpstreamSettings] = Field(default_factory=list)
    lease_sources: list[LeaseSourceSettings] = Field(default_factory=list)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's values arrive as init arguments; the environment overrides them.
        return (env_settings, init_settings)

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        value = several_hosts(value)
        try:
            url = sa.make_url(value)
        except sa.exc.ArgumentError as error:
            raise ValueError("not a database URL") from error
        if url.drivername not in ("sqlite+aiosqlite", "postgresql+asyncpg"):
            raise ValueError("use sqlite+aiosqlite:///path.db or postgresql+asyncpg://user@host/db")
        if url.get_backend_name() == "sqlite" and is_in_memory(url):
            raise ValueError(f"{IN_MEMORY} (sqlite+aiosqlite:///path.db)")
        hosts = url.query.get("host", ())
        attrs = url.query.get("target_session_attrs")
        if not isinstance(hosts, str) and len(hosts) > 1:
            portless = [h for h in hosts if not _HAS_PORT.search(h)]
            if portless:
                raise ValueError(f"give every host its port: {', '.join(portless)} has none")
        if not isinstance(hosts, str) and len(hosts) > 1 and attrs not in WRITABLE_SESSIONS:
            raise ValueError(
                "several hosts need target_session_attrs=read-write (or primary): without it "
                "the gateway may connect to a standby, which takes no writes"
            )
        if url.drivername == "postgresql+asyncpg" and not _driver_installed("asyncpg"):
            raise ValueError(
                "the PostgreSQL driver asyncpg is not installed: pip install 'fencegate[postgres]'"
            )
        return value

    @model_validator(mode="after")
    def _checks(self) -> Settings:
        names = [u.name for u in self.upstreams]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"upstreams: duplicate name(s) {', '.join(duplicates)}")
        sources = [s.name for s in self.lease_sources]
        duplicates = sorted({n for n in sources if sources.count(n) > 1})
        if duplicates:
            raise ValueError(f"lease_sources: duplicate name(s) {', '.join(duplicates)}")
        if "fencegate" in sources:
            # The audit, its source= filter and the metrics call the gateway's own leases
            # "fencegate": a lease source of that name could not be told apart from them.
            raise ValueError("lease_sources: the name fencegate is the gateway's own leases")
        return self

    def exposed_without_auth(self) -> list[str]:
        """``serve``'s rule: a listener on a non-loopback address needs auth tokens.
        Only the commands that listen apply it (``for_serving``): ``migrate`` and the
        other commands of a deployment run with the database URL alone."""
        if self.auth.enabled:
            return []
        problems = []
        for key in ("proxy_listen", "control_listen"):
            host, _ = parse_listen(getattr(self, key))
            if not is_loopback(host):
                problems.append(
                    f"{key}: {host} is not a loopback address and no auth tokens are "
                    "configured; set auth.worker_tokens / auth.admin_tokens first"
                )
        return problems

    @property
    def sqlite(self) -> bool:
        return sa.make_url(self.database_url).get_backend_name() == "sqlite"

    def secret_values(self) -> list[str]:
        """Every secret of this configuration: control tokens and upstream header values
        (kept out of every log line, see ``gateway.observe.logs.protect``)."""
        auth = self.auth
        values = [
            t.get_secret_value()
            for t in (*auth.worker_tokens, *auth.admin_tokens, *auth.metrics_tokens)
        ]
        for upstream in self.upstreams:
            values.extend(v.get_secret_value() for v in upstream.set_headers.values())
            if upstream.signing is not None:
                values.extend(v.get_secret_value() for v in upstream.signing.secrets().values())
        return values

    def upstream(self, name: str) -> UpstreamSettings | None:
        for upstream in self.upstreams:
            if upstream.name == name:
                return upstream
        return None


def load_settings(
    path: str | Path | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Read ``path`` (or ``./fencegate.toml`` when present), apply the environment,
    validate and resolve a relative SQLite path against the config file's folder.
    ``${NAME}`` in upstream headers stays as written (``resolve_secrets`` expands it)."""
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    base = Path.cwd()
    if path is None and Path(DEFAULT_CONFIG_FILE).is_file():
        path = DEFAULT_CONFIG_FILE
    if path is not None:
        file = Path(path)
        try:
            data = tomllib.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError as error:
            raise ConfigError([f"{file}: no such file"]) from error
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError([f"{file}: cannot be read ({error})"]) from error
        except tomllib.TOMLDecodeError as error:
            raise ConfigError([f"{file}: not valid TOML ({error})"]) from error
        base = file.resolve().parent
    problems = _json_variables(environ)
    if problems:
        raise ConfigError(problems)
    try:
        settings = Settings(**data)
    except ValidationError as error:
        raise ConfigError(_describe(error, os.environ)) from error
    except SettingsError as error:  # e.g. malformed JSON in a FENCEGATE_* variable
        cause = f" ({error.__cause__})" if error.__cause__ else ""
        raise ConfigError([f"environment: {error}{cause}"]) from error
    settings = _resolve_sqlite(settings, base)
    return settings.model_copy(update={"tls": settings.tls.resolved(base)})


def env_references(
    settings: Settings, environ: Mapping[str, str] | None = None
) -> list[tuple[str, str, bool]]:
    """``(key, NAME, set now)`` for every ``${NAME}`` in the upstreams' headers: what
    ``serve`` will read from its environment. A variable set to the empty string is not
    set: an empty secret would go out as ``Authorization: Bearer `` with nothing after it."""
    environ = os.environ if environ is None else environ
    return [
        *(
            (f"upstreams.{index}.set_headers.{name}", ref, bool(environ.get(ref)))
            for index, upstream in enumerate(settings.upstreams)
            for name, value in upstream.set_headers.items()
            for ref in ENV_REF.findall(value.get_secret_value())
        ),
        *(
            (f"upstreams.{index}.signing.{name}", ref, bool(environ.get(ref)))
            for index, upstream in enumerate(settings.upstreams)
            if upstream.signing is not None
            for name, value in upstream.signing.secrets().items()
            for ref in ENV_REF.findall(value.get_secret_value())
        ),
        *(
            (f"lease_sources.{index}.public_keys.{number}", ref, bool(environ.get(ref)))
            for index, source in enumerate(settings.lease_sources)
            if isinstance(source, JwtSourceSettings)
            for number, key in enumerate(source.public_keys)
            for ref in ENV_REF.findall(key)
        ),
    ]


def for_serving(settings: Settings, environ: Mapping[str, str] | None = None) -> Settings:
    """The configuration as ``serve`` runs it (and ``check-config`` checks it): no
    listener exposed without auth tokens, the secrets expanded (``resolve_secrets``)."""
    exposed = settings.exposed_without_auth()
    if exposed:
        raise ConfigError(exposed)
    return resolve_secrets(settings, environ)


def resolve_secrets(settings: Settings, environ: Mapping[str, str] | None = None) -> Settings:
    """Expand ``${NAME}`` in the upstreams' headers, whether they came from the file or
    from ``FENCEGATE_UPSTREAMS``. Only ``serve`` needs the values (it forwards with
    them): every other command works on the configuration as loaded, without them."""
    environ = os.environ if environ is None else environ
    missing = [
        f"{key}: environment variable {name} "
        + ("is empty, the same as if it is not set" if name in environ else "is not set")
        for key, name, is_set in env_references(settings, environ)
        if not is_set
    ]
    if missing:
        raise ConfigError(missing)
    upstreams = []
    for index, upstream in enumerate(settings.upstreams):
        headers = {
            name: SecretStr(ENV_REF.sub(lambda m: environ[m.group(1)], value.get_secret_value()))
            for name, value in upstream.set_headers.items()
        }
        for name, value in headers.items():
            if any(c in value.get_secret_value() for c in "\r\n\0"):
                raise ConfigError(
                    [
                        f"upstreams.{index}.set_headers.{name}: the expanded value contains a "
                        "line break or NUL"
                    ]
                )
        update: dict[str, Any] = {"set_headers": headers}
        if upstream.signing is not None:
            expanded = {
                name: SecretStr(ENV_REF.sub(lambda m: environ[m.group(1)], v.get_secret_value()))
                for name, v in upstream.signing.secrets().items()
            }
            update["signing"] = upstream.signing.model_copy(update=expanded)
        upstreams.append(upstream.model_copy(update=update))
    sources: list[LeaseSourceSettings] = []
    for index, source in enumerate(settings.lease_sources):
        if isinstance(source, JwtSourceSettings):
            keys = [ENV_REF.sub(lambda m: environ[m.group(1)], key) for key in source.public_keys]
            for number, key in enumerate(keys):
                try:
                    check_public_key(key)
                except ValueError as error:
                    raise ConfigError(
                        [f"lease_sources.{index}.public_keys.{number}: {error}"]
                    ) from error
            source = source.model_copy(update={"public_keys": keys})
        sources.append(source)
    return settings.model_copy(update={"upstreams": upstreams, "lease_sources": sources})


ENV_PREFIX = "FENCEGATE_"
_EXAMPLES = {
    ("auth", "worker_tokens"): '["a-worker-token-of-16-or-more-characters"]',
    ("auth", "admin_tokens"): '["an-admin-token-of-16-or-more-characters"]',
    ("upstreams",): '[{"name": "payments", "url": "https://api.example.com"}]',
}


def _json_variables(environ: Mapping[str, str]) -> list[str]:
    """A ``FENCEGATE_*`` variable for a list or a table must hold JSON of that shape;
    name the variable and the expected form (never its value: it may be a token)."""
    problems = []
    for variable, raw in environ.items():
        if not variable.upper().startswith(ENV_PREFIX):
            continue
        path = tuple(variable[len(ENV_PREFIX) :].lower().split("__"))
        kind = _json_kind(Settings, path)
        if kind is None:
            continue
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if not isinstance(value, list if kind == "list" else dict):
            example = _EXAMPLES.get(path, '["…"]' if kind == "list" else '{"key": "value"}')
            problems.append(
                f"{variable}: must be a JSON {kind}, for example {variable}='{example}'"
            )
    return problems


def _json_kind(model: type[BaseModel], path: tuple[str, ...]) -> str | None:
    """``list`` or ``object`` when ``path`` names a list or table setting of ``model``."""
    field = model.model_fields.get(path[0])
    if field is None:
        return None
    annotation = field.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _json_kind(annotation, path[1:]) if len(path) > 1 else "object"
    if len(path) > 1:
        return None
    origin = get_origin(annotation)
    if origin is list:
        return "list"
    if origin is dict:
        return "object"
    return None


def _driver_installed(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _describe(error: ValidationError, environ: Mapping[str, str]) -> list[str]:
    problems = []
    for item in error.errors(include_url=False):
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = _unknown_setting(item["loc"], environ)
        problems.append(f"{key}: {message}")
    return problems


def _unknown_setting(loc: tuple[int | str, ...], environ: Mapping[str, str]) -> str:
    """``unknown setting``, with the variable it came from when a ``FENCEGATE_*`` one did
    (pydantic-settings reads the nested ones: ``FENCEGATE_LEASE__MAX_TTL``) and the
    nearest valid name at that level, if one is near."""
    *parents, name = (str(part) for part in loc)
    variable = ENV_PREFIX + "__".join((*parents, name)).upper()
    from_env = any(v.upper() == variable for v in environ)
    message = f"unknown setting (from {variable})" if from_env else "unknown setting"
    near = difflib.get_close_matches(name, _known_keys(loc[:-1]), n=1)
    if not near:
        return message
    if from_env:
        nearest = ENV_PREFIX + "__".join((*parents, near[0])).upper()
        return f"{message}; did you mean `{near[0]}` ({nearest})?"
    return f"{message}; did you mean `{near[0]}`?"


def _known_keys(loc: tuple[int | str, ...]) -> list[str]:
    """The setting names of the table at ``loc`` (as pydantic reports locations: list
    indexes, and a tagged union's tag, such as ``lease_sources.0.jwt``)."""
    annotation: Any = Settings
    for part in loc:
        annotation = _inside(annotation, part)
        if annotation is None:
            return []
    model = _model(annotation, None)
    return list(model.model_fields) if model is not None else []


def _model(annotation: Any, tag: str | None) -> type[BaseModel] | None:
    """The model that ``annotation`` stands for (through ``Annotated`` and unions; in a
    union of several, the one whose ``Literal`` field holds ``tag``)."""
    if get_origin(annotation) is Annotated:
        return _model(get_args(annotation)[0], tag)
    if get_origin(annotation) in (Union, types.UnionType):
        members = [m for m in (_model(a, None) for a in get_args(annotation)) if m is not None]
        if len(members) == 1:
            return members[0]
        for member in members:
            for field in member.model_fields.values():
                if get_origin(field.annotation) is Literal and tag in get_args(field.annotation):
                    return member
        return None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _inside(annotation: Any, part: int | str) -> Any:
    """What is at ``part`` of a value of ``annotation``: a model's field, a list's item,
    a table's value, a tagged union's member."""
    if get_origin(annotation) is Annotated:
        return _inside(get_args(annotation)[0], part)
    origin = get_origin(annotation)
    if origin is list and isinstance(part, int):
        return get_args(annotation)[0]
    if origin is dict:
        return get_args(annotation)[1]
    if origin in (Union, types.UnionType):
        members = [m for m in (_model(a, None) for a in get_args(annotation)) if m is not None]
        tagged = _model(annotation, str(part)) if len(members) > 1 else None
        if tagged is not None:
            return tagged
        return _inside(members[0], part) if len(members) == 1 else None
    model = _model(annotation, None)
    if model is None or not isinstance(part, str) or part not in model.model_fields:
        return None
    return model.model_fields[part].annotation


def _resolve_sqlite(settings: Settings, base: Path) -> Settings:
    url = sa.make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return settings
    db_path = Path(url.database)
    if not db_path.is_absolute():
        db_path = base / db_path
        settings = settings.model_copy(
            update={
                "database_url": url.set(database=str(db_path)).render_as_string(hide_password=False)
            }
        )
    return settings


def sqlite_folder_problem(settings: Settings) -> str | None:
    """SQLite creates the database file, never its folder: a missing folder is named
    before anything opens the database (instead of "unable to open database file")."""
    url = sa.make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or not url.database:
        return None
    path = Path(url.database)
    if path.parent.is_dir():
        return None
    return (
        f"database_url: the folder of the SQLite database {path} does not exist "
        f"({path.parent}); create it or change database_url"
    )
