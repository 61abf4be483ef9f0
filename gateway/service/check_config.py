"""``fencegate check-config``: validate what serve would run with and print a summary,
one line per setting (the database, its replication, listeners, tokens, TLS, upstreams,
lease sources)."""

from __future__ import annotations

import argparse
import os
import ssl
import sys

import sqlalchemy as sa

from gateway.config import (
    ConfigError,
    DynamoDbSourceSettings,
    Settings,
    env_references,
    for_serving,
    unknown_variables,
)
from gateway.records import migrate
from gateway.service.cli_common import EXIT_USAGE, run_loop
from gateway.service.describe import source_target
from lease_core.db import create_engine


def cmd_check_config(args: argparse.Namespace, settings: Settings) -> int:
    problems, contexts = _serving_problems(settings)
    if problems:
        problems = [
            f"{p} (serve needs it; the other commands do not)" if p.endswith("is not set") else p
            for p in problems
        ]
        print(f"fencegate: {ConfigError(problems)}", file=sys.stderr)
        return EXIT_USAGE
    replicated, refused = _replication_line(settings)
    if refused:
        print(f"fencegate: {refused}", file=sys.stderr)
        return 1
    for warning in unknown_variables(os.environ):
        print(f"fencegate: warning: {warning}", file=sys.stderr)
    _print_summary(settings, replicated, tls_on=bool(contexts))
    return 0


def _serving_problems(settings: Settings) -> tuple[list[str], dict[str, ssl.SSLContext]]:
    """What serve would run with: the ${NAME} of set_headers resolved here too (only serve
    and this command read them), named with whether this shell has them, never shown.
    Every problem at once: the secrets, the lease sources' files, the listeners'
    certificates, the AWS credentials of a DynamoDB source. With the listeners' TLS
    contexts, when they load."""
    from gateway.service import tls

    problems: list[str] = []
    contexts: dict[str, ssl.SSLContext] = {}
    try:
        for_serving(settings)
    except ConfigError as error:
        problems += error.problems
    try:
        contexts = tls.contexts(settings)  # the certificate files load, keys fit
    except ConfigError as error:
        problems += error.problems
    return problems, contexts


def _print_summary(settings: Settings, replicated: str, *, tls_on: bool) -> None:
    """One line per setting: the database, its replication, listeners, tokens, TLS,
    upstreams, lease sources, and what serve needs from this shell."""
    print("configuration is valid")
    print(f"  database        {_safe_url(settings.database_url)}")
    if replicated:
        print(f"  replication     {replicated}")
    print(f"  proxy_listen    {settings.proxy_listen}")
    print(f"  control_listen  {settings.control_listen}")
    print(
        f"  auth            {len(settings.auth.worker_tokens)} worker token(s), "
        f"{len(settings.auth.admin_tokens)} admin token(s), "
        f"{len(settings.auth.metrics_tokens)} metrics token(s)"
    )
    for name, listener in settings.tls.listeners.items():
        client = (
            ""
            if listener.client_certs == "none"
            else f", client certificates {listener.client_certs}"
        )
        print(f"  tls             {name} listener: {listener.cert_file}{client}")
    if not tls_on:
        print("  tls             off (both listeners speak plain HTTP)")
    print(
        f"  lease           default ttl {settings.lease.default_ttl_seconds:g}s, "
        f"max ttl {settings.lease.max_ttl_seconds:g}s"
    )
    for upstream in settings.upstreams:
        print(
            f"  upstream        {upstream.name} -> {upstream.display_url} "
            f"(fenced: {', '.join(upstream.fenced_methods) or 'none'}; "
            f"unknown outcome: {upstream.unknown_outcome})"
        )
    for source in settings.lease_sources:
        print(
            f"  lease source    {source.name}: {source.kind} ({source_target(source)}); "
            f"tokens {source.name}:..."
        )
    for key, name, _ in env_references(settings):
        print(f"  serve needs     {name} (set) for {key}")
    for line in _source_credentials(settings):
        print(f"  serve needs     {line}")


def _source_credentials(settings: Settings) -> list[str]:
    """The AWS credentials of the DynamoDB sources, as botocore's chain finds them in this
    shell: a line each. Not a refusal: check-config often runs where serve does not (CI,
    a laptop); serve refuses to start without them (``DynamoDbSource.start``)."""
    if not any(isinstance(s, DynamoDbSourceSettings) for s in settings.lease_sources):
        return []
    from gateway.sources.dynamodb import credentials_problem

    problem = credentials_problem()
    found = (
        "AWS credentials (botocore's chain found them in this shell)"
        if problem is None
        else f"AWS credentials, which this shell lacks: {problem}"
    )
    return [
        f"{found} for lease_sources.{index}"
        for index, source in enumerate(settings.lease_sources)
        if isinstance(source, DynamoDbSourceSettings)
    ]


def _replication_line(settings: Settings) -> tuple[str, str]:
    """(what check-config says of a PostgreSQL's replication, the refusal serve would
    give or ""). An unreachable database is said, not refused: the file is what is checked."""
    from gateway.records import replication

    if settings.sqlite:
        return "", ""
    seen: list[replication.Replication] = []

    async def read() -> None:
        engine = create_engine(settings.database_url)
        try:
            seen.append(await replication.replication(engine))
        finally:
            await engine.dispose()

    try:
        run_loop(read())
    except Exception as error:
        return f"not checked: {migrate.database_error(error, settings.database_url)}", ""
    refused = seen[0].refusal(settings.database.allow_async_failover)
    if refused is not None:
        return "", refused
    if seen[0].problems():
        return f"{seen[0].summary()}; can lose commits (allow_async_failover = true)", ""
    return seen[0].summary(), ""


def _safe_url(url: str) -> str:
    return sa.make_url(url).render_as_string(hide_password=True)
