"""``verify run``'s count of a store's lock workers (etcd, ZooKeeper): one rule for both."""

from __future__ import annotations

import pytest

from verify.__main__ import DEFAULT_LOCK_WORKERS, _store_lock_workers

NEEDS = "the etcd lock workers need etcd: apt-get install etcd-server"


def workers(
    given: int | None, nemeses: list[str], *, direct: bool = False, installed: bool = True
) -> int | None:
    return _store_lock_workers(
        given, "etcd", frozenset({"etcd-loss"}), nemeses, direct,
        lambda: "/usr/bin/etcd" if installed else None, NEEDS,
    )  # fmt: skip


def test_the_default_follows_the_store_s_nemesis() -> None:
    assert workers(None, ["pause", "etcd-loss"]) == DEFAULT_LOCK_WORKERS
    assert workers(None, ["pause"]) == 0
    assert workers(5, ["pause"]) == 5


@pytest.mark.parametrize(
    ("given", "direct", "installed", "said"),
    [
        (65, False, True, "--etcd-lock-workers 0..64"),
        (-1, False, True, "--etcd-lock-workers 0..64"),
        (2, True, True, "none with --direct"),
        (2, False, False, NEEDS),
    ],
)
def test_a_count_that_cannot_run_says_why(
    given: int, direct: bool, installed: bool, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert workers(given, ["pause"], direct=direct, installed=installed) is None
    assert said in capsys.readouterr().out


def test_none_wanted_needs_no_store() -> None:
    assert workers(0, ["etcd-loss"], installed=False) == 0
    assert workers(None, ["pause"], direct=True, installed=False) == 0
