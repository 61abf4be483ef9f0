"""The gateway's tables and the database's shape: ``store`` (each idempotency key's
record, through the SQL catalogue of ``lease_core``), ``audit`` (every refusal),
``dashboard_queries``, ``schema`` (the tables, for alembic), ``migrate`` and
``replication`` (whether a replicated PostgreSQL keeps a fence across a failover)."""
