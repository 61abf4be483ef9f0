"""The lease service's Prometheus metrics, every series prefixed ``fencegate_``. One
registry per process (per store in tests), exposed at ``/metrics`` on the control
listener; the gateway adds its own series to it (``gateway.observe.metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.grants = Counter("fencegate_lease_grants", "Leases granted.", ["kind"], registry=r)
        self.renewals = Counter("fencegate_lease_renewals", "Leases renewed.", registry=r)
        self.losses = Counter(
            "fencegate_lease_losses",
            "Renew / complete / fail / release refused because the lease was no longer current.",
            ["reason"],
            registry=r,
        )
        self.store_seconds = Histogram(
            "fencegate_store_transaction_seconds",
            "Database transaction latency.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.store_errors = Counter(
            "fencegate_store_unavailable",
            "Transactions that failed because the database was unreachable.",
            registry=r,
        )
        self.db_connections = Counter(
            "fencegate_db_connections",
            "Connections the hot path's pool opened to PostgreSQL: beyond the pool's size, "
            "each one replaces a connection lost to a restart or a failover.",
            registry=r,
        )
        self.db_primary_changes = Counter(
            "fencegate_db_primary_changes",
            "New connections that reached another server than the one before: a failover "
            "or switchover seen by this replica.",
            registry=r,
        )
        self.purged = Counter(
            "fencegate_purged_rows", "Rows removed by retention.", ["what"], registry=r
        )
