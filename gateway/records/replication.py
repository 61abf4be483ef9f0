"""Whether a failover of the PostgreSQL that ``database_url`` names can lose a commit, and
so move a fence back (docs/operations.md, "Replicated PostgreSQL and failover").

A fence is only as durable as the commit that raised it. With asynchronous standbys, the
primary acknowledges a commit before any standby has it; if the primary is lost then and
a standby is promoted, the commit is gone: the job's newest generation, its grant and the
fence it raised with them. The worker of the generation before wakes up, its lease is
current again on the new primary, and its stale write is admitted. ``serve`` refuses to
start on such a database, and ``check-config`` says why, unless the operator accepts it
(``database.allow_async_failover = true``).

Asked of the primary the gateway connects to (``pg_stat_replication``: the standbys
streaming from it now); a standby cascading from another standby is not seen, nor one
that is disconnected at the moment.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

# How long serve checks again before refusing (a standby rejoining after a failover streams
# asynchronously until the failover manager lists it as synchronous: about one of
# Patroni's loops).
SETTLE_SECONDS = 15.0
# synchronous_commit values that acknowledge a commit before a standby has it.
LOCAL_COMMITS = ("off", "local")
# sync_state values of a standby that is not waited for (potential: it would be, if the
# synchronous one went away).
NOT_WAITED_FOR = ("async", "potential")

_SERVER = sa.text(
    "SELECT coalesce(host(inet_server_addr()), 'local socket') AS host,"
    " inet_server_port() AS port,"
    " pg_is_in_recovery() AS in_recovery,"
    " current_setting('synchronous_commit') AS synchronous_commit"
)
_STANDBYS = sa.text(
    "SELECT application_name, sync_state FROM pg_stat_replication ORDER BY application_name"
)


@dataclass(frozen=True)
class Standby:
    name: str
    sync_state: str | None  # None: this role may not read it (grant pg_monitor)


@dataclass(frozen=True)
class Replication:
    """The primary as the gateway's connection sees it, and its standbys."""

    server: str  # host:port of the server that answered
    in_recovery: bool
    synchronous_commit: str
    standbys: tuple[Standby, ...]

    @property
    def synchronous(self) -> list[str]:
        return [s.name for s in self.standbys if s.sync_state in ("sync", "quorum")]

    def problems(self) -> list[str]:
        """Why a failover could lose an acknowledged commit; empty when it cannot (or
        when nothing replicates from this server)."""
        if not self.standbys:
            return []
        found = []
        if self.synchronous_commit in LOCAL_COMMITS:
            found.append(
                f"synchronous_commit is {self.synchronous_commit}: a commit is acknowledged "
                "before any standby has it"
            )
        unread = [s.name for s in self.standbys if s.sync_state is None]
        if unread:
            found.append(
                f"how {_standbys(unread)} replicate(s) cannot be read by this role "
                "(grant it pg_monitor)"
            )
        for state in NOT_WAITED_FOR:
            names = [s.name for s in self.standbys if s.sync_state == state]
            if names:
                verb = "replicates" if len(names) == 1 else "replicate"
                found.append(
                    f"{_standbys(names)} {verb} asynchronously (sync_state {state}): a "
                    "failover to one loses the commits it has not received"
                )
        return found

    def refusal(self, allowed: bool) -> str | None:
        """Why ``serve`` and ``check-config`` refuse this database, or None when they
        may go on (nothing can be lost, or ``allowed``: database.allow_async_failover)."""
        found = self.problems()
        return _refusal(found) if found and not allowed else None

    def summary(self) -> str:
        if not self.standbys:
            return f"primary {self.server}, no standby streaming from it"
        return (
            f"primary {self.server}, {len(self.synchronous)} of {len(self.standbys)} "
            f"standby(s) synchronous, synchronous_commit {self.synchronous_commit}"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "primary": self.server,
            "synchronous_commit": self.synchronous_commit,
            "standbys": {s.name: s.sync_state for s in self.standbys},
        }


def _standbys(names: list[str]) -> str:
    return ("standby " if len(names) == 1 else "standbys ") + ", ".join(names)


async def replication(engine: AsyncEngine) -> Replication:
    """Read it from the server ``engine`` connects to (PostgreSQL only)."""
    async with engine.connect() as conn:
        server = (await conn.execute(_SERVER)).one()
        standbys = tuple(Standby(r[0], r[1]) for r in (await conn.execute(_STANDBYS)).all())
    return Replication(
        server=f"{server.host}:{server.port}",
        in_recovery=bool(server.in_recovery),
        synchronous_commit=str(server.synchronous_commit),
        standbys=standbys,
    )


def _refusal(found: list[str]) -> str:
    reasons = "; ".join(found)
    return (
        f"the database can lose an acknowledged commit at a failover ({reasons}). A lost "
        "commit can move a job's fence back and let a stale worker's write through. Make "
        "every standby synchronous (Patroni: synchronous_mode, synchronous_node_count; "
        "PostgreSQL: synchronous_standby_names), or accept the risk with "
        "database.allow_async_failover = true (docs/operations.md, "
        '"Replicated PostgreSQL and failover")'
    )
