"""Slow hostile clients against a real ``fencegate serve`` (SQLite and PostgreSQL): sockets
that trickle request bodies, with a made-up well-formed token, with none, or on an
unfenced method, must not take the concurrency slots of workers that hold a lease.

What keeps them out: a fenced write whose body is still arriving has its lease checked
before the body is read (an unknown token is refused at once and never takes a slot);
unfenced requests have a pool of their own; every body must arrive within
``body_timeout_seconds`` (and no read may wait longer than ``body_idle_timeout_seconds``),
or the request is answered ``408 body-timeout`` and its connection closed; a request head
must be complete within ``keepalive_timeout_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.records import migrate
from tests.support import pg_admin, pg_url_of, postgres_unavailable

from ._support import (
    KEEPALIVE,
    MAX_BODY,
    MAX_CONCURRENT,
    WELL_FORMED_UNKNOWN_TOKEN,
    Stack,
    build,
    read_response,
    request,
)

BODY_TIMEOUT = 3.0
BODY_IDLE_TIMEOUT = 0.5  # the trickles send a byte every 0.2 s: under it
HOSTILE = 2 * MAX_CONCURRENT  # per kind: more than all the slots there are
DECLARED = MAX_BODY - 10  # under the limit: only its slowness is hostile


class SlowStack(Stack):
    def config_text(self) -> str:
        return (
            super()
            .config_text()
            .replace(
                "[gateway]\n",
                "[gateway]\n"
                f"body_timeout_seconds = {BODY_TIMEOUT}\n"
                f"body_idle_timeout_seconds = {BODY_IDLE_TIMEOUT}\n",
            )
        )


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """Overrides the package's ``stack``: this module's server has short body timeouts;
    the package's ``stays_up`` checks it after every test."""
    home = Path(tmp_path_factory.mktemp(f"starve-{request.param}"))
    if request.param == "sqlite":
        srv = SlowStack(home)
        try:
            srv.start()
            yield srv
        finally:
            srv.stop()
        return
    name = f"fencegate_starve_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        asyncio.run(asyncio.wait_for(pg_admin(f'CREATE DATABASE "{name}"'), 10))
    except Exception as error:  # any failure to reach the server
        postgres_unavailable(f"{type(error).__name__}: {error}")
    url = pg_url_of(name)
    srv = SlowStack(home, database_url=url)
    try:
        migrate.upgrade(url)
        srv.start()
        yield srv
    finally:
        srv.stop()
        asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def fenced(token: str, key: str) -> list[tuple[str, str]]:
    return [("Fencing-Token", token), ("Idempotency-Key", key)]


def slow_head(method: str, target: str, headers: list[tuple[str, str]]) -> bytes:
    """A request head that declares a body of DECLARED bytes; the body is sent later."""
    return build(method, target, [*headers, ("Content-Length", str(DECLARED))])


async def trickle(port: int, head: bytes, stop: asyncio.Event, answers: Counter[Any]) -> None:
    """Send ``head``, then one body byte every 0.2 s, never finishing the body; when the
    server answers or closes, count the answer and start again, until ``stop``."""
    while not stop.is_set():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = asyncio.ensure_future(read_response(reader))
        started = time.monotonic()
        try:
            writer.write(head)
            while not stop.is_set() and not answer.done():
                writer.write(b"x")
                await writer.drain()
                await asyncio.wait([answer], timeout=0.2)
        except ConnectionError:
            pass
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait([answer], timeout=1)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        response = None
        if answer.done() and not answer.cancelled() and answer.exception() is None:
            response = answer.result()
        if response is not None:
            answers[(response.status, response.problem_reason)] += 1
            answers[("ms", response.problem_reason)] = max(
                answers[("ms", response.problem_reason)],
                int((time.monotonic() - started) * 1000),
            )
        elif not stop.is_set():
            answers[("closed", None)] += 1
        answer.cancel()


async def test_trickling_bodies_do_not_starve_lease_holders(stack: Stack) -> None:
    """Three kinds of hostile sockets, each twice as many as there are slots, trickle
    bodies the whole time; four workers with valid leases write 10 times each meanwhile,
    and every one of their writes is forwarded and answered by the upstream."""
    stop = asyncio.Event()
    forged: Counter[Any] = Counter()
    tokenless: Counter[Any] = Counter()
    unfenced: Counter[Any] = Counter()
    kinds = [
        (slow_head("POST", "/pay/forged", fenced(WELL_FORMED_UNKNOWN_TOKEN, "hostile")), forged),
        (slow_head("POST", "/pay/no-token", [("Idempotency-Key", "hostile")]), tokenless),
        (slow_head("GET", "/pay/unfenced", []), unfenced),  # passes through, body and all
    ]
    hostile = [
        asyncio.create_task(trickle(stack.proxy_port, head, stop, answers))
        for head, answers in kinds
        for _ in range(HOSTILE)
    ]
    leases = [await stack.lease(f"starve-{uuid.uuid4().hex[:8]}-{i}") for i in range(4)]
    mark = stack.mark()

    async def worker(lease: dict[str, Any]) -> list[int]:
        statuses = []
        for n in range(10):
            resp = await request(
                stack.proxy_port,
                "POST",
                f"/pay/{lease['job_id']}/{n}",
                fenced(lease["lease_token"], f"step-{n}"),
                b'{"amount": 1}',
            )
            statuses.append(resp.status)
            await asyncio.sleep(0.1)
        return statuses

    try:
        await asyncio.sleep(0.5)  # the hostile sockets are all in place
        results = await asyncio.wait_for(asyncio.gather(*(worker(lease) for lease in leases)), 30)
        assert results == [[201] * 10] * 4, (results, forged, tokenless, unfenced)
        # Long enough for the unfenced ones to run into the body timeout.
        deadline = time.monotonic() + BODY_TIMEOUT + 20
        while unfenced[(408, "body-timeout")] < HOSTILE:
            await asyncio.sleep(0.1)
            assert time.monotonic() < deadline, unfenced
            assert not any(task.done() for task in hostile), [t.exception() for t in hostile]
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*hostile, return_exceptions=True), 30)

    forwarded = [e["target"] for e in stack.since(mark)]
    assert sorted(forwarded) == sorted(
        f"/{lease['job_id']}/{n}" for lease in leases for n in range(10)
    )

    def answered(answers: Counter[Any]) -> set[tuple[int, str | None]]:
        return {k for k in answers if isinstance(k[0], int)}

    # The forged token and the missing one were refused without their bodies being
    # read (a body read would have ended in 408 body-timeout: it never completes).
    assert answered(forged) == {(403, "invalid-fencing-token")}, forged
    assert forged[(403, "invalid-fencing-token")] >= HOSTILE, forged
    assert answered(tokenless) == {(428, "missing-fencing-token")}, tokenless
    assert tokenless[(428, "missing-fencing-token")] >= HOSTILE, tokenless
    # The unfenced ones were cut off at the body timeout (those beyond their own pool
    # got 503 at once; the workers got none); none was forwarded.
    assert answered(unfenced) <= {(408, "body-timeout"), (503, "gateway-overloaded")}, unfenced
    assert unfenced[("ms", "body-timeout")] >= BODY_TIMEOUT * 1000, unfenced


async def test_a_lease_holder_that_trickles_is_cut_off(stack: Stack) -> None:
    """A worker with a valid lease gets a slot, but not for longer than the body may
    take: 408 body-timeout, the connection closed, nothing forwarded."""
    lease = await stack.lease(f"slow-{uuid.uuid4().hex[:8]}")
    mark = stack.mark()
    stop = asyncio.Event()
    answers: Counter[Any] = Counter()
    head = slow_head("POST", "/pay/slow-holder", fenced(lease["lease_token"], "slow"))
    task = asyncio.create_task(trickle(stack.proxy_port, head, stop, answers))
    try:
        deadline = time.monotonic() + BODY_TIMEOUT + 10
        while not answers[(408, "body-timeout")]:
            await asyncio.sleep(0.05)
            assert time.monotonic() < deadline, answers
            assert not task.done(), task.exception()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert answers[("ms", "body-timeout")] >= BODY_TIMEOUT * 1000, answers
    assert stack.since(mark) == []
    # The same key, sent whole, is forwarded: the cut-off write left no claim behind.
    resp = await request(
        stack.proxy_port,
        "POST",
        "/pay/slow-holder",
        fenced(lease["lease_token"], "slow"),
        b"x" * DECLARED,
    )
    assert resp.status == 201, resp


async def test_a_stalled_body_is_cut_off_after_the_idle_timeout(stack: Stack) -> None:
    lease = await stack.lease(f"stall-{uuid.uuid4().hex[:8]}")
    mark = stack.mark()
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.proxy_port)
    try:
        started = time.monotonic()
        writer.write(slow_head("POST", "/pay/stalled", fenced(lease["lease_token"], "st")))
        writer.write(b"x" * 100)
        response = await asyncio.wait_for(read_response(reader), BODY_TIMEOUT + 5)
        elapsed = time.monotonic() - started
        assert response is not None and response.status == 408, response
        assert response.problem_reason == "body-timeout"
        assert response.header("Connection") == "close", response
        assert BODY_IDLE_TIMEOUT <= elapsed < BODY_TIMEOUT, elapsed  # idle, not total
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    assert stack.since(mark) == []


async def test_a_trickled_head_is_closed_after_keepalive_timeout(stack: Stack) -> None:
    """Bytes of a head that never ends do not extend the head's time."""
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.proxy_port)
    started = time.monotonic()
    closed_after = None
    try:
        writer.write(b"POST /pay/x HTTP/1.1\r\nHost: gateway.test\r\nX-Slow: ")
        for _ in range(int((KEEPALIVE + 5) / 0.2)):
            try:
                writer.write(b"a")
                await writer.drain()
                data = await asyncio.wait_for(reader.read(1), 0.2)
            except TimeoutError:
                continue
            except ConnectionError:
                data = b""
            if data == b"":
                closed_after = time.monotonic() - started
                break
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    assert closed_after is not None, "the server kept a trickled head open"
    assert KEEPALIVE * 0.9 <= closed_after < KEEPALIVE + 8, closed_after


async def test_the_two_pools_are_separate(stack: Stack) -> None:
    """max_concurrent_requests fenced writes in flight (to an upstream that answers
    after 10 s): the next fenced write gets 503 at once, while an unfenced request is
    still served from its own pool."""
    leases = [
        await stack.lease(f"pool-{uuid.uuid4().hex[:8]}-{i}") for i in range(MAX_CONCURRENT + 1)
    ]
    mark = stack.mark()
    slow = [
        asyncio.create_task(
            request(stack.proxy_port, "POST", "/pay/slow", fenced(lease["lease_token"], "s"), b"{}")
        )
        for lease in leases[:MAX_CONCURRENT]
    ]
    try:
        deadline = time.monotonic() + 5
        while len(stack.since(mark)) < MAX_CONCURRENT:
            assert time.monotonic() < deadline, "the slow writes never arrived"
            await asyncio.sleep(0.02)
        resp = await request(
            stack.proxy_port, "POST", "/pay/x", fenced(leases[-1]["lease_token"], "x"), b"{}"
        )
        assert (resp.status, resp.problem_reason) == (503, "gateway-overloaded"), resp
        resp = await request(stack.proxy_port, "GET", "/pay/unfenced-meanwhile")
        assert resp.status == 201, resp
    finally:
        answers = await asyncio.gather(*slow)
    assert {(a.status, a.problem_reason) for a in answers} == {(504, "upstream-timeout")}
