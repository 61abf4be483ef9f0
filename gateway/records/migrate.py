"""Schema migrations (alembic) run from code: ``fencegate migrate`` and the SQLite
quickstart's migrate-on-start."""

from __future__ import annotations

import asyncio
import errno
import functools
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import AsyncEngine

from alembic import command
from lease_core.db import create_engine


def script_location() -> Path:
    """The ``alembic/`` folder: the source tree's (an editable install, a checkout) or
    the copy a regular install puts under ``<prefix>/share/fencegate/alembic``."""
    candidates = [
        Path(__file__).resolve().parents[2] / "alembic",
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


@functools.cache
def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def database_error(error: BaseException, database_url: str) -> str:
    """One line for any failure to use the database, as every command says it:
    ``database error: cannot connect to PostgreSQL at host:port (connection refused)``,
    the same for a server that refuses the database or the user, with what to do about
    it, else ``database error: <the driver's first line>``. Never the statement's
    parameters (the engines hide them) nor a password."""
    url = sa.make_url(database_url)
    hosts = url.query.get("host")
    if isinstance(hosts, tuple) and len(hosts) > 1:  # several (config.several_hosts)
        where = ", ".join(hosts)
    else:
        where = f"{url.host or 'localhost'}:{url.port or 5432}"
    cause: BaseException | None = error
    seen = 0
    while cause is not None and seen < 10:
        if isinstance(cause, OSError) and url.get_backend_name() != "sqlite":
            reason = _os_reason(cause)
            return f"database error: cannot connect to PostgreSQL at {where} ({reason})"
        refused = _refusal(cause, url)
        if refused is not None:
            said, todo = refused
            return f"database error: cannot connect to PostgreSQL at {where} ({said}); {todo}"
        cause = getattr(cause, "orig", None) or cause.__cause__
        seen += 1
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"database error: {text}"


def _refusal(error: BaseException, url: sa.URL) -> tuple[str, str] | None:
    """The server's reason for refusing the connection and what to do about it, when
    ``error`` is such a refusal (by its SQLSTATE): no such database, a user or password
    refused."""
    sqlstate = getattr(error, "sqlstate", None)
    if not isinstance(sqlstate, str):
        return None
    said = str(error).strip().splitlines()[0] if str(error).strip() else sqlstate
    if sqlstate == "3D000":  # invalid_catalog_name
        name = url.database or "postgres"
        command = ["createdb"]
        for flag, value in (("-h", url.host), ("-p", url.port), ("-U", url.username)):
            if value:
                command += [flag, str(value)]
        command.append(name)
        quoted = '"' + name.replace('"', '""') + '"'
        return said, (
            f"create it with `{shlex.join(command)}` (or CREATE DATABASE {quoted}), "
            "then run `fencegate migrate`"
        )
    if sqlstate in ("28000", "28P01"):  # invalid_authorization_specification, password
        return said, "check the user and password in database_url"
    return None


def _os_reason(error: OSError) -> str:
    if isinstance(error, ConnectionRefusedError) or error.errno == errno.ECONNREFUSED:
        return "connection refused"
    if isinstance(error, socket.gaierror):
        return "host name not found"
    if isinstance(error, TimeoutError):
        return "timed out"
    return error.strerror or str(error) or type(error).__name__


@functools.cache
def known_revisions() -> frozenset[str]:
    """Every revision this code's migrations know (a newer schema's are not among them)."""
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return frozenset(rev.revision for rev in script.walk_revisions())


@dataclass(frozen=True)
class SchemaState:
    """The database's schema revision, and when it is ahead of this code, its floor: the
    oldest revisions whose code may serve it (``schema_floor``, migration 0009)."""

    revision: str | None
    floor: tuple[str, ...] = ()

    @property
    def ahead(self) -> bool:
        """Migrated past this code (a revision it does not know is newer)."""
        return self.revision is not None and self.revision not in known_revisions()

    def below_floor(self) -> str | None:
        """Why this code must not serve a schema migrated ahead of it: a migration since
        its revision set the floor past it (None: it may, as in a rolling upgrade)."""
        unknown = [floor for floor in self.floor if floor not in known_revisions()]
        if not self.ahead or not unknown:
            return None
        return (
            f"The database schema is at {self.revision} and serves code from revision "
            f"{unknown[0]} on; this replica's code is at {head_revision()}: replace it "
            "with the newer version."
        )

    def refusal(self) -> str | None:
        """Why this code may not serve the schema (None: it may): not migrated, older
        than the code, or migrated past it beyond its floor."""
        if self.revision is None or (not self.ahead and self.revision != head_revision()):
            return (
                f"The database schema is at {self.revision or 'no revision'}, this version "
                f"needs {head_revision()}: run `fencegate migrate`."
            )
        return self.below_floor()


async def schema_state(engine: AsyncEngine) -> SchemaState:
    """The schema's revision, and its floor when it is ahead of this code (only then is
    ``schema_floor`` read: a schema at this code's revision or older needs none)."""

    def read(conn: sa.Connection) -> SchemaState:
        revision = MigrationContext.configure(conn).get_current_revision()
        state = SchemaState(revision)
        if not state.ahead:
            return state
        floor = conn.execute(sa.text("SELECT revision FROM schema_floor")).scalars().all()
        return SchemaState(revision, tuple(floor))

    async with engine.connect() as conn:
        return await conn.run_sync(read)


def read_schema_state(database_url: str) -> SchemaState:
    """``schema_state`` outside an event loop (``fencegate migrate``): blocking."""

    async def read() -> SchemaState:
        # The project's own engine: its SQLite settings, parameters kept out of errors.
        engine = create_engine(database_url, pool_size=1)
        try:
            return await schema_state(engine)
        finally:
            await engine.dispose()

    return asyncio.run(read())
