"""The upkeep (every purge interval) finds its rows through indexes: expired leases by
their expiry (a partial index of leased jobs), old grants by their expiry.

Without them ``fail_exhausted`` read every job ever enqueued and ``purge_grants`` every
grant ever made, once a minute; on SQLite that ran under the one write lock and held up
every write for as long as the tables were large. Both indexes are small beside their
tables: leased jobs are the ones being worked on now, and a grant's expiry is written
once, when it is granted (a renewal extends the job's lease, not its grant row).
On PostgreSQL both indexes are built and dropped CONCURRENTLY: writes go on meanwhile.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04 12:40:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LEASED = sa.text("state = 'leased'")


def _concurrently() -> dict[str, bool]:
    return (
        {"postgresql_concurrently": True} if op.get_context().dialect.name == "postgresql" else {}
    )


def upgrade() -> None:
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_jobs_leased",
            "jobs",
            ["lease_expires_at"],
            postgresql_where=LEASED,
            sqlite_where=LEASED,
            **_concurrently(),
        )
        op.create_index("ix_leases_expires_at", "leases", ["expires_at"], **_concurrently())


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index("ix_leases_expires_at", table_name="leases", **_concurrently())
        op.drop_index("ix_jobs_leased", table_name="jobs", **_concurrently())
