"""OpenTelemetry spans (the optional extra ``otel``): one per gateway decision and one
per lease operation, with the W3C ``traceparent`` carried to the upstream.

Off unless ``[tracing] enabled`` (or a test calls ``enable``): then no middleware is
installed and the two hooks on the request path (``forwarding`` in
``intake.forward_headers``, ``answered`` in ``answers``) are one test of a module
global each. OpenTelemetry is imported only when tracing is switched on.

The spans:

- ``fencegate.gateway <METHOD>`` (kind SERVER, a child of the worker's
  ``traceparent``): ``fencegate.upstream``, ``fencegate.outcome`` (``forwarded``,
  ``replayed`` or ``refused``), ``fencegate.reason`` (the audit's reason, ``forwarded``
  for a forward), ``fencegate.job_id``, ``fencegate.generation``,
  ``fencegate.lease_source`` (for a token of ``[[lease_sources]]``),
  ``http.request.method``, ``http.response.status_code`` and, for a forward,
  ``fencegate.upstream.latency_ms``: from the forwarded request's headers being built,
  right before the send, to the end of the answer streamed back to the worker. The
  forwarded request carries this span's ``traceparent`` (replacing the worker's, whose
  span is its parent).
- ``fencegate.lease <operation>`` (kind SERVER) for each lease API call under ``/v1/``:
  ``fencegate.operation`` (``enqueue``, ``claim``, ``acquire``, ``renew``, ``complete``,
  ``fail``, ``release``, ``get-job``), ``fencegate.job_id``, ``fencegate.generation`` and
  ``fencegate.owner`` from the answer, ``fencegate.reason`` of a refusal,
  ``http.response.status_code``.

Not covered: a refusal given before the body after ``Expect: 100-continue`` (aiohttp
answers it before any middleware runs), and requests refused by the HTTP parser.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer
    from opentelemetry.trace import TracerProvider as ApiTracerProvider

    from gateway.config import TracingSettings
    from gateway.fencing.fence import Presented

log = logging.getLogger("fencegate.tracing")

ENABLED = False
_tracer: Tracer | None = None
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The lease API's operations by (method, route).
OPERATIONS = {
    ("POST", "/v1/jobs"): "enqueue",
    ("POST", "/v1/queues/{queue}/claim"): "claim",
    ("PUT", "/v1/jobs/{job_id}/lease"): "acquire",
    ("POST", "/v1/leases/renew"): "renew",
    ("POST", "/v1/leases/complete"): "complete",
    ("POST", "/v1/leases/fail"): "fail",
    ("POST", "/v1/leases/release"): "release",
    ("GET", "/v1/jobs/{job_id}"): "get-job",
}


@dataclass(slots=True)
class _Forward:
    started: float | None = None


_FORWARD: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar(
    "fencegate_forward", default=None
)


def enable(provider: ApiTracerProvider | None = None) -> None:
    """Switch spans on, from ``provider`` (the global one when None). Apps made after
    this call are instrumented (``instrument``)."""
    from opentelemetry import trace

    global ENABLED, _tracer
    _tracer = trace.get_tracer("fencegate", tracer_provider=provider)
    ENABLED = True


def disable() -> None:
    global ENABLED, _tracer
    ENABLED = False
    _tracer = None


def configure(settings: TracingSettings) -> TracerProvider | None:
    """``fencegate serve``: a tracer provider exporting to OTLP over HTTP, or None when
    tracing is off. ``SystemExit`` naming the extra when it is not installed."""
    if not settings.enabled:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as error:
        raise SystemExit(
            "fencegate: tracing.enabled needs OpenTelemetry: pip install 'fencegate[otel]'"
        ) from error
    provider = TracerProvider(
        resource=Resource.create({"service.name": settings.service_name}),
        sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
    )
    # The endpoint: the setting, else OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT as the
    # exporter reads it, else http://localhost:4318/v1/traces.
    exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint or None)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    enable(provider)
    log.info("tracing on: OTLP to %s", settings.otlp_endpoint or "the OTEL_* default")
    return provider


def instrument(app: web.Application, listener: str) -> None:
    """Put the span middleware outermost in ``app`` (before it starts), when on:
    ``listener`` is ``"proxy"`` or ``"control"``."""
    if ENABLED:
        app.middlewares.insert(0, _proxy_middleware if listener == "proxy" else _control)


# -- hooks on the request path -----------------------------------------------------------


def forwarding(
    headers: MutableMapping[str, str], job_id: str | None, generation: int | None
) -> None:
    """The request is about to be sent upstream with ``headers``: name the decision on
    the current span and carry its ``traceparent``."""
    from opentelemetry import propagate, trace

    span = trace.get_current_span()
    span.set_attribute("fencegate.outcome", "forwarded")
    span.set_attribute("fencegate.reason", "forwarded")
    if job_id is not None and generation is not None:
        span.set_attribute("fencegate.job_id", job_id)
        span.set_attribute("fencegate.generation", generation)
    for name in ("traceparent", "tracestate"):
        headers.pop(name, None)
    propagate.inject(headers)
    state = _FORWARD.get()
    if state is not None:
        state.started = time.perf_counter()


def answered(
    reason: str, *, replayed: bool, presented: Presented | None, source_name: str | None
) -> None:
    """The gateway answered the request itself (a refusal or a replay)."""
    from opentelemetry import trace

    span = trace.get_current_span()
    span.set_attribute("fencegate.outcome", "replayed" if replayed else "refused")
    span.set_attribute("fencegate.reason", reason)
    if presented is not None:
        span.set_attribute("fencegate.job_id", presented.job_id)
        span.set_attribute("fencegate.generation", presented.generation)
    if source_name is not None:
        span.set_attribute("fencegate.lease_source", source_name)


# -- the middlewares ---------------------------------------------------------------------


@web.middleware
async def _proxy_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    assert _tracer is not None
    upstream = request.path.lstrip("/").partition("/")[0]
    state = _Forward()
    token = _FORWARD.set(state)
    try:
        with _tracer.start_as_current_span(
            f"fencegate.gateway {request.method}",
            context=propagate.extract(request.headers),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "fencegate.upstream": upstream},
        ) as span:
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            if state.started is not None:
                latency = (time.perf_counter() - state.started) * 1000
                span.set_attribute("fencegate.upstream.latency_ms", round(latency, 3))
            return response
    finally:
        _FORWARD.reset(token)


@web.middleware
async def _control(request: web.Request, handler: Handler) -> web.StreamResponse:
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    resource = request.match_info.route.resource
    operation = OPERATIONS.get((request.method, resource.canonical if resource is not None else ""))
    if operation is None:
        return await handler(request)
    assert _tracer is not None
    with _tracer.start_as_current_span(
        f"fencegate.lease {operation}",
        context=propagate.extract(request.headers),
        kind=SpanKind.SERVER,
        attributes={"fencegate.operation": operation, "http.request.method": request.method},
    ) as span:
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        for key, value in _answer_fields(response).items():
            span.set_attribute(key, value)
        return response


def _answer_fields(response: web.StreamResponse) -> dict[str, Any]:
    """``fencegate.*`` attributes from a JSON answer: the lease or job, or the refusal."""
    if not isinstance(response, web.Response) or not isinstance(response.body, bytes):
        return {}
    if not response.body or "json" not in (response.content_type or ""):
        return {}
    try:
        doc = json.loads(response.body)
    except ValueError:
        return {}
    if not isinstance(doc, dict):
        return {}
    out: dict[str, Any] = {}
    for field, attribute in (
        ("job_id", "fencegate.job_id"),
        ("generation", "fencegate.generation"),
        ("owner", "fencegate.owner"),
        ("reason", "fencegate.reason"),
    ):
        value = doc.get(field)
        if isinstance(value, str | int) and not isinstance(value, bool):
            out[attribute] = value
    return out
