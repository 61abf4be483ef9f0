"""The audit's grouped rows (requests without a lease) by when they were last counted
(``last_at``): the upkeep finds the ones past their retention through this index,
whatever the database's statistics say. Every grouped row is written with its
``last_at`` (the statement has set both since 0003 added them).

Without it PostgreSQL, with no statistics on the audit table (autovacuum off, never
analyzed), read the whole table once a minute to find them: ``group_key IS NOT NULL`` is
nearly every row to a planner that knows nothing, so no index of the table was worth it.
The index holds the grouped rows only (a partial index), a small part of the audit.
On PostgreSQL it is built and dropped CONCURRENTLY: writes go on meanwhile.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 20:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

GROUPED = sa.text("group_key IS NOT NULL")


def _concurrently() -> dict[str, bool]:
    return (
        {"postgresql_concurrently": True} if op.get_context().dialect.name == "postgresql" else {}
    )


def upgrade() -> None:
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_audit_log_grouped_last_at",
            "audit_log",
            ["last_at"],
            postgresql_where=GROUPED,
            sqlite_where=GROUPED,
            **_concurrently(),
        )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index("ix_audit_log_grouped_last_at", table_name="audit_log", **_concurrently())
