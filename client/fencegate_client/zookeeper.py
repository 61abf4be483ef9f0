"""The fencing token of a lock held with kazoo (a ``kind = "zookeeper"`` lease source).

A worker takes the lock with ZooKeeper's standard recipe, kazoo's ``Lock`` (an ephemeral
sequential node under the lock's path; the lowest holds the lock), and sends the node's
path, prefixed with the source's name::

    from kazoo.client import KazooClient
    from fencegate_client.zookeeper import lock_token

    zk = KazooClient(hosts="127.0.0.1:2181")
    zk.start()
    lock = zk.Lock("/locks/order-42", identifier="worker-1")
    with lock:
        headers = {"Fencing-Token": lock_token(lock, source="zk"), "Idempotency-Key": "charge"}
        ...

The gateway reads the lock's children: the node present and the lowest holds the lock
(the generation is the node's ``czxid``); a node still waiting, or gone, is refused
(docs/lease-sources.md). Needs kazoo: ``pip install 'fencegate-client[zookeeper]'``.
"""

from __future__ import annotations

from typing import Any

from ._needs import needs

try:
    import kazoo.recipe.lock  # noqa: F401  (the Lock whose node this names)
except ModuleNotFoundError as error:
    needs(error, __name__, "kazoo", install="'fencegate-client[zookeeper]'")
    raise

__all__ = ["lock_token"]


def lock_token(lock: Any, *, source: str, chroot: str = "") -> str:
    """``<source>:<the lock node's path>`` of a held kazoo ``Lock``, the path as the
    gateway reads it: below ``chroot``, the chroot its ``hosts`` end in (none: from
    ZooKeeper's root), whatever chroot the worker's own client has. ValueError when the
    lock is not held (a contender still waiting has a node too, and is refused) or lies
    outside the gateway's chroot."""
    if not getattr(lock, "is_acquired", False) or not getattr(lock, "node", None):
        raise ValueError("the lock is not held: acquire it first")
    path = (getattr(lock.client, "chroot", "") or "").rstrip("/") + lock.path.rstrip("/")
    prefix = chroot.rstrip("/")
    if prefix:
        if not path.startswith(prefix + "/"):
            raise ValueError(f"the lock {path!r} is outside the gateway's chroot {chroot!r}")
        path = path[len(prefix) :]
    return f"{source}:{path}/{lock.node}"
