"""The lease service's Prometheus metrics, every series prefixed ``fencegate_``. One
registry per process (per store in tests), exposed at ``/metrics`` on the control
listener; the gateway adds its own series to it (``gateway.observe.metrics``).

Under ``fencegate serve --workers N`` (N > 1) each worker's values live in files of
prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by the parent
before the worker starts), which ``/metrics`` sums over the workers
(``gateway.observe.metrics.scrape_registry``)."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client import values as client_values
from prometheus_client.metrics_core import HistogramMetricFamily, Metric

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# The phases of one write: some take microseconds (a pool's free connection, a slot), so
# the buckets start lower.
PHASE_BUCKETS = (0.0001, 0.00025, *LATENCY_BUCKETS)
# ``fencegate_db_seconds``'s phases: waiting for a connection of the pool, the statement
# (a single-statement operation's own commit included: it is sent without BEGIN/COMMIT),
# and the COMMIT of an operation of several statements.
DB_PHASES = ("pool", "statement", "commit")


def multiprocess() -> bool:
    """Whether prometheus_client keeps this process's values in the files of its
    multiprocess mode: it decided so when it was imported, from
    ``PROMETHEUS_MULTIPROC_DIR`` (which ``fencegate serve --workers`` sets for its
    workers). Its answer, not the variable read again here."""
    return bool(getattr(client_values.ValueClass, "_multiprocess", False))


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
        self.store_seconds = LoopHistogram(
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
        self.db_seconds = LoopHistogram(
            "fencegate_db_seconds",
            "The hot path's database work by catalogue operation and phase: pool (waiting "
            "for a connection), statement (sent and answered; a one-statement operation's "
            "commit included), commit (of an operation of several statements; on SQLite "
            "the group transaction's, operation 'group').",
            ["operation", "phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.purged = Counter(
            "fencegate_purged_rows", "Rows removed by retention.", ["what"], registry=r
        )


class Observes(Protocol):
    def observe(self, amount: float) -> None: ...


class PhaseTimers(dict[object, tuple[Observes, Observes, Observes]]):
    """``fencegate_db_seconds``'s series of each statement (or of a name: SQLite's
    ``group``): its operation's pool, statement and commit, bound on first use (a
    ``labels()`` call takes a lock and builds a key; the executors look these up on
    every hot call)."""

    def __init__(self, histogram: LoopHistogram, names: Mapping[object, str]) -> None:
        super().__init__()
        self._histogram = histogram
        self._names = names

    def __missing__(self, key: object) -> tuple[Observes, Observes, Observes]:
        name = self._names.get(key) or (key if isinstance(key, str) else "other")
        pool, statement, commit = (self._histogram.labels(name, phase) for phase in DB_PHASES)
        found = self[key] = (pool, statement, commit)
        return found


class LoopHistogram:
    """A histogram observed from the event loop's thread, in Prometheus's format but
    without ``prometheus_client``'s locks: an observation is a ``bisect`` and two
    additions (about a quarter of a ``Histogram.observe``, which takes a lock for each of
    its two counts; the write path observes about ten a write). The registry reads it
    as a collector. Another thread's observation (SQLite's database thread, rare) may
    race with the loop's and lose a count, never corrupt one. ``labels(*values)`` gives
    a labelled series' child, bound once by its callers; an unlabelled one observes
    itself.

    In prometheus_client's multiprocess mode (``multiprocess()``: a worker of ``serve
    --workers``) the series are a ``prometheus_client.Histogram``'s instead, whose
    values are in the files that ``/metrics`` sums over the workers: a collector of
    this process's memory would show one worker's share. Each observation then takes
    the library's lock and writes to its file."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...] | list[str] = (),
        *,
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self.buckets = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], LoopSeries] = {}
        self._shared: Histogram | None = None
        self._alone: Observes | None = None
        if multiprocess():
            self._shared = Histogram(
                name, documentation, self.labelnames, buckets=self.buckets, registry=registry
            )
            self._alone = None if self.labelnames else self._shared
            return
        self._alone = None if self.labelnames else self.labels()
        registry.register(self)

    def labels(self, *values: str) -> Observes:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: labels {self.labelnames}, given {values}")
        if self._shared is not None:
            series: Observes = self._shared.labels(*values)
            return series
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = LoopSeries(self.buckets)
        return child

    def observe(self, amount: float) -> None:
        assert self._alone is not None, f"{self.name} has labels"
        self._alone.observe(amount)

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        bounds = [repr(b) for b in self.buckets] + ["+Inf"]  # as prometheus_client writes them
        for values, child in list(self._children.items()):
            counts, total, running = list(child.counts), child.sum, 0.0
            cumulative = []
            for bound, count in zip(bounds, counts, strict=True):
                running += count
                cumulative.append((bound, running))
            family.add_metric(list(values), cumulative, total)
            family.add_sample(
                f"{self.name}_created",
                dict(zip(self.labelnames, values, strict=True)),
                child.created,
            )
        yield family


class LoopSeries:
    """One series of a ``LoopHistogram``: a count per bucket (the last one past every
    bound) and their sum."""

    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.sum += amount
