"""Upstream profiles through the gateway, on SQLite and PostgreSQL: the key the upstream
reads is the gateway's own, the same for every retry of a step across generations, and
never shared between jobs."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.fencing.profiles import upstream_key
from tests.gateway_helpers import ok, replayed
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


async def test_an_answer_the_profile_calls_not_final_leaves_the_key_free(
    make_stack: Any, upstream: Upstream
) -> None:
    """Stripe saves a key's answer only once the endpoint began executing: a request that
    failed validation (400) is not the key's answer, so the retry under the same key is
    sent again (and Stripe, had it kept one, would answer with it: the gateway's key is
    the same)."""
    stack = await make_stack(upstreams=[upstream_config(upstream, profile="stripe")])
    lease = await stack.lease("job-1")
    upstream.status = 400
    await ok(await stack.write("/pay/charges", lease, key="pay-1"), 400)
    upstream.status = 402  # a declined card: the endpoint ran, the answer is final
    await ok(await stack.write("/pay/charges", lease, key="pay-1"), 402)
    await replayed(await stack.write("/pay/charges", lease, key="pay-1"), 402)
    assert len(upstream.received) == 2
    keys = {r["headers"]["Idempotency-Key"] for r in upstream.received}
    assert keys == {upstream_key("job-1", "pay-1")}


@pytest.mark.parametrize(
    ("final", "status", "stored"),
    [
        (["2xx"], 422, False),
        (["2xx"], 201, True),
        (["2xx", 409], 409, True),
        (["4XX"], 404, True),
        (["5xx"], 500, True),
        (["2xx"], 429, False),  # not_processed_statuses are never final
    ],
)
async def test_final_statuses_decide_which_answers_are_stored(
    make_stack: Any, upstream: Upstream, final: list[Any], status: int, stored: bool
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream, dedup={"final_statuses": final})])
    lease = await stack.lease("job-1")
    upstream.status = status
    await ok(await stack.write("/pay/charges", lease, key="pay-1"), status)
    again = await stack.write("/pay/charges", lease, key="pay-1")
    if stored:
        await replayed(again, status)
        assert len(upstream.received) == 1
    else:
        await ok(again, status)
        assert len(upstream.received) == 2


async def test_an_unknown_status_stays_unknown_whatever_final_statuses_say(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream, dedup={"final_statuses": ["5xx"]})]
    )
    lease = await stack.lease("job-1")
    upstream.status = 504
    assert (await stack.write("/pay/charges", lease, key="pay-1")).status == 504
    [held] = (await (await stack.control.get("/admin/unknown-outcomes")).json())["items"]
    assert held["state"] == "unknown" and held["status"] == 504
