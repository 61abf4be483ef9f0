"""The idempotency records' indexes become partial, one per state they serve: writes in
flight by (job_id, generation), completed and unknown ones by age.

The full index on (job_id, state, generation) could serve a lookup by (job_id, key) on
its first column alone; with statistics that said job_id was unique (or none, or stale
ones) PostgreSQL planned the admission's record lookup and the settle on it and read
every record the job ever had. A partial index cannot serve a query that does not say
state = 'in_flight', so those lookups go to the primary key whatever the statistics.
The (state, updated_at) index goes for the same reason (with statistics gathered while
nothing was in flight it looked like the cheapest way to find writes in flight) and is
replaced by two partial ones, for the retention purge and the operators' list of unknown
outcomes.
On PostgreSQL both indexes are built and dropped CONCURRENTLY: writes go on meanwhile.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 14:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

IN_FLIGHT = sa.text("state = 'in_flight'")
COMPLETED = sa.text("state = 'completed'")
UNKNOWN = sa.text("state = 'unknown'")
TABLE = "idempotency_records"


def _concurrently() -> dict[str, bool]:
    return (
        {"postgresql_concurrently": True} if op.get_context().dialect.name == "postgresql" else {}
    )


def upgrade() -> None:
    with op.get_context().autocommit_block():
        for name, columns, where in (
            ("ix_idempotency_records_writing", ["job_id", "generation"], IN_FLIGHT),
            ("ix_idempotency_records_completed", ["updated_at"], COMPLETED),
            ("ix_idempotency_records_unknown", ["updated_at"], UNKNOWN),
        ):
            op.create_index(
                name,
                TABLE,
                columns,
                postgresql_where=where,
                sqlite_where=where,
                **_concurrently(),
            )
        for name in ("ix_idempotency_records_in_flight", "ix_idempotency_records_state_updated"):
            op.drop_index(name, table_name=TABLE, **_concurrently())


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_idempotency_records_in_flight",
            TABLE,
            ["job_id", "state", "generation"],
            **_concurrently(),
        )
        op.create_index(
            "ix_idempotency_records_state_updated",
            TABLE,
            ["state", "updated_at"],
            **_concurrently(),
        )
        for name in (
            "ix_idempotency_records_writing",
            "ix_idempotency_records_completed",
            "ix_idempotency_records_unknown",
        ):
            op.drop_index(name, table_name=TABLE, **_concurrently())
