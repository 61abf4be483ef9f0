"""The replica that answered, in the audit: ``audit_log.replica`` (issue 46), the
answering replica's ``gateway.replica_name`` (default its hostname).

Only adds a nullable column: code of ``0008`` to ``0010`` runs beside it (the floor stays
at ``0008``); its entries, and every entry written before this revision, have no replica
(NULL). No index: the audit's filters read it as they read the upstream, newest first
within the page asked for, and every audit entry would pay for one.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06 09:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("audit_log", sa.Column("replica", sa.String(100), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("audit_log") as batch:
        batch.drop_column("replica")
