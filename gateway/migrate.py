"""Schema migrations (alembic) run from code: ``fencegate migrate`` and the SQLite
quickstart's migrate-on-start."""

from __future__ import annotations

import sys
from pathlib import Path

import sqlalchemy as sa
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import AsyncEngine

from alembic import command


def script_location() -> Path:
    """The ``alembic/`` folder: the source tree's (an editable install, a checkout) or
    the copy a regular install puts under ``<prefix>/share/fencegate/alembic``."""
    candidates = [
        Path(__file__).resolve().parent.parent / "alembic",
        Path(sys.prefix) / "share" / "fencegate" / "alembic",
    ]
    for location in candidates:
        if (location / "env.py").is_file():
            return location
    raise FileNotFoundError(
        "migration scripts not found (looked in "
        + ", ".join(str(c) for c in candidates)
        + "); reinstall fencegate"
    )


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(script_location()))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Upgrade the schema (blocking: call it before the event loop, or in a thread)."""
    command.upgrade(alembic_config(database_url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


async def current_revision(engine: AsyncEngine) -> str | None:
    def read(conn: sa.Connection) -> str | None:
        return MigrationContext.configure(conn).get_current_revision()

    async with engine.connect() as conn:
        return await conn.run_sync(read)


async def is_at_head(engine: AsyncEngine) -> bool:
    return await current_revision(engine) == head_revision()


def is_compatible(revision: str | None) -> bool:
    """This code can serve a database at ``revision``: our head, or a newer revision we
    do not know (a rolling upgrade migrated the database ahead of this replica;
    migrations only add, so the old code keeps working until it is replaced)."""
    if revision is None:
        return False
    if revision == head_revision():
        return True
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    try:
        script.get_revision(revision)
    except Exception:
        return True  # unknown to us: newer
    return False
