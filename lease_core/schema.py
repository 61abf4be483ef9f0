"""Tables of the lease service. Times are seconds since the epoch (double precision),
so that one expression serves PostgreSQL's clock and an injected one alike."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

Json = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

jobs = sa.Table(
    "jobs",
    metadata,
    sa.Column("job_id", sa.String(200), primary_key=True),
    sa.Column("queue", sa.String(200), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("owner", sa.String(200)),
    sa.Column("lease_token_hash", sa.String(64)),
    sa.Column("lease_ttl_seconds", sa.Float),
    sa.Column("lease_expires_at", sa.Float),
    # When the job can next be claimed: the retry time of a pending job, the lease expiry
    # of a leased one, NULL once finished. One indexed range serves "pending or expired".
    sa.Column("claimable_at", sa.Float),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("payload", Json),
    sa.Column("result", Json),
    sa.Column("error", sa.Text),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Index(
        "ix_jobs_claim",
        "queue",
        "claimable_at",
        postgresql_where=sa.text("claimable_at IS NOT NULL"),
        sqlite_where=sa.text("claimable_at IS NOT NULL"),
    ),
    sa.Index("ix_jobs_lease_token_hash", "lease_token_hash", unique=True),
    sa.Index("ix_jobs_queue_state", "queue", "state", "created_at"),
    # The leases being worked on, by expiry: the upkeep's "expired on the last attempt"
    # reads these, never every job ever enqueued.
    sa.Index(
        "ix_jobs_leased",
        "lease_expires_at",
        postgresql_where=sa.text("state = 'leased'"),
        sqlite_where=sa.text("state = 'leased'"),
    ),
)

# Every grant ever made, by token hash: an earlier generation's token stays recognisable
# (refused as stale, not as unknown) for as long as this row is kept.
leases = sa.Table(
    "leases",
    metadata,
    sa.Column("token_hash", sa.String(64), primary_key=True),
    sa.Column("job_id", sa.String(200), nullable=False),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("owner", sa.String(200), nullable=False),
    sa.Column("granted_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.UniqueConstraint("job_id", "generation"),
    # The upkeep forgets grants by their expiry (written once, at the grant).
    sa.Index("ix_leases_expires_at", "expires_at"),
)

# The last generation of each purged job, so a job created again under the same id
# continues above it: generations are never reused.
job_tombstones = sa.Table(
    "job_tombstones",
    metadata,
    sa.Column("job_id", sa.String(200), primary_key=True),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("purged_at", sa.Float, nullable=False),
)
