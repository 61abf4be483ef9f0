"""The schema says which code may serve it: ``schema_floor`` holds the oldest revision
whose code runs correctly on this schema.

A replica of an older version keeps serving a schema migrated ahead of it, as long as the
migrations since only add (a rolling upgrade). ``0008`` was the first that did not: the
writes in flight moved into their own table, and a replica of before ``0008`` goes on
writing records in flight that the ordering no longer sees. The code could not tell,
because a revision it does not know was taken as newer, hence compatible. From this
revision on, a migration that older code cannot run beside sets the floor to itself, and
the code checks it: at start, in ``/readyz``, and every few seconds while it serves (a
replica below the floor refuses every write of the database, ``store-unavailable``).

Only code from this revision on reads the floor; replicas of before ``0008`` are already
below it and must be stopped before ``0008`` (docs/operations.md). Adding the table is
safe beside a running ``0008``: its code never reads it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05 21:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The oldest revision whose code may serve the schema as this migration leaves it.
FLOOR = "0008"


def upgrade() -> None:
    floor = op.create_table(
        "schema_floor",
        sa.Column("revision", sa.String(32), primary_key=True),
    )
    op.bulk_insert(floor, [{"revision": FLOOR}])


def downgrade() -> None:
    op.drop_table("schema_floor")
