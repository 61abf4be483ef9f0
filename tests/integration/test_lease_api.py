"""The lease API of the control listener, over real HTTP, on SQLite and PostgreSQL.

Every call of the SPEC's lease API table with each of its answers, the refusals of a
lease that is no longer current, and bad input: a 400 problem document naming the field
and nothing written.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import random
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from aiohttp.test_utils import TestClient

from gateway.service.server import create_control_app
from lease_core import exceptions as exc
from lease_core.schema import job_tombstones, jobs, leases
from lease_core.store import GRANT_SWEEP_SECONDS, LeaseStore
from tests import lease_model as rules
from tests.support import FakeClock

Client = TestClient[Any, Any]
PROBLEM = "application/problem+json"
LEASE_KEYS = {
    "job_id",
    "generation",
    "owner",
    "lease_token",
    "expires_at",
    "ttl_seconds",
    "payload",
}
JOB_KEYS = {
    "job_id",
    "queue",
    "state",
    "generation",
    "owner",
    "lease_expires_at",
    "attempts",
    "max_attempts",
    "payload",
    "result",
    "error",
}


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


async def expect(resp: Any, status: int) -> Any:
    """The answer's JSON (None for an empty body) after checking its status."""
    body = await resp.read()
    assert resp.status == status, body
    if not body:
        return None
    return await resp.json(content_type=None)


async def expect_problem(resp: Any, status: int, reason: str) -> dict[str, Any]:
    doc: dict[str, Any] = await expect(resp, status)
    assert resp.content_type == PROBLEM
    assert doc["status"] == status
    assert doc["reason"] == reason
    assert doc["type"].endswith("/" + reason)
    assert doc["title"] and doc["detail"]
    return doc


Call = Callable[..., Awaitable[Any]]


@pytest.fixture
def api(control: Client) -> Call:
    """``await api(method, path, json=..., status=...)`` -> the answer's JSON."""

    async def call(method: str, path: str, status: int, **kwargs: Any) -> Any:
        return await expect(await control.request(method, path, **kwargs), status)

    return call


@pytest.fixture
def lease_of(api: Call) -> Callable[..., Awaitable[dict[str, Any]]]:
    """Acquire a named job and return the lease."""

    async def acquire(job_id: str, owner: str = "w1", **body: Any) -> dict[str, Any]:
        lease: dict[str, Any] = await api(
            "PUT", f"/v1/jobs/{job_id}/lease", 201, json={"owner": owner, **body}
        )
        return lease

    return acquire


async def db_snapshot(store: LeaseStore) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the lease tables, to prove that a refused request wrote nothing."""
    out = {}
    async with store.backend.engine.connect() as conn:
        for table, key in ((jobs, jobs.c.job_id), (leases, leases.c.token_hash)):
            rows = await conn.execute(sa.select(table).order_by(key))
            out[table.name] = [tuple(r) for r in rows]
        rows = await conn.execute(sa.select(job_tombstones).order_by(job_tombstones.c.job_id))
        out[job_tombstones.name] = [tuple(r) for r in rows]
    return out


# -- enqueue and get ------------------------------------------------------------------------


async def test_enqueue_then_get(api: Call) -> None:
    job = await api(
        "POST",
        "/v1/jobs",
        201,
        json={"queue": "mail", "job_id": "j-1", "payload": {"to": "a@b"}, "max_attempts": 5},
    )
    assert JOB_KEYS <= set(job)
    assert job["job_id"] == "j-1"
    assert job["queue"] == "mail"
    assert job["state"] == "pending"
    assert job["generation"] == 0
    assert job["owner"] is None and job["lease_expires_at"] is None
    assert job["attempts"] == 0 and job["max_attempts"] == 5
    assert job["payload"] == {"to": "a@b"}
    assert job["result"] is None and job["error"] is None
    assert await api("GET", "/v1/jobs/j-1", 200) == job


async def test_enqueue_defaults(api: Call) -> None:
    job = await api("POST", "/v1/jobs", 201, json={})
    assert job["queue"] == "default"
    assert job["max_attempts"] == 3
    assert len(job["job_id"]) >= 16
    other = await api("POST", "/v1/jobs", 201)  # no body at all
    assert other["job_id"] != job["job_id"]


async def test_enqueue_existing_job_id_is_409(
    api: Call, control: Client, store: LeaseStore
) -> None:
    await api("POST", "/v1/jobs", 201, json={"job_id": "dup", "payload": 1})
    before = await db_snapshot(store)
    doc = await expect_problem(
        await control.post("/v1/jobs", json={"job_id": "dup", "payload": 2}), 409, "job-exists"
    )
    assert doc["job_id"] == "dup"
    assert await db_snapshot(store) == before
    assert (await api("GET", "/v1/jobs/dup", 200))["payload"] == 1


async def test_get_unknown_job_is_404(control: Client) -> None:
    doc = await expect_problem(await control.get("/v1/jobs/nope"), 404, "job-not-found")
    assert doc["job_id"] == "nope"


# -- claim ------------------------------------------------------------------------------------


async def test_claim_grants_a_lease(api: Call, clock: FakeClock) -> None:
    await api("POST", "/v1/jobs", 201, json={"queue": "q", "job_id": "a", "payload": [1, 2]})
    lease = await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w1", "ttl_seconds": 12.5})
    assert set(lease) == LEASE_KEYS
    assert lease["job_id"] == "a"
    assert lease["generation"] == 1
    assert lease["owner"] == "w1"
    assert lease["ttl_seconds"] == 12.5
    assert lease["payload"] == [1, 2]
    assert lease["lease_token"].startswith("fgl_")
    assert len(lease["lease_token"]) >= 4 + 22  # >= 128 random bits in base64
    assert lease["expires_at"] == rfc3339(clock.now + 12.5)

    job = await api("GET", "/v1/jobs/a", 200)
    assert job["state"] == "leased"
    assert job["owner"] == "w1"
    assert job["generation"] == 1
    assert job["attempts"] == 1
    assert job["lease_expires_at"] == lease["expires_at"]
    assert lease["lease_token"] not in str(job)


async def test_claim_uses_the_default_ttl(api: Call, clock: FakeClock) -> None:
    await api("POST", "/v1/jobs", 201, json={"queue": "q"})
    lease = await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w1"})
    assert lease["ttl_seconds"] == 30
    assert lease["expires_at"] == rfc3339(clock.now + 30)


async def test_ttl_seconds_is_one_json_type_on_every_database(control: Client) -> None:
    """The lease document's ``ttl_seconds`` on SQLite and PostgreSQL alike: a whole
    number of seconds is a JSON integer (SQLite gave ``30``, PostgreSQL ``30.0``); a
    fraction stays a fraction. Read from the raw JSON text, as any client sees it."""

    async def ttl_of(resp: Any, status: int) -> Any:
        text = await resp.text()
        assert resp.status == status, text
        return json.loads(text)["ttl_seconds"]

    await control.post("/v1/jobs", json={"queue": "q"})
    claimed = await ttl_of(await control.post("/v1/queues/q/claim", json={"owner": "w"}), 200)
    assert claimed == 30 and type(claimed) is int  # the default, 30.0 in the settings
    resp = await control.put("/v1/jobs/a/lease", json={"owner": "w", "ttl_seconds": 12})
    assert await ttl_of(resp, 201) == 12
    resp = await control.put("/v1/jobs/b/lease", json={"owner": "w", "ttl_seconds": 12.0})
    whole = await ttl_of(resp, 201)
    assert whole == 12 and type(whole) is int
    resp = await control.put("/v1/jobs/c/lease", json={"owner": "w", "ttl_seconds": 1.5})
    token = (await resp.json())["lease_token"]
    assert (await resp.json())["ttl_seconds"] == 1.5
    renew = {"lease_token": token}
    kept = await ttl_of(await control.post("/v1/leases/renew", json=renew), 200)
    assert kept == 1.5 and type(kept) is float
    renewed = await ttl_of(
        await control.post("/v1/leases/renew", json={**renew, "ttl_seconds": 20.0}), 200
    )
    assert renewed == 20 and type(renewed) is int


async def test_claim_with_nothing_to_claim_is_204(api: Call, control: Client) -> None:
    resp = await control.post("/v1/queues/empty/claim", json={"owner": "w1"})
    assert resp.status == 204
    assert await resp.read() == b""
    # Jobs of another queue are not claimed, and a held job is not claimed twice.
    await api("POST", "/v1/jobs", 201, json={"queue": "other"})
    await api("POST", "/v1/jobs", 201, json={"queue": "q"})
    assert await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w1"})
    assert await api("POST", "/v1/queues/q/claim", 204, json={"owner": "w2"}) is None


async def test_each_claim_takes_a_different_job(api: Call) -> None:
    for i in range(3):
        await api("POST", "/v1/jobs", 201, json={"queue": "q", "job_id": f"j{i}"})
    got = [
        (await api("POST", "/v1/queues/q/claim", 200, json={"owner": f"w{i}"}))["job_id"]
        for i in range(3)
    ]
    assert sorted(got) == ["j0", "j1", "j2"]
    await api("POST", "/v1/queues/q/claim", 204, json={"owner": "w9"})


async def test_expired_lease_is_reclaimed_with_a_higher_generation(
    api: Call, control: Client, clock: FakeClock
) -> None:
    await api("POST", "/v1/jobs", 201, json={"queue": "q", "job_id": "j"})
    first = await api("POST", "/v1/queues/q/claim", 200, json={"owner": "a", "ttl_seconds": 10})
    clock.advance(9.9)
    await api("POST", "/v1/queues/q/claim", 204, json={"owner": "b"})
    clock.advance(0.1)  # exactly at expiry: expired
    second = await api("POST", "/v1/queues/q/claim", 200, json={"owner": "b", "ttl_seconds": 10})
    assert second["job_id"] == "j"
    assert second["generation"] > first["generation"]
    assert second["lease_token"] != first["lease_token"]
    # The first lease is now stale for every operation.
    for op, body in (
        ("renew", {}),
        ("complete", {"result": 1}),
        ("fail", {"error": "x"}),
        ("release", {}),
    ):
        resp = await control.post(
            f"/v1/leases/{op}", json={"lease_token": first["lease_token"], **body}
        )
        await expect_problem(resp, 409, "stale-generation")
    job = await api("GET", "/v1/jobs/j", 200)
    assert job["owner"] == "b" and job["state"] == "leased" and job["result"] is None


# -- acquire ----------------------------------------------------------------------------------


async def test_acquire_creates_the_job(api: Call, lease_of: Any, clock: FakeClock) -> None:
    lease = await lease_of("named", "w1", ttl_seconds=5, queue="q2", payload={"k": 1})
    assert set(lease) == LEASE_KEYS
    assert lease["generation"] == 1
    assert lease["expires_at"] == rfc3339(clock.now + 5)
    assert lease["payload"] == {"k": 1}
    job = await api("GET", "/v1/jobs/named", 200)
    assert job["queue"] == "q2"
    assert job["state"] == "leased"
    assert job["owner"] == "w1"


async def test_acquire_of_a_held_job_is_409(
    control: Client, lease_of: Any, store: LeaseStore
) -> None:
    await lease_of("named", "w1", ttl_seconds=60)
    before = await db_snapshot(store)
    resp = await control.put("/v1/jobs/named/lease", json={"owner": "w2"})
    doc = await expect_problem(resp, 409, "lease-held")
    assert doc["job_id"] == "named"
    # The answer says when the lease ends.
    assert doc["lease_expires_at"].endswith("Z")
    assert f"until {doc['lease_expires_at']}" in doc["detail"]
    assert await db_snapshot(store) == before


async def test_acquire_of_an_expired_lease_by_another_owner(
    control: Client, lease_of: Any, clock: FakeClock
) -> None:
    first = await lease_of("named", "w1", ttl_seconds=10)
    clock.advance(10)
    second = await lease_of("named", "w2")
    assert second["generation"] > first["generation"]
    resp = await control.post("/v1/leases/renew", json={"lease_token": first["lease_token"]})
    await expect_problem(resp, 409, "stale-generation")


async def test_same_owner_reacquire_fences_its_predecessor(
    api: Call, control: Client, lease_of: Any
) -> None:
    first = await lease_of("named", "w1", ttl_seconds=60)
    second = await lease_of("named", "w1", ttl_seconds=60)
    assert second["generation"] > first["generation"]
    assert second["lease_token"] != first["lease_token"]
    resp = await control.post("/v1/leases/renew", json={"lease_token": first["lease_token"]})
    await expect_problem(resp, 409, "stale-generation")
    resp = await control.post("/v1/leases/complete", json={"lease_token": first["lease_token"]})
    await expect_problem(resp, 409, "stale-generation")
    # The new lease is untouched by the refused calls and still works.
    assert (await api("GET", "/v1/jobs/named", 200))["state"] == "leased"
    await api("POST", "/v1/leases/renew", 200, json={"lease_token": second["lease_token"]})


async def test_acquire_of_a_finished_job_is_refused(
    control: Client, api: Call, lease_of: Any
) -> None:
    lease = await lease_of("named")
    await api("POST", "/v1/leases/complete", 200, json={"lease_token": lease["lease_token"]})
    resp = await control.put("/v1/jobs/named/lease", json={"owner": "w1"})
    await expect_problem(resp, 409, "job-finished")
    assert (await api("GET", "/v1/jobs/named", 200))["generation"] == lease["generation"]


# -- renew ------------------------------------------------------------------------------------


async def test_renew_extends_the_lease_without_giving_out_the_token(
    api: Call, lease_of: Any, clock: FakeClock
) -> None:
    lease = await lease_of("j", ttl_seconds=10)
    clock.advance(8)
    renewed = await api("POST", "/v1/leases/renew", 200, json={"lease_token": lease["lease_token"]})
    assert "lease_token" not in renewed
    assert set(renewed) == LEASE_KEYS - {"lease_token"}
    assert renewed["generation"] == lease["generation"]  # renewing is not a grant
    assert renewed["ttl_seconds"] == 10  # the lease's own TTL by default
    assert renewed["expires_at"] == rfc3339(clock.now + 10)
    clock.advance(8)  # past the first expiry, within the renewed one
    again = await api(
        "POST",
        "/v1/leases/renew",
        200,
        json={"lease_token": lease["lease_token"], "ttl_seconds": 3},
    )
    assert again["ttl_seconds"] == 3
    assert again["expires_at"] == rfc3339(clock.now + 3)
    assert (await api("GET", "/v1/jobs/j", 200))["lease_expires_at"] == again["expires_at"]


async def test_renew_after_expiry_is_lease_expired(
    api: Call, control: Client, lease_of: Any, clock: FakeClock
) -> None:
    lease = await lease_of("j", ttl_seconds=10)
    clock.advance(10.001)
    for op in ("renew", "complete", "fail", "release"):
        resp = await control.post(f"/v1/leases/{op}", json={"lease_token": lease["lease_token"]})
        await expect_problem(resp, 409, "lease-expired")
    job = await api("GET", "/v1/jobs/j", 200)
    assert job["state"] == "leased"
    assert job["lease_expires_at"] == lease["expires_at"]


async def test_unknown_or_malformed_token_is_refused(control: Client) -> None:
    for token in ("fgl_" + "A" * 32, "not-a-token", "x"):
        resp = await control.post("/v1/leases/renew", json={"lease_token": token})
        await expect_problem(resp, 403, "invalid-lease-token")


# -- complete, fail, release --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "body", "state"),
    [
        ("complete", {"result": {"charged": 42}}, "completed"),
        ("fail", {"error": "boom"}, "pending"),
        ("release", {}, "pending"),
    ],
)
async def test_ending_a_lease_then_every_call_with_it_is_lease_ended(
    api: Call, control: Client, lease_of: Any, op: str, body: dict[str, Any], state: str
) -> None:
    lease = await lease_of("j", ttl_seconds=30)
    token = lease["lease_token"]
    job = await api("POST", f"/v1/leases/{op}", 200, json={"lease_token": token, **body})
    assert job["job_id"] == "j"
    assert job["state"] == state
    assert job["generation"] == lease["generation"]
    assert job["lease_expires_at"] is None
    if op == "complete":
        assert job["result"] == {"charged": 42}
    if op == "fail":
        assert job["error"] == "boom"
        assert job["attempts"] == 1
    if op == "release":
        assert job["attempts"] == 0  # a release does not use up an attempt
    for again in ("renew", "complete", "fail", "release"):
        resp = await control.post(f"/v1/leases/{again}", json={"lease_token": token})
        await expect_problem(resp, 409, "lease-ended")
    assert await api("GET", "/v1/jobs/j", 200) == job


async def test_released_job_is_claimable_at_once(api: Call, lease_of: Any) -> None:
    lease = await lease_of("j", queue="q")
    await api("POST", "/v1/leases/release", 200, json={"lease_token": lease["lease_token"]})
    again = await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w2"})
    assert again["job_id"] == "j"
    assert again["generation"] == lease["generation"] + 1


async def test_fail_with_retry_delay(api: Call, clock: FakeClock) -> None:
    await api("POST", "/v1/jobs", 201, json={"queue": "q", "job_id": "j", "max_attempts": 3})
    lease = await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w1"})
    job = await api(
        "POST",
        "/v1/leases/fail",
        200,
        json={"lease_token": lease["lease_token"], "error": "try later", "retry_in_seconds": 60},
    )
    assert job["state"] == "pending"
    await api("POST", "/v1/queues/q/claim", 204, json={"owner": "w2"})
    clock.advance(59.9)
    await api("POST", "/v1/queues/q/claim", 204, json={"owner": "w2"})
    clock.advance(0.1)
    again = await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w2"})
    assert again["job_id"] == "j"
    assert again["generation"] == lease["generation"] + 1


async def test_fail_out_of_attempts_is_failed(api: Call, clock: FakeClock) -> None:
    await api("POST", "/v1/jobs", 201, json={"queue": "q", "job_id": "j", "max_attempts": 2})
    for attempt in (1, 2):
        lease = await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w"})
        job = await api(
            "POST", "/v1/leases/fail", 200, json={"lease_token": lease["lease_token"], "error": "e"}
        )
        assert job["attempts"] == attempt
    assert job["state"] == "failed"
    assert job["error"] == "e"
    clock.advance(3600)
    await api("POST", "/v1/queues/q/claim", 204, json={"owner": "w"})
    page = await api("GET", "/v1/jobs?state=failed", 200)
    assert [j["job_id"] for j in page["items"]] == ["j"]


async def test_expired_lease_on_the_last_attempt_is_not_claimed(
    api: Call, clock: FakeClock, store: LeaseStore
) -> None:
    await api("POST", "/v1/jobs", 201, json={"queue": "q", "job_id": "j", "max_attempts": 1})
    await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w", "ttl_seconds": 5})
    clock.advance(6)
    await api("POST", "/v1/queues/q/claim", 204, json={"owner": "w"})
    assert await store.fail_exhausted() == 1
    job = await api("GET", "/v1/jobs/j", 200)
    assert job["state"] == "failed"
    assert job["error"]


async def test_a_renewed_lease_is_not_failed_at_its_first_expiry(
    api: Call, clock: FakeClock, store: LeaseStore
) -> None:
    # The upkeep finds expired leases through the index of leased jobs by expiry, which
    # every renewal moves.
    await api("POST", "/v1/jobs", 201, json={"queue": "q", "job_id": "j", "max_attempts": 1})
    lease = await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w", "ttl_seconds": 5})
    clock.advance(4)
    await api("POST", "/v1/leases/renew", 200, json={"lease_token": lease["lease_token"]})
    clock.advance(4)  # past the first expiry, within the renewed one
    assert await store.fail_exhausted() == 0
    clock.advance(2)
    assert await store.fail_exhausted() == 1
    assert (await api("GET", "/v1/jobs/j", 200))["state"] == "failed"


async def test_old_grants_are_forgotten_but_a_jobs_current_grant_is_kept(
    api: Call, clock: FakeClock, store: LeaseStore
) -> None:
    await api("POST", "/v1/jobs", 201, json={"queue": "q", "job_id": "j"})
    first = await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w", "ttl_seconds": 5})
    clock.advance(6)
    current = await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w", "ttl_seconds": 5})
    clock.advance(20)  # both grants expired more than 10 s ago
    assert await store.purge_grants(10) == 1  # the first; the current one stays
    assert await store.purge_grants(10) == 0
    # A kept grant's token is still known (its lease expired); a forgotten one is not.
    with pytest.raises(exc.LeaseExpired):
        await store.renew(current["lease_token"])
    with pytest.raises(exc.InvalidLeaseToken):
        await store.renew(first["lease_token"])


def _transactions(store: LeaseStore) -> float:
    """How many operations the store has run (its transaction-latency histogram's count)."""
    [metric] = store.metrics.store_seconds.collect()
    return next(s.value for s in metric.samples if s.name.endswith("_count"))


async def test_a_kept_grant_is_not_looked_at_again_until_the_daily_sweep(
    api: Call, clock: FakeClock, store: LeaseStore
) -> None:
    # Each step looks at the grants that crossed the retention since the step before: a
    # job's current grant, kept when it crossed, is not read again once a minute for ever.
    # Granted again later, the job's old grant is found by the sweep of all old grants
    # (the first step, then once a day).
    await api("POST", "/v1/jobs", 201, json={"queue": "q", "job_id": "j"})
    first = await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w", "ttl_seconds": 5})
    clock.advance(20)
    assert await store.purge_grants(10) == 0  # the first step sweeps all: kept, current
    await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w", "ttl_seconds": 5})
    clock.advance(20)
    assert await store.purge_grants(10) == 0  # the first grant crossed before: not seen
    with pytest.raises(exc.StaleGeneration):
        await store.renew(first["lease_token"])
    clock.advance(GRANT_SWEEP_SECONDS)
    assert await store.purge_grants(10) == 1  # the daily sweep
    with pytest.raises(exc.InvalidLeaseToken):
        await store.renew(first["lease_token"])


async def test_the_sweep_of_all_old_grants_goes_in_slices(
    api: Call, clock: FakeClock, store: LeaseStore, backend: str
) -> None:
    # Five jobs granted twice each, the first grants expiring a second apart; on SQLite
    # the sweep looks at them two at a time, each slice its own transaction.
    for i in range(5):
        await api("POST", "/v1/jobs", 201, json={"queue": "q", "job_id": f"j{i}"})
    for _ in range(5):
        await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w", "ttl_seconds": 5})
        clock.advance(1)
    clock.advance(10)
    current = [
        await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w", "ttl_seconds": 5})
        for _ in range(5)
    ]
    clock.advance(30)
    async with store.backend.engine.connect() as conn:
        expiries = sorted((await conn.execute(sa.select(leases.c.expires_at))).scalars())
    # A slice of two after the start ends at the third grant's expiry; none past the end.
    found = await store.backend.run("grant_slice_end", since=-math.inf, batch=2)
    assert found is not None and found["slice_end"] == expiries[2]
    found = await store.backend.run("grant_slice_end", since=expiries[7], batch=2)
    assert found is not None and found["slice_end"] is None
    transactions = _transactions(store)
    assert await store.purge_grants(10, batch=2) == 5  # every first grant, slice by slice
    # On SQLite slices of two after their start, each its end and then its delete: the
    # five first grants, then the five current ones (one expiry) make three slices.
    # PostgreSQL holds up no writer while it deletes: one statement.
    ran = _transactions(store) - transactions
    assert ran == (6 if backend == "sqlite" else 1)
    for lease in current:  # the current grants stay: their leases expired, not forgotten
        with pytest.raises(exc.LeaseExpired):
            await store.renew(lease["lease_token"])


# -- listing ------------------------------------------------------------------------------------


async def test_list_jobs_filters_and_pages(api: Call, clock: FakeClock) -> None:
    ids = [f"job-{i}" for i in range(7)]
    for i, job_id in enumerate(ids):
        await api("POST", "/v1/jobs", 201, json={"queue": "a", "job_id": job_id})
        if i % 2:
            clock.advance(1)  # some share a creation time: ties are ordered by id
    await api("POST", "/v1/jobs", 201, json={"queue": "b", "job_id": "other"})
    await api("PUT", "/v1/jobs/job-3/lease", 201, json={"owner": "w"})

    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        query = "queue=a&limit=3" + (f"&cursor={cursor}" if cursor else "")
        page = await api("GET", f"/v1/jobs?{query}", 200)
        pages += 1
        assert len(page["items"]) == (3 if pages < 3 else 1)
        seen += [job["job_id"] for job in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
        assert pages < 5
    assert pages == 3
    assert seen == ids  # creation order, no job twice, none left out

    everything = await api("GET", "/v1/jobs", 200)
    assert {j["job_id"] for j in everything["items"]} == {*ids, "other"}
    assert everything["next_cursor"] is None
    leased = await api("GET", "/v1/jobs?state=leased", 200)
    assert [j["job_id"] for j in leased["items"]] == ["job-3"]
    pending_b = await api("GET", "/v1/jobs?queue=b&state=pending", 200)
    assert [j["job_id"] for j in pending_b["items"]] == ["other"]
    assert (await api("GET", "/v1/jobs?queue=nope", 200))["items"] == []


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("state=running", "state"),
        ("limit=0", "limit"),
        ("limit=501", "limit"),
        ("limit=-1", "limit"),
        ("limit=abc", "limit"),
        ("cursor=%%%", "cursor"),
        ("cursor=bm90LWpzb24", "cursor"),
        ("queue=a%01b", "queue"),
    ],
)
async def test_list_jobs_bad_query(control: Client, query: str, field: str) -> None:
    doc = await expect_problem(await control.get(f"/v1/jobs?{query}"), 400, "invalid-request")
    assert doc["field"] == field


# -- generations are never reused -------------------------------------------------------------


async def test_purge_and_create_again_continues_above_the_old_generation(
    api: Call, control: Client, lease_of: Any, clock: FakeClock
) -> None:
    tokens = []
    for _ in range(3):
        lease = await lease_of("j", queue="q")
        tokens.append(lease["lease_token"])
    await api("POST", "/v1/leases/complete", 200, json={"lease_token": tokens[-1]})
    old = await api("GET", "/v1/jobs/j", 200)
    assert old["generation"] == 3

    await api("DELETE", "/admin/jobs/j", 204)
    await expect_problem(await control.get("/v1/jobs/j"), 404, "job-not-found")
    resp = await control.post("/v1/leases/renew", json={"lease_token": tokens[0]})
    await expect_problem(resp, 409, "stale-generation")

    again = await api("POST", "/v1/jobs", 201, json={"queue": "q", "job_id": "j"})
    assert again["generation"] >= old["generation"]
    lease = await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w"})
    assert lease["generation"] > old["generation"]
    for token in tokens:
        resp = await control.post("/v1/leases/complete", json={"lease_token": token})
        await expect_problem(resp, 409, "stale-generation")

    # Twice over, and through a named acquire that creates the job.
    clock.advance(3600)
    await api("DELETE", "/admin/jobs/j", 204)
    third = await lease_of("j")
    assert third["generation"] > lease["generation"]


async def test_purge_through_the_store(store: LeaseStore, clock: FakeClock) -> None:
    lease = await store.acquire(job_id="j", owner="w", ttl=5, queue="q")
    clock.advance(5)
    await store.purge_job("j")  # expired: may be purged
    await store.enqueue(queue="q", job_id="j")
    again = await store.claim(queue="q", owner="w", ttl=5)
    assert again is not None
    assert again.generation > lease.generation


async def test_purge_of_a_held_or_unknown_job_is_refused(
    api: Call, control: Client, lease_of: Any, store: LeaseStore
) -> None:
    await lease_of("held", ttl_seconds=60)
    before = await db_snapshot(store)
    await expect_problem(await control.delete("/admin/jobs/held"), 409, "lease-held")
    await expect_problem(await control.delete("/admin/jobs/nope"), 404, "job-not-found")
    assert await db_snapshot(store) == before


# -- bad input: 400 naming the field, nothing written -------------------------------------------

LONG = "x" * 10_000

BAD_REQUESTS: list[tuple[str, str, Any, str]] = [
    # (method, path, body (bytes are sent raw), field)
    ("POST", "/v1/jobs", b"{not json", "body"),
    ("POST", "/v1/jobs", b'{"job_id": "a",}', "body"),
    ("POST", "/v1/jobs", b"[1, 2]", "body"),
    ("POST", "/v1/jobs", b'"text"', "body"),
    ("POST", "/v1/jobs", b'{"job_id": "nan", "payload": NaN}', "body"),
    ("POST", "/v1/jobs", b'{"job_id": "inf", "payload": Infinity}', "body"),
    ("POST", "/v1/jobs", b'{"job_id": "big", "payload": 1e400}', "body"),
    (
        "POST",
        "/v1/jobs",
        b'{"job_id": "deep", "payload": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "body",
    ),
    ("POST", "/v1/jobs", b"\xff\xfe{}", "body"),
    ("POST", "/v1/jobs", {"job_id": "a\x01b"}, "job_id"),
    ("POST", "/v1/jobs", {"job_id": "a\nb"}, "job_id"),
    ("POST", "/v1/jobs", {"job_id": "ok\n"}, "job_id"),
    ("POST", "/v1/jobs", {"job_id": ""}, "job_id"),
    ("POST", "/v1/jobs", {"job_id": LONG}, "job_id"),
    ("POST", "/v1/jobs", {"job_id": 7}, "job_id"),
    ("POST", "/v1/jobs", {"queue": "q\x00"}, "queue"),
    ("POST", "/v1/jobs", {"queue": "q\x01"}, "queue"),
    ("POST", "/v1/jobs", {"job_id": "a", "max_attempts": "3"}, "max_attempts"),
    ("POST", "/v1/jobs", {"job_id": "a", "max_attempts": 0}, "max_attempts"),
    ("POST", "/v1/jobs", {"job_id": "a", "max_attempts": 2.5}, "max_attempts"),
    ("POST", "/v1/jobs", {"job_id": "a", "max_attempts": True}, "max_attempts"),
    ("POST", "/v1/jobs", {"job_id": "a", "priority": 1}, "priority"),
    ("POST", "/v1/queues/q/claim", {}, "owner"),
    ("POST", "/v1/queues/q/claim", {"owner": 5}, "owner"),
    ("POST", "/v1/queues/q/claim", {"owner": ""}, "owner"),
    ("POST", "/v1/queues/q/claim", {"owner": LONG}, "owner"),
    ("POST", "/v1/queues/q/claim", {"owner": "w\x07"}, "owner"),
    ("POST", "/v1/queues/q/claim", {"owner": "w\u2028"}, "owner"),
    ("POST", "/v1/queues/q/claim", {"owner": "w", "ttl_seconds": "10"}, "ttl_seconds"),
    ("POST", "/v1/queues/q/claim", {"owner": "w", "ttl_seconds": True}, "ttl_seconds"),
    ("POST", "/v1/queues/q/claim", {"owner": "w", "ttl_seconds": 0}, "ttl_seconds"),
    ("POST", "/v1/queues/q/claim", {"owner": "w", "ttl_seconds": -5}, "ttl_seconds"),
    ("POST", "/v1/queues/q/claim", {"owner": "w", "ttl_seconds": 600.001}, "ttl_seconds"),
    ("POST", "/v1/queues/q/claim", {"owner": "w", "ttl_seconds": 1e300}, "ttl_seconds"),
    ("POST", "/v1/queues/q/claim", b'{"owner": "w", "ttl_seconds": NaN}', "body"),
    ("POST", "/v1/queues/q/claim", b'{"owner": "w", "ttl_seconds": 1e400}', "body"),
    ("POST", "/v1/queues/q/claim", b'{"owner": "w", "ttl_seconds": -Infinity}', "body"),
    ("POST", "/v1/queues/q/claim", {"owner": "w", "lease": 1}, "lease"),
    ("POST", "/v1/queues/a%01b/claim", {"owner": "w"}, "queue"),
    ("POST", "/v1/queues/a%0Ab/claim", {"owner": "w"}, "queue"),
    ("PUT", "/v1/jobs/a%01b/lease", {"owner": "w"}, "job_id"),
    ("PUT", "/v1/jobs/a%00b/lease", {"owner": "w"}, "job_id"),
    ("PUT", "/v1/jobs/a%20b/lease", {"owner": "w"}, "job_id"),
    ("PUT", f"/v1/jobs/{'j' * 201}/lease", {"owner": "w"}, "job_id"),
    ("PUT", "/v1/jobs/new/lease", {"owner": 1}, "owner"),
    ("PUT", "/v1/jobs/new/lease", {"owner": "w", "ttl_seconds": 0}, "ttl_seconds"),
    ("PUT", "/v1/jobs/new/lease", {"owner": "w", "ttl_seconds": 601}, "ttl_seconds"),
    ("PUT", "/v1/jobs/new/lease", {"owner": "w", "ttl_seconds": "5"}, "ttl_seconds"),
    ("PUT", "/v1/jobs/new/lease", {"owner": "w", "queue": "q\x01"}, "queue"),
    ("PUT", "/v1/jobs/new/lease", {"owner": "w", "max_attempts": -1}, "max_attempts"),
    ("PUT", "/v1/jobs/new/lease", {"owner": "w", "fenced": True}, "fenced"),
    ("GET", "/v1/jobs/a%01b", None, "job_id"),
    ("DELETE", "/admin/jobs/a%01b", None, "job_id"),
]


async def test_bad_input_is_400_naming_the_field_and_writes_nothing(
    control: Client, store: LeaseStore, subtests: pytest.Subtests
) -> None:
    """One database for all the cases (a fresh one per case would cost more than the
    cases): after each refused request, every table is as it was."""
    # A claimable job, so that a claim that wrongly went through would change it.
    await store.enqueue(queue="q", job_id="waiting")
    before = await db_snapshot(store)
    for method, path, body, field in BAD_REQUESTS:
        with subtests.test(f"{method} {path[:40]} {str(body)[:60]!r}"):
            if isinstance(body, bytes):
                resp = await control.request(
                    method, path, data=body, headers={"Content-Type": "application/json"}
                )
            else:
                resp = await control.request(method, path, json=body)
            doc = await expect_problem(resp, 400, "invalid-request")
            assert doc["field"] == field
            assert doc["detail"].startswith(f"{field}:")
            assert await db_snapshot(store) == before


LEASE_OP_BAD_BODIES: list[tuple[str, Any, str]] = [
    ("renew", {"ttl_seconds": 0}, "ttl_seconds"),
    ("renew", {"ttl_seconds": -1}, "ttl_seconds"),
    ("renew", {"ttl_seconds": 600.5}, "ttl_seconds"),
    ("renew", {"ttl_seconds": "30"}, "ttl_seconds"),
    ("renew", {"ttl_seconds": False}, "ttl_seconds"),
    ("renew", b', "ttl_seconds": NaN}', "body"),
    ("renew", b', "ttl_seconds": 1e400}', "body"),
    ("renew", {"extra": 1}, "extra"),
    ("complete", {"result": 1, "state": "done"}, "state"),
    ("complete", b', "result": NaN}', "body"),
    ("fail", {"retry_in_seconds": -1}, "retry_in_seconds"),
    ("fail", {"retry_in_seconds": "5"}, "retry_in_seconds"),
    ("fail", {"retry_in_seconds": 86400 * 31}, "retry_in_seconds"),
    ("fail", {"error": 5}, "error"),
    ("fail", {"error": LONG + "x"}, "error"),
    ("release", {"owner": "w"}, "owner"),
]


async def test_bad_lease_operation_body_is_400_and_the_lease_is_untouched(
    control: Client, api: Call, store: LeaseStore, lease_of: Any, subtests: pytest.Subtests
) -> None:
    lease = await lease_of("j", ttl_seconds=30)
    token = lease["lease_token"]
    before = await db_snapshot(store)
    for op, body, field in LEASE_OP_BAD_BODIES:
        with subtests.test(f"{op} {str(body)[:60]!r}"):
            if isinstance(body, bytes):
                raw = b'{"lease_token": "' + token.encode() + b'"' + body
                resp = await control.post(
                    f"/v1/leases/{op}", data=raw, headers={"Content-Type": "application/json"}
                )
            else:
                resp = await control.post(f"/v1/leases/{op}", json={"lease_token": token, **body})
            doc = await expect_problem(resp, 400, "invalid-request")
            assert doc["field"] == field
            assert await db_snapshot(store) == before
    # The lease is still current.
    await api("POST", "/v1/leases/renew", 200, json={"lease_token": token})


async def test_bad_lease_token_field_is_400(control: Client) -> None:
    for token in (None, 5, "", "t" * 201):
        resp = await control.post("/v1/leases/renew", json={"lease_token": token})
        doc = await expect_problem(resp, 400, "invalid-request")
        assert doc["field"] == "lease_token", token


async def test_body_over_the_limit_is_refused(control: Client, store: LeaseStore) -> None:
    before = await db_snapshot(store)
    body = json.dumps({"job_id": "big", "payload": "x" * (2 * 1024 * 1024)}).encode()
    resp = await control.post(
        "/v1/jobs", data=io.BytesIO(body), headers={"Content-Type": "application/json"}
    )
    assert resp.status == 413
    assert resp.content_type == PROBLEM
    assert await db_snapshot(store) == before


async def test_unknown_path_and_method_are_problems(control: Client) -> None:
    await expect_problem(await control.get("/v2/jobs"), 404, "not-found")
    await expect_problem(await control.patch("/v1/jobs"), 405, "method-not-allowed")


async def test_a_write_sent_to_the_control_listener_is_pointed_at_the_proxy(
    control: Client,
) -> None:
    """A newcomer's fenced write on the wrong port: the 404 names the proxy's address."""
    resp = await control.post("/payments/charges", json={"amount": 1})
    doc = await expect_problem(resp, 404, "not-found")
    assert "control listener" in doc["detail"]
    assert "proxy listener, 127.0.0.1:8080: /<upstream>/<path>" in doc["detail"]


# -- the store follows lease_core.rules ----------------------------------------------------------


async def test_max_ttl_itself_is_accepted(api: Call, clock: FakeClock) -> None:
    await api("POST", "/v1/jobs", 201, json={"queue": "q"})
    lease = await api("POST", "/v1/queues/q/claim", 200, json={"owner": "w", "ttl_seconds": 600})
    assert lease["expires_at"] == rfc3339(clock.now + 600)


async def test_random_operation_sequences_answer_as_the_rules_say(
    control: Client, clock: FakeClock
) -> None:
    """Seeded random walks of claims, acquires, renewals, completions, failures,
    releases (by current and by old leases) and clock moves, each through HTTP, held to
    ``lease_core.rules``: the status, the refusal reason and the job afterwards."""
    for seed in range(4):
        rng = random.Random(seed)
        queue = f"q{seed}"
        episode = 0
        model = rules.Job("", rules.State.COMPLETED, 0)  # starts a new job below
        grants: list[tuple[rules.Lease, str, float]] = []
        for step in range(60):
            if (model.state in rules.FINISHED and rng.random() < 0.5) or not model.job_id:
                # A new job (each walk goes through several: finishing is common).
                episode += 1
                job_id = f"walk-{seed}-{episode}"
                max_attempts = rng.choice([1, 2, 4])
                doc = {"queue": queue, "job_id": job_id, "max_attempts": max_attempts}
                await expect(await control.post("/v1/jobs", json=doc), 201)
                model = rules.Job(job_id, rules.State.PENDING, 0, max_attempts=max_attempts)
                grants = []
            now = clock.now
            op = rng.choice(["claim", "acquire", "lease-op", "lease-op", "lease-op", "advance"])
            where = f"seed {seed} step {step} {op}"
            if op == "advance":
                clock.advance(rng.choice([0.0, 1.0, 3.0, 5.0, 10.0, 20.0]))
                continue
            if op in ("claim", "acquire"):
                owner = rng.choice(["a", "b"])
                ttl = rng.choice([5.0, 10.0, 20.0])
                if op == "claim":
                    allowed = rules.is_claimable(model, now)
                    resp = await control.post(
                        f"/v1/queues/{queue}/claim", json={"owner": owner, "ttl_seconds": ttl}
                    )
                    if not allowed:
                        assert resp.status == 204, where
                        continue
                    expected_status = 200
                else:
                    allowed = rules.can_acquire(model, owner, now)
                    resp = await control.put(
                        f"/v1/jobs/{job_id}/lease", json={"owner": owner, "ttl_seconds": ttl}
                    )
                    if not allowed:
                        reason = "job-finished" if model.state in rules.FINISHED else "lease-held"
                        await expect_problem(resp, 409, reason)
                        continue
                    expected_status = 201
                body = await expect(resp, expected_status)
                model, lease = rules.grant(model, owner, ttl, now)
                assert body["generation"] == lease.generation, where
                assert body["expires_at"] == rfc3339(lease.expires_at), where
                grants.append((lease, body["lease_token"], ttl))
            else:
                if not grants:
                    continue
                lease, token, granted_ttl = rng.choice(grants[-2:])  # the newest or the one before
                action = rng.choice(["renew"] * 4 + ["fail"] * 2 + ["release"] * 2 + ["complete"])
                where += f" {action} gen {lease.generation}"
                retry = rng.choice([0.0, 3.0])
                body = {"lease_token": token}
                if action == "fail":
                    body["retry_in_seconds"] = retry
                resp = await control.post(f"/v1/leases/{action}", json=body)
                if not rules.is_current(lease, model, now):
                    reason = rules.refusal_reason(lease.generation, model, now)
                    await expect_problem(resp, 409, reason)
                    continue
                await expect(resp, 200)
                if action == "renew":  # without a TTL: the lease keeps its own
                    model = rules.renew(model, granted_ttl, now)
                elif action == "complete":
                    model = rules.complete(model)
                elif action == "fail":
                    model = rules.fail(model, retry, now)
                else:
                    model = rules.release(model, now)
            job = await expect(await control.get(f"/v1/jobs/{job_id}"), 200)
            assert job["state"] == model.state.value, where
            assert job["generation"] == model.generation, where
            assert job["attempts"] == model.attempts, where
            expires = model.lease_expires_at if model.state is rules.State.LEASED else None
            assert job["lease_expires_at"] == (rfc3339(expires) if expires else None), where


# -- health -------------------------------------------------------------------------------------


async def test_healthz_and_readyz(control: Client) -> None:
    assert await expect(await control.get("/healthz"), 200) == {"status": "ok"}
    assert (await expect(await control.get("/readyz"), 200))["status"] == "ready"


# -- auth ---------------------------------------------------------------------------------------

WORKER = "worker-token-0123456789"
ADMIN = "admin-token-0123456789ab"


@pytest.fixture
async def authed(
    store: LeaseStore,
    aiohttp_client: Callable[..., Awaitable[Client]],
    make_settings: Callable[..., Any],
) -> Client:
    settings = make_settings(auth={"worker_tokens": [WORKER], "admin_tokens": [ADMIN]})
    return await aiohttp_client(create_control_app(settings, store))


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


BAD_CREDENTIALS: dict[str, dict[str, str]] = {
    "missing": {},
    "unknown": bearer("unknown-token-0123456789"),
    "prefix": bearer(WORKER[:-1]),
    "longer": bearer(WORKER + "x"),
    "no-scheme": {"Authorization": WORKER},
    "basic": {"Authorization": f"Basic {WORKER}"},
    "empty": {"Authorization": "Bearer "},
}


async def test_missing_or_unknown_token_is_401(
    authed: Client, store: LeaseStore, subtests: pytest.Subtests
) -> None:
    before = await db_snapshot(store)
    for name, headers in BAD_CREDENTIALS.items():
        for method, path in (
            ("POST", "/v1/jobs"),
            ("GET", "/v1/jobs"),
            ("POST", "/v1/queues/q/claim"),
            ("DELETE", "/admin/jobs/x"),
            ("GET", "/metrics"),
        ):
            with subtests.test(f"{name} {method} {path}"):
                resp = await authed.request(method, path, json={"owner": "w"}, headers=headers)
                await expect_problem(resp, 401, "unauthorized")
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert await db_snapshot(store) == before


async def test_worker_token_on_admin_path_is_403(authed: Client, store: LeaseStore) -> None:
    await store.enqueue(queue="q", job_id="keep")
    resp = await authed.delete("/admin/jobs/keep", headers=bearer(WORKER))
    await expect_problem(resp, 403, "forbidden")
    await expect_problem(await authed.get("/metrics", headers=bearer(WORKER)), 403, "forbidden")
    assert (await store.get_job("keep")).state == "pending"


async def test_worker_and_admin_tokens_may_use_v1(authed: Client, store: LeaseStore) -> None:
    for token in (WORKER, ADMIN):
        resp = await authed.post("/v1/jobs", json={"queue": "q"}, headers=bearer(token))
        job = await expect(resp, 201)
        resp = await authed.get(f"/v1/jobs/{job['job_id']}", headers=bearer(token))
        assert (await expect(resp, 200))["job_id"] == job["job_id"]
        resp = await authed.post("/v1/queues/q/claim", json={"owner": "w"}, headers=bearer(token))
        await expect(resp, 200)
    # The scheme is case-insensitive.
    resp = await authed.get("/v1/jobs", headers={"Authorization": f"bearer {WORKER}"})
    assert len((await expect(resp, 200))["items"]) == 2


async def test_admin_token_may_use_admin(authed: Client, store: LeaseStore) -> None:
    await store.enqueue(queue="q", job_id="gone")
    await expect(await authed.delete("/admin/jobs/gone", headers=bearer(ADMIN)), 204)
    resp = await authed.get("/v1/jobs/gone", headers=bearer(ADMIN))
    await expect_problem(resp, 404, "job-not-found")


async def test_health_needs_no_token(authed: Client) -> None:
    assert await expect(await authed.get("/healthz"), 200) == {"status": "ok"}
    assert (await expect(await authed.get("/readyz"), 200))["status"] == "ready"
    # ... and a wrong one does not matter there either.
    resp = await authed.get("/healthz", headers=bearer("nonsense-token-1234567"))
    await expect(resp, 200)


SCRAPE = "scrape-token-0123456789ab"


@pytest.fixture
async def scraped(
    store: LeaseStore,
    aiohttp_client: Callable[..., Awaitable[Client]],
    make_settings: Callable[..., Any],
) -> Client:
    settings = make_settings(
        auth={"worker_tokens": [WORKER], "admin_tokens": [ADMIN], "metrics_tokens": [SCRAPE]}
    )
    return await aiohttp_client(create_control_app(settings, store))


async def test_metrics_token_reads_metrics_and_nothing_else(
    scraped: Client, store: LeaseStore, subtests: pytest.Subtests
) -> None:
    await store.enqueue(queue="q", job_id="keep")
    for token in (SCRAPE, ADMIN):  # admin tokens keep reading /metrics
        resp = await scraped.get("/metrics", headers=bearer(token))
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/plain")
        assert "fencegate_lease_grants_total" in await resp.text()
    before = await db_snapshot(store)
    for method, path in (
        ("GET", "/v1/jobs"),
        ("POST", "/v1/jobs"),
        ("POST", "/v1/queues/q/claim"),
        ("GET", "/v1/jobs/keep"),
        ("GET", "/admin/rejections"),
        ("DELETE", "/admin/jobs/keep"),
        ("GET", "/admin/ui/api/refusals-over-time"),
        ("GET", "/metrics/"),
        ("GET", "/metricsx"),
    ):
        with subtests.test(f"{method} {path}"):
            resp = await scraped.request(method, path, json={"owner": "w"}, headers=bearer(SCRAPE))
            await expect_problem(resp, 403, "forbidden")
    assert await db_snapshot(store) == before
    # A worker token still cannot scrape, and a near miss of the scrape token is unknown.
    await expect_problem(await scraped.get("/metrics", headers=bearer(WORKER)), 403, "forbidden")
    resp = await scraped.get("/metrics", headers=bearer(SCRAPE[:-1]))
    await expect_problem(resp, 401, "unauthorized")


async def test_metrics_tokens_alone_turn_auth_on(
    store: LeaseStore,
    aiohttp_client: Callable[..., Awaitable[Client]],
    make_settings: Callable[..., Any],
) -> None:
    """A scrape token configured without worker or admin tokens still means tokens are
    required: nothing is open that was closed before."""
    settings = make_settings(auth={"metrics_tokens": [SCRAPE]})
    client = await aiohttp_client(create_control_app(settings, store))
    assert (await client.get("/metrics", headers=bearer(SCRAPE))).status == 200
    await expect_problem(await client.get("/v1/jobs"), 401, "unauthorized")
    await expect_problem(await client.get("/metrics"), 401, "unauthorized")


async def test_no_tokens_configured_needs_none(control: Client) -> None:
    await expect(await control.get("/v1/jobs"), 200)
    await expect_problem(await control.delete("/admin/jobs/x"), 404, "job-not-found")


async def test_a_body_that_never_arrives_is_cut_off_on_the_control_listener(
    store: LeaseStore, aiohttp_client: Any, make_settings: Any
) -> None:
    """A client that sends a request's head and then trickles (or never sends) its body
    must not hold a connection and a handler of the control listener for ever: the body
    has the proxy listener's deadline (``gateway.body_timeout_seconds``), then 408 and
    the connection closed."""
    settings = make_settings(gateway={"body_timeout_seconds": 0.5})
    client = await aiohttp_client(create_control_app(settings, store))
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    try:
        started = time.monotonic()
        writer.write(
            b"POST /v1/jobs HTTP/1.1\r\nHost: control\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"queue": '
        )
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(65536), 5)
        waited = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"connection: close" in answer.lower()
        assert 0.4 <= waited < 3
        assert await asyncio.wait_for(reader.read(65536), 5) == b""  # closed
    finally:
        writer.close()


# -- one voice: every detail is a sentence ------------------------------------------------------


def not_a_sentence(doc: dict[str, Any]) -> bool:
    """As the gateway writes its details: a sentence that ends with a full stop and starts
    with a capital letter, or with the name of the field it is about (``ttl_seconds: must
    be above zero.``), which keeps the field's spelling."""
    detail: str = doc["detail"]
    field = doc.get("field")
    starts = detail[:1].isupper() or (field is not None and detail.startswith(f"{field}: "))
    return not (starts and detail.endswith("."))


async def test_every_problem_of_the_control_listener_is_a_sentence(
    scraped: Client, store: LeaseStore, clock: FakeClock
) -> None:
    """The lease and admin API speak in the gateway's voice: each detail of each kind of
    refusal, from bad input to a lease that is held, lost or unknown."""
    admin = bearer(ADMIN)
    seen: list[dict[str, Any]] = []

    async def refused(method: str, path: str, headers: Any = admin, **kwargs: Any) -> None:
        resp = await scraped.request(method, path, headers=headers, **kwargs)
        assert resp.status >= 400, await resp.text()
        assert resp.content_type == PROBLEM
        seen.append(await resp.json(content_type=None))

    for method, path, body, _ in BAD_REQUESTS:
        if isinstance(body, bytes):
            await refused(method, path, data=body, headers={**admin, "Content-Type": "a/json"})
        else:
            await refused(method, path, json=body)
    lease = await store.acquire(queue="q", job_id="held", owner="w1", ttl=60)
    token = lease.lease_token
    for operation, body, _ in LEASE_OP_BAD_BODIES:
        if isinstance(body, bytes):
            raw = b'{"lease_token": "' + str(token).encode() + b'"' + body
            await refused("POST", f"/v1/leases/{operation}", data=raw)
        else:
            await refused("POST", f"/v1/leases/{operation}", json={"lease_token": token, **body})
    await store.enqueue(queue="q", job_id="twice")
    await refused("POST", "/v1/jobs", json={"queue": "q", "job_id": "twice"})  # job-exists
    await refused("PUT", "/v1/jobs/held/lease", json={"owner": "w2"})  # lease-held
    await refused("DELETE", "/admin/jobs/held")  # lease-held: purge of a held job
    await refused("DELETE", "/admin/jobs/nope")  # job-not-found
    await refused("GET", "/v1/jobs/nope")
    done = await store.acquire(queue="q", job_id="done", owner="w1", ttl=60)
    await store.complete(str(done.lease_token))
    await refused("PUT", "/v1/jobs/done/lease", json={"owner": "w1"})  # job-finished
    ended = {"lease_token": done.lease_token}
    await refused("POST", "/v1/leases/renew", json=ended)  # lease-ended
    await refused("POST", "/v1/leases/renew", json={"lease_token": "fgl_" + "x" * 30})
    await refused("POST", "/v1/leases/renew", json={"lease_token": "not a token"})
    short = await store.acquire(queue="q", job_id="short", owner="w1", ttl=5)
    clock.advance(6)
    await refused("POST", "/v1/leases/renew", json={"lease_token": short.lease_token})
    await store.acquire(queue="q", job_id="short", owner="w2", ttl=60)
    await refused("POST", "/v1/leases/complete", json={"lease_token": short.lease_token})
    for query in ("queue=a%01b", "state=done", "limit=0", "cursor=nope", "a=%00"):
        await refused("GET", f"/v1/jobs?{query}")
    for query in ("reason=bogus", "upstream=nope", "since=soon", "cursor=nope", "limit=x"):
        await refused("GET", f"/admin/rejections?{query}")
    await refused("GET", "/admin/unknown-outcomes?limit=0")
    resolve = {"job_id": "held", "key": "k", "applied": True, "status": 201}
    await refused("POST", "/admin/unknown-outcomes/resolve", json={**resolve, "applied": 1})
    await refused("POST", "/admin/unknown-outcomes/resolve", json={**resolve, "status": None})
    bad_body = {**resolve, "body_base64": "%%%"}
    await refused("POST", "/admin/unknown-outcomes/resolve", json=bad_body)
    await refused("POST", "/admin/unknown-outcomes/resolve", json=resolve)  # not-found
    for query in ("since=2030-01-01T00:00:00Z&until=2020-01-01T00:00:00Z", "bucket_seconds=0"):
        await refused("GET", f"/admin/ui/api/refusals-over-time?{query}")
    await refused("GET", "/admin/ui/api/refusals-over-time?since=0&window_seconds=60")
    await refused("GET", "/admin/ui/api/refusals-over-time?bucket_seconds=1&window_seconds=86400")
    await refused("GET", "/admin/ui/api/jobs/a%01b/timeline")
    await refused("GET", "/nothing-here")  # not-found
    await refused("PATCH", "/v1/jobs")  # method-not-allowed
    await refused("GET", "/v1/jobs", headers={})  # unauthorized: no token
    await refused("GET", "/v1/jobs", headers=bearer("unknown-token-0123456789"))
    await refused("GET", "/admin/rejections", headers=bearer(WORKER))  # forbidden
    await refused("GET", "/v1/jobs", headers=bearer(SCRAPE))  # forbidden: metrics only
    wrong = [f"{doc['reason']}: {doc['detail']!r}" for doc in seen if not_a_sentence(doc)]
    assert not wrong, "\n".join(wrong)
    assert len(seen) > 60
