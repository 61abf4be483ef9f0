"""Audit: requests without a lease are counted in grouped rows (count, last_at, group_key).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 11:05:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("count", sa.Integer(), server_default=sa.text("1"), nullable=False)
        )
        batch_op.add_column(sa.Column("last_at", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("group_key", sa.String(length=64), nullable=True))
        batch_op.create_index("ux_audit_log_group_key", ["group_key"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.drop_index("ux_audit_log_group_key")
        batch_op.drop_column("group_key")
        batch_op.drop_column("last_at")
        batch_op.drop_column("count")
