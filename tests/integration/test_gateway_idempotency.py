"""Idempotency keys through the gateway, on SQLite and PostgreSQL: replays, key reuse,
keys that belong to the job across generations, concurrent duplicates, unknown outcomes
and their resolution, and retention.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.service.admin import GATEWAY_STATE
from gateway.service.server import SETTINGS, upkeep
from lease_core.api import STORE
from tests.gateway_helpers import PROBLEM, ok, problem, replayed, until_in_flight
from tests.support import FakeClock, Upstream, upstream_config


async def problem_from(
    status: int, headers: Any, body: bytes, expect: int, reason: str
) -> dict[str, Any]:
    assert status == expect, body
    assert headers["Content-Type"] == PROBLEM
    doc: dict[str, Any] = json.loads(body)
    assert doc["reason"] == reason and doc["status"] == expect
    return doc


async def upstream_idle(upstream: Upstream, timeout: float = 5.0) -> None:
    """Wait until the upstream has finished every request it started (it keeps going
    after the gateway gave up on it)."""
    deadline = time.monotonic() + timeout
    while upstream.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert upstream.in_flight == 0


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def unknown_outcomes(stack: Any) -> list[dict[str, Any]]:
    resp = await stack.control.get("/admin/unknown-outcomes")
    assert resp.status == 200, await resp.text()
    items: list[dict[str, Any]] = (await resp.json())["items"]
    return items


async def resolve(stack: Any, expect: int = 200, **body: Any) -> dict[str, Any]:
    resp = await stack.control.post("/admin/unknown-outcomes/resolve", json=body)
    assert resp.status == expect, await resp.text()
    doc: dict[str, Any] = await resp.json(content_type=None)
    return doc


# -- replays ------------------------------------------------------------------------------


async def test_replay_gives_the_stored_answer(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    upstream.body = b'{"id": "ch_1", "amount": 5}'
    upstream.headers = {"X-Charge-Id": "ch_1", "Location": "/charges/ch_1"}
    lease = await stack.lease("job-1")
    first = await stack.write("/pay/charges?expand=1", lease, key="charge-1", body={"amount": 5})
    assert await ok(first) == upstream.body

    # The upstream would now answer differently: the duplicate must not reach it.
    upstream.status, upstream.body = 500, b"boom"
    again = await stack.write("/pay/charges?expand=1", lease, key="charge-1", body={"amount": 5})
    assert await replayed(again) == b'{"id": "ch_1", "amount": 5}'
    assert again.headers["X-Charge-Id"] == "ch_1"
    assert again.headers["Location"] == "/charges/ch_1"
    assert again.content_type == "application/json"
    # The bare and the quoted form of a key are the same key.
    quoted = await stack.write("/pay/charges?expand=1", lease, key='"charge-1"', body={"amount": 5})
    await replayed(quoted)
    assert len(upstream.received) == 1

    entries = await stack.audit()
    assert [(e["reason"], e["status"]) for e in entries] == [("idempotent-replay", 201)] * 2
    assert entries[0]["idempotency_key"] == "charge-1"


async def test_replay_of_an_error_answer(make_stack: Any, upstream: Upstream) -> None:
    """A definite answer is stored whatever its status: a 400 or 500 replays too."""
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    for status in (400, 500):
        upstream.status, upstream.body = status, b'{"error": "card declined"}'
        await ok(await stack.write("/pay/c", lease, key=f"k{status}"), status)
        upstream.status = 201
        resp = await stack.write("/pay/c", lease, key=f"k{status}")
        assert await replayed(resp, status) == b'{"error": "card declined"}'
    assert len(upstream.received) == 2
    assert await unknown_outcomes(stack) == []


async def test_same_key_different_request_is_refused(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    original: dict[str, Any] = {"path": "/pay/charges", "body": {"amount": 5}, "method": "POST"}
    await ok(await stack.write(lease=lease, key="charge-1", **original))
    for change in (
        {"body": {"amount": 6}},
        {"path": "/pay/refunds"},
        {"path": "/pay/charges?currency=usd"},
        {"path": "/pay/charges/"},
        {"method": "PUT"},
    ):
        resp = await stack.write(lease=lease, key="charge-1", **{**original, **change})
        doc = await problem(resp, 422, "idempotency-key-reused")
        assert doc["job_id"] == "job-1" and doc["generation"] == 1
    assert len(upstream.received) == 1
    # The original request still replays.
    await replayed(await stack.write(lease=lease, key="charge-1", **original))
    entries = await stack.audit(reason="idempotency-key-reused")
    assert [(e["status"], e["idempotency_key"]) for e in entries] == [(422, "charge-1")] * 5


async def test_same_key_on_another_upstream_is_a_different_request(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream), upstream_config(upstream, name="mail")]
    )
    lease = await stack.lease("job-1")
    await ok(await stack.write("/pay/send", lease, key="step"))
    await problem(await stack.write("/mail/send", lease, key="step"), 422, "idempotency-key-reused")
    assert len(upstream.received) == 1


async def test_keys_belong_to_the_job_across_generations(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    first = await stack.lease("job-1", owner="a", ttl=10)
    answer = await ok(await stack.write("/pay/charges", first, key="charge", body={"amount": 5}))
    clock.advance(11)
    second = await stack.lease("job-1", owner="b", ttl=10)
    # The new worker repeats the step: it gets the old worker's answer.
    resp = await stack.write("/pay/charges", second, key="charge", body={"amount": 5})
    assert await replayed(resp) == answer
    # ...but may not reuse the key for something else.
    resp = await stack.write("/pay/charges", second, key="charge", body={"amount": 7})
    await problem(resp, 422, "idempotency-key-reused")
    # A new step of the new worker goes through, with the new generation.
    await ok(await stack.write("/pay/charges", second, key="charge-2", body={"amount": 7}))
    assert [r["generation"] for r in upstream.received] == ["1", "2"]
    [entry] = await stack.audit(reason="idempotent-replay")
    assert (entry["generation"], entry["owner"]) == (2, "b")


async def test_a_job_created_again_after_a_purge_inherits_no_answers(
    make_stack: Any, upstream: Upstream
) -> None:
    """A purged job's records go with it: the new job under the same id sends its first
    write of a step to the upstream, instead of being given the old job's answer."""
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    old = await stack.lease("job-1")
    await ok(await stack.write("/pay/charges", old, key="charge", body={"amount": 5}))
    resp = await stack.control.post("/v1/leases/complete", json={"lease_token": old["lease_token"]})
    assert resp.status == 200, await resp.text()
    resp = await stack.control.delete("/admin/jobs/job-1")
    assert resp.status in (200, 204), await resp.text()
    new = await stack.lease("job-1")
    assert new["generation"] > old["generation"]
    await ok(await stack.write("/pay/charges", new, key="charge", body={"amount": 5}))
    assert [r["generation"] for r in upstream.received] == ["1", str(new["generation"])]
    # The old token stays fenced off.
    await problem(
        await stack.write("/pay/charges", old, key="other", body={"amount": 5}),
        409,
        "stale-generation",
    )


async def test_a_job_with_a_write_in_flight_is_not_purged(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    """Purging a job while one of its writes is in flight (its lease expired meanwhile)
    is refused: that write's record must settle before the job's records can go."""
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    upstream.delay = 0.5
    lease = await stack.lease("job-1", ttl=5)
    write = asyncio.ensure_future(stack.write("/pay/charges", lease, key="charge"))
    await until_in_flight(upstream)
    clock.advance(6)  # the lease has expired; the write is still on its way
    resp = await stack.control.delete("/admin/jobs/job-1")
    doc = await problem(resp, 409, "lease-held")
    assert doc["detail"].startswith("A write of this job is still in flight")
    assert doc["detail"].endswith(".")
    await ok(await write)
    await stack.written()  # its record settles behind its answer
    resp = await stack.control.delete("/admin/jobs/job-1")
    assert resp.status in (200, 204), await resp.text()


async def test_the_same_key_on_another_job_is_independent(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    one = await stack.lease("job-1")
    two = await stack.lease("job-2")
    assert await ok(await stack.write("/pay/c", one, key="step-1")) == b'{"applied": 1}'
    assert await ok(await stack.write("/pay/c", two, key="step-1")) == b'{"applied": 2}'
    # A different body under the same key on the other job is fine too.
    three = await stack.lease("job-3")
    await ok(await stack.write("/pay/c", three, key="step-1", body={"amount": 99}))
    assert [(r["headers"]["Fencing-Job"], r["key"]) for r in upstream.received] == [
        ("job-1", "step-1"),
        ("job-2", "step-1"),
        ("job-3", "step-1"),
    ]
    assert await replayed(await stack.write("/pay/c", one, key="step-1")) == b'{"applied": 1}'
    assert await replayed(await stack.write("/pay/c", two, key="step-1")) == b'{"applied": 2}'


# -- concurrent duplicates ------------------------------------------------------------------


async def test_100_concurrent_duplicates_reach_the_upstream_once(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    upstream.delay = 0.2
    upstream.body = b'{"id": "ch_once"}'
    lease = await stack.lease("job-1")

    async def one() -> tuple[int, Any, bytes]:
        resp = await stack.write("/pay/charges", lease, key="once", body={"amount": 5})
        return resp.status, resp.headers, await resp.read()

    results = await asyncio.gather(*(one() for _ in range(100)))
    assert len(upstream.received) == 1
    forwarded = replays = in_progress = 0
    for status, headers, body in results:
        if status == 201 and "Idempotent-Replayed" not in headers:
            forwarded += 1
            assert body == b'{"id": "ch_once"}'
        elif status == 201:
            replays += 1
            assert headers["Idempotent-Replayed"] == "true"
            assert body == b'{"id": "ch_once"}'
        else:
            in_progress += 1
            assert status == 409, body
            assert headers["Content-Type"] == PROBLEM
            assert b'"reason":"request-in-progress"' in body
            assert int(headers["Retry-After"]) >= 1
    assert forwarded == 1
    assert forwarded + replays + in_progress == 100
    assert in_progress >= 1  # the upstream took 0.2 s: some duplicates came meanwhile
    # Once settled, every retry gets the replay.
    for _ in range(3):
        resp = await stack.write("/pay/charges", lease, key="once", body={"amount": 5})
        assert await replayed(resp) == b'{"id": "ch_once"}'
    assert len(upstream.received) == 1


async def test_a_duplicate_while_in_flight_is_told_to_retry(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    upstream.delay = 0.3
    lease = await stack.lease("job-1")
    first = asyncio.ensure_future(stack.write("/pay/c", lease, key="slow"))
    while not upstream.in_flight:
        await asyncio.sleep(0.01)
    resp = await stack.write("/pay/c", lease, key="slow")
    doc = await problem(resp, 409, "request-in-progress")
    assert resp.headers["Retry-After"] == "1"
    assert doc["job_id"] == "job-1"
    # A different request with that key is still a reuse, in flight or not.
    await problem(
        await stack.write("/pay/c", lease, key="slow", body={"x": 2}), 422, "idempotency-key-reused"
    )
    await ok(await first)
    await replayed(await stack.write("/pay/c", lease, key="slow"))
    assert len(upstream.received) == 1


# -- unknown outcomes -----------------------------------------------------------------------


async def _lose_track(stack: Any, upstream: Upstream, lease: dict[str, Any], cause: str) -> int:
    """Forward one write whose outcome the gateway cannot know. Returns how many requests
    the upstream has recorded (a handler cut off by the timeout records nothing, but it
    did start: ``max_in_flight``)."""
    if cause == "timeout":
        upstream.delay = 0.6
        resp = await stack.write("/pay/charges", lease, key="pay-1")
        doc = await problem(resp, 504, "upstream-timeout")
        assert doc["job_id"] == "job-1" and doc["generation"] == 1
        await upstream_idle(upstream)
        assert upstream.max_in_flight == 1
    else:
        upstream.status = int(cause)
        upstream.body = b'{"error": "bad gateway upstream of the upstream"}'
        resp = await stack.write("/pay/charges", lease, key="pay-1")
        # The upstream's own answer is passed on as it is.
        assert await ok(resp, int(cause)) == upstream.body
        assert len(upstream.received) == 1
    upstream.status, upstream.delay, upstream.body = 201, 0.0, None
    return len(upstream.received)


@pytest.mark.parametrize("cause", ["502", "504", "timeout"])
async def test_unknown_outcome_is_held(make_stack: Any, upstream: Upstream, cause: str) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream, timeout_seconds=0.3)],
        gateway={"ordering_wait_seconds": 0.5},
    )
    lease = await stack.lease("job-1")
    before = await _lose_track(stack, upstream, lease, cause)

    [held] = await unknown_outcomes(stack)
    assert held["job_id"] == "job-1" and held["key"] == "pay-1"
    assert held["state"] == "unknown"
    assert (held["upstream"], held["method"], held["path"]) == ("pay", "POST", "charges")
    assert held["generation"] == 1
    assert held["status"] == (None if cause == "timeout" else int(cause))
    # The note as docs/protocol.md and docs/operations.md show it to operators.
    assert held["note"] == (
        "no answer: TimeoutError" if cause == "timeout" else f"upstream answered {cause}"
    )

    for _ in range(2):
        doc = await problem(
            await stack.write("/pay/charges", lease, key="pay-1"), 409, "outcome-unknown"
        )
        assert doc["job_id"] == "job-1" and doc["generation"] == 1
        # It names the way out: the command and the admin endpoint that resolve it.
        assert "fencegate outcomes resolve" in doc["detail"]
        assert "POST /admin/unknown-outcomes/resolve" in doc["detail"]
    await upstream_idle(upstream)
    assert len(upstream.received) == before
    # Reusing the held key for another request is still a reuse.
    resp = await stack.write("/pay/charges", lease, key="pay-1", body={"amount": 2})
    await problem(resp, 422, "idempotency-key-reused")
    # Other keys are not affected.
    await ok(await stack.write("/pay/charges", lease, key="pay-2"))
    reasons = [e["reason"] for e in await stack.audit()]
    assert reasons[:3] == ["idempotency-key-reused", "outcome-unknown", "outcome-unknown"]
    assert reasons[3:] == (["upstream-timeout"] if cause == "timeout" else [])


@pytest.mark.parametrize("cause", ["502", "504", "timeout"])
async def test_unknown_outcome_is_retried_with_the_same_key(
    make_stack: Any, upstream: Upstream, cause: str
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream, timeout_seconds=0.3, unknown_outcome="retry")],
        gateway={"ordering_wait_seconds": 0.5},
    )
    lease = await stack.lease("job-1")
    before = await _lose_track(stack, upstream, lease, cause)
    assert [i["key"] for i in await unknown_outcomes(stack)] == ["pay-1"]

    answer = await ok(await stack.write("/pay/charges", lease, key="pay-1"))
    assert answer == b'{"applied": %d}' % (before + 1)
    assert [r["key"] for r in upstream.received] == ["pay-1"] * (before + 1)
    assert upstream.received[-1]["body"] == b'{"amount": 1}'
    # Now it has a definite answer: duplicates replay it.
    assert await replayed(await stack.write("/pay/charges", lease, key="pay-1")) == answer
    assert len(upstream.received) == before + 1
    assert await unknown_outcomes(stack) == []


async def test_concurrent_retries_of_an_unknown_key_forward_once(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream, unknown_outcome="retry")],
        gateway={"ordering_wait_seconds": 0.5},
    )
    lease = await stack.lease("job-1")
    upstream.status = 502
    await ok(await stack.write("/pay/c", lease, key="k"), 502)
    upstream.status, upstream.delay = 201, 0.2

    async def one() -> tuple[int, Any, bytes]:
        resp = await stack.write("/pay/c", lease, key="k")
        return resp.status, resp.headers, await resp.read()

    results = await asyncio.gather(*(one() for _ in range(30)))
    assert len(upstream.received) == 2  # the first try and exactly one retry
    fresh = [r for r in results if r[0] == 201 and "Idempotent-Replayed" not in r[1]]
    assert len(fresh) == 1
    for status, headers, body in results:
        if status == 201:
            assert body == fresh[0][2]
        else:
            assert status == 409 and b'"reason":"request-in-progress"' in body, body
            assert headers["Retry-After"]


async def test_a_retry_that_fails_again_stays_unknown(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream, unknown_outcome="retry")],
        gateway={"ordering_wait_seconds": 0.5},
    )
    lease = await stack.lease("job-1")
    upstream.status = 502
    await ok(await stack.write("/pay/c", lease, key="k"), 502)
    await ok(await stack.write("/pay/c", lease, key="k"), 502)
    assert len(upstream.received) == 2
    [held] = await unknown_outcomes(stack)
    assert held["status"] == 502


async def test_resolve_as_applied_makes_duplicates_replay(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    await _lose_track(stack, upstream, lease, "504")

    done = await resolve(
        stack,
        job_id="job-1",
        key="pay-1",
        applied=True,
        status=201,
        headers={"Content-Type": "application/json", "X-Charge-Id": "ch_9"},
        body='{"id": "ch_9"}',
    )
    assert done == {"job_id": "job-1", "key": "pay-1", "resolved": "applied"}
    assert await unknown_outcomes(stack) == []
    resp = await stack.write("/pay/charges", lease, key="pay-1")
    assert await replayed(resp) == b'{"id": "ch_9"}'
    assert resp.headers["X-Charge-Id"] == "ch_9"
    assert len(upstream.received) == 1
    # Resolved once is resolved: a second verdict finds nothing to resolve.
    doc = await resolve(stack, 404, job_id="job-1", key="pay-1", applied=False)
    assert doc["reason"]
    assert await replayed(await stack.write("/pay/charges", lease, key="pay-1"))


async def test_resolve_as_applied_with_a_binary_body(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    await _lose_track(stack, upstream, lease, "502")
    raw = bytes(range(256))
    await resolve(
        stack,
        job_id="job-1",
        key="pay-1",
        applied=True,
        status=200,
        body_base64=base64.b64encode(raw).decode(),
    )
    assert await replayed(await stack.write("/pay/charges", lease, key="pay-1"), 200) == raw


async def test_resolve_as_not_applied_lets_the_next_request_through(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream, timeout_seconds=0.3)])
    lease = await stack.lease("job-1")
    before = await _lose_track(stack, upstream, lease, "timeout")
    await problem(await stack.write("/pay/charges", lease, key="pay-1"), 409, "outcome-unknown")
    done = await resolve(stack, job_id="job-1", key="pay-1", applied=False)
    assert done["resolved"] == "not-applied"
    assert await unknown_outcomes(stack) == []
    answer = await ok(await stack.write("/pay/charges", lease, key="pay-1"))
    assert [r["key"] for r in upstream.received] == ["pay-1"] * (before + 1)
    assert await replayed(await stack.write("/pay/charges", lease, key="pay-1")) == answer
    assert len(upstream.received) == before + 1


async def test_resolve_refuses_bad_input(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    await _lose_track(stack, upstream, lease, "502")
    for body, status in (
        ({"job_id": "job-1", "key": "pay-1", "applied": True}, 400),  # no status
        ({"job_id": "job-1", "key": "pay-1", "applied": True, "status": 99}, 400),
        (
            {
                "job_id": "job-1",
                "key": "pay-1",
                "applied": True,
                "status": 201,
                "body_base64": "***",
            },
            400,
        ),
        # Not ASCII: base64 refuses it with a ValueError of its own, which was a 500
        # (found by Schemathesis, tests/e2e/test_openapi_fuzz.py).
        (
            {
                "job_id": "job-1",
                "key": "pay-1",
                "applied": True,
                "status": 201,
                "body_base64": "\u009e\u00e2",
            },
            400,
        ),
        ({"job_id": "job-1", "key": "other", "applied": False}, 404),
        ({"job_id": "job-2", "key": "pay-1", "applied": False}, 404),
        ({"key": "pay-1", "applied": False}, 400),
    ):
        resp = await stack.control.post("/admin/unknown-outcomes/resolve", json=body)
        assert resp.status == status, (body, await resp.text())
        assert resp.content_type == PROBLEM
    # Nothing was resolved by the refused calls.
    assert [i["key"] for i in await unknown_outcomes(stack)] == ["pay-1"]
    # A key with a definite answer is not an unknown outcome.
    await ok(await stack.write("/pay/charges", lease, key="fine"))
    await resolve(stack, 404, job_id="job-1", key="fine", applied=False)
    await replayed(await stack.write("/pay/charges", lease, key="fine"))


async def test_an_in_flight_record_past_its_deadline_is_unknown(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    """A record whose replica crashed is never settled; once its deadline passes the key
    is held as unknown instead of 'in progress' forever."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream, timeout_seconds=5, connect_timeout_seconds=1)],
        gateway={"ordering_wait_seconds": 0.5},
    )
    upstream.delay = 0.5
    lease = await stack.lease("job-1", ttl=600)
    first = asyncio.ensure_future(stack.write("/pay/c", lease, key="k"))
    while not upstream.in_flight:
        await asyncio.sleep(0.01)
    await problem(await stack.write("/pay/c", lease, key="k"), 409, "request-in-progress")
    # ordering wait + timeout + connect timeout + margin later, nobody settled it.
    clock.advance(60)
    await problem(await stack.write("/pay/c", lease, key="k"), 409, "outcome-unknown")
    assert [i["key"] for i in await unknown_outcomes(stack)] == ["k"]
    await ok(await first)  # the "crashed" forward turns out to settle after all
    # Its record is settled behind its answer: replayed once the settle is in (a loaded
    # machine may take longer than a duplicate's wait for it; outcome-unknown meanwhile,
    # never sent again).
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        resp = await stack.write("/pay/c", lease, key="k")
        if resp.headers.get("Idempotent-Replayed") == "true":
            break
        await problem(resp, 409, "outcome-unknown")
        assert asyncio.get_running_loop().time() < deadline, "the late answer was never kept"
        await asyncio.sleep(0.05)
    await replayed(resp)
    assert len(upstream.received) == 1


class FlakyUpstream:
    """An upstream that loses the connection: after the body was sent to it (``close``),
    or halfway through its answer (``cut``); ``ok`` answers normally."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.calls: list[str | None] = []
        self.url = ""

    async def handler(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls.append(request.headers.get("Idempotency-Key"))
        assert request.transport is not None
        if self.mode == "close":
            request.transport.close()
            return web.Response(status=201)
        resp = web.StreamResponse(status=201, headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"charged": ')
        if self.mode == "cut":
            await asyncio.sleep(0.05)
            request.transport.close()
            return resp
        await resp.write(b"true}")
        await resp.write_eof()
        return resp


@pytest.fixture
async def flaky(aiohttp_server: Callable[..., Any]) -> FlakyUpstream:
    up = FlakyUpstream()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", up.handler)
    server = await aiohttp_server(app)
    up.url = str(server.make_url("")).rstrip("/")
    return up


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
@pytest.mark.parametrize("mode", ["close", "cut"])
async def test_a_connection_lost_after_sending_is_an_unknown_outcome(
    make_stack: Any, flaky: FlakyUpstream, mode: str, method: str
) -> None:
    """Once a fenced request has been sent, nothing in the gateway sends it again, for
    every method: aiohttp's client re-sends "idempotent" methods (PUT, DELETE) once by
    itself after a reset connection, and the gateway must not let it."""
    stack = await make_stack(upstreams=[{"name": "pay", "url": flaky.url}])
    lease = await stack.lease("job-1")
    flaky.mode = mode
    try:
        resp = await stack.write("/pay/charges", lease, key="pay-1", method=method)
        body = await resp.read()
    except aiohttp.ClientPayloadError:
        # The answer was cut: the client must see that it is incomplete.
        assert mode == "cut"
    else:
        assert mode == "close", body
        doc = await problem_from(resp.status, resp.headers, body, 502, "upstream-connection-lost")
        assert doc["sent"] == "maybe"
    assert flaky.calls == ["pay-1"]
    [held] = await unknown_outcomes(stack)
    assert (held["key"], held["upstream"]) == ("pay-1", "pay")
    flaky.mode = "ok"
    await problem(
        await stack.write("/pay/charges", lease, key="pay-1", method=method),
        409,
        "outcome-unknown",
    )
    assert flaky.calls == ["pay-1"]


async def test_a_key_reaches_the_upstream_in_one_form_however_it_was_quoted(
    make_stack: Any, upstream: Upstream
) -> None:
    """``"step-1"`` and ``step-1`` are one key to the gateway, and the upstream (which may
    deduplicate by key byte for byte, as Stripe does) must see one key too: a retry of an
    unknown outcome in the other quoting is forwarded with the same bytes."""
    stack = await make_stack(upstreams=[upstream_config(upstream, unknown_outcome="retry")])
    lease = await stack.lease("job-1")
    upstream.status = 502
    await ok(await stack.write("/pay/charges", lease, key='"step-1"'), 502)
    upstream.status = 201
    await ok(await stack.write("/pay/charges", lease, key="step-1"))
    assert [r["key"] for r in upstream.received] == ["step-1", "step-1"]
    assert [r["headers"]["Idempotency-Key"] for r in upstream.received] == ["step-1"] * 2


async def test_retry_policy_keeps_the_key_unknown_when_the_retry_is_not_sent(
    make_stack: Any, aiohttp_server: Callable[..., Any]
) -> None:
    up = Upstream()
    up.status = 502
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", up.handler)
    server = await aiohttp_server(app)
    stack = await make_stack(
        upstreams=[
            {"name": "pay", "url": str(server.make_url("")).rstrip("/"), "unknown_outcome": "retry"}
        ]
    )
    lease = await stack.lease("job-1")
    await ok(await stack.write("/pay/c", lease, key="k"), 502)
    await server.close()  # the upstream goes away: the retry cannot even connect
    await problem(await stack.write("/pay/c", lease, key="k"), 502, "upstream-unavailable")
    # The key is back to unknown (not freed, not stuck in flight).
    [held] = await unknown_outcomes(stack)
    assert (held["key"], held["status"]) == ("k", 502)
    await problem(await stack.write("/pay/c", lease, key="k"), 502, "upstream-unavailable")
    await problem(
        await stack.write("/pay/c", lease, key="k", body={"other": 1}),
        422,
        "idempotency-key-reused",
    )
    assert len(up.received) == 1


@pytest.mark.parametrize(
    ("config", "status"),
    [({}, 429), ({}, 503), ({"not_processed_statuses": [409, 425]}, 425)],
)
async def test_an_answer_that_means_not_processed_leaves_the_key_free(
    make_stack: Any, upstream: Upstream, config: dict[str, Any], status: int
) -> None:
    """ "Too many requests, try later" is not the step's answer: stored, it would be
    replayed on every retry and the step could never succeed under its key."""
    stack = await make_stack(upstreams=[upstream_config(upstream, **config)])
    lease = await stack.lease("job-1")
    upstream.status = status
    upstream.headers = {"Retry-After": "1"}
    resp = await stack.write("/pay/charges", lease, key="pay-1")
    await ok(resp, status)  # the worker gets the upstream's own answer
    assert resp.headers["Retry-After"] == "1"
    upstream.status, upstream.headers = 201, {}
    await ok(await stack.write("/pay/charges", lease, key="pay-1"))
    await replayed(await stack.write("/pay/charges", lease, key="pay-1"))
    assert len(upstream.received) == 2
    assert await unknown_outcomes(stack) == []


async def test_not_processed_statuses_can_be_turned_off(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream, not_processed_statuses=[])])
    lease = await stack.lease("job-1")
    upstream.status = 429
    await ok(await stack.write("/pay/charges", lease, key="pay-1"), 429)
    await replayed(await stack.write("/pay/charges", lease, key="pay-1"), 429)
    assert len(upstream.received) == 1


async def test_connection_refused_leaves_the_key_free(make_stack: Any) -> None:
    stack = await make_stack(
        upstreams=[{"name": "pay", "url": f"http://127.0.0.1:{closed_port()}"}],
        gateway={"ordering_wait_seconds": 0.5},
    )
    lease = await stack.lease("job-1")
    for _ in range(2):
        doc = await problem(
            await stack.write("/pay/charges", lease, key="pay-1"), 502, "upstream-unavailable"
        )
        assert doc["job_id"] == "job-1" and doc["generation"] == 1
    assert await unknown_outcomes(stack) == []
    reasons = [e["reason"] for e in await stack.audit()]
    assert reasons == ["upstream-unavailable", "upstream-unavailable"]


# -- retention ------------------------------------------------------------------------------


async def test_records_past_retention_are_purged_but_unknown_ones_kept(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream)],
        gateway={"idempotency_retention_seconds": 60},
    )
    app = stack.control.app
    lease = await stack.lease("job-1", ttl=600)
    await ok(await stack.write("/pay/c", lease, key="done"))
    upstream.status = 502
    await ok(await stack.write("/pay/c", lease, key="unknown"), 502)
    upstream.status = 201

    clock.advance(30)
    await upkeep(app[SETTINGS], app[STORE], app[GATEWAY_STATE])
    await replayed(await stack.write("/pay/c", lease, key="done"))

    clock.advance(31)
    await upkeep(app[SETTINGS], app[STORE], app[GATEWAY_STATE])
    # The completed record is gone: the key is forwarded again.
    await ok(await stack.write("/pay/c", lease, key="done"))
    # The unknown one is never purged by retention.
    await problem(await stack.write("/pay/c", lease, key="unknown"), 409, "outcome-unknown")
    assert [r["key"] for r in upstream.received] == ["done", "unknown", "done"]


async def test_retention_purges_in_batches_of_short_transactions(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    """One purge statement removes ``:limit`` records at most (the oldest first), so no
    transaction holds SQLite's write lock for a whole backlog; the store runs it until
    the backlog is gone (on SQLite in batches, on PostgreSQL in one statement). Unknown
    outcomes stay."""
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    gateway = stack.control.app[GATEWAY_STATE]
    lease = await stack.lease("job-1", ttl=600)
    for i in range(25):
        await ok(await stack.write("/pay/c", lease, key=f"k{i:02d}"))
        clock.advance(1)
    upstream.status = 502
    await ok(await stack.write("/pay/c", lease, key="unknown"), 502)
    clock.advance(100)

    first = await gateway.store.backend.run("purge_records", older_than=110.0, limit=10)
    # k00..k14 are older than 110 s; the oldest ten went, k10 still replays.
    assert first is not None and first["changed"] == 10
    await replayed(await stack.write("/pay/c", lease, key="k10"))
    assert await gateway.store.purge_records(60, batch=4) == 15
    assert await gateway.store.purge_records(0, batch=4) == 0
    upstream.status = 201
    # Every completed record is gone (the keys are sent again); the unknown one stays.
    await ok(await stack.write("/pay/c", lease, key="k00"))
    await ok(await stack.write("/pay/c", lease, key="k24"))
    await problem(await stack.write("/pay/c", lease, key="unknown"), 409, "outcome-unknown")
