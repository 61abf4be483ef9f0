"""The settle of an answer becomes heap-only on PostgreSQL (HOT): the writes in flight
get their own table, ``writes_in_flight``, and no index of ``idempotency_records`` names
a column the settle changes.

Before, every index of the records named ``state`` in its predicate and two of them
indexed ``updated_at``; the settle changes both, so each one wrote a new entry into every
index and left a dead row that only a vacuum removes (0.0 % HOT updates, 700,000 dead
rows in a four-minute soak with autovacuum off). Now the ordering barrier, the purge's
"a write is in flight" and the resolver's overdue writes read ``writes_in_flight`` (a
row per write in flight, deleted when it settles), unknown outcomes are indexed by
``unknown_at`` (NULL for every other record), and retention by ``updated_at``, which the
settle leaves; ``settled_at`` keeps when the answer came. The records' fillfactor leaves
room on each page for the settled versions of the rows inserted there.

The writes in flight are copied into the new table, so no gateway may write meanwhile:
stop every replica of the old version before this migration (docs/operations.md).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05 18:20:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "idempotency_records"
IN_FLIGHT = sa.text("state = 'in_flight'")
COMPLETED = sa.text("state = 'completed'")
UNKNOWN = sa.text("state = 'unknown'")
UNKNOWN_AT = sa.text("unknown_at IS NOT NULL")
# Of each page, the share that inserts fill: the rest is for the settled versions of the
# rows inserted there (a stored answer makes a row several times its size in flight).
FILLFACTOR = 50


def upgrade() -> None:
    op.create_table(
        "writes_in_flight",
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.String(32), nullable=False),
        sa.Column("deadline", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "key"),
    )
    with op.batch_alter_table(TABLE) as batch:
        batch.add_column(sa.Column("settled_at", sa.Float(), nullable=True))
        batch.add_column(sa.Column("unknown_at", sa.Float(), nullable=True))
    op.execute(
        "INSERT INTO writes_in_flight (job_id, key, generation, attempt, deadline) "
        f"SELECT job_id, key, generation, attempt, deadline FROM {TABLE} "
        "WHERE state = 'in_flight'"
    )
    op.execute(f"UPDATE {TABLE} SET unknown_at = updated_at WHERE state = 'unknown'")
    op.execute(f"UPDATE {TABLE} SET settled_at = updated_at WHERE state = 'completed'")
    for name in (
        "ix_idempotency_records_writing",
        "ix_idempotency_records_completed",
        "ix_idempotency_records_unknown",
    ):
        op.drop_index(name, table_name=TABLE)
    op.create_index("ix_idempotency_records_updated_at", TABLE, ["updated_at"])
    op.create_index(
        "ix_idempotency_records_unknown",
        TABLE,
        ["unknown_at"],
        postgresql_where=UNKNOWN_AT,
        sqlite_where=UNKNOWN_AT,
    )
    if op.get_context().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE {TABLE} SET (fillfactor = {FILLFACTOR})")


def downgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE {TABLE} RESET (fillfactor)")
    op.drop_index("ix_idempotency_records_unknown", table_name=TABLE)
    op.drop_index("ix_idempotency_records_updated_at", table_name=TABLE)
    op.execute(f"UPDATE {TABLE} SET updated_at = settled_at WHERE settled_at IS NOT NULL")
    for name, columns, where in (
        ("ix_idempotency_records_writing", ["job_id", "generation"], IN_FLIGHT),
        ("ix_idempotency_records_completed", ["updated_at"], COMPLETED),
        ("ix_idempotency_records_unknown", ["updated_at"], UNKNOWN),
    ):
        op.create_index(name, TABLE, columns, postgresql_where=where, sqlite_where=where)
    with op.batch_alter_table(TABLE) as batch:
        batch.drop_column("unknown_at")
        batch.drop_column("settled_at")
    op.drop_table("writes_in_flight")
