"""Configuration: one TOML file plus ``FENCEGATE_*`` variables, validated once at start.

Environment variables win over the file; nested keys use ``__``
(``FENCEGATE_LEASE__MAX_TTL_SECONDS=900``), lists and tables are JSON
(``FENCEGATE_AUTH__ADMIN_TOKENS='["s3cret"]'``). This package is the only reader of
``os.environ``: ``${NAME}`` in an upstream's ``set_headers`` and in a lease source's
``public_keys`` is expanded here, by ``resolve_secrets``, for ``serve`` only.

One module per part, each name importable from here (``from gateway.config import X``):

- ``settings``: ``Settings``, the whole configuration and the rules across its tables;
  ``ConfigError``.
- ``load``: ``load_settings`` (the TOML file and the environment over it; relative paths
  resolved against the file's folder), ``sqlite_folder_problem``.
- ``problems``: pydantic's errors and malformed ``FENCEGATE_*`` variables as problems
  that name the key.
- ``secrets``: ``${NAME}`` references (``env_references``) and their expansion
  (``resolve_secrets``, ``for_serving``).
- ``env``: the ``FENCEGATE_`` prefix and the ``${NAME}`` pattern.
- ``upstreams``: ``[[upstreams]]`` with ``[upstreams.dedup]`` and ``[upstreams.signing]``.
- ``sources``: ``[[lease_sources]]``, one settings class per kind.
- ``listeners``: the listen addresses and ``[tls]``.
- ``database``: ``database_url`` (several hosts, drivers) and ``[database]``.
- ``gateway``: ``[gateway]``, the gateway's behaviour and limits.
- ``auth``: ``[auth]``, the control tokens. ``tracing``: ``[tracing]``.
"""

from __future__ import annotations

from gateway.config.auth import AuthSettings
from gateway.config.database import WRITABLE_SESSIONS, DatabaseSettings, several_hosts
from gateway.config.env import ENV_PREFIX, ENV_REF
from gateway.config.gateway import REPLICA_NAME, GatewaySettings
from gateway.config.listeners import (
    LISTENERS,
    ClientCerts,
    Listen,
    ListenerTls,
    ListenerTlsSettings,
    TlsSettings,
    is_loopback,
    parse_listen,
)
from gateway.config.load import DEFAULT_CONFIG_FILE, load_settings, sqlite_folder_problem
from gateway.config.problems import unknown_variables
from gateway.config.secrets import env_references, for_serving, resolve_secrets
from gateway.config.settings import ConfigError, Settings
from gateway.config.sources import (
    SOURCE_NAME,
    DynamoDbSourceSettings,
    EtcdSourceSettings,
    JwtAlgorithm,
    JwtSourceSettings,
    LeaseSourceSettings,
    RedisSourceSettings,
    ZooKeeperSourceSettings,
    check_public_key,
)
from gateway.config.tracing import TracingSettings
from gateway.config.upstreams import (
    TOKEN_CHARS,
    DedupSettings,
    SigningSettings,
    UpstreamSettings,
    mask_url,
)

__all__ = [
    "DEFAULT_CONFIG_FILE",
    "ENV_PREFIX",
    "ENV_REF",
    "LISTENERS",
    "REPLICA_NAME",
    "SOURCE_NAME",
    "TOKEN_CHARS",
    "WRITABLE_SESSIONS",
    "AuthSettings",
    "ClientCerts",
    "ConfigError",
    "DatabaseSettings",
    "DedupSettings",
    "DynamoDbSourceSettings",
    "EtcdSourceSettings",
    "GatewaySettings",
    "JwtAlgorithm",
    "JwtSourceSettings",
    "LeaseSourceSettings",
    "Listen",
    "ListenerTls",
    "ListenerTlsSettings",
    "RedisSourceSettings",
    "Settings",
    "SigningSettings",
    "TlsSettings",
    "TracingSettings",
    "UpstreamSettings",
    "ZooKeeperSourceSettings",
    "check_public_key",
    "env_references",
    "for_serving",
    "is_loopback",
    "load_settings",
    "mask_url",
    "parse_listen",
    "resolve_secrets",
    "several_hosts",
    "sqlite_folder_problem",
    "unknown_variables",
]
