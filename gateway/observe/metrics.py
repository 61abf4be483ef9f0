"""The gateway's Prometheus series, on the lease store's registry (one ``/metrics``)."""

from __future__ import annotations

import weakref
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lease_core.metrics import LATENCY_BUCKETS


class GatewayMetrics:
    """The series; ``of(registry)`` gives every gateway on one registry the same ones (a
    series can be registered once)."""

    _by_registry: ClassVar[weakref.WeakKeyDictionary[CollectorRegistry, GatewayMetrics]] = (
        weakref.WeakKeyDictionary()
    )

    @classmethod
    def of(cls, registry: CollectorRegistry) -> GatewayMetrics:
        found = cls._by_registry.get(registry)
        if found is None:
            found = cls._by_registry[registry] = cls(registry)
        return found

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.decisions = Counter(
            "fencegate_gateway_decisions",
            "Gateway decisions by upstream and reason (reason 'forwarded' for forwards).",
            ["upstream", "reason"],
            registry=r,
        )
        self.source_decisions = Counter(
            "fencegate_gateway_source_decisions",
            "Decisions on fenced writes by lease source ('fencegate' for the gateway's own "
            "leases, else the name of a [[lease_sources]] entry) and reason.",
            ["source", "reason"],
            registry=r,
        )
        self.forward_seconds = Histogram(
            "fencegate_gateway_forward_seconds",
            "Time from forwarding a request to the end of the upstream's answer.",
            ["upstream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decision_seconds = Histogram(
            "fencegate_gateway_decision_seconds",
            "Time spent deciding a fenced write before forwarding it (database included).",
            ["upstream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.resolutions = Counter(
            "fencegate_gateway_resolutions",
            'Re-sends of unknown outcomes by the gateway (unknown_outcome = "resolve"), by '
            "upstream and outcome: resolved (the answer stored), unknown (to be re-sent "
            "again), mismatch (the upstream says the key was used with other parameters) "
            "and superseded (a newer generation wrote since); the last two go to an operator.",
            ["upstream", "outcome"],
            registry=r,
        )
        self.in_flight = Gauge(
            "fencegate_gateway_in_flight_writes",
            "Fenced writes being forwarded right now.",
            ["upstream"],
            registry=r,
        )
