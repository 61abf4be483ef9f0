"""The gateway's Prometheus series, on the lease store's registry (one ``/metrics``).

Under ``fencegate serve --workers N`` the values are in prometheus_client's multiprocess
files (``lease_core.metrics``) and ``/metrics`` reads them all (``scrape_registry``):
counters and histograms are summed over the workers, dead ones included, so a total
never goes back when a worker is replaced; each gauge says how it is combined
(``multiprocess_mode``, ignored by a single process)."""

from __future__ import annotations

import time
import weakref
from typing import ClassVar

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.fencing.decision import Act
from gateway.fencing.machine import RequestMachine
from lease_core.metrics import LATENCY_BUCKETS, PHASE_BUCKETS, LoopHistogram, Observes

# ``fencegate_write_phase_seconds``'s phases beside the driver's steps (``Act``): the
# exchange with the upstream (from the send to the answer's end streamed back), the
# settle of the key's record (behind the answer or before it) and an audit entry's write.
FORWARD, SETTLE, AUDIT = "forward", "settle", "audit"
PHASES = (*(act.value for act in Act), FORWARD, SETTLE, AUDIT)
# A fenced write's steps and their seconds, kept for its ``Server-Timing`` header
# (``gateway.server_timing``).
STEPS = web.RequestKey("steps", list[tuple[str, float]])


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
        # The write path's histograms take no lock (``LoopHistogram``).
        self.forward_seconds = LoopHistogram(
            "fencegate_gateway_forward_seconds",
            "Time from forwarding a request to the end of the upstream's answer.",
            ["upstream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decision_seconds = LoopHistogram(
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
        self.write_phase_seconds = LoopHistogram(
            "fencegate_write_phase_seconds",
            "The phases of fenced writes inside the gateway: each step of the request's "
            "machine (check-lease, take-slot, read-body, admit, wait-first, wait-older, "
            "read-claim, release), forward (the send to the answer's end), settle (the "
            "key's record stored) and audit (an audit entry written).",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        # Bound once: ``labels()`` takes a lock and builds a key on every call.
        self.phase: dict[str, Observes] = {
            phase: self.write_phase_seconds.labels(phase) for phase in PHASES
        }
        self.in_flight = in_flight_gauge(r)
        self.waiting = waiting_gauge(r)


def in_flight_gauge(registry: CollectorRegistry) -> Gauge:
    """Writes being forwarded. Across workers, the sum of the live ones' (a dead
    worker's writes are no longer in flight: its parent drops its file,
    ``mark_process_dead``)."""
    return Gauge(
        "fencegate_gateway_in_flight_writes",
        "Fenced writes being forwarded right now.",
        ["upstream"],
        registry=registry,
        multiprocess_mode="livesum",
    )


def waiting_gauge(registry: CollectorRegistry) -> Gauge:
    """Requests in a bounded wait, holding no slot and no body: for their key's first
    attempt (``Prefer: wait``) or for older generations' writes to their job."""
    return Gauge(
        "fencegate_gateway_waiting_requests",
        "Requests waiting right now: for their key's first attempt (first) or for older "
        "generations' writes (older).",
        ["wait"],
        registry=registry,
        multiprocess_mode="livesum",  # as ``in_flight``: the live workers' waits, summed
    )


def scrape_registry(own: CollectorRegistry, multiprocess_dir: str | None) -> CollectorRegistry:
    """What ``/metrics`` reads: this process's registry, or, for a worker of ``serve
    --workers`` (``multiprocess_dir``, its ``PROMETHEUS_MULTIPROC_DIR``), every worker's
    files through prometheus_client's ``MultiProcessCollector``, so a scrape that any
    worker answers shows the whole server's counts."""
    if multiprocess_dir is None:
        return own
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=multiprocess_dir)  # type: ignore[no-untyped-call]
    return registry


class StepTimer:
    """The driver's timing of a request's steps (``Driver.handle``): a fenced write's
    step goes to its phase's histogram and, with ``gateway.server_timing``, to the
    request's own list, which its ``Server-Timing`` header reads (``forwarding``)."""

    __slots__ = ("_by_act", "_per_request")

    def __init__(self, metrics: GatewayMetrics, *, per_request: bool) -> None:
        self._by_act: dict[Act, Observes] = {act: metrics.phase[act.value] for act in Act}
        self._per_request = per_request

    def took(self, act: Act, began: float, request: web.Request, machine: RequestMachine) -> None:
        if not machine.facts.fenced:
            return
        seconds = time.perf_counter() - began
        self._by_act[act].observe(seconds)
        if self._per_request:
            steps = request.get(STEPS)
            if steps is None:
                steps = request[STEPS] = []
            steps.append((act.value, seconds))
