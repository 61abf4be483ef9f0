"""The configuration file of a replica that verify or the fault tests start: one writer
for both (``verify.stack`` and ``tests/faults/harness.py``), so a setting the workload
depends on changes in one place.

Keys and tables as docs/configuration.md names them; values written as TOML (strings
quoted as JSON quotes them, which TOML's basic strings read alike)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

LEASE_DEFAULT_TTL_SECONDS = 5
LEASE_MAX_TTL_SECONDS = 600


@dataclass(frozen=True)
class UpstreamTable:
    """One ``[[upstreams]]`` table."""

    name: str
    url: str
    unknown_outcome: str = "hold"
    timeout_seconds: float = 1.0
    connect_timeout_seconds: float = 0.3
    dedup: Mapping[str, object] | None = None  # its ``[upstreams.dedup]`` table, if any

    def toml(self) -> str:
        text = (
            "[[upstreams]]\n"
            f"name = {json.dumps(self.name)}\n"
            f"url = {json.dumps(self.url)}\n"
            f"unknown_outcome = {json.dumps(self.unknown_outcome)}\n"
            f"timeout_seconds = {self.timeout_seconds}\n"
            f"connect_timeout_seconds = {self.connect_timeout_seconds}\n"
        )
        if self.dedup is not None:
            text += "[upstreams.dedup]\n" + _keys(self.dedup)
        return text


def replica_config(
    *,
    database_url: str,
    proxy_listen: str,
    control_listen: str,
    upstreams: Iterable[UpstreamTable],
    gateway: Mapping[str, object],
    max_attempts: int,
    tokens: tuple[str, str] | None = None,
    extra: str = "",
) -> str:
    """The file's text. ``gateway``: the ``[gateway]`` table's keys; ``tokens``: the
    worker's and the admin's bearer token (``[auth]``; none: no auth); ``extra``: more
    TOML after the upstreams (``[[lease_sources]]`` tables, or a test's own keys)."""
    text = (
        f"database_url = {json.dumps(database_url)}\n"
        f"proxy_listen = {json.dumps(proxy_listen)}\n"
        f"control_listen = {json.dumps(control_listen)}\n"
    )
    if tokens is not None:
        worker, admin = tokens
        text += f"[auth]\nworker_tokens = [{json.dumps(worker)}]\n"
        text += f"admin_tokens = [{json.dumps(admin)}]\n"
    text += (
        "[lease]\n"
        f"default_ttl_seconds = {LEASE_DEFAULT_TTL_SECONDS}\n"
        f"max_ttl_seconds = {LEASE_MAX_TTL_SECONDS}\n"
        f"default_max_attempts = {max_attempts}\n"
        "[gateway]\n" + _keys(gateway)
    )
    text += "".join(upstream.toml() for upstream in upstreams)
    return text + extra


def _keys(table: Mapping[str, object]) -> str:
    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in table.items())
