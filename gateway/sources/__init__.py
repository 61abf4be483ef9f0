"""Lease sources: fencing tokens of leases that other services hand out.

A token names its source with a prefix, ``<source>:<the source's token>``; the gateway's
own ``fgl_`` tokens have none. A source's adapter turns its token into facts for the
decision table, and writes nothing: the lease is current, ended or expired, or the token
is not one (``None``); with the job (namespaced ``<source>/<job>``, so no two sources,
nor ``lease_core``, whose ids never hold ``/``, can share a job) and the generation.
The fence is still the database's: the admission (``admit_external`` in the catalogue)
raises the job's fence only to a generation that is not below it.

- ``jwt``: a compact JWS (RFC 7515/7519) whose claims carry the job (``sub``), the
  generation (``gen``), ``exp`` and ``iss``; verified with PyJWT against the configured
  public keys, algorithms and issuer. The expiry is handed to the admission, which
  judges it with the database's clock (the clock that judges the gateway's own leases).
- ``etcd``: the key of a lock held through etcd's lock API (``<name>/<lease id>``); the
  job is the lock's name, the generation the key's create revision. Read through etcd's
  JSON gateway (``/v3/kv/range``, ``/v3/lease/timetolive``), a held lock briefly
  cached (``cache_seconds``).
- ``zookeeper``: the path of a lock node of ZooKeeper's lock recipe (kazoo's ``Lock``,
  ``<lock path>/<guid>__lock__<sequence>``); the job is the lock's path, the generation
  the node's ``czxid``; current while the node is the lowest under the lock's path. Read
  through kazoo's asynchronous calls, bridged to the event loop; nothing cached.
- ``redis``: ``<lock name>:<value>`` of a lock taken with Fencegate's Redis recipe
  (``fencegate_client.redis_lock``); the generation is the fence the value carries;
  current while the lock holds that value. Read with ``redis.asyncio``; nothing cached.
- ``dynamodb``: ``<table>/<lock key>:<fence>.<record version>`` of a lock item whose
  fence a conditional update raises at each acquisition, with a new random record
  version (``fencegate_client.dynamodb_lock``); current while the item has that fence,
  that record version and an ``expires_at``, which the admission judges with the
  database's clock. A consistent read through botocore, in a thread; nothing cached.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gateway.config import LeaseSourceSettings
from gateway.sources.base import (
    JOB_ID_MAX,
    MAX_TOKEN,
    ExternalLease,
    Source,
    bounded,
    namespaced,
)
from gateway.sources.dynamodb import DynamoDbSource
from gateway.sources.etcd import EtcdSource
from gateway.sources.redis_lock import RedisSource
from gateway.sources.signed import JwtSource
from gateway.sources.zookeeper import ZooKeeperSource

__all__ = [
    "JOB_ID_MAX",
    "MAX_TOKEN",
    "DynamoDbSource",
    "EtcdSource",
    "ExternalLease",
    "JwtSource",
    "RedisSource",
    "Source",
    "ZooKeeperSource",
    "bounded",
    "build",
    "namespaced",
    "split_token",
]

# The adapter of each ``kind`` of ``[[lease_sources]]``: its settings in, a Source out
# (a new kind: its settings in gateway/config/sources.py, a module here, a
# line below).
KINDS: dict[str, Callable[[Any], Source]] = {
    "jwt": JwtSource,
    "etcd": EtcdSource,
    "redis": RedisSource,
    "dynamodb": DynamoDbSource,
    "zookeeper": ZooKeeperSource,
}


def build(settings: Sequence[LeaseSourceSettings]) -> dict[str, Source]:
    """One adapter per configured source, by name."""
    return {source.name: KINDS[source.kind](source) for source in settings}


def split_token(token: str, sources: Mapping[str, Source]) -> tuple[Source, str] | None:
    """The source a token names and its own token, when it names one."""
    name, colon, rest = token.partition(":")
    if not colon:
        return None
    source = sources.get(name)
    return None if source is None else (source, rest)
