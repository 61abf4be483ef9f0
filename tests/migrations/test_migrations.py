"""The alembic migrations against the models: an empty database upgraded to head has
exactly the schema of ``gateway.records.schema.metadata`` (lease and gateway tables), on SQLite
and on PostgreSQL, and every revision goes down and up again."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import create_async_engine

from alembic import command
from gateway.records import migrate
from gateway.records.schema import metadata
from tests.support import pg_admin, pg_url_of


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _inspect(url: str) -> tuple[list[Any], set[str], str | None]:
    """The differences between the database and the models, its tables, its revision."""

    def read(conn: sa.Connection) -> tuple[list[Any], set[str], str | None]:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(context, metadata)
        tables = set(sa.inspect(conn).get_table_names())
        return diff, tables, context.get_current_revision()

    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            result: tuple[list[Any], set[str], str | None] = await conn.run_sync(read)
            return result
    finally:
        await engine.dispose()


def _revisions() -> list[str]:
    """Every revision, base first."""
    script = ScriptDirectory.from_config(migrate.alembic_config("sqlite://"))
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]


@pytest.fixture
def empty_sqlite(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}"


@pytest.fixture
def empty_postgres(pg_database_url: str) -> Iterator[str]:
    """A throwaway, empty PostgreSQL database (``pg_database_url`` only proves that the
    server is there: it fails in CI, skips elsewhere, when it is not)."""
    name = f"fencegate_migr_{uuid.uuid4().hex[:10]}"
    _run(pg_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield pg_url_of(name)
    finally:
        _run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_database(request: pytest.FixtureRequest) -> str:
    fixture = "empty_sqlite" if request.param == "sqlite" else "empty_postgres"
    url: str = request.getfixturevalue(fixture)
    return url


def test_one_linear_history() -> None:
    script = ScriptDirectory.from_config(migrate.alembic_config("sqlite://"))
    assert len(script.get_heads()) == 1
    assert script.get_heads()[0] == migrate.head_revision()
    revisions = _revisions()
    assert revisions[-1] == migrate.head_revision()
    base = script.get_revision(revisions[0])
    assert base is not None and base.down_revision is None


def test_upgrade_empty_database_to_head_matches_the_models(empty_database: str) -> None:
    migrate.upgrade(empty_database)
    diff, tables, revision = _run(_inspect(empty_database))
    assert diff == []
    assert revision == migrate.head_revision()
    assert {t.name for t in metadata.sorted_tables} <= tables
    # Upgrading again is a no-op (``fencegate migrate`` is idempotent).
    migrate.upgrade(empty_database)
    assert _run(_inspect(empty_database))[0] == []


def test_downgrade_to_base_and_up_again(empty_database: str) -> None:
    migrate.upgrade(empty_database)
    config = migrate.alembic_config(empty_database)
    command.downgrade(config, "base")
    diff, tables, revision = _run(_inspect(empty_database))
    assert revision is None
    assert tables <= {"alembic_version"}  # every table of ours is gone
    assert diff  # ... so the models differ from it

    migrate.upgrade(empty_database)
    diff, _, revision = _run(_inspect(empty_database))
    assert diff == []
    assert revision == migrate.head_revision()


def test_every_revision_goes_down_and_up_again(empty_database: str) -> None:
    """The stairway: up one, down one, up one again, for each revision in turn."""
    config = migrate.alembic_config(empty_database)
    previous: str | None = None
    for revision in _revisions():
        command.upgrade(config, revision)
        assert _run(_inspect(empty_database))[2] == revision
        command.downgrade(config, previous or "base")
        assert _run(_inspect(empty_database))[2] == previous
        command.upgrade(config, revision)
        previous = revision
    assert _run(_inspect(empty_database))[0] == []


def test_is_at_head_follows_the_schema(empty_database: str) -> None:
    async def at_head() -> bool:
        engine = create_async_engine(empty_database)
        try:
            return (await migrate.schema_state(engine)).revision == migrate.head_revision()
        finally:
            await engine.dispose()

    assert not _run(at_head())
    migrate.upgrade(empty_database)
    assert _run(at_head())
    revisions = _revisions()
    if len(revisions) > 1:
        command.downgrade(migrate.alembic_config(empty_database), revisions[-2])
        assert not _run(at_head())


async def _fillfactors(url: str) -> dict[str, str | None]:
    """PostgreSQL: each of our tables' fillfactor as its storage parameters say (None:
    the default)."""
    engine = create_async_engine(url)
    query = sa.text(
        "SELECT c.relname, (SELECT split_part(o, '=', 2) FROM unnest(c.reloptions) AS o"
        "                   WHERE o LIKE 'fillfactor=%') AS fillfactor"
        " FROM pg_class AS c WHERE c.relkind = 'r' AND c.relname = ANY(:names)"
    )
    try:
        async with engine.connect() as conn:
            names = [t.name for t in metadata.sorted_tables]
            rows = (await conn.execute(query, {"names": names})).all()
    finally:
        await engine.dispose()
    return {row.relname: row.fillfactor for row in rows}


@pytest.mark.postgres
def test_the_fillfactors_are_the_models(empty_postgres: str) -> None:
    """The storage parameters the models declare (``postgresql_with``), which
    autogenerate does not compare: what migration 0012 sets, and what going below it
    puts back."""
    migrate.upgrade(empty_postgres)
    declared = {
        t.name: str(t.dialect_options["postgresql"]["with"]["fillfactor"])
        for t in metadata.sorted_tables
        if (t.dialect_options["postgresql"]["with"] or {}).get("fillfactor")
    }
    assert declared == {"idempotency_records": "25", "fences": "70"}
    found = _run(_fillfactors(empty_postgres))
    assert {name: v for name, v in found.items() if v is not None} == declared
    command.downgrade(migrate.alembic_config(empty_postgres), "0011")
    assert {n: v for n, v in _run(_fillfactors(empty_postgres)).items() if v} == {
        "idempotency_records": "50"
    }
