"""Configuration: one TOML file plus ``FENCEGATE_*`` variables, validated once at start.

Environment variables win over the file; nested keys use ``__``
(``FENCEGATE_LEASE__MAX_TTL_SECONDS=900``), lists and tables are JSON
(``FENCEGATE_AUTH__ADMIN_TOKENS='["s3cret"]'``). This module is the only reader of
``os.environ``: ``${NAME}`` in an upstream's ``set_headers`` is expanded here.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

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


class AuthSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    worker_tokens: list[SecretStr] = Field(default_factory=list)
    admin_tokens: list[SecretStr] = Field(default_factory=list)

    @field_validator("worker_tokens", "admin_tokens")
    @classmethod
    def _long_enough(cls, tokens: list[SecretStr]) -> list[SecretStr]:
        for token in tokens:
            if len(token.get_secret_value()) < 16:
                raise ValueError("each token must be at least 16 characters")
        return tokens

    @property
    def enabled(self) -> bool:
        return bool(self.worker_tokens or self.admin_tokens)


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
    unknown_outcome: Literal["hold", "retry"] = "hold"
    # Query parameters that may appear in this upstream's audit entries; every other one
    # is left out (a query can carry credentials: ``?api_key=``).
    audit_query_params: list[str] = Field(default_factory=list, max_length=100)

    def summary(self) -> dict[str, Any]:
        """What operators may see of this upstream (header names, never their values)."""
        return {
            "name": self.name,
            "url": self.url,
            "fenced_methods": self.fenced_methods,
            "require_idempotency_key": self.require_idempotency_key,
            "timeout_seconds": self.timeout_seconds,
            "max_body_bytes": self.max_body_bytes,
            "unknown_outcome": self.unknown_outcome,
            "audit_query_params": self.audit_query_params,
            "set_headers": sorted(self.set_headers),
        }

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
    shutdown_timeout_seconds: float = Field(15.0, ge=0, le=600, allow_inf_nan=False)
    # Answers up to this size are stored for replay; a duplicate of a larger one gets
    # 409 replay-unavailable (the write was applied; its body was not kept).
    max_replay_body_bytes: int = Field(1024 * 1024, ge=0, le=64 * 1024 * 1024)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="FENCEGATE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    database_url: str = "sqlite+aiosqlite:///fencegate.db"
    proxy_listen: Listen = "127.0.0.1:8080"
    control_listen: Listen = "127.0.0.1:8081"
    auth: AuthSettings = Field(default_factory=AuthSettings)
    lease: LeaseSettings = Field(default_factory=LeaseSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    upstreams: list[UpstreamSettings] = Field(default_factory=list)

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
        try:
            url = sa.make_url(value)
        except sa.exc.ArgumentError as error:
            raise ValueError("not a database URL") from error
        if url.drivername not in ("sqlite+aiosqlite", "postgresql+asyncpg"):
            raise ValueError("use sqlite+aiosqlite:///path.db or postgresql+asyncpg://user@host/db")
        if url.get_backend_name() == "sqlite" and is_in_memory(url):
            raise ValueError(f"{IN_MEMORY} (sqlite+aiosqlite:///path.db)")
        return value

    @model_validator(mode="after")
    def _checks(self) -> Settings:
        names = [u.name for u in self.upstreams]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"upstreams: duplicate name(s) {', '.join(duplicates)}")
        if not self.auth.enabled:
            for key in ("proxy_listen", "control_listen"):
                host, _ = parse_listen(getattr(self, key))
                if not is_loopback(host):
                    raise ValueError(
                        f"{key}: {host} is not a loopback address and no auth tokens are "
                        "configured; set auth.worker_tokens / auth.admin_tokens first"
                    )
        return self

    @property
    def sqlite(self) -> bool:
        return sa.make_url(self.database_url).get_backend_name() == "sqlite"

    def upstream(self, name: str) -> UpstreamSettings | None:
        for upstream in self.upstreams:
            if upstream.name == name:
                return upstream
        return None


def load_settings(
    path: str | Path | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Read ``path`` (or ``./fencegate.toml`` when present), apply the environment,
    validate, expand ``${ENV}`` in upstream headers and resolve a relative SQLite path
    against the config file's folder."""
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
    try:
        settings = Settings(**data)
    except ValidationError as error:
        raise ConfigError(_describe(error)) from error
    except SettingsError as error:  # e.g. malformed JSON in a FENCEGATE_* variable
        cause = f" ({error.__cause__})" if error.__cause__ else ""
        raise ConfigError([f"environment: {error}{cause}"]) from error
    return _resolve_sqlite(_expand_env(settings, environ), base)


def _expand_env(settings: Settings, environ: Mapping[str, str]) -> Settings:
    """``${NAME}`` in upstream headers, whether they came from the file or from
    ``FENCEGATE_UPSTREAMS``."""
    upstreams = []
    for index, upstream in enumerate(settings.upstreams):
        headers = {
            name: SecretStr(
                _expand_one(
                    value.get_secret_value(), environ, f"upstreams.{index}.set_headers.{name}"
                )
            )
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
        upstreams.append(upstream.model_copy(update={"set_headers": headers}))
    return settings.model_copy(update={"upstreams": upstreams})


def _expand_one(value: str, environ: Mapping[str, str], key: str) -> str:
    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise ConfigError([f"{key}: environment variable {name} is not set"])
        return environ[name]

    return ENV_REF.sub(sub, value)


def _describe(error: ValidationError) -> list[str]:
    problems = []
    for item in error.errors(include_url=False):
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown setting"
        problems.append(f"{key}: {message}")
    return problems


def _resolve_sqlite(settings: Settings, base: Path) -> Settings:
    url = sa.make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return settings
    db_path = Path(url.database)
    if db_path.is_absolute():
        return settings
    resolved = url.set(database=str(base / db_path))
    return settings.model_copy(
        update={"database_url": resolved.render_as_string(hide_password=False)}
    )
