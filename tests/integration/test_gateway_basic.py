from __future__ import annotations

import asyncio
from typing import Any

from tests.support import FakeClock, Upstream, upstream_config


async def test_forward_replay_and_stale(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
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


async def _raw_exchange(port: int, head: bytes, wait: float = 2.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    try:
        data = await asyncio.wait_for(reader.read(65536), wait)
    finally:
        writer.close()
    return data


async def test_expect_continue_with_stale_token_refused_before_body(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    first = await stack.lease("job-e", owner="a", ttl=5)
    clock.advance(6)
    await stack.lease("job-e", owner="b", ttl=5)
    head = (
        "POST /pay/charges HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Fencing-Token: {first['lease_token']}\r\nIdempotency-Key: k9\r\n"
        "Content-Length: 1000\r\nExpect: 100-continue\r\n\r\n"
    ).encode()
    # The body is never sent: the refusal must come without it.
    answer = await _raw_exchange(stack.proxy.port, head)
    assert answer.startswith(b"HTTP/1.1 409"), answer[:200]
    assert b"stale-generation" in answer
    assert b"100 Continue" not in answer
    assert upstream.received == []


async def test_an_early_refusal_closes_the_connection_the_body_never_came_on(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    """RFC 9110 10.1.1: a final answer before the body says whether the connection stays.
    A client that got the refusal instead of 100 Continue never sends the body, and may
    send its next request on the same connection (botocore does): the gateway must not
    read that request as the missing body. It answers ``Connection: close`` and closes."""
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    first = await stack.lease("job-c", owner="a", ttl=5)
    clock.advance(6)
    current = await stack.lease("job-c", owner="b", ttl=5)
    head = (
        "PUT /pay/files/a HTTP/1.1\r\nHost: gw\r\n"
        f"Fencing-Token: {first['lease_token']}\r\nIdempotency-Key: k1\r\n"
        "Content-Length: 40\r\nExpect: 100-continue\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.proxy.port)
    try:
        writer.write(head)
        refused = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        assert refused.startswith(b"HTTP/1.1 409"), refused
        assert b"connection: close" in refused.lower(), refused
        length = int(refused.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await asyncio.wait_for(reader.readexactly(length), 2)
        # The next request, as a client that believes the connection is still usable
        # would send it: it never reaches the upstream as part of the first.
        writer.write(
            (
                "PUT /pay/files/b HTTP/1.1\r\nHost: gw\r\n"
                f"Fencing-Token: {current['lease_token']}\r\nIdempotency-Key: k2\r\n"
                "Content-Length: 2\r\n\r\n{}"
            ).encode()
        )
        rest = await asyncio.wait_for(reader.read(65536), 5)
        assert rest == b"", rest[:200]  # closed: nothing more is read or answered here
    finally:
        writer.close()
    assert upstream.received == []


async def test_expect_continue_with_current_token_gets_continue(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-f", owner="a", ttl=30)
    head = (
        "POST /pay/charges HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Fencing-Token: {lease['lease_token']}\r\nIdempotency-Key: k9\r\n"
        "Content-Length: 2\r\nExpect: 100-continue\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.proxy.port)
    try:
        writer.write(head)
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        assert interim.startswith(b"HTTP/1.1 100 Continue"), interim
        writer.write(b"{}")
        final = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert final.startswith(b"HTTP/1.1 201"), final
    finally:
        writer.close()
    assert len(upstream.received) == 1 and upstream.received[0]["body"] == b"{}"


def _sample(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not in /metrics")


async def test_metrics_count_forwards_and_refusals(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    first = await stack.lease("job-m", owner="a", ttl=10)
    for key in ("m-1", "m-2"):
        assert (await stack.write("/pay/charges", first, key=key)).status == 201
    clock.advance(11)
    await stack.lease("job-m", owner="b", ttl=10)
    assert (await stack.write("/pay/charges", first, key="m-3")).status == 409

    text = await (await stack.control.get("/metrics")).text()
    pay = 'upstream="pay"'
    assert _sample(text, f'fencegate_gateway_decisions_total{{reason="forwarded",{pay}}}') == 2
    assert _sample(text, f"fencegate_gateway_forward_seconds_count{{{pay}}}") == 2
    assert _sample(text, f"fencegate_gateway_decision_seconds_count{{{pay}}}") == 2
    assert _sample(text, f"fencegate_gateway_in_flight_writes{{{pay}}}") == 0
    stale = f'fencegate_gateway_decisions_total{{reason="stale-generation",{pay}}}'
    assert _sample(text, stale) == 1
    # Two admissions and two settles went through the hot path, timed like transactions.
    assert _sample(text, "fencegate_store_transaction_seconds_count") >= 4
