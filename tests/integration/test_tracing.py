"""OpenTelemetry spans (``gateway.observe.tracing``), recorded with the SDK's in-memory exporter
around a real ``serve`` in this process and a real upstream: one span per gateway
decision (forwarded, replayed, refused) with the job, the generation, the reason and the
upstream latency, the worker's ``traceparent`` as the parent and the gateway's carried
to the upstream; one span per lease operation. Off, nothing is instrumented."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.config import ConfigError
from gateway.observe import tracing
from tests.integration.test_tls import config, running
from tests.support import Upstream

TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-0[01]")
WORKER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
WORKER_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    try:
        yield exporter
    finally:
        tracing.disable()
        provider.shutdown()


def named(exporter: InMemorySpanExporter, prefix: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith(prefix)]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def call(
    session: aiohttp.ClientSession, method: str, url: str, **kwargs: Any
) -> tuple[int, Any]:
    async with session.request(method, url, **kwargs) as resp:
        text = await resp.text()
        return resp.status, text


async def test_spans_of_decisions_and_lease_operations(
    spans: InMemorySpanExporter, upstream: Upstream, tmp_path: Path
) -> None:
    settings = config(tmp_path, "", f'[[upstreams]]\nname = "pay"\nurl = "{upstream.url}"\n')
    async with running(settings) as addresses, aiohttp.ClientSession() as session:
        control = f"http://{addresses['control']}"
        status, _ = await call(
            session, "PUT", control + "/v1/jobs/job-t/lease", json={"owner": "worker-a"}
        )
        assert status == 201
        status, _ = await call(
            session, "PUT", control + "/v1/jobs/job-t/lease", json={"owner": "worker-a"}
        )
        assert status == 201  # the same owner again: generation 2
        leases = named(spans, "fencegate.lease ")
        assert [s.name for s in leases] == ["fencegate.lease acquire"] * 2
        assert [attrs(s)["fencegate.generation"] for s in leases] == [1, 2]
        assert attrs(leases[0])["fencegate.job_id"] == "job-t"
        assert attrs(leases[0])["fencegate.owner"] == "worker-a"
        assert attrs(leases[0])["http.response.status_code"] == 201
        # The token is a secret: no attribute holds it.
        assert all("fgl_" not in str(v) for s in leases for v in attrs(s).values())


async def test_a_forward_a_replay_and_a_refusal(
    spans: InMemorySpanExporter, upstream: Upstream, tmp_path: Path
) -> None:
    upstream.delay = 0.05
    settings = config(tmp_path, "", f'[[upstreams]]\nname = "pay"\nurl = "{upstream.url}"\n')
    worker = {"traceparent": f"00-{WORKER_TRACE}-{WORKER_SPAN}-01"}
    async with running(settings) as addresses, aiohttp.ClientSession() as session:
        control, proxy = f"http://{addresses['control']}", f"http://{addresses['proxy']}"
        leases = []
        for _ in range(2):
            async with session.put(
                control + "/v1/jobs/job-1/lease", json={"owner": "worker-a"}
            ) as resp:
                assert resp.status == 201
                leases.append(await resp.json())
        first, second = leases

        def write(lease: dict[str, Any], key: str) -> dict[str, str]:
            return {**worker, "Fencing-Token": lease["lease_token"], "Idempotency-Key": key}

        status, _ = await call(
            session, "POST", proxy + "/pay/charges", json={"a": 1}, headers=write(second, "k1")
        )
        assert status == 201
        status, _ = await call(
            session, "POST", proxy + "/pay/charges", json={"a": 1}, headers=write(second, "k1")
        )
        assert status == 201  # replayed
        status, _ = await call(
            session, "POST", proxy + "/pay/charges", json={"a": 1}, headers=write(first, "k2")
        )
        assert status == 409  # stale-generation
        status, _ = await call(
            session,
            "POST",
            control + "/v1/leases/renew",
            json={"lease_token": first["lease_token"]},
        )
        assert status == 409

    forwarded, replayed, refused = named(spans, "fencegate.gateway ")
    assert {s.name for s in (forwarded, replayed, refused)} == {"fencegate.gateway POST"}
    for span in (forwarded, replayed, refused):
        # A child of the worker's span, in the worker's trace.
        assert span.parent is not None
        assert (f"{span.parent.trace_id:032x}", f"{span.parent.span_id:016x}") == (
            WORKER_TRACE,
            WORKER_SPAN,
        )
        assert f"{span.context.trace_id:032x}" == WORKER_TRACE
        assert attrs(span)["fencegate.upstream"] == "pay"
        assert attrs(span)["fencegate.job_id"] == "job-1"

    a = attrs(forwarded)
    assert (a["fencegate.outcome"], a["fencegate.reason"]) == ("forwarded", "forwarded")
    assert a["fencegate.generation"] == 2
    assert a["http.response.status_code"] == 201
    assert a["fencegate.upstream.latency_ms"] >= 50  # the upstream's delay
    # The upstream got the gateway's span as its parent (not the worker's), once.
    (received,) = upstream.received
    match = TRACEPARENT.fullmatch(received["headers"]["traceparent"])
    assert match is not None
    assert match[1] == WORKER_TRACE
    assert match[2] == f"{forwarded.context.span_id:016x}"

    a = attrs(replayed)
    assert (a["fencegate.outcome"], a["fencegate.reason"]) == ("replayed", "idempotent-replay")
    assert a["fencegate.generation"] == 2 and "fencegate.upstream.latency_ms" not in a

    a = attrs(refused)
    assert (a["fencegate.outcome"], a["fencegate.reason"]) == ("refused", "stale-generation")
    assert a["fencegate.generation"] == 1
    assert a["http.response.status_code"] == 409

    (renew,) = named(spans, "fencegate.lease renew")
    assert attrs(renew)["fencegate.reason"] == "stale-generation"
    assert attrs(renew)["http.response.status_code"] == 409


async def test_off_nothing_is_instrumented(upstream: Upstream, tmp_path: Path) -> None:
    assert not tracing.ENABLED
    app = web.Application()
    tracing.instrument(app, "proxy")
    tracing.instrument(app, "control")
    assert list(app.middlewares) == []
    # The worker's traceparent reaches the upstream as it was sent.
    settings = config(tmp_path, "", f'[[upstreams]]\nname = "pay"\nurl = "{upstream.url}"\n')
    traceparent = f"00-{WORKER_TRACE}-{WORKER_SPAN}-01"
    async with running(settings) as addresses, aiohttp.ClientSession() as session:
        async with session.get(
            f"http://{addresses['proxy']}/pay/x", headers={"traceparent": traceparent}
        ) as resp:
            assert resp.status == 201
    (received,) = upstream.received
    assert received["headers"]["traceparent"] == traceparent


def test_tracing_settings_are_checked(tmp_path: Path) -> None:
    settings = config(
        tmp_path,
        '[tracing]\nenabled = true\notlp_endpoint = "http://collector:4318/v1/traces"\n'
        "sample_ratio = 0.5\n",
    )
    assert settings.tracing.enabled and settings.tracing.sample_ratio == 0.5
    with pytest.raises(ConfigError, match=r"tracing.otlp_endpoint: .*http"):
        config(tmp_path, '[tracing]\notlp_endpoint = "collector:4318"\n')
    with pytest.raises(ConfigError, match=r"tracing.sample_ratio"):
        config(tmp_path, "[tracing]\nsample_ratio = 2\n")
    provider = tracing.configure(settings.tracing)
    try:
        assert provider is not None and tracing.ENABLED
    finally:
        tracing.disable()
        if provider is not None:
            provider.shutdown()
