"""The database: ``database_url`` (its drivers, several hosts, the writable session they
need) and ``[database]``."""

from __future__ import annotations

import importlib
import re

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict

from lease_core.direct import IN_MEMORY, is_in_memory


class DatabaseSettings(BaseModel):
    """How the database is used beyond its URL (``database_url``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # serve refuses a PostgreSQL primary whose standbys replicate asynchronously (or that
    # acknowledges commits locally): a failover could lose the commit that raised a fence
    # (gateway/records/replication.py). True starts anyway, logged at every start and on /readyz.
    allow_async_failover: bool = False


# target_session_attrs that connect only to the server that takes writes.
WRITABLE_SESSIONS = ("read-write", "primary")
_HAS_PORT = re.compile(r":\d+$")
_SEVERAL_HOSTS = re.compile(r"^(?P<head>[a-z0-9+]+://(?:[^@/]*@)?)(?P<hosts>[^/?#]*,[^/?#]*)")


def several_hosts(url: str) -> str:
    """libpq's spelling of several hosts, ``postgresql+asyncpg://user@h1:5432,h2:5432/db``,
    in SQLAlchemy's (``.../db?host=h1:5432&host=h2:5432``), which asyncpg connects with:
    the first that accepts (and, with ``target_session_attrs=read-write``, takes writes)."""
    match = _SEVERAL_HOSTS.match(url)
    if match is None:
        return url
    hosts = [h.strip() for h in match["hosts"].split(",")]
    if not all(hosts):
        raise ValueError("an empty host in the list of hosts")
    # asyncpg needs every host's port once there are several; libpq's default is 5432.
    hosts = [h if _HAS_PORT.search(h) else f"{h}:5432" for h in hosts]
    rest = url[match.end() :]
    path, _, query = rest.partition("?")
    pairs = "&".join(f"host={h}" for h in hosts)
    return f"{match['head']}{path}?{pairs}{'&' + query if query else ''}"


def check_database_url(value: str) -> str:
    """``database_url`` as the gateway uses it (several hosts in SQLAlchemy's spelling),
    or ValueError: a supported driver, a file for SQLite, a port for every host and a
    writable session when there are several, an installed driver."""
    value = several_hosts(value)
    try:
        url = sa.make_url(value)
    except sa.exc.ArgumentError as error:
        raise ValueError("not a database URL") from error
    if url.drivername not in ("sqlite+aiosqlite", "postgresql+asyncpg"):
        raise ValueError("use sqlite+aiosqlite:///path.db or postgresql+asyncpg://user@host/db")
    if url.get_backend_name() == "sqlite" and is_in_memory(url):
        raise ValueError(f"{IN_MEMORY} (sqlite+aiosqlite:///path.db)")
    hosts = url.query.get("host", ())
    attrs = url.query.get("target_session_attrs")
    if not isinstance(hosts, str) and len(hosts) > 1:
        portless = [h for h in hosts if not _HAS_PORT.search(h)]
        if portless:
            raise ValueError(f"give every host its port: {', '.join(portless)} has none")
    if not isinstance(hosts, str) and len(hosts) > 1 and attrs not in WRITABLE_SESSIONS:
        raise ValueError(
            "several hosts need target_session_attrs=read-write (or primary): without it "
            "the gateway may connect to a standby, which takes no writes"
        )
    if url.drivername == "postgresql+asyncpg" and not _driver_installed("asyncpg"):
        raise ValueError(
            "the PostgreSQL driver asyncpg is not installed: pip install 'fencegate[postgres]'"
        )
    return value


def _driver_installed(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
