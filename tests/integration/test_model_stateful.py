"""A model-based test of the lease core and the gateway together (hypothesis stateful).

A ``RuleBasedStateMachine`` drives the real control and proxy apps (aiohttp test servers
in an event loop the machine owns, on a SQLite copy of the migrated template and on
PostgreSQL, with a ``FakeClock``) and a real upstream that counts what it receives, and
holds every answer to a plain model of the rules written here from the spec:

- enqueue, acquire (named), claim, renew, complete, fail and release with any token the
  test ever got (current or stale), advancing the clock between them;
- writes through the gateway with any of those tokens, a few idempotency keys and two
  bodies (so keys get reused with a different request), against an upstream that can be
  told to fail (500: a definite answer; 504: an unknown outcome, held);
- an operator resolving unknown outcomes (truthfully "not applied" only when the
  upstream did not apply the write; "applied" at will).

After every step: the database equals the model (job states, generations, owners,
attempts, idempotency records), generations only grow per job, at most one lease per job
is current, the upstream received at most one write per (job, key) (one more only after an
operator said the earlier one was not applied) and applied at most one, and it never
received a write of a generation lower than one it had already received for that job.

CI runs 30 examples of up to 30 steps (the ``fencegate-model-ci`` profile); set
``FENCEGATE_FAULTS_LONG=1`` for ``fencegate-model-long`` (300 x 60).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from gateway.config import Settings
from gateway.proxy.gateway import Gateway, create_proxy_app
from gateway.records.schema import requests, writing
from gateway.service.server import create_control_app
from lease_core import tokens
from lease_core.db import create_engine
from lease_core.schema import jobs, metadata
from lease_core.store import LeaseStore
from tests.support import FakeClock

settings.register_profile(
    "fencegate-model-ci",
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile(
    "fencegate-model-long",
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
LONG = os.environ.get("FENCEGATE_FAULTS_LONG", "").lower() not in ("", "0", "false")
PROFILE = settings.get_profile("fencegate-model-long" if LONG else "fencegate-model-ci")

JOBS = ["j1", "j2", "j3"]
OWNERS = ["alice", "bob"]
KEYS = ["k1", "k2", "k3"]
TTLS = [1.0, 5.0, 30.0]
MAX_ATTEMPTS = 3  # the lease settings' default_max_attempts
QUEUE = "default"


@dataclass
class MJob:
    """The model of one job."""

    state: str = "pending"
    generation: int = 0
    owner: str | None = None
    expires: float | None = None
    claimable: float | None = None
    attempts: int = 0
    token: str | None = None  # the token of the current grant


@dataclass(frozen=True)
class Held:
    """A token the test was given: it stays usable (and stale) forever."""

    job: str
    generation: int
    owner: str
    token: str


@dataclass
class MRecord:
    """The model of one idempotency record."""

    amount: int  # the request's body, i.e. its fingerprint here
    state: str  # completed | unknown
    status: int | None = None
    body: bytes | None = None


@dataclass
class CountingUpstream:
    """A real HTTP upstream: records every write; ``status`` decides the answer (201
    applies it; 500 and 504 do not)."""

    status: int = 201
    received: list[dict[str, Any]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        entry = {
            "job": request.headers["Fencing-Job"],
            "key": request.headers["Idempotency-Key"],
            "generation": int(request.headers["Fencing-Generation"]),
            "applied": self.status == 201,
            "body": body,
        }
        self.received.append(entry)
        answer = json.dumps({"n": len(self.received), "status": self.status, **entry}, default=str)
        return web.Response(status=self.status, text=answer, content_type="application/json")


def refusal(job: MJob | None, generation: int, now: float) -> str:
    """Why a lease of ``generation`` may not act on ``job`` (written from the spec)."""
    if job is None or job.generation > generation:
        return "stale-generation"
    if job.state != "leased":
        return "lease-ended"
    assert job.expires is not None
    if job.expires <= now:
        return "lease-expired"
    return "stale-generation"


class LeaseAndGatewayModel(RuleBasedStateMachine):
    def __init__(self, template: Path | None = None, postgres_url: str | None = None) -> None:
        """On a copy of the SQLite ``template``, or on the emptied PostgreSQL database
        at ``postgres_url`` (its statements are the production admission's)."""
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="fencegate-model-"))
        if postgres_url is not None:
            self.url = postgres_url
        else:
            assert template is not None
            shutil.copy(template, self.folder / "model.db")
            self.url = f"sqlite+aiosqlite:///{self.folder / 'model.db'}"
        self.clock = FakeClock()
        self.loop = asyncio.new_event_loop()
        self.jobs: dict[str, MJob] = {}
        self.records: dict[tuple[str, str], MRecord] = {}
        self.held: list[Held] = []
        self.grants: dict[str, list[int]] = {}
        self.let_through: dict[tuple[str, str], int] = {}  # "not applied" verdicts
        self.upstream = CountingUpstream()
        self.clients: list[TestClient[Any, Any]] = []
        self.run(self._start())

    # -- the system under test ---------------------------------------------------------

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def _start(self) -> None:
        self.engine = create_engine(self.url)
        if self.engine.dialect.name == "postgresql":
            async with self.engine.begin() as conn:
                names = ", ".join(f'"{t.name}"' for t in metadata.sorted_tables)
                await conn.execute(sa.text(f"TRUNCATE {names}"))
        store = LeaseStore(self.engine, clock=self.clock)
        upstream_app = web.Application()
        upstream_app.router.add_route("*", "/{tail:.*}", self.upstream.handle)
        upstream = TestClient(TestServer(upstream_app))
        await upstream.start_server()
        self.clients.append(upstream)
        config = Settings(
            database_url=self.url,
            upstreams=[{"name": "pay", "url": str(upstream.make_url("")).rstrip("/")}],
            gateway={"ordering_wait_seconds": 0.2},
        )
        gateway = self.gateway = Gateway(config, store)
        self.control = TestClient(TestServer(create_control_app(config, store, gateway)))
        self.proxy = TestClient(TestServer(create_proxy_app(gateway)))
        for client in (self.control, self.proxy):
            await client.start_server()
            self.clients.append(client)

    async def _stop(self) -> None:
        for client in reversed(self.clients):
            await client.close()
        await self.engine.dispose()

    def teardown(self) -> None:
        try:
            self.run(self._stop())
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()
            shutil.rmtree(self.folder, ignore_errors=True)

    def call(
        self, client: TestClient[Any, Any], method: str, path: str, **kwargs: Any
    ) -> tuple[int, Any, Any]:
        async def go() -> tuple[int, Any, Any]:
            async with client.request(method, path, **kwargs) as resp:
                raw = await resp.read()
                doc = json.loads(raw) if raw else None
                return resp.status, doc, (raw, dict(resp.headers))

        result: tuple[int, Any, Any] = self.run(go())
        return result

    @property
    def now(self) -> float:
        return self.clock.now

    # -- model helpers --------------------------------------------------------------------

    def is_current(self, held: Held) -> bool:
        job = self.jobs.get(held.job)
        return (
            job is not None
            and job.token == held.token
            and job.state == "leased"
            and job.expires is not None
            and job.expires > self.now
        )

    def granted(self, job_id: str, doc: dict[str, Any], owner: str, ttl: float) -> None:
        job = self.jobs[job_id]
        job.generation += 1
        assert doc["generation"] == job.generation, (doc, job)
        assert doc["owner"] == owner and doc["job_id"] == job_id
        previous = self.grants.setdefault(job_id, [])
        assert not previous or doc["generation"] > previous[-1]  # only ever grows
        previous.append(doc["generation"])
        job.state, job.owner, job.token = "leased", owner, doc["lease_token"]
        job.expires = job.claimable = self.now + ttl
        job.attempts += 1
        self.held.append(Held(job_id, job.generation, owner, doc["lease_token"]))

    def refused(self, status: int, doc: Any, reason: str) -> None:
        assert (status, doc["reason"]) == (409, reason), (status, doc, reason)
        event(f"refused: {reason}")

    # -- lease rules ----------------------------------------------------------------------

    @initialize()
    def first_lease(self) -> None:
        self.acquire(JOBS[0], OWNERS[0], TTLS[-1])

    @rule(job_id=st.sampled_from(JOBS))
    def enqueue(self, job_id: str) -> None:
        status, doc, _ = self.call(
            self.control, "POST", "/v1/jobs", json={"job_id": job_id, "queue": QUEUE}
        )
        if job_id in self.jobs:
            assert (status, doc["reason"]) == (409, "job-exists"), doc
            return
        assert status == 201, doc
        self.jobs[job_id] = MJob(claimable=self.now)

    @rule(job_id=st.sampled_from(JOBS), owner=st.sampled_from(OWNERS), ttl=st.sampled_from(TTLS))
    def acquire(self, job_id: str, owner: str, ttl: float) -> None:
        status, doc, _ = self.call(
            self.control,
            "PUT",
            f"/v1/jobs/{job_id}/lease",
            json={"owner": owner, "ttl_seconds": ttl},
        )
        job = self.jobs.setdefault(job_id, MJob(claimable=self.now))
        if job.state in ("completed", "failed"):
            self.refused(status, doc, "job-finished")
        elif job.state == "leased" and job.owner != owner and job.expires > self.now:  # type: ignore[operator]
            self.refused(status, doc, "lease-held")
        else:
            assert status == 201, doc
            self.granted(job_id, doc, owner, ttl)

    @rule(owner=st.sampled_from(OWNERS), ttl=st.sampled_from(TTLS))
    def claim(self, owner: str, ttl: float) -> None:
        status, doc, _ = self.call(
            self.control,
            "POST",
            f"/v1/queues/{QUEUE}/claim",
            json={"owner": owner, "ttl_seconds": ttl},
        )
        claimable = {
            job_id: job.claimable
            for job_id, job in self.jobs.items()
            if job.claimable is not None
            and job.claimable <= self.now
            and job.attempts < MAX_ATTEMPTS
        }
        if not claimable:
            assert status == 204, doc
            return
        assert status == 200, doc
        first = min(claimable.values())
        assert claimable.get(doc["job_id"]) == first, (doc, claimable)  # the longest waiting
        event("claim: granted")
        self.granted(doc["job_id"], doc, owner, ttl)

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0, 10.0, 40.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 1000), ttl=st.none() | st.sampled_from(TTLS))
    def renew(self, index: int, ttl: float | None) -> None:
        held = self.held[index % len(self.held)]
        body: dict[str, Any] = {"lease_token": held.token}
        if ttl is not None:
            body["ttl_seconds"] = ttl
        status, doc, _ = self.call(self.control, "POST", "/v1/leases/renew", json=body)
        job = self.jobs[held.job]
        if not self.is_current(held):
            self.refused(status, doc, refusal(job, held.generation, self.now))
            return
        assert status == 200, doc
        assert "lease_token" not in doc and doc["generation"] == held.generation
        if ttl is None:
            ttl = doc["ttl_seconds"]
        job.expires = job.claimable = self.now + ttl

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 1000), how=st.sampled_from(["complete", "release", "fail"]))
    def end(self, index: int, how: str) -> None:
        held = self.held[index % len(self.held)]
        body: dict[str, Any] = {"lease_token": held.token}
        retry_in = 5.0
        if how == "fail":
            body["retry_in_seconds"] = retry_in
        status, doc, _ = self.call(self.control, "POST", f"/v1/leases/{how}", json=body)
        job = self.jobs[held.job]
        if not self.is_current(held):
            self.refused(status, doc, refusal(job, held.generation, self.now))
            return
        assert status == 200, doc
        job.token, job.expires = None, None
        if how == "complete":
            job.state, job.claimable = "completed", None
        elif how == "release":
            job.state, job.claimable = "pending", self.now
            job.attempts = max(job.attempts - 1, 0)
        elif job.attempts >= MAX_ATTEMPTS:
            job.state, job.claimable = "failed", None
        else:
            job.state, job.claimable = "pending", self.now + retry_in
        assert doc["state"] == job.state, (doc, job)

    # -- the gateway ----------------------------------------------------------------------

    @rule(status=st.sampled_from([201, 201, 500, 504]))
    def upstream_answers(self, status: int) -> None:
        self.upstream.status = status

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 1000), key=st.sampled_from(KEYS), amount=st.sampled_from([1, 2]))
    def write(self, index: int, key: str, amount: int) -> None:
        """A write with any token the test was given (most of them stale by now)."""
        self.write_with(self.held[index % len(self.held)], key, amount)

    @precondition(lambda self: any(self.is_current(h) for h in self.held))
    @rule(index=st.integers(0, 1000), key=st.sampled_from(KEYS), amount=st.sampled_from([1, 1, 2]))
    def write_current(self, index: int, key: str, amount: int) -> None:
        """A write with a lease that is current (as the model sees it)."""
        current = [h for h in self.held if self.is_current(h)]
        self.write_with(current[index % len(current)], key, amount)

    def write_with(self, held: Held, key: str, amount: int) -> None:
        before = len(self.upstream.received)
        status, doc, (raw, headers) = self.call(
            self.proxy,
            "POST",
            "/pay/charges",
            json={"amount": amount},
            headers={"Fencing-Token": held.token, "Idempotency-Key": key},
        )
        # A final answer's record is written behind the answer: the invariants read
        # the database once it is.
        self.run(self.gateway.behind.flush())
        forwarded = self.upstream.received[before:]
        if not self.is_current(held):
            self.refused(status, doc, refusal(self.jobs[held.job], held.generation, self.now))
            assert forwarded == []
            return
        record = self.records.get((held.job, key))
        if record is not None and record.amount != amount:
            assert (status, doc["reason"]) == (422, "idempotency-key-reused"), doc
            assert forwarded == []
            event("write: key reused")
        elif record is not None and record.state == "completed":
            assert (status, raw) == (record.status, record.body), (status, raw, record)
            assert headers.get("Idempotent-Replayed") == "true"
            assert forwarded == []
            event(f"write: replayed {status}")
        elif record is not None:
            self.refused(status, doc, "outcome-unknown")
            assert forwarded == []
        else:
            [sent] = forwarded
            assert (sent["job"], sent["key"], sent["generation"]) == (
                held.job,
                key,
                held.generation,
            )
            assert status == self.upstream.status and "Idempotent-Replayed" not in headers
            state = "unknown" if status == 504 else "completed"
            event(f"write: forwarded, {status}")
            self.records[(held.job, key)] = MRecord(amount, state, status, raw)

    @precondition(lambda self: any(r.state == "unknown" for r in self.records.values()))
    @rule(index=st.integers(0, 1000), claim_applied=st.booleans())
    def resolve(self, index: int, claim_applied: bool) -> None:
        unknown = sorted(k for k, r in self.records.items() if r.state == "unknown")
        job_id, key = unknown[index % len(unknown)]
        applied_upstream = any(
            e["applied"] and (e["job"], e["key"]) == (job_id, key) for e in self.upstream.received
        )
        applied = applied_upstream or claim_applied  # never "not applied" when it was
        body: dict[str, Any] = {"job_id": job_id, "key": key, "applied": applied}
        if applied:
            body |= {"status": 201, "body": '{"resolved": true}'}
        status, doc, _ = self.call(
            self.control, "POST", "/admin/unknown-outcomes/resolve", json=body
        )
        assert status == 200, doc
        event(f"resolved: {'applied' if applied else 'not applied'}")
        if applied:
            record = self.records[(job_id, key)]
            record.state, record.status, record.body = "completed", 201, b'{"resolved": true}'
        else:
            del self.records[(job_id, key)]
            self.let_through[(job_id, key)] = self.let_through.get((job_id, key), 0) + 1

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def database_equals_model(self) -> None:
        async def read() -> tuple[list[Any], list[Any], list[Any]]:
            async with self.engine.connect() as conn:
                job_rows = (await conn.execute(sa.select(jobs))).mappings().all()
                record_rows = (await conn.execute(sa.select(requests))).mappings().all()
                marker_rows = (await conn.execute(sa.select(writing))).mappings().all()
            return list(job_rows), list(record_rows), list(marker_rows)

        job_rows, record_rows, marker_rows = self.run(read())
        # writes_in_flight holds each record in flight, as it is, and nothing else.
        assert {
            (m["job_id"], m["key"], m["generation"], m["attempt"], m["deadline"])
            for m in marker_rows
        } == {
            (r["job_id"], r["key"], r["generation"], r["attempt"], r["deadline"])
            for r in record_rows
            if r["state"] == "in_flight"
        }
        assert all((r["unknown_at"] is not None) == (r["state"] == "unknown") for r in record_rows)
        assert {r["job_id"] for r in job_rows} == set(self.jobs)
        for row in job_rows:
            job = self.jobs[row["job_id"]]
            assert (row["state"], row["generation"], row["attempts"]) == (
                job.state,
                job.generation,
                job.attempts,
            ), (row, job)
            assert row["claimable_at"] == job.claimable, (row, job)
            if job.state == "leased":
                assert (row["owner"], row["lease_expires_at"]) == (job.owner, job.expires)
                assert row["lease_token_hash"] == tokens.hash_token(job.token or "")
        stored = {(r["job_id"], r["key"]): r for r in record_rows}
        assert set(stored) == set(self.records)
        for at, record in self.records.items():
            row = stored[at]
            assert (row["state"], row["status"], bytes(row["body"] or b"")) == (
                record.state,
                record.status,
                record.body,
            ), (row, record)

    @invariant()
    def at_most_one_current_lease_per_job(self) -> None:
        current: dict[str, list[Held]] = {}
        for held in self.held:
            if self.is_current(held):
                current.setdefault(held.job, []).append(held)
        assert all(len(leases) == 1 for leases in current.values()), current
        for job_id, generations in self.grants.items():
            assert generations == sorted(set(generations)), (job_id, generations)
            assert self.jobs[job_id].generation == generations[-1]

    @invariant()
    def upstream_got_each_key_once_and_in_generation_order(self) -> None:
        """One write per (job, key) reaches the upstream, plus one more after each time
        an operator said the earlier one was not applied; it applied at most one; and
        per job the generations it received never go down."""
        received: dict[tuple[str, str], int] = {}
        applied: set[tuple[str, str]] = set()
        highest: dict[str, int] = {}
        for entry in self.upstream.received:
            at = (entry["job"], entry["key"])
            received[at] = received.get(at, 0) + 1
            assert received[at] <= 1 + self.let_through.get(at, 0), (at, self.upstream.received)
            if entry["applied"]:
                assert at not in applied, f"{at} applied twice"
                applied.add(at)
            assert entry["generation"] >= highest.get(entry["job"], 0), self.upstream.received
            highest[entry["job"]] = entry["generation"]


def test_lease_core_and_gateway_follow_the_model(sqlite_template: Path) -> None:
    run_state_machine_as_test(lambda: LeaseAndGatewayModel(sqlite_template), settings=PROFILE)


@pytest.mark.postgres
def test_lease_core_and_gateway_follow_the_model_on_postgres(pg_database_url: str) -> None:
    """The same model against PostgreSQL: the admission that guards every write in
    production (one statement, batched across concurrent writes) is model-checked too."""
    run_state_machine_as_test(
        lambda: LeaseAndGatewayModel(postgres_url=pg_database_url), settings=PROFILE
    )
