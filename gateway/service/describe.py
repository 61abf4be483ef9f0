"""A lease source as ``fencegate check-config`` prints it and ``fencegate serve`` logs it at
start: its kind and where it points, never a secret."""

from __future__ import annotations

from typing import assert_never

from yarl import URL

from gateway.config import (
    DynamoDbSourceSettings,
    EtcdSourceSettings,
    JwtSourceSettings,
    LeaseSourceSettings,
    RedisSourceSettings,
    ZooKeeperSourceSettings,
    mask_url,
)


def shown_url(value: str) -> str:
    """A URL as it may be shown: a password (or a lone user name) as ``***``, as
    ``mask_url`` does, and no query (redis-py reads ``?password=`` too)."""
    try:
        url = URL(value)
    except ValueError:
        return "(not a URL)"
    if url.query_string or url.fragment:
        url = url.with_query(None).with_fragment(None)
    return mask_url(str(url))


def source_target(source: LeaseSourceSettings) -> str:
    """Where a lease source points: etcd's endpoints, ZooKeeper's hosts, the Redis URL,
    the DynamoDB table and region (and endpoint), a signed-token source's issuer and
    algorithms (it points nowhere: the keys are in the config)."""
    if isinstance(source, JwtSourceSettings):
        return f"issuer {source.issuer!r}, {', '.join(source.algorithms)}"
    if isinstance(source, EtcdSourceSettings):
        return ", ".join(shown_url(endpoint) for endpoint in source.endpoints)
    if isinstance(source, ZooKeeperSourceSettings):
        return ", ".join(source.hosts)
    if isinstance(source, RedisSourceSettings):
        return shown_url(source.url)
    if isinstance(source, DynamoDbSourceSettings):
        where = f"table {source.table}, {source.region}"
        return f"{where}, {shown_url(source.endpoint_url)}" if source.endpoint_url else where
    assert_never(source)
