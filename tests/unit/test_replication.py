"""What makes a PostgreSQL unsafe for fences at a failover (gateway/records/replication.py),
and the spellings of several hosts in database_url (gateway/config/database.py). The
refusal itself, on real servers: tests/failover."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.config import Settings, several_hosts
from gateway.records.replication import Replication, Standby


def primary(*standbys: tuple[str, str | None], commit: str = "on") -> Replication:
    return Replication(
        server="10.0.0.1:5432",
        in_recovery=False,
        synchronous_commit=commit,
        standbys=tuple(Standby(name, state) for name, state in standbys),
    )


def test_a_primary_without_standbys_loses_nothing_at_a_failover() -> None:
    assert primary().problems() == []
    assert primary(commit="off").problems() == []  # nothing to fail over to
    assert primary().summary() == "primary 10.0.0.1:5432, no standby streaming from it"


def test_every_standby_synchronous_is_safe() -> None:
    safe = primary(("pg1", "sync"), ("pg2", "quorum"))
    assert safe.problems() == []
    assert safe.synchronous == ["pg1", "pg2"]
    assert "2 of 2 standby(s) synchronous" in safe.summary()


@pytest.mark.parametrize("state", ["async", "potential"])
def test_a_standby_not_waited_for_is_refused(state: str) -> None:
    (problem,) = primary(("pg1", "sync"), ("pg2", state)).problems()
    assert problem.startswith(f"standby pg2 replicates asynchronously (sync_state {state})")


def test_several_asynchronous_standbys_are_named_in_one_sentence() -> None:
    (problem,) = primary(("pg1", "async"), ("pg2", "async")).problems()
    assert problem.startswith("standbys pg1, pg2 replicate asynchronously")


@pytest.mark.parametrize("commit", ["off", "local"])
def test_commits_acknowledged_locally_are_refused(commit: str) -> None:
    problems = primary(("pg1", "sync"), commit=commit).problems()
    assert problems == [
        f"synchronous_commit is {commit}: a commit is acknowledged before any standby has it"
    ]


def test_an_unreadable_sync_state_asks_for_pg_monitor() -> None:
    (problem,) = primary(("pg1", None)).problems()
    assert "grant it pg_monitor" in problem


def test_libpq_hosts_become_sqlalchemy_hosts() -> None:
    url = "postgresql+asyncpg://u:p@h1:5433,h2/db?target_session_attrs=read-write"
    assert several_hosts(url) == (
        "postgresql+asyncpg://u:p@/db?host=h1:5433&host=h2:5432&target_session_attrs=read-write"
    )
    one = "postgresql+asyncpg://u@h1:5432/db"
    assert several_hosts(one) == one
    assert several_hosts("sqlite+aiosqlite:///a,b.db") == "sqlite+aiosqlite:///a,b.db"
    with pytest.raises(ValueError, match="empty host"):
        several_hosts("postgresql+asyncpg://u@h1,,h2/db")


def test_several_hosts_need_a_writable_session_and_ports() -> None:
    hosts = "postgresql+asyncpg://u@/db?host=h1:5432&host=h2:5432"
    with pytest.raises(ValidationError, match="target_session_attrs=read-write"):
        Settings(database_url=hosts)
    with pytest.raises(ValidationError, match="h2 has none"):
        Settings(
            database_url="postgresql+asyncpg://u@/db?host=h1:1&host=h2&target_session_attrs=primary"
        )
    settings = Settings(database_url=hosts + "&target_session_attrs=read-write")
    assert settings.database_url.endswith("target_session_attrs=read-write")
    assert settings.database.allow_async_failover is False
