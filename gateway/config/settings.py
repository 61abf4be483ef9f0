"""``Settings``: the whole configuration, its tables put together (each defined in its own
module of ``gateway.config``; ``[lease]`` in ``lease_core.config``), the rules across
them, and ``ConfigError``."""

from __future__ import annotations

import sqlalchemy as sa
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.config.auth import AuthSettings
from gateway.config.database import DatabaseSettings, check_database_url
from gateway.config.gateway import GatewaySettings
from gateway.config.listeners import Listen, TlsSettings, is_loopback, parse_listen
from gateway.config.sources import LeaseSourceSettings
from gateway.config.tracing import TracingSettings
from gateway.config.upstreams import UpstreamSettings
from lease_core.config import LeaseSettings


class ConfigError(Exception):
    """The configuration is not valid."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  {p}" for p in problems))


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
        return check_database_url(value)

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
        """Every secret of this configuration: control tokens, upstream header values and
        the lease sources' passwords (kept out of every log line, see
        ``gateway.observe.logs.protect``)."""
        auth = self.auth
        values = [
            t.get_secret_value()
            for t in (*auth.worker_tokens, *auth.admin_tokens, *auth.metrics_tokens)
        ]
        for upstream in self.upstreams:
            values.extend(v.get_secret_value() for v in upstream.set_headers.values())
            if upstream.signing is not None:
                values.extend(v.get_secret_value() for v in upstream.signing.secrets().values())
        for source in self.lease_sources:
            secrets = getattr(source, "secrets", None)
            if secrets is not None:
                values.extend(v.get_secret_value() for v in secrets().values())
        return values

    def upstream(self, name: str) -> UpstreamSettings | None:
        for upstream in self.upstreams:
            if upstream.name == name:
                return upstream
        return None
