"""Lease core: jobs, the grant history (leases) and tombstones of purged jobs.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Json = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("queue", sa.String(200), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("owner", sa.String(200), nullable=True),
        sa.Column("lease_token_hash", sa.String(64), nullable=True),
        sa.Column("lease_ttl_seconds", sa.Float(), nullable=True),
        sa.Column("lease_expires_at", sa.Float(), nullable=True),
        sa.Column("claimable_at", sa.Float(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("payload", Json, nullable=True),
        sa.Column("result", Json, nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_jobs")),
    )
    op.create_index(
        "ix_jobs_claim",
        "jobs",
        ["queue", "claimable_at"],
        postgresql_where=sa.text("claimable_at IS NOT NULL"),
        sqlite_where=sa.text("claimable_at IS NOT NULL"),
    )
    op.create_index("ix_jobs_lease_token_hash", "jobs", ["lease_token_hash"], unique=True)
    op.create_index("ix_jobs_queue_state", "jobs", ["queue", "state", "created_at"])
    op.create_table(
        "leases",
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("granted_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("token_hash", name=op.f("pk_leases")),
        sa.UniqueConstraint("job_id", "generation", name=op.f("uq_leases_job_id_generation")),
    )
    op.create_table(
        "job_tombstones",
        sa.Column("job_id", sa.String(200), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("purged_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_job_tombstones")),
    )


def downgrade() -> None:
    op.drop_table("job_tombstones")
    op.drop_table("leases")
    op.drop_table("jobs")
