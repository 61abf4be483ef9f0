"""The ``zookeeper`` lease source without a server: its settings and the shape of its
tokens (a lock node's path), judged before any read; and the client's token helper."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.config import Settings, ZooKeeperSourceSettings
from gateway.sources import KINDS, ZooKeeperSource, build, split_token
from gateway.sources.zookeeper import split_node

NODE = "8f14e45fceea167a5a36dedd4bea2543__lock__0000000003"


def settings(**extra: Any) -> Settings:
    source = {"name": "zk", "kind": "zookeeper", "hosts": ["127.0.0.1:2181"], **extra}
    return Settings(database_url="sqlite+aiosqlite:////tmp/x.db", lease_sources=[source])


def test_settings_and_defaults() -> None:
    (source,) = settings().lease_sources
    assert isinstance(source, ZooKeeperSourceSettings)
    assert (source.timeout_seconds, source.session_timeout_seconds) == (2.0, 10.0)
    assert KINDS["zookeeper"] is ZooKeeperSource
    assert isinstance(build([source])["zk"], ZooKeeperSource)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"hosts": []}, "hosts"),
        ({"hosts": ["127.0.0.1"]}, "host:port"),
        ({"hosts": ["127.0.0.1:2181/chroot/"]}, "chroot"),
        ({"hosts": ["a:2181/x", "b:2181"]}, "only the last"),
        ({"hosts": ["a:2181,b"]}, "host:port"),
        ({"hosts": ["a:0"]}, "host:port"),
        ({"hosts": ["a:70000"]}, "host:port"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"session_timeout_seconds": 1}, "session_timeout_seconds"),
        ({"endpoints": ["http://e"]}, "endpoints"),
    ],
)
def test_bad_settings_are_named(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings(**extra)


def source() -> ZooKeeperSource:
    return ZooKeeperSource(ZooKeeperSourceSettings(name="zk", kind="zookeeper", hosts=["h:1"]))


@pytest.mark.parametrize(
    "token",
    [f"/locks/order-42/{NODE}", f"/a/{NODE}", f"/a/b-c.d_e/{NODE}"],
)
def test_lock_node_paths_are_well_formed(token: str) -> None:
    assert source().well_formed(token)


@pytest.mark.parametrize(
    "token",
    [
        f"locks/order-42/{NODE}",  # not absolute
        f"/{NODE}",  # a lock at the root: no lock path
        f"/locks//{NODE}",
        f"/locks/./{NODE}",
        f"/locks/../{NODE}",
        "/locks/order-42/" + NODE.replace("__lock__", "__rlock__"),  # a ReadLock's node
        "/locks/order-42/" + NODE[:-1],  # nine digits
        "/locks/order-42/" + NODE.upper(),
        "/locks/order-42/" + NODE + "x",
        "/locks/order-42",
        f"/locks/a\nb/{NODE}",
        f"/{'x' * 1000}/{NODE}",
        "",
    ],
)
def test_other_tokens_are_malformed(token: str) -> None:
    assert not source().well_formed(token)


def test_the_job_is_the_lock_path_and_the_token_names_the_source() -> None:
    assert split_node(f"/locks/order-42/{NODE}") == ("/locks/order-42", NODE, 3)
    found = split_token(f"zk:/locks/order-42/{NODE}", {"zk": source()})
    assert found is not None and found[1] == f"/locks/order-42/{NODE}"


def test_the_client_helper_names_a_held_lock_only() -> None:
    from fencegate_client.zookeeper import lock_token

    client = SimpleNamespace(chroot="")
    held = SimpleNamespace(is_acquired=True, node=NODE, path="/locks/order-42", client=client)
    assert lock_token(held, source="zk") == f"zk:/locks/order-42/{NODE}"
    waiting = SimpleNamespace(is_acquired=False, node=NODE, path="/locks/x", client=client)
    with pytest.raises(ValueError, match="not held"):
        lock_token(waiting, source="zk")
    chrooted = SimpleNamespace(
        is_acquired=True, node=NODE, path="/locks/x", client=SimpleNamespace(chroot="/app")
    )
    # The path as the gateway reads it: from the root, or below the gateway's chroot.
    assert lock_token(chrooted, source="zk") == f"zk:/app/locks/x/{NODE}"
    assert lock_token(chrooted, source="zk", chroot="/app") == f"zk:/locks/x/{NODE}"
    assert lock_token(held, source="zk", chroot="/locks") == f"zk:/order-42/{NODE}"
    with pytest.raises(ValueError, match="outside the gateway's chroot"):
        lock_token(chrooted, source="zk", chroot="/other")
    with pytest.raises(ValueError, match="outside the gateway's chroot"):
        lock_token(chrooted, source="zk", chroot="/ap")


def test_kazoos_reconnect_chatter_is_said_once_then_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An unreachable ZooKeeper: kazoo's connection thread warns at every try (about 30
    a minute); the source's kazoo logger lets the first through, holds the rest back
    for CHATTER_EVERY_SECONDS, and then says how many it held back."""
    from gateway.sources.zookeeper import ReconnectChatter, kazoo_logger

    options = ZooKeeperSource(
        ZooKeeperSourceSettings(name="zk-chatter", kind="zookeeper", hosts=["h:1"])
    ).client_options()
    logger = options["logger"]
    assert logger is kazoo_logger("zk-chatter") and logger.name.startswith("fencegate.")
    [chatter] = [f for f in logger.filters if isinstance(f, ReconnectChatter)]
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        for _ in range(30):  # a minute of kazoo's retries
            logger.info("Connecting to %s(%s):%s, use_ssl: %r", "h", "10.0.0.1", 1, False)
            logger.warning("Connection dropped: %s", "outstanding heartbeat ping not received")
            logger.warning("Transition to CONNECTING")
        logger.warning("AUTH_FAILED closing: %s", "bad")  # not chatter: always said
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 4, said
        assert said[0].startswith("Connecting to h(10.0.0.1):1, use_ssl: False; kazoo keeps")
        assert said[1].startswith("Connection dropped: outstanding heartbeat ping not received")
        assert said[2].startswith("Transition to CONNECTING")
        assert said[3] == "AUTH_FAILED closing: bad"
        chatter.next_at.clear()  # CHATTER_EVERY_SECONDS later
        logger.warning("Connection dropped: %s", "x")
        assert "Connection dropped: x (29 more held back)" in caplog.records[-1].getMessage()
