"""Schema migrations (alembic) run from code: ``fencegate migrate`` and the SQLite
quickstart's migrate-on-start."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import AsyncEngine

from alembic import command


def script_location() -> Path:
    """The ``alembic/`` folder of the source tree this package runs from."""
    location = Path(__file__).resolve().parent.parent / "alembic"
    if not (location / "env.py").is_file():
        raise FileNotFoundError(
            f"migration scripts not found at {location}; install fencegate from its source "
            "tree (pip install -e .) or run from the container image"
        )
    return location


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
