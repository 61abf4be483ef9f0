"""Gateway: fences, idempotency records, the audit log.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 13:07:10.350954
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("reason", sa.String(length=40), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=200), nullable=True),
        sa.Column("generation", sa.BigInteger(), nullable=True),
        sa.Column("highest_generation", sa.BigInteger(), nullable=True),
        sa.Column("owner", sa.String(length=200), nullable=True),
        sa.Column("upstream", sa.String(length=63), nullable=True),
        sa.Column("method", sa.String(length=32), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("client", sa.String(length=64), nullable=True),
        sa.Column("fingerprint", sa.String(length=64), nullable=True),
        sa.Column("body", sa.LargeBinary(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.create_index("ix_audit_log_at", ["at"], unique=False)
        batch_op.create_index("ix_audit_log_job_id_at", ["job_id", "at"], unique=False)

    op.create_table(
        "fences",
        sa.Column("job_id", sa.String(length=200), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_fences")),
    )
    op.create_table(
        "idempotency_records",
        sa.Column("job_id", sa.String(length=200), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.String(length=32), nullable=False),
        sa.Column("upstream", sa.String(length=63), nullable=False),
        sa.Column("method", sa.String(length=32), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("deadline", sa.Float(), nullable=False),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("headers", sa.JSON(), nullable=True),
        sa.Column("body", sa.LargeBinary(), nullable=True),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "key", name=op.f("pk_idempotency_records")),
    )
    with op.batch_alter_table("idempotency_records", schema=None) as batch_op:
        batch_op.create_index(
            "ix_idempotency_records_in_flight", ["job_id", "state", "generation"], unique=False
        )
        batch_op.create_index(
            "ix_idempotency_records_state_updated", ["state", "updated_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("idempotency_records", schema=None) as batch_op:
        batch_op.drop_index("ix_idempotency_records_state_updated")
        batch_op.drop_index("ix_idempotency_records_in_flight")

    op.drop_table("idempotency_records")
    op.drop_table("fences")
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.drop_index("ix_audit_log_job_id_at")
        batch_op.drop_index("ix_audit_log_at")

    op.drop_table("audit_log")
