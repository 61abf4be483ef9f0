"""Secrets from the environment: the ``${NAME}`` references in the upstreams' headers and
signing credentials and in the lease sources' public keys (``env_references``), and their
expansion (``resolve_secrets``), which only ``serve`` needs (``for_serving``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import SecretStr

from gateway.config.env import ENV_REF
from gateway.config.settings import ConfigError, Settings
from gateway.config.source_files import file_problems
from gateway.config.sources import (
    JwtSourceSettings,
    LeaseSourceSettings,
    SecuredSource,
    check_public_key,
)


def env_references(
    settings: Settings, environ: Mapping[str, str] | None = None
) -> list[tuple[str, str, bool]]:
    """``(key, NAME, set now)`` for every ``${NAME}`` in the upstreams' headers and
    signing credentials, the JWT sources' public keys and the other sources' passwords: what
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
        *(
            (f"lease_sources.{index}.password", ref, bool(environ.get(ref)))
            for index, source in enumerate(settings.lease_sources)
            if isinstance(source, SecuredSource) and source.password is not None
            for ref in ENV_REF.findall(source.password.get_secret_value())
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
    missing += file_problems(settings)
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
        elif isinstance(source, SecuredSource) and source.password is not None:
            password = ENV_REF.sub(
                lambda m: environ[m.group(1)], source.password.get_secret_value()
            )
            source = source.model_copy(update={"password": SecretStr(password)})
        sources.append(source)
    return settings.model_copy(update={"upstreams": upstreams, "lease_sources": sources})
