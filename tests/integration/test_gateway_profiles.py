"""Upstream profiles through the gateway, on SQLite and PostgreSQL: the key the upstream
reads is the gateway's own, the same for every retry of a step across generations, and
never shared between jobs."""

from __future__ import annotations

from typing import Any

from gateway.profiles import upstream_key
from tests.gateway_helpers import ok
from tests.support import Upstream, upstream_config


async def test_stripe_gets_a_key_derived_from_job_and_key(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream, profile="stripe")])
    first = await stack.lease("job-1")
    other = await stack.lease("job-2")
    await ok(await stack.write("/pay/charges", first, key="pay-1"))
    await ok(await stack.write("/pay/charges", other, key="pay-1"))
    sent = [r["headers"]["Idempotency-Key"] for r in upstream.received]
    assert sent == [upstream_key("job-1", "pay-1"), upstream_key("job-2", "pay-1")]
    assert sent[0] != sent[1]  # the same worker key of two jobs never collides upstream


async def test_the_key_is_the_same_across_generations(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream, profile="stripe", unknown_outcome="retry")]
    )
    upstream.status = 502  # unknown outcome: the next generation sends it again
    first = await stack.lease("job-1")
    resp = await stack.write("/pay/charges", first, key="pay-1")
    assert resp.status == 502
    upstream.status = 201
    second = await stack.lease("job-1")  # the same owner again: a newer generation
    assert second["generation"] > first["generation"]
    await ok(await stack.write("/pay/charges", second, key="pay-1"))
    generations = [r["generation"] for r in upstream.received]
    assert generations == [str(first["generation"]), str(second["generation"])]
    keys = {r["headers"]["Idempotency-Key"] for r in upstream.received}
    assert keys == {upstream_key("job-1", "pay-1")}


async def test_paypal_reads_its_own_header_and_a_workers_is_dropped(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream, profile="paypal")])
    lease = await stack.lease("job-1")
    await ok(
        await stack.write(
            "/pay/v2/checkout/orders", lease, key="order-1", headers={"PayPal-Request-Id": "mine"}
        )
    )
    [received] = upstream.received
    assert received["headers"]["PayPal-Request-Id"] == upstream_key("job-1", "order-1")
    assert "Idempotency-Key" not in received["headers"]


async def test_a_write_without_a_key_sends_no_upstream_key(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream, profile="checkout", require_idempotency_key=False)]
    )
    lease = await stack.lease("job-1")
    await ok(
        await stack.write("/pay/payments", lease, key=None, headers={"Cko-Idempotency-Key": "x"})
    )
    [received] = upstream.received
    assert "Cko-Idempotency-Key" not in received["headers"]


async def test_generic_forwards_the_workers_key(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    await ok(await stack.write("/pay/charges", lease, key='"pay-1"'))
    assert upstream.received[0]["headers"]["Idempotency-Key"] == "pay-1"
