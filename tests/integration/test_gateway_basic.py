from __future__ import annotations

from typing import Any

from tests.conftest import FakeClock, Upstream, upstream_config


async def test_forward_replay_and_stale(make_stack: Any, upstream: Upstream, clock: FakeClock) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    first = await stack.lease("job-1", owner="a", ttl=10)
    resp = await stack.write("/pay/charges", first, key="step-1")
    assert resp.status == 201, await resp.text()
    assert len(upstream.received) == 1
    sent = upstream.received[0]["headers"]
    assert "Fencing-Token" not in sent
    assert sent["Fencing-Generation"] == "1" and sent["Fencing-Job"] == "job-1"

    clock.advance(11)
    second = await stack.lease("job-1", owner="b", ttl=10)
    resp = await stack.write("/pay/charges", second, key="step-1")
    assert resp.status == 201
    assert resp.headers["Idempotent-Replayed"] == "true"
    assert len(upstream.received) == 1

    resp = await stack.write("/pay/charges", first, key="step-2")
    assert resp.status == 409
    doc = await resp.json()
    assert doc["reason"] == "stale-generation"
    assert doc["generation"] == 1 and doc["highest_generation"] == 2
    assert len(upstream.received) == 1
    reasons = [e["reason"] for e in await stack.audit()]
    assert reasons == ["stale-generation", "idempotent-replay"]
