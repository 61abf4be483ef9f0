"""The gateway's tables. They share one MetaData with the lease service's, so alembic
sees every table and the lease check and the fence update can run in one transaction."""

from __future__ import annotations

import sqlalchemy as sa

from lease_core.schema import metadata

# PostgreSQL's fillfactor of the tables whose rows the write path updates (migration
# 0012; SQLite has none): the share of a page that inserts fill, the rest left for the
# updated versions of its rows, so an update stays heap-only (HOT: no index entry, and
# the old version pruned from the page without a vacuum). A settled record is several
# times its size in flight (it holds the answer): at 25 the settles stay HOT for
# answers up to about 550 bytes. A fence row is rewritten at each new generation.
RECORDS_FILLFACTOR = 25
FENCES_FILLFACTOR = 70

# Per job, the highest generation that the gateway admitted to write; for a job of a
# lease source, the holder admitted under it (a digest; NULL for the gateway's own
# leases, whose generations name one holder by construction). Migration 0010.
fences = sa.Table(
    "fences",
    metadata,
    sa.Column("job_id", sa.String(200), primary_key=True),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("holder", sa.String(64)),
    postgresql_with={"fillfactor": FENCES_FILLFACTOR},
)

# One row per (job, idempotency key), across generations. Writes without a key get a
# synthetic key (never replayed) so that in-flight tracking and ordering see them too.
#   state: in_flight -> completed | unknown ; unknown -> in_flight (retry policy or
#   operator "not applied") | completed (operator "applied")
# The settle of an answer (in_flight -> completed, the write path's second statement)
# changes no column that an index names, its key, columns or predicate, so PostgreSQL
# keeps it heap-only (HOT) when the page has room for the settled version
# (RECORDS_FILLFACTOR): no index entry and no dead row that only a vacuum removes.
# What the ordering needs of writes in flight is in writes_in_flight, and the unknown
# outcomes are found by unknown_at, NULL for every other record.
requests = sa.Table(
    "idempotency_records",
    metadata,
    sa.Column("job_id", sa.String(200), primary_key=True),
    sa.Column("key", sa.String(255), primary_key=True),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("attempt", sa.String(32), nullable=False),
    sa.Column("upstream", sa.String(63), nullable=False),
    sa.Column("method", sa.String(32), nullable=False),
    sa.Column("path", sa.Text, nullable=False),
    sa.Column("deadline", sa.Float, nullable=False),
    sa.Column("status", sa.Integer),
    sa.Column("headers", sa.JSON),
    sa.Column("body", sa.LargeBinary),
    sa.Column("note", sa.Text),
    # An unknown outcome the gateway may resolve itself (``unknown_outcome = "resolve"``):
    # the request as it was forwarded (its query and headers, without the configured
    # secrets; its body) and how many times the gateway has re-sent it.
    sa.Column("request_head", sa.JSON),
    sa.Column("request_body", sa.LargeBinary),
    sa.Column("resolve_attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
    sa.Column("created_at", sa.Float, nullable=False),
    # When the record last changed hands: admitted, taken over, held for resolution or
    # resolved. The settle of an answer leaves it (retention counts from the admission,
    # at most the write's deadline before its answer); settled_at says when it settled.
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("settled_at", sa.Float),
    # Since when the outcome is unknown; NULL while in flight or completed.
    sa.Column("unknown_at", sa.Float),
    # Retention: records by when they last changed hands (the purge keeps all but the
    # completed ones).
    sa.Index("ix_idempotency_records_updated_at", "updated_at"),
    # The operators' list and the resolver: unknown outcomes by age.
    sa.Index(
        "ix_idempotency_records_unknown",
        "unknown_at",
        postgresql_where=sa.text("unknown_at IS NOT NULL"),
        sqlite_where=sa.text("unknown_at IS NOT NULL"),
    ),
    postgresql_with={"fillfactor": RECORDS_FILLFACTOR},
)

# The writes in flight: one row for each record in flight (state in_flight), written by
# the statement that puts the record in flight and deleted by the one that takes it out,
# with the record's generation, attempt and deadline. The ordering barrier's "an older
# generation is still writing" (by the primary key's job_id), the purge's "a write is
# in flight" and the resolver's "in flight past its deadline" (a scan) read it. It holds
# as many live rows as writes are in flight, and the gateway vacuums it every 10 s on
# PostgreSQL (GatewayStore.vacuum_writing), so its dead ones stay few: no other index,
# since each would cost every admission an entry.
writing = sa.Table(
    "writes_in_flight",
    metadata,
    sa.Column("job_id", sa.String(200), primary_key=True),
    sa.Column("key", sa.String(255), primary_key=True),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("attempt", sa.String(32), nullable=False),
    sa.Column("deadline", sa.Float, nullable=False),
)

# One row: the oldest schema revision whose code may serve this database (migration
# 0009). A migration that older code cannot run beside sets it to itself;
# gateway.records.migrate.SchemaState reads it when the schema is ahead of the code.
schema_floor = sa.Table(
    "schema_floor",
    metadata,
    sa.Column("revision", sa.String(32), primary_key=True),
)

# Every request the gateway answered itself (rejections and replays).
audit = sa.Table(
    "audit_log",
    metadata,
    sa.Column(
        "id",
        sa.BigInteger().with_variant(sa.Integer, "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("reason", sa.String(40), nullable=False),
    sa.Column("status", sa.Integer, nullable=False),
    sa.Column("job_id", sa.String(200)),
    sa.Column("generation", sa.BigInteger),
    sa.Column("highest_generation", sa.BigInteger),
    sa.Column("owner", sa.String(200)),
    sa.Column("upstream", sa.String(63)),
    sa.Column("method", sa.String(32), nullable=False),
    sa.Column("path", sa.Text, nullable=False),
    sa.Column("idempotency_key", sa.String(255)),
    sa.Column("client", sa.String(64)),
    sa.Column("fingerprint", sa.String(64)),
    sa.Column("body", sa.LargeBinary),
    # Requests without a lease behind them are counted, not stored one by one: one row
    # per group (reason, status, upstream, method, path prefix, client) and time bucket,
    # its ``group_key``; ``count`` requests from ``at`` to ``last_at``. NULL otherwise.
    sa.Column("count", sa.Integer, nullable=False, server_default=sa.text("1")),
    sa.Column("last_at", sa.Float),
    sa.Column("group_key", sa.String(64)),
    # The replica that answered (``gateway.replica_name``; migration 0011). NULL for
    # entries written before it, or by a replica of older code. Part of a grouped row's
    # group: a grouped row counts one replica's requests.
    sa.Column("replica", sa.String(100)),
    sa.Index("ix_audit_log_at", "at"),
    sa.Index("ix_audit_log_job_id_at", "job_id", "at"),
    sa.Index("ux_audit_log_group_key", "group_key", unique=True),
    # The grouped rows by their last request: the upkeep finds those past retention
    # here, never by reading the table (migration 0007).
    sa.Index(
        "ix_audit_log_grouped_last_at",
        "last_at",
        postgresql_where=sa.text("group_key IS NOT NULL"),
        sqlite_where=sa.text("group_key IS NOT NULL"),
    ),
)

__all__ = ["audit", "fences", "metadata", "requests", "schema_floor", "writing"]
