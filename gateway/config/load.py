"""Reading the configuration: ``fencegate.toml`` (or the file named), the ``FENCEGATE_*``
variables over it, validated into ``Settings``; relative paths resolved against the
file's folder."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from pydantic import ValidationError
from pydantic_settings import SettingsError

from gateway.config.problems import describe, json_variables
from gateway.config.settings import ConfigError, Settings

DEFAULT_CONFIG_FILE = "fencegate.toml"


def load_settings(
    path: str | Path | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Read ``path`` (or ``./fencegate.toml`` when present), apply the environment,
    validate and resolve a relative SQLite path against the config file's folder.
    ``${NAME}`` in upstream headers stays as written (``resolve_secrets`` expands it)."""
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    base = Path.cwd()
    if path is None and Path(DEFAULT_CONFIG_FILE).is_file():
        path = DEFAULT_CONFIG_FILE
    if path is not None:
        file = Path(path)
        try:
            data = tomllib.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError as error:
            raise ConfigError([f"{file}: no such file"]) from error
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError([f"{file}: cannot be read ({error})"]) from error
        except tomllib.TOMLDecodeError as error:
            raise ConfigError([f"{file}: not valid TOML ({error})"]) from error
        base = file.resolve().parent
    problems = json_variables(environ)
    if problems:
        raise ConfigError(problems)
    try:
        settings = Settings(**data)
    except ValidationError as error:
        raise ConfigError(describe(error, os.environ)) from error
    except SettingsError as error:  # e.g. malformed JSON in a FENCEGATE_* variable
        cause = f" ({error.__cause__})" if error.__cause__ else ""
        raise ConfigError([f"environment: {error}{cause}"]) from error
    settings = _resolve_sqlite(settings, base)
    return settings.model_copy(update={"tls": settings.tls.resolved(base)})


def _resolve_sqlite(settings: Settings, base: Path) -> Settings:
    url = sa.make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return settings
    db_path = Path(url.database)
    if not db_path.is_absolute():
        db_path = base / db_path
        settings = settings.model_copy(
            update={
                "database_url": url.set(database=str(db_path)).render_as_string(hide_password=False)
            }
        )
    return settings


def sqlite_folder_problem(settings: Settings) -> str | None:
    """SQLite creates the database file, never its folder: a missing folder is named
    before anything opens the database (instead of "unable to open database file")."""
    url = sa.make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or not url.database:
        return None
    path = Path(url.database)
    if path.parent.is_dir():
        return None
    return (
        f"database_url: the folder of the SQLite database {path} does not exist "
        f"({path.parent}); create it or change database_url"
    )
