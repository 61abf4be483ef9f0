"""Unknown outcomes that the gateway resolves itself (``unknown_outcome = "resolve"``),
on SQLite and PostgreSQL, against a real upstream that deduplicates by key as Stripe
documents it (https://docs.stripe.com/api/idempotent_requests): the first request with a
key is applied and its answer kept; the same key with the same parameters gets that
answer back; the same key with other parameters is refused with an
``idempotency_error``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web

from gateway.fencing.profiles import upstream_key
from gateway.proxy.gateway import Gateway
from gateway.service.admin import GATEWAY_STATE
from tests.gateway_helpers import ok, problem
from tests.support import FakeClock


class StripeLike:
    """Charges, deduplicated by ``Idempotency-Key``. ``lose`` makes the next new charge
    be applied and then lose its answer: ``"cut"`` closes the connection, ``"timeout"``
    answers after the gateway has given up. ``gate``, when set, holds every request
    until it is opened."""

    def __init__(self) -> None:
        self.charges = 0
        self.kept: dict[str, tuple[bytes, bytes]] = {}  # key -> (request body, answer)
        self.received: list[dict[str, Any]] = []
        self.lose: str | None = None
        self.gate: asyncio.Event | None = None
        self.url = ""

    async def handler(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        key = request.headers.get("Idempotency-Key", "")
        self.received.append({"key": key, "body": body, "headers": dict(request.headers)})
        if self.gate is not None:
            await self.gate.wait()
        if key in self.kept:
            first, answer = self.kept[key]
            if first != body:
                error = {"error": {"type": "idempotency_error", "message": "other parameters"}}
                return web.json_response(error, status=400)
            return web.Response(
                status=200,
                body=answer,
                content_type="application/json",
                headers={"Idempotent-Replayed": "true"},
            )
        self.charges += 1
        answer = json.dumps({"id": f"ch_{self.charges}"}).encode()
        self.kept[key] = (body, answer)
        lose, self.lose = self.lose, None
        if lose == "cut":
            assert request.transport is not None
            request.transport.close()
            raise asyncio.CancelledError  # the answer is never written
        if lose == "timeout":
            await asyncio.sleep(3.0)  # past the upstream's timeout_seconds (config)
        return web.Response(status=200, body=answer, content_type="application/json")


@pytest.fixture
async def stripe(aiohttp_server: Callable[..., Any]) -> StripeLike:
    up = StripeLike()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", up.handler)
    server = await aiohttp_server(app)
    up.url = str(server.make_url("")).rstrip("/")
    return up


def config(up: StripeLike, **extra: Any) -> dict[str, Any]:
    return {
        "name": "pay",
        "url": up.url,
        "profile": "stripe",
        "unknown_outcome": "resolve",
        # Long enough that a loaded machine connects and sends within it (a write that
        # could not connect is told upstream-unavailable, not the loss these tests make).
        "timeout_seconds": 2.0,
        "set_headers": {"Authorization": "Bearer sk_test_gateway_secret"},
        **extra,
    }


def gateway_of(stack: Any) -> Gateway:
    gateway: Gateway = stack.control.app[GATEWAY_STATE]
    return gateway


async def outcomes(stack: Any) -> list[dict[str, Any]]:
    resp = await stack.control.get("/admin/unknown-outcomes")
    assert resp.status == 200
    items: list[dict[str, Any]] = (await resp.json())["items"]
    return items


async def lose_a_charge(stack: Any, up: StripeLike, lease: dict[str, Any], how: str) -> None:
    up.lose = how
    resp = await stack.write("/pay/v1/charges", lease, key="charge-1", body={"amount": 500})
    await problem(
        resp,
        504 if how == "timeout" else 502,
        f"upstream-{'timeout' if how == 'timeout' else 'connection-lost'}",
    )
    assert up.charges == 1
    [held] = await outcomes(stack)
    assert held["state"] == "unknown" and held["resolvable"] is True


@pytest.fixture
async def lost_and_due(
    make_stack: Any, stripe: StripeLike, clock: FakeClock
) -> tuple[Any, dict[str, Any]]:
    """A gateway (upstream timeout and ordering wait long enough for a re-send held at
    the upstream) whose charge ``charge-1`` of ``job-1`` was applied and lost its answer,
    with the clock past the resolver's pause: its next round re-sends the charge. The
    stack and the lease of generation 1."""
    stack = await make_stack(
        upstreams=[config(stripe, timeout_seconds=5)], gateway={"ordering_wait_seconds": 5}
    )
    lease = await stack.lease("job-1")
    await lose_a_charge(stack, stripe, lease, "cut")
    clock.advance(2)
    return stack, lease


@pytest.mark.parametrize("how", ["cut", "timeout"])
async def test_a_lost_answer_is_resolved_by_the_gateway(
    make_stack: Any, stripe: StripeLike, clock: FakeClock, how: str
) -> None:
    stack = await make_stack(upstreams=[config(stripe)])
    lease = await stack.lease("job-1")
    await lose_a_charge(stack, stripe, lease, how)
    # Held until the gateway resolves it: the worker's retry is not sent.
    await problem(
        await stack.write("/pay/v1/charges", lease, key="charge-1", body={"amount": 500}),
        409,
        "outcome-unknown",
    )
    clock.advance(2)
    assert await gateway_of(stack).resolver.run_once() == 1

    # One charge: the re-send carried the same key and the same bytes, and got the
    # upstream's kept answer; the gateway's credential was set again, not stored.
    assert stripe.charges == 1
    first, again = stripe.received
    assert first["key"] == again["key"] == upstream_key("job-1", "charge-1")
    assert first["body"] == again["body"]
    assert again["headers"]["Authorization"] == "Bearer sk_test_gateway_secret"
    assert again["headers"]["Fencing-Job"] == "job-1"
    # The worker's retry gets the stored answer; no operator was needed.
    resp = await stack.write("/pay/v1/charges", lease, key="charge-1", body={"amount": 500})
    assert resp.status == 200 and resp.headers["Idempotent-Replayed"] == "true"
    assert json.loads(await resp.read()) == {"id": "ch_1"}
    assert len(stripe.received) == 2
    assert await outcomes(stack) == []
    [entry] = await stack.audit(reason="auto-resolved")
    assert entry["status"] == 200 and entry["job_id"] == "job-1"
    assert entry["idempotency_key"] == "charge-1"
    metrics = await (await stack.control.get("/metrics")).text()
    assert 'fencegate_gateway_resolutions_total{outcome="resolved",upstream="pay"} 1.0' in metrics


async def test_the_background_task_of_serve_resolves(make_stack: Any, stripe: StripeLike) -> None:
    stack = await make_stack(
        use_clock=False,
        upstreams=[config(stripe)],
        gateway={"resolve_interval_seconds": 0.2},
    )
    lease = await stack.lease("job-1")
    await lose_a_charge(stack, stripe, lease, "cut")
    for _ in range(100):
        if not await outcomes(stack):
            break
        await asyncio.sleep(0.1)
    assert await outcomes(stack) == []
    assert stripe.charges == 1 and len(stripe.received) == 2
    resp = await stack.write("/pay/v1/charges", lease, key="charge-1", body={"amount": 500})
    assert json.loads(await resp.read()) == {"id": "ch_1"}


async def test_a_key_used_with_other_parameters_goes_to_the_operator(
    make_stack: Any, stripe: StripeLike, clock: FakeClock
) -> None:
    stack = await make_stack(upstreams=[config(stripe)])
    lease = await stack.lease("job-1", ttl=300)
    await lose_a_charge(stack, stripe, lease, "cut")
    key = upstream_key("job-1", "charge-1")
    stripe.kept[key] = (b'{"amount": 999}', stripe.kept[key][1])  # someone else's request
    clock.advance(2)
    assert await gateway_of(stack).resolver.run_once() == 0
    [held] = await outcomes(stack)
    assert held["state"] == "unknown" and held["resolvable"] is False
    assert "other parameters" in held["note"] and held["resolve_attempts"] == 1
    clock.advance(60)
    assert await gateway_of(stack).resolver.run_once() == 0
    assert len(stripe.received) == 2  # never re-sent again
    await problem(
        await stack.write("/pay/v1/charges", lease, key="charge-1", body={"amount": 500}),
        409,
        "outcome-unknown",
    )


async def test_past_the_window_it_goes_to_the_operator(
    make_stack: Any, stripe: StripeLike, clock: FakeClock
) -> None:
    stack = await make_stack(upstreams=[config(stripe, dedup={"window_seconds": 10})])
    lease = await stack.lease("job-1")
    await lose_a_charge(stack, stripe, lease, "cut")
    clock.advance(9)  # the window, less the timeout and a margin, has passed
    assert await gateway_of(stack).resolver.run_once() == 0
    assert len(stripe.received) == 1
    [held] = await outcomes(stack)
    assert held["state"] == "unknown"


async def test_a_body_above_the_replay_limit_is_not_kept(
    make_stack: Any, stripe: StripeLike, clock: FakeClock
) -> None:
    stack = await make_stack(upstreams=[config(stripe)], gateway={"max_replay_body_bytes": 10})
    lease = await stack.lease("job-1")
    stripe.lose = "cut"
    resp = await stack.write("/pay/v1/charges", lease, key="charge-1", body={"amount": 500})
    assert resp.status == 502
    [held] = await outcomes(stack)
    assert held["resolvable"] is False  # waits for an operator, as with "hold"
    clock.advance(2)
    assert await gateway_of(stack).resolver.run_once() == 0
    assert len(stripe.received) == 1


async def test_during_resolution_a_retry_is_in_progress_and_a_newer_generation_waits(
    lost_and_due: tuple[Any, dict[str, Any]], stripe: StripeLike
) -> None:
    stack, lease = lost_and_due
    stripe.gate = asyncio.Event()
    resolving = asyncio.create_task(gateway_of(stack).resolver.run_once())
    while len(stripe.received) < 2:
        await asyncio.sleep(0.01)
    [held] = await outcomes(stack)
    assert held["state"] == "resolving" and held["resolve_attempts"] == 1
    await problem(
        await stack.write("/pay/v1/charges", lease, key="charge-1", body={"amount": 500}),
        409,
        "request-in-progress",
    )
    newer = await stack.lease("job-1")
    later = asyncio.create_task(
        stack.write("/pay/v1/refunds", newer, key="refund-1", body={"charge": "ch_1"})
    )
    await asyncio.sleep(0.3)
    assert not later.done() and len(stripe.received) == 2  # waits for the older write
    stripe.gate.set()
    assert await resolving == 1
    assert (await later).status == 200
    assert [r["key"] for r in stripe.received][2] == upstream_key("job-1", "refund-1")
    # The key belongs to the job: the newer generation repeating the step gets the
    # stored answer; the older generation is fenced off.
    resp = await stack.write("/pay/v1/charges", newer, key="charge-1", body={"amount": 500})
    assert resp.status == 200 and resp.headers["Idempotent-Replayed"] == "true"
    assert json.loads(await resp.read()) == {"id": "ch_1"}
    await problem(
        await stack.write("/pay/v1/charges", lease, key="charge-1", body={"amount": 500}),
        409,
        "stale-generation",
    )
    assert len(stripe.received) == 3 and stripe.charges == 2


async def test_a_newer_generation_that_wrote_first_leaves_it_to_the_operator(
    make_stack: Any, stripe: StripeLike, clock: FakeClock
) -> None:
    stack = await make_stack(upstreams=[config(stripe)])
    lease = await stack.lease("job-1")
    await lose_a_charge(stack, stripe, lease, "cut")
    newer = await stack.lease("job-1")
    await ok(await stack.write("/pay/v1/refunds", newer, key="refund-1"), 200)
    clock.advance(2)
    assert await gateway_of(stack).resolver.run_once() == 0
    assert len(stripe.received) == 2  # the charge was never sent after the refund
    [held] = await outcomes(stack)
    assert held["key"] == "charge-1" and held["state"] == "unknown"


async def test_two_replicas_resolve_a_record_once(
    make_stack: Any, stripe: StripeLike, clock: FakeClock
) -> None:
    one = await make_stack(upstreams=[config(stripe, timeout_seconds=5)])
    two = await make_stack(upstreams=[config(stripe, timeout_seconds=5)])
    lease = await one.lease("job-1")
    stripe.lose = "cut"
    assert (await one.write("/pay/v1/charges", lease, key="charge-1")).status == 502
    clock.advance(2)
    stripe.gate = asyncio.Event()
    rounds = [
        asyncio.create_task(gateway_of(stack).resolver.run_once()) for stack in (one, two, one)
    ]
    while len(stripe.received) < 2:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    stripe.gate.set()
    assert sorted(await asyncio.gather(*rounds)) == [0, 0, 1]
    assert len(stripe.received) == 2 and stripe.charges == 1


async def test_a_resolution_claimed_during_a_newer_admission_is_waited_for(
    lost_and_due: tuple[Any, dict[str, Any]], stripe: StripeLike, engine: Any, backend: str
) -> None:
    """The seam between the resolver's claim and a newer generation's admission: the
    admission's statement has read the job's records (the older one unknown, not in
    flight) but not yet committed when the resolver claims the older record and reads
    the fence (not raised yet), so the resolver re-sends. The newer write must then wait
    for the re-send rather than go out beside it. On PostgreSQL the admission is held
    after its snapshot by a lock on the job's row (the admission locks it FOR SHARE;
    the resolver's claim does not touch it); SQLite's one writer serializes the two."""
    stack, _ = lost_and_due
    newer = await stack.lease("job-1")
    stripe.gate = asyncio.Event()
    resolver = gateway_of(stack).resolver
    resolving: asyncio.Task[int] | None = None
    if backend == "postgres":
        from sqlalchemy import text

        async with engine.connect() as holder:
            await holder.execute(text("SELECT 1 FROM jobs WHERE job_id = 'job-1' FOR UPDATE"))
            later = asyncio.create_task(
                stack.write("/pay/v1/refunds", newer, key="refund-1", body={"charge": "ch_1"})
            )
            # Until the admission waits for the job's row (within 30 s: a loaded machine
            # running the suite in parallel took more than 5). Each look reads the
            # activity afresh: the holder's transaction would otherwise keep reading the
            # statistics snapshot its first look took.
            for _ in range(3000):
                await holder.execute(text("SELECT pg_stat_clear_snapshot()"))
                waiting = await holder.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND datname = current_database()"
                    )
                )
                if waiting.scalar_one():
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the admission never waited for the job's row")
            resolving = asyncio.create_task(resolver.run_once())
            while len(stripe.received) < 2 and not resolving.done():
                await asyncio.sleep(0.01)
            await holder.rollback()
    else:
        resolving = asyncio.create_task(resolver.run_once())
        while len(stripe.received) < 2 and not resolving.done():
            await asyncio.sleep(0.01)
        later = asyncio.create_task(
            stack.write("/pay/v1/refunds", newer, key="refund-1", body={"charge": "ch_1"})
        )
    assert len(stripe.received) == 2  # the older charge re-sent, held at the upstream
    await asyncio.sleep(0.5)
    # The newer write waits for the older one's re-send; it has not gone out beside it.
    assert not later.done() and len(stripe.received) == 2
    stripe.gate.set()
    assert await resolving == 1
    assert (await later).status == 200
    assert [r["key"] for r in stripe.received] == [
        upstream_key("job-1", "charge-1"),
        upstream_key("job-1", "charge-1"),
        upstream_key("job-1", "refund-1"),
    ]


async def test_a_resolution_whose_re_send_never_ended_is_claimed_again_once_overdue(
    lost_and_due: tuple[Any, dict[str, Any]], stripe: StripeLike, clock: FakeClock
) -> None:
    """A replica that claimed a record for a re-send and died leaves it in flight; once
    its deadline has passed the next round claims it again (the "in flight and overdue"
    candidates, read from the in-flight index) and resolves it."""
    stack, _ = lost_and_due
    gateway = gateway_of(stack)
    claim = gateway.store.claim_resolution
    taken = await claim("pay", window=3600, max_attempts=5, pause=1, deadline_in=10)
    assert taken is not None and taken.key == "charge-1"
    # In flight under the dead replica's attempt: not claimable before its deadline.
    assert await claim("pay", window=3600, max_attempts=5, pause=1, deadline_in=10) is None
    clock.advance(11)
    assert await gateway.resolver.run_once() == 1
    assert stripe.charges == 1 and len(stripe.received) == 2
    assert await outcomes(stack) == []
