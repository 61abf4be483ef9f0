"""All tables, for alembic: the lease service's and the gateway's share one MetaData."""

from lease_core.schema import metadata

__all__ = ["metadata"]
