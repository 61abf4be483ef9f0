"""Idempotency records keep the request of an unknown outcome that the gateway may
resolve itself (``unknown_outcome = "resolve"``): its forwarded headers and body, and how
many times it was re-sent. Nullable columns (and a constant default): no table rewrite.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 15:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "idempotency_records"


def upgrade() -> None:
    with op.batch_alter_table(TABLE) as batch:
        batch.add_column(sa.Column("request_head", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("request_body", sa.LargeBinary(), nullable=True))
        batch.add_column(
            sa.Column("resolve_attempts", sa.Integer(), nullable=False, server_default=sa.text("0"))
        )


def downgrade() -> None:
    with op.batch_alter_table(TABLE) as batch:
        batch.drop_column("resolve_attempts")
        batch.drop_column("request_body")
        batch.drop_column("request_head")
