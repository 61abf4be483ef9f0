"""The hot path sent straight to the driver (``lease_core.direct``), on real databases.

PostgreSQL: concurrent admissions and settles are coalesced into one statement over
arrays; every write in a batch must be judged as if it were alone, and a call that the
database rejects must fail alone. SQLite: the operations of one event-loop turn share one
IMMEDIATE transaction (a savepoint each); when another connection holds the write lock
they are handed to a database thread. Both: the engine's ``dispose()`` closes it all, and
an unreachable database is ``StoreUnavailable``.

Batches are observed by wrapping ``PostgresDirect._fetch_all`` on the instance with a
counter that still calls the real method (nothing is replaced).
"""

from __future__ import annotations

import asyncio
import gc
import sqlite3
import time
import uuid
import warnings
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from gateway.fencing import fence
from gateway.fencing.fence import Admission, RecordState
from gateway.records.schema import fences, requests
from gateway.records.store import GatewayStore, WriteRequest
from lease_core import direct_sqlite as direct_module
from lease_core import exceptions as exc
from lease_core import tokens
from lease_core.catalogue import parse
from lease_core.db import Engine, create_engine, direct_of
from lease_core.direct_postgres import PostgresDirect
from lease_core.direct_sqlite import SqliteDirect
from lease_core.statement import BATCH_LANES, MAX_BATCH, Batched, Statement
from lease_core.store import LeaseStore
from tests.support import FakeClock

ON_POSTGRES = pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
ON_SQLITE = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)

Row = Mapping[str, Any]


# -- helpers --------------------------------------------------------------------------------


class FetchAllCounter:
    """Counts the statements ``PostgresDirect._fetch_all`` sends (batched statements and
    lone calls of a statement without a ``single`` form): their sizes, failures and how
    many ran at once."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.failed = 0
        self.in_flight = 0
        self.max_in_flight = 0

    def install(self, direct: PostgresDirect, monkeypatch: pytest.MonkeyPatch) -> None:
        real = direct._fetch_all

        async def counting(statement: Statement, params: Mapping[str, Any]) -> list[Row]:
            self.sizes.append(_batch_size(params))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                return await real(statement, params)
            except BaseException:
                self.failed += 1
                raise
            finally:
                self.in_flight -= 1

        monkeypatch.setattr(direct, "_fetch_all", counting)


def _batch_size(params: Mapping[str, Any]) -> int:
    sizes = {len(value) for name, value in params.items() if name != "now"}
    assert len(sizes) == 1, params
    return sizes.pop()


@pytest.fixture
def statements(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> FetchAllCounter:
    """The statement counter, installed on PostgreSQL (on SQLite it stays empty)."""
    counter = FetchAllCounter()
    direct = direct_of(engine)
    if isinstance(direct, PostgresDirect):
        counter.install(direct, monkeypatch)
    return counter


@pytest.fixture
def gstore(store: LeaseStore) -> GatewayStore:
    return GatewayStore(store)


def write(
    token: str | None,
    key: str,
    fingerprint: str = "fp",
    *,
    method: str = "POST",
    path: str = "charges",
    deadline_in: float = 300.0,
) -> WriteRequest:
    """A fenced write; ``token`` None: a well-formed token that was never granted."""
    if token is None:
        token = tokens.new_token()[0]
    return WriteRequest(
        token_hash=tokens.hash_token(token),
        key=key,
        fingerprint=fingerprint,
        upstream="pay",
        method=method,
        path=path,
        deadline_in=deadline_in,
    )


async def lease(store: LeaseStore, job_id: str, owner: str = "worker", ttl: float = 300.0) -> str:
    granted = await store.acquire(job_id=job_id, owner=owner, ttl=ttl, queue="q", max_attempts=100)
    assert granted.lease_token is not None
    return granted.lease_token


async def record_rows(store: LeaseStore, prefix: str = "") -> dict[tuple[str, str], Row]:
    stmt = sa.select(requests).where(requests.c.job_id.startswith(prefix, autoescape=True))
    async with store.backend.transaction() as conn:
        rows = (await conn.execute(stmt)).mappings().all()
    return {(row["job_id"].removeprefix(prefix), row["key"]): dict(row) for row in rows}


async def fence_rows(store: LeaseStore, prefix: str = "") -> dict[str, int]:
    stmt = sa.select(fences.c.job_id, fences.c.generation).where(
        fences.c.job_id.startswith(prefix, autoescape=True)
    )
    async with store.backend.transaction() as conn:
        rows = (await conn.execute(stmt)).all()
    return {row.job_id.removeprefix(prefix): row.generation for row in rows}


def store_errors(store: LeaseStore) -> float:
    value = store.metrics.registry.get_sample_value("fencegate_store_unavailable_total")
    return value or 0.0


# -- Statement on the real databases ----------------------------------------------------------


async def test_fetchrow_binds_names_and_an_injected_now(engine: AsyncEngine) -> None:
    direct = direct_of(engine)
    statement = Statement(
        "SELECT {now} AS now, CAST(:a AS INTEGER) + CAST(:b AS INTEGER) AS total, "
        "CAST(:a AS INTEGER) AS a, {now} + CAST(:a AS INTEGER) AS later, "
        "CAST(:label AS TEXT) AS label"
    )
    row = await direct.fetchrow(statement, {"a": 2, "b": 40, "now": 1234.5, "label": "x"})
    assert row is not None
    assert float(row["now"]) == 1234.5
    assert row["total"] == 42 and row["a"] == 2 and row["label"] == "x"
    assert float(row["later"]) == 1236.5


async def test_fetchrow_gives_the_first_row_or_none(engine: AsyncEngine) -> None:
    direct = direct_of(engine)
    await direct.fetchrow(
        Statement(
            "INSERT INTO fences (job_id, generation, updated_at) "
            "VALUES ('f1', 1, 0), ('f2', 1, 0), ('f3', 1, 0)"
        ),
        {},
    )
    none = await direct.fetchrow(
        Statement("SELECT job_id FROM fences WHERE job_id = :id"), {"id": "nope"}
    )
    assert none is None
    # A statement returning several rows: the first, and the whole statement ran.
    row = await direct.fetchrow(
        Statement(
            "UPDATE fences SET generation = generation + CAST(:step AS INTEGER) "
            "WHERE job_id LIKE 'f%' "
            "RETURNING job_id, generation"
        ),
        {"step": 4},
    )
    assert row is not None and row["generation"] == 5
    total = await direct.fetchrow(Statement("SELECT sum(generation) AS s FROM fences"), {})
    assert total is not None and total["s"] == 15


_CHAIN = parse(
    """
-- name: chain
-- Raise one fence; the second statement sees the first's column; a third matches no row.
UPDATE fences SET generation = generation + CAST(:step AS INTEGER) WHERE job_id = :job_id
RETURNING generation AS raised;
SELECT CAST(:raised AS INTEGER) * 10 AS tenfold, CAST(:job_id AS TEXT) AS job_id;
SELECT job_id AS missing FROM fences WHERE job_id = 'nope';
-- name: doomed
-- The second statement fails: the first one's change is undone with it.
UPDATE fences SET generation = 99 WHERE job_id = :job_id;
INSERT INTO fences (job_id, generation, updated_at) VALUES (:job_id, 1, 0);
"""
)


async def test_an_operation_of_several_statements_is_one_transaction(
    engine: AsyncEngine,
) -> None:
    """A catalogue operation's statements run in order in one transaction: each one's
    columns are parameters of the next (never in place of the caller's), NULL when it
    returned no row; the answer is all of them; a failing statement undoes them all."""
    direct = direct_of(engine)
    await direct.fetchrow(
        Statement("INSERT INTO fences (job_id, generation, updated_at) VALUES ('c', 1, 0)"), {}
    )
    row = await direct.execute(_CHAIN["chain"], {"job_id": "c", "step": 2, "now": None})
    assert row is not None
    assert dict(row) == {"raised": 3, "tenfold": 30, "job_id": "c", "missing": None}
    with pytest.raises(Exception, match=r"(?i)unique|duplicate"):
        await direct.execute(_CHAIN["doomed"], {"job_id": "c", "now": None})
    left = await direct.fetchrow(Statement("SELECT generation FROM fences WHERE job_id = 'c'"), {})
    assert left is not None and left["generation"] == 3
    nothing = await direct.execute(_CHAIN["chain"], {"job_id": "none", "step": 1, "now": None})
    assert nothing is not None and nothing["raised"] is None and nothing["tenfold"] is None


@ON_POSTGRES
async def test_postgres_server_now_and_casts(engine: AsyncEngine) -> None:
    direct = direct_of(engine)
    row = await direct.fetchrow(
        Statement("SELECT {now} AS now, :a::int + CAST(:b AS int) AS s, :t::text AS t, :a AS a"),
        {"now": None, "a": 5, "b": 6, "t": "x"},
    )
    assert row is not None
    assert abs(float(row["now"]) - time.time()) < 5  # the server's clock
    assert (row["s"], row["t"], row["a"]) == (11, "x", 5)
    injected = await direct.fetchrow(Statement("SELECT {now} AS now"), {"now": 7.25})
    assert injected is not None and injected["now"] == 7.25


@ON_SQLITE
async def test_sqlite_batched_statement_runs_its_single_form(engine: AsyncEngine) -> None:
    direct = direct_of(engine)
    both = Batched(
        many=Statement("SELECT 'many' AS via"),
        single=Statement("SELECT 'single' AS via, :x * 2 AS doubled"),
    )
    rows = await asyncio.gather(*(direct.fetchrow_batched(both, {"x": i}) for i in range(5)))
    assert [(r["via"], r["doubled"]) for r in rows if r is not None] == [
        ("single", 2 * i) for i in range(5)
    ]
    with pytest.raises(TypeError, match="no form for one caller"):
        await direct.fetchrow_batched(Batched(Statement("SELECT 1")), {})


# -- PostgreSQL: batches of a generic statement ------------------------------------------------

_DOUBLE_MANY = Statement(
    """
SELECT v.n, v.x * 2 AS doubled, 'many' AS via
FROM unnest(CAST(:x AS integer[])) WITH ORDINALITY AS v(x, n)
WHERE v.x >= 0
ORDER BY v.n DESC
"""
)
_DOUBLE_SINGLE = Statement("SELECT CAST(:x AS integer) * 2 AS doubled, 'single' AS via")


@ON_POSTGRES
async def test_postgres_concurrent_calls_share_statements_and_get_their_own_rows(
    engine: AsyncEngine, statements: FetchAllCounter
) -> None:
    direct = direct_of(engine)
    doubled = Batched(_DOUBLE_MANY, _DOUBLE_SINGLE)
    # Rows come back in reverse order and negative inputs have no row: ``n`` maps them.
    inputs = [i if i % 5 else -i - 1 for i in range(100)]
    rows = await asyncio.gather(*(direct.fetchrow_batched(doubled, {"x": x}) for x in inputs))
    for x, row in zip(inputs, rows, strict=True):
        if x < 0:
            assert row is None
        else:
            assert row is not None and row["doubled"] == 2 * x and row["via"] == "many"
    assert sum(statements.sizes) == 100 and len(statements.sizes) < 100
    assert max(statements.sizes) <= MAX_BATCH
    assert statements.failed == 0


@ON_POSTGRES
async def test_postgres_a_lone_call_uses_the_single_form(
    engine: AsyncEngine, statements: FetchAllCounter
) -> None:
    direct = direct_of(engine)
    row = await direct.fetchrow_batched(Batched(_DOUBLE_MANY, _DOUBLE_SINGLE), {"x": 21})
    assert row is not None and (row["doubled"], row["via"]) == (42, "single")
    assert statements.sizes == []  # the single form goes through fetchrow
    # Without a single form, a lone call is sent the batch statement over arrays of one.
    row = await direct.fetchrow_batched(Batched(_DOUBLE_MANY), {"x": 4})
    assert row is not None and (row["doubled"], row["via"]) == (8, "many")
    missing = await direct.fetchrow_batched(Batched(_DOUBLE_MANY), {"x": -1})
    assert missing is None
    assert statements.sizes == [1, 1]


@ON_POSTGRES
async def test_postgres_a_value_the_database_rejects_fails_only_its_call(
    engine: AsyncEngine, statements: FetchAllCounter
) -> None:
    direct = direct_of(engine)
    parse = Batched(
        Statement(
            "SELECT v.n, CAST(v.x AS integer) AS i, 'many' AS via "
            "FROM unnest(CAST(:x AS text[])) WITH ORDINALITY AS v(x, n)"
        ),
        Statement("SELECT CAST(CAST(:x AS text) AS integer) AS i, 'single' AS via"),
    )
    inputs = [str(i) for i in range(12)]
    inputs[5] = "not-a-number"
    results = await asyncio.gather(
        *(direct.fetchrow_batched(parse, {"x": x}) for x in inputs), return_exceptions=True
    )
    bad = results[5]
    assert isinstance(bad, asyncpg.exceptions.InvalidTextRepresentationError), bad
    for i, result in enumerate(results):
        if i == 5:
            continue
        assert not isinstance(result, BaseException), result
        assert result is not None and result["i"] == i
        assert result["via"] == "single"  # answered by the retry, alone
    assert statements.sizes == [12] and statements.failed == 1


@ON_POSTGRES
async def test_postgres_a_rejected_value_next_to_a_word_like_connect_fails_alone(
    engine: AsyncEngine,
) -> None:
    direct = direct_of(engine)
    echo = Batched(
        Statement("SELECT v.n, v.x AS x FROM unnest(CAST(:x AS text[])) WITH ORDINALITY AS v(x, n)")
    )
    inputs = ["/pay/connect/accounts", "/pay/charges", "/pay/\udcff"]  # undecodable bytes
    results = await asyncio.gather(
        *(direct.fetchrow_batched(echo, {"x": x}) for x in inputs), return_exceptions=True
    )
    assert not isinstance(results[2], exc.StoreUnavailable)
    assert isinstance(results[2], asyncpg.exceptions.DataError)  # refused by the driver
    for x, result in zip(inputs[:2], results[:2], strict=True):
        assert not isinstance(result, BaseException), result
        assert result is not None and result["x"] == x


# -- admissions: batches judge each write as if alone --------------------------------------------


@dataclass
class Planned:
    label: str
    write: WriteRequest
    refused: bool = False  # the lease is not current: judged first in the sequential run


async def plan_scenario(store: LeaseStore, gstore: GatewayStore, p: str) -> list[Planned]:
    """Jobs (ids prefixed ``p``) in every state an admission distinguishes, and 42 writes
    over them. Everything set up here is sequential."""
    a = await lease(store, f"{p}a")
    b = await lease(store, f"{p}b")
    # A re-grant to the same owner makes the first token stale.
    s1 = await lease(store, f"{p}s", owner="ws")
    s2 = await lease(store, f"{p}s", owner="ws")
    assert s1 != s2
    # Generation 1 leaves a write in flight, then generation 2 is granted.
    o1 = await lease(store, f"{p}o", owner="wo")
    old = await gstore.admit(write(o1, "o-old", "f-old"))
    assert old.claimed
    o2 = await lease(store, f"{p}o", owner="wo")
    # A completed record and an in-flight one.
    c = await lease(store, f"{p}c")
    done = await gstore.admit(write(c, "done", "f-done"))
    assert done.claimed and done.attempt is not None
    await gstore.settle(
        f"{p}c",
        "done",
        done.attempt,
        state=RecordState.COMPLETED,
        status=201,
        headers=[("x-id", "7")],
        body=b"applied",
    )
    assert (await gstore.admit(write(c, "fp", "f1"))).claimed
    e = await lease(store, f"{p}e", ttl=5)  # expires when the test moves the clock
    d = await lease(store, f"{p}d")
    await store.complete(d)
    x = await lease(store, f"{p}x")
    await store.complete(x)
    await store.purge_job(f"{p}x")

    planned = [
        Planned("a1", write(a, "k1", "fa1")),
        Planned("a2", write(a, "k2", "fa2")),
        Planned("a-dup", write(a, "dup", "fdup")),
        Planned("a-dup", write(a, "dup", "fdup")),
        Planned("a-fp", write(a, "kfp", "g1")),
        Planned("a-fp", write(a, "kfp", "g2")),
        Planned("a-anonymous", write(a, fence.anonymous_key(), "fanon")),
    ]
    planned += [Planned(f"b{i}", write(b, f"kb{i}", f"fb{i}")) for i in range(16)]
    planned += [
        Planned("s-stale", write(s1, "s1"), refused=True),
        Planned("s-current", write(s2, "s2")),
        Planned("s-stale-same-key", write(s1, "s2"), refused=True),
        Planned("o-new", write(o2, "o-new")),
        Planned("o-old-key-again", write(o2, "o-old", "f-old")),
        Planned("o-stale", write(o1, "o-x"), refused=True),
        Planned("c-done", write(c, "done", "f-done")),
        Planned("c-done-other-request", write(c, "done", "f-other")),
        Planned("c-fp", write(c, "fp", "f2")),
        Planned("c-fp-same", write(c, "fp", "f1")),
        Planned("c-new", write(c, "c-new", "fcn")),  # beside an in-flight write of its own gen
        Planned("e-expired", write(e, "e1"), refused=True),
        Planned("d-ended", write(d, "d1"), refused=True),
        Planned("x-purged", write(x, "x1"), refused=True),
    ]
    planned += [Planned("unknown", write(None, f"u{i}"), refused=True) for i in range(3)]
    planned += [Planned("b-more", write(b, f"kb-more{i}", "fbm")) for i in range(3)]
    return planned


def summary(planned: Planned, admission: Admission, prefix: str) -> tuple[object, ...]:
    """What an admission judged, without the random attempt ids and the job prefix."""
    presented = admission.presented
    record = admission.record
    return (
        planned.label,
        None
        if presented is None
        else (presented.job_id.removeprefix(prefix), presented.generation, presented.owner),
        None
        if presented is None or presented.job is None
        else (presented.job.state, presented.job.generation),
        admission.lease,
        admission.highest,
        admission.claimed,
        admission.attempt is not None,
        None
        if record is None
        else (
            record.state,
            record.generation,
            record.fingerprint == planned.write.fingerprint,
            record.status,
            None if record.headers is None else tuple(record.headers),
            record.body,
        ),
        admission.older_in_flight,
    )


async def test_concurrent_admissions_are_judged_as_sequential_ones(
    store: LeaseStore,
    gstore: GatewayStore,
    clock: FakeClock,
    statements: FetchAllCounter,
    backend: str,
) -> None:
    batch_plan = await plan_scenario(store, gstore, "bat-")
    alone_plan = await plan_scenario(store, gstore, "seq-")
    clock.advance(10)  # the "e" leases expire; every other lease and deadline holds
    assert len(batch_plan) >= 40

    statements.sizes.clear()
    batched = await asyncio.gather(*(gstore.admit(p.write) for p in batch_plan))
    if backend == "postgres":
        # Real batches formed, each write was in exactly one, and none was retried.
        assert max(statements.sizes) > 1
        assert len(statements.sizes) < len(batch_plan)
        assert sum(statements.sizes) == len(batch_plan)
        assert statements.failed == 0

    # The same writes one at a time, in an order that the concurrent run is equivalent to.
    # SQLite runs the writes of one turn one after the other, in order. A PostgreSQL batch
    # reads the fence from before its own raise: refused writes are as if judged first.
    order = list(range(len(alone_plan)))
    if backend == "postgres":
        order.sort(key=lambda i: not alone_plan[i].refused)
    alone: list[Admission | None] = [None] * len(alone_plan)
    for i in order:
        alone[i] = await gstore.admit(alone_plan[i].write)

    got = Counter(summary(p, a, "bat-") for p, a in zip(batch_plan, batched, strict=True))
    want = Counter(
        summary(p, a, "seq-") for p, a in zip(alone_plan, alone, strict=True) if a is not None
    )
    assert got == want

    # The same rows and fences result.
    def comparable(rows: dict[tuple[str, str], Row]) -> set[tuple[object, ...]]:
        return {
            (
                job,
                "anon" if fence.is_anonymous(key) else key,
                row["state"],
                row["generation"],
                row["fingerprint"],
                row["status"],
            )
            for (job, key), row in rows.items()
        }

    batch_records = await record_rows(store, "bat-")
    assert comparable(batch_records) == comparable(await record_rows(store, "seq-"))
    assert await fence_rows(store, "bat-") == await fence_rows(store, "seq-")
    assert await fence_rows(store, "bat-") == {"a": 1, "b": 1, "c": 1, "o": 2, "s": 2}
    assert len(batch_records) == len(await record_rows(store, "seq-"))

    by_label: dict[str, list[Admission]] = {}
    for p, a in zip(batch_plan, batched, strict=True):
        by_label.setdefault(p.label, []).append(a)
    # The same key twice in one batch: exactly one claim; the other sees that claim.
    for label in ("a-dup", "a-fp"):
        pair = by_label[label]
        winners = [a for a in pair if a.claimed]
        losers = [a for a in pair if not a.claimed]
        assert len(winners) == 1 and len(losers) == 1, pair
        assert losers[0].record is not None and losers[0].attempt is None
        assert losers[0].record.attempt == winners[0].attempt
        assert losers[0].record.state is RecordState.IN_FLIGHT
    key = ("a", "dup")
    assert batch_records[key]["attempt"] in {a.attempt for a in by_label["a-dup"]}
    # A stale token is refused and claims nothing, even with the current write's key.
    for label in ("s-stale", "s-stale-same-key", "o-stale"):
        (refused,) = by_label[label]
        assert refused.lease is fence.Reason.STALE_GENERATION
        assert not refused.claimed and refused.record is None and refused.attempt is None
    assert ("s", "s1") not in batch_records and ("o", "o-x") not in batch_records
    (current,) = by_label["s-current"]
    assert current.claimed and batch_records[("s", "s2")]["attempt"] == current.attempt
    assert batch_records[("s", "s2")]["generation"] == 2
    # An older generation's write in flight: the newer generation's claim is told so.
    (newer,) = by_label["o-new"]
    assert newer.claimed and newer.older_in_flight
    assert not by_label["a1"][0].older_in_flight
    (same_generation,) = by_label["c-new"]
    assert same_generation.claimed and not same_generation.older_in_flight
    (again,) = by_label["o-old-key-again"]
    assert not again.claimed and again.record is not None and again.record.generation == 1
    # Unknown tokens, expired, ended and purged leases.
    assert all(a.presented is None for a in by_label["unknown"])
    assert by_label["e-expired"][0].lease is fence.Reason.LEASE_EXPIRED
    assert by_label["d-ended"][0].lease is fence.Reason.LEASE_ENDED
    assert by_label["x-purged"][0].lease is fence.Reason.STALE_GENERATION
    assert all(a.lease is fence.Reason.INVALID_FENCING_TOKEN for a in by_label["unknown"])
    (done,) = by_label["c-done"]
    assert done.record is not None and done.record.state is RecordState.COMPLETED
    assert (done.record.status, done.record.headers, done.record.body) == (
        201,
        [("x-id", "7")],
        b"applied",
    )


@ON_POSTGRES
async def test_postgres_one_hot_key_across_overlapping_batches_is_claimed_once(
    store: LeaseStore, gstore: GatewayStore, statements: FetchAllCounter
) -> None:
    """Waves of writes with one key, so that batches run in both lanes at once and a
    batch meets a claim that another, uncommitted batch made."""
    token = await lease(store, "hot")
    other = await lease(store, "cold")
    await gstore.check_lease(tokens.hash_token(token))  # the pool is open

    async def wave(n: int) -> list[Admission]:
        for _ in range(n):  # each wave arrives in its own turn of the event loop
            await asyncio.sleep(0)
        calls = [gstore.admit(write(token, "hot", "same")) for _ in range(6)]
        calls += [gstore.admit(write(other, f"cold-{n}-{i}")) for i in range(2)]
        return list(await asyncio.gather(*calls))

    results = [a for group in await asyncio.gather(*(wave(n) for n in range(8))) for a in group]
    hot = [a for a in results if a.presented is not None and a.presented.job_id == "hot"]
    cold = [a for a in results if a.presented is not None and a.presented.job_id == "cold"]
    assert len(hot) == 48 and len(cold) == 16
    winners = [a for a in hot if a.claimed]
    assert len(winners) == 1
    for loser in hot:
        if loser.claimed:
            continue
        assert loser.record is not None and loser.attempt is None
        assert loser.record.attempt == winners[0].attempt
    assert all(a.claimed for a in cold)
    rows = await record_rows(store)
    assert rows[("hot", "hot")]["attempt"] == winners[0].attempt
    assert len([key for key in rows if key[0] == "cold"]) == 16
    assert len(statements.sizes) > 1 and max(statements.sizes) > 1
    assert sum(statements.sizes) == len(results) and statements.failed == 0


@ON_POSTGRES
async def test_postgres_more_writes_than_a_batch_holds_use_both_lanes(
    store: LeaseStore, gstore: GatewayStore, statements: FetchAllCounter
) -> None:
    lease_tokens = [await lease(store, f"job-{j}") for j in range(5)]
    count = 2 * MAX_BATCH + 22
    writes = [write(lease_tokens[i % 5], f"key-{i}", f"fp-{i}") for i in range(count)]
    results = await asyncio.gather(*(gstore.admit(w) for w in writes))
    assert all(a.claimed and a.attempt is not None for a in results)
    assert len({a.attempt for a in results}) == count
    rows = await record_rows(store)
    assert len(rows) == count
    for w, a in zip(writes, results, strict=True):
        assert a.presented is not None
        row = rows[(a.presented.job_id, w.key)]
        assert row["attempt"] == a.attempt and row["fingerprint"] == w.fingerprint
    assert sum(statements.sizes) == count and statements.failed == 0
    assert max(statements.sizes) == MAX_BATCH
    assert len(statements.sizes) == -(-count // MAX_BATCH)
    assert statements.max_in_flight == BATCH_LANES


@ON_POSTGRES
async def test_postgres_admissions_on_the_server_clock(
    engine: AsyncEngine, statements: FetchAllCounter
) -> None:
    store = LeaseStore(engine)  # PostgreSQL's now() decides
    gstore = GatewayStore(store)
    token = await lease(store, "j", ttl=60)
    results = await asyncio.gather(*(gstore.admit(write(token, f"k{i}")) for i in range(20)))
    assert all(a.claimed for a in results)
    assert all(abs(a.now - time.time()) < 5 for a in results)
    assert max(statements.sizes) > 1
    rows = await record_rows(store)
    assert all(abs(row["deadline"] - (time.time() + 300)) < 10 for row in rows.values())


@ON_POSTGRES
async def test_postgres_each_write_is_judged_on_its_own_clock(
    engine: AsyncEngine, store: LeaseStore, gstore: GatewayStore
) -> None:
    server_store = LeaseStore(engine)
    server_gstore = GatewayStore(server_store)
    injected_token = await lease(store, "on-injected-clock")
    server_token = await lease(server_store, "on-server-clock")
    alone = await server_gstore.admit(write(server_token, "alone"))
    assert alone.claimed
    injected, served = await asyncio.gather(
        gstore.admit(write(injected_token, "k")), server_gstore.admit(write(server_token, "k"))
    )
    assert injected.claimed
    assert served.lease is None
    assert served.claimed


@ON_POSTGRES
async def test_postgres_admit_reports_a_purged_jobs_fence_like_check_lease(
    store: LeaseStore, gstore: GatewayStore
) -> None:
    token = await lease(store, "purged")
    admitted = await gstore.admit(write(token, "k"))
    assert admitted.claimed and admitted.attempt is not None
    await gstore.settle(
        "purged",
        "k",
        admitted.attempt,
        state=RecordState.COMPLETED,
        status=201,
        headers=[],
        body=b"",
    )
    await store.complete(token)
    await store.purge_job("purged")
    checked = await gstore.check_lease(tokens.hash_token(token))
    admitted = await gstore.admit(write(token, "k2"))
    assert checked.presented is not None and checked.presented.job is None
    assert admitted.presented == checked.presented
    assert admitted.highest == checked.highest


@ON_POSTGRES
async def test_postgres_a_rejected_admission_fails_alone(
    store: LeaseStore, gstore: GatewayStore, statements: FetchAllCounter
) -> None:
    """Values the database refuses (method over String(32), key over String(255), a path
    the driver cannot encode) fail their own call; the batch is retried call by call."""
    token = await lease(store, "j")
    second = await lease(store, "j2")
    writes = [write(token if i % 2 else second, f"good-{i}") for i in range(20)]
    bad = {
        3: write(token, "bad-method", method="M" * 40),
        9: write(second, "k" * 300),
        15: write(token, "bad-path", path="charges/\udcff"),
    }
    for i, w in bad.items():
        writes.insert(i, w)
    results = await asyncio.gather(*(gstore.admit(w) for w in writes), return_exceptions=True)
    assert isinstance(results[3], asyncpg.exceptions.StringDataRightTruncationError)
    assert isinstance(results[9], asyncpg.exceptions.StringDataRightTruncationError)
    assert isinstance(results[15], asyncpg.exceptions.DataError)  # refused by the driver
    good = [r for i, r in enumerate(results) if i not in bad]
    assert all(isinstance(r, Admission) and r.claimed for r in good), good
    rows = await record_rows(store)
    assert {key for _job, key in rows} == {f"good-{i}" for i in range(20)}
    # One batch failed, then every call ran alone, in admit's form for one caller.
    assert statements.sizes == [len(writes)] and statements.failed == 1
    assert store_errors(store) == 0


# -- settles ---------------------------------------------------------------------------------


async def test_concurrent_settles_land_each_on_its_own_record(
    store: LeaseStore, gstore: GatewayStore, statements: FetchAllCounter, backend: str
) -> None:
    token = await lease(store, "j")
    other = await lease(store, "other")
    keys = [f"k{i}" for i in range(40)]
    admitted = await asyncio.gather(
        *(
            gstore.admit(write(token if i % 3 else other, key, f"fp-{i}"))
            for i, key in enumerate(keys)
        )
    )
    assert all(a.claimed and a.attempt is not None for a in admitted)
    anonymous = [fence.anonymous_key() for _ in range(3)]
    anonymous_admitted = [await gstore.admit(write(token, key)) for key in anonymous]

    statements.sizes.clear()

    def job_of(i: int) -> str:
        return "j" if i % 3 else "other"

    def expected(i: int) -> dict[str, Any]:
        if i % 10 == 5:  # wrong attempt: nothing changes
            return {"state": "in_flight", "status": None, "headers": None, "body": None}
        if i % 4 == 3:
            return {"state": "unknown", "status": None, "headers": None, "body": None}
        return {
            "state": "completed",
            "status": 200 + i,
            "headers": [["x-i", str(i)], ["content-type", "application/json"]],
            "body": f"body-{i}".encode(),
        }

    calls = []
    for i, (key, a) in enumerate(zip(keys, admitted, strict=True)):
        assert a.attempt is not None
        attempt = uuid.uuid4().hex if i % 10 == 5 else a.attempt
        want = expected(i)
        calls.append(
            gstore.settle(
                job_of(i),
                key,
                attempt,
                state=RecordState.UNKNOWN if want["state"] == "unknown" else RecordState.COMPLETED,
                status=want["status"],
                headers=None if want["headers"] is None else [tuple(h) for h in want["headers"]],
                body=want["body"],
                note=f"note-{i}" if want["state"] == "unknown" else None,
            )
        )
    # Anonymous keys: completed is forgotten (unless the attempt is not ours), unknown kept.
    attempts = [a.attempt for a in anonymous_admitted]
    assert all(attempt is not None for attempt in attempts)
    calls.append(
        gstore.settle(
            "j",
            anonymous[0],
            str(attempts[0]),
            state=RecordState.COMPLETED,
            status=201,
            headers=[],
            body=b"",
        )
    )
    calls.append(
        gstore.settle(
            "j",
            anonymous[1],
            uuid.uuid4().hex,
            state=RecordState.COMPLETED,
            status=201,
            headers=[],
            body=b"",
        )
    )
    calls.append(
        gstore.settle(
            "j",
            anonymous[2],
            str(attempts[2]),
            state=RecordState.UNKNOWN,
            status=None,
            headers=None,
            body=None,
            note="timed out",
        )
    )
    assert await asyncio.gather(*calls) == [None] * len(calls)
    if backend == "postgres":
        assert max(statements.sizes) > 1 and len(statements.sizes) < len(calls)
        assert statements.failed == 0

    rows = await record_rows(store)
    for i, key in enumerate(keys):
        row = rows[(job_of(i), key)]
        want = expected(i)
        got = {name: row[name] for name in want}
        assert got == want, (i, got)
        assert row["note"] == (f"note-{i}" if want["state"] == "unknown" else None)
        assert row["attempt"] == admitted[i].attempt
    assert ("j", anonymous[0]) not in rows
    assert rows[("j", anonymous[1])]["state"] == "in_flight"
    assert rows[("j", anonymous[2])]["state"] == "unknown"
    assert rows[("j", anonymous[2])]["note"] == "timed out"
    # A duplicate of a settled write sees the stored answer.
    again = await gstore.admit(write(token, "k1", "fp-1"))
    assert not again.claimed and again.record is not None
    assert again.record.state is RecordState.COMPLETED
    assert again.record.status == 201
    assert again.record.headers == [("x-i", "1"), ("content-type", "application/json")]
    assert again.record.body == b"body-1"


async def test_concurrent_claim_readings_each_see_their_own_claim(
    store: LeaseStore,
    gstore: GatewayStore,
    statements: FetchAllCounter,
    backend: str,
    clock: FakeClock,
) -> None:
    """``GatewayStore.claim``, the last reading before a write is sent: the job's fence,
    and the deadline only while the record is still this attempt's and in flight."""
    first = {job: await lease(store, job) for job in ("j", "other")}
    keys = [f"k{i}" for i in range(30)]

    def job_of(i: int) -> str:
        return "j" if i % 2 else "other"

    admitted = [await gstore.admit(write(first[job_of(i)], key)) for i, key in enumerate(keys)]
    assert all(a.claimed and a.attempt is not None for a in admitted)
    await gstore.settle(
        "j", "k1", str(admitted[1].attempt), state=RecordState.COMPLETED, status=200,
        headers=[], body=b"",
    )  # fmt: skip
    # The same owner again: generation 2 of "other", admitted, so its fence moves to 2.
    newer = await lease(store, "other")
    assert (await gstore.admit(write(newer, "k-newer"))).claimed
    statements.sizes.clear()

    def attempt_of(i: int) -> str:
        return uuid.uuid4().hex if i % 7 == 3 else str(admitted[i].attempt)

    claims = await asyncio.gather(
        *(gstore.claim(job_of(i), key, attempt_of(i)) for i, key in enumerate(keys))
    )
    for i, claim in enumerate(claims):
        assert claim.now == clock.now
        assert claim.fence == (1 if job_of(i) == "j" else 2), i
        ours = i % 7 != 3 and i != 1  # not another attempt's, not settled
        assert claim.deadline == (clock.now + 300.0 if ours else None), i
    if backend == "postgres":
        assert max(statements.sizes) > 1 and len(statements.sizes) < len(keys)
        assert statements.failed == 0
    # A job nobody ever wrote to: no fence, no claim.
    assert (await gstore.claim("nobody", "k0", "a")).fence is None


@ON_POSTGRES
async def test_postgres_a_rejected_settle_fails_alone(
    store: LeaseStore, gstore: GatewayStore, statements: FetchAllCounter
) -> None:
    token = await lease(store, "j")
    admitted = [await gstore.admit(write(token, f"k{i}")) for i in range(10)]
    statements.sizes.clear()

    async def settle(i: int, status: int) -> None:
        attempt = admitted[i].attempt
        assert attempt is not None
        await gstore.settle(
            "j",
            f"k{i}",
            attempt,
            state=RecordState.COMPLETED,
            status=status,
            headers=[("a", "b")],
            body=b"x",
        )

    results = await asyncio.gather(
        *(settle(i, 3_000_000_000 if i == 4 else 200) for i in range(10)),
        return_exceptions=True,
    )
    assert isinstance(results[4], asyncpg.exceptions.DataError)  # out of range for integer
    assert [r for i, r in enumerate(results) if i != 4] == [None] * 9
    rows = await record_rows(store)
    assert rows[("j", "k4")]["state"] == "in_flight"
    assert all(rows[("j", f"k{i}")]["state"] == "completed" for i in range(10) if i != 4)
    assert statements.sizes == [10] and statements.failed == 1  # then each alone


# -- SQLite: one transaction per event-loop turn ----------------------------------------------


@pytest.fixture
def sqlite_path(database_url: str) -> Path:
    """The test's SQLite file, with a scratch table ``probe``."""
    database = sa.make_url(database_url).database
    assert database
    path = Path(database)
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE probe (id INTEGER PRIMARY KEY, who TEXT NOT NULL, blob BLOB)")
        conn.commit()
    return path


@pytest.fixture
def reader(sqlite_path: Path) -> Iterator[Callable[[str], int]]:
    """``reader(pattern)``: how many committed probe rows match, seen by another
    connection."""
    conn = sqlite3.connect(sqlite_path, isolation_level=None, check_same_thread=False)

    def count(pattern: str = "%") -> int:
        value: int = conn.execute(
            "SELECT count(*) FROM probe WHERE who LIKE ?", (pattern,)
        ).fetchone()[0]
        return value

    yield count
    conn.close()


def insert(who: str, blob: bytes | None = None) -> Callable[[sqlite3.Connection], int]:
    def work(conn: sqlite3.Connection) -> int:
        cursor = conn.execute("INSERT INTO probe (who, blob) VALUES (?, ?)", (who, blob))
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    return work


async def write_load(
    direct: SqliteDirect,
    prefix: str,
    each: int,
    blob: bytes | None = None,
    *,
    after: Callable[[], None] = lambda: None,
) -> None:
    """Sixteen writers that never pause, ``each`` rows apiece (``prefix-writer-row``);
    ``after`` runs after every row."""

    async def writer(n: int) -> None:
        for i in range(each):
            await direct.in_write_transaction(insert(f"{prefix}-{n}-{i}", blob))
            after()

    await asyncio.gather(*(writer(n) for n in range(16)))


class Boom(Exception):
    pass


def sqlite_direct(engine: AsyncEngine) -> SqliteDirect:
    direct = direct_of(engine)
    assert isinstance(direct, SqliteDirect)
    return direct


@ON_SQLITE
async def test_sqlite_operations_of_one_turn_share_one_transaction(
    engine: AsyncEngine, sqlite_path: Path, reader: Callable[[str], int]
) -> None:
    direct = sqlite_direct(engine)
    seen: list[tuple[int, int, bool]] = []

    def work(i: int) -> Callable[[sqlite3.Connection], int]:
        def run(conn: sqlite3.Connection) -> int:
            conn.execute("INSERT INTO probe (who) VALUES (?)", (f"w{i}",))
            own = conn.execute("SELECT count(*) FROM probe").fetchone()[0]
            seen.append((own, reader("%"), conn.in_transaction))
            return i

        return run

    answered: list[int] = []
    tasks = [asyncio.ensure_future(direct.in_write_transaction(work(i))) for i in range(10)]
    for task in tasks:
        task.add_done_callback(lambda _t: answered.append(reader("%")))
    assert await asyncio.gather(*tasks) == list(range(10))
    # Each saw the uncommitted rows before it; nobody else saw any of them until the end.
    assert seen == [(i + 1, 0, True) for i in range(10)]
    # Every caller was answered after the one COMMIT.
    assert answered == [10] * 10
    assert direct.handed_off == 0


@ON_SQLITE
async def test_sqlite_the_answer_comes_after_commit(
    engine: AsyncEngine, sqlite_path: Path, reader: Callable[[str], int]
) -> None:
    direct = sqlite_direct(engine)
    for i in range(5):
        await direct.in_write_transaction(insert(f"row-{i}"))
        assert reader("row-%") == i + 1  # committed as soon as the await returns
    row = await direct.fetchrow(
        Statement("INSERT INTO probe (who) VALUES (:who) RETURNING id, who"), {"who": "fetched"}
    )
    assert row is not None and row["who"] == "fetched"
    assert reader("fetched") == 1


@ON_SQLITE
async def test_sqlite_a_failing_operation_rolls_back_alone_and_raises_at_once(
    engine: AsyncEngine, sqlite_path: Path, reader: Callable[[str], int]
) -> None:
    direct = sqlite_direct(engine)
    await direct.in_write_transaction(insert("existing"))
    existing = reader("existing")
    assert existing == 1

    def failing(conn: sqlite3.Connection) -> int:
        conn.execute("INSERT INTO probe (who) VALUES ('doomed')")
        conn.execute("UPDATE probe SET who = 'changed' WHERE who = 'existing'")
        raise Boom("no")

    def duplicate(conn: sqlite3.Connection) -> int:
        conn.execute("INSERT INTO probe (who) VALUES ('dup-doomed')")
        conn.execute("INSERT INTO probe (id, who) VALUES (1, 'clash')")  # id 1 exists
        return 0

    def after(conn: sqlite3.Connection) -> int:
        # Runs after the failures in the same transaction: their writes are gone.
        value: int = conn.execute(
            "SELECT count(*) FROM probe WHERE who IN ('doomed', 'dup-doomed', 'changed')"
        ).fetchone()[0]
        conn.execute("INSERT INTO probe (who) VALUES ('after')")
        return value

    async def caller(work: Callable[[sqlite3.Connection], int]) -> tuple[str, int]:
        try:
            return "ok", await direct.in_write_transaction(work)
        except (Boom, sqlite3.IntegrityError) as error:
            # Raised before the group's COMMIT: the other callers' rows are not in yet.
            return type(error).__name__, reader("%")

    results = await asyncio.gather(
        caller(insert("before")), caller(failing), caller(duplicate), caller(after)
    )
    assert results[0][0] == "ok"
    assert results[1] == ("Boom", 1)  # only 'existing' was committed when it raised
    assert results[2] == ("IntegrityError", 1)
    assert results[3] == ("ok", 0)
    assert reader("before") == 1 and reader("after") == 1 and reader("existing") == 1
    assert reader("doomed") == 0 and reader("dup-doomed") == 0 and reader("changed") == 0


@ON_SQLITE
async def test_sqlite_the_first_operation_of_a_turn_fails_without_a_savepoint(
    engine: AsyncEngine, reader: Callable[[str], int]
) -> None:
    """The first operation of a group runs without a savepoint: when it fails, the whole
    transaction is rolled back (nothing else was in it), and the operations after it in
    the same turn run in a new one and commit."""
    direct = sqlite_direct(engine)
    await direct.in_write_transaction(insert("warm"))

    def failing_first(conn: sqlite3.Connection) -> int:
        conn.execute("INSERT INTO probe (who) VALUES ('first-doomed')")
        conn.execute("UPDATE probe SET who = 'first-changed' WHERE who = 'warm'")
        raise Boom("first")

    results = await asyncio.gather(
        direct.in_write_transaction(failing_first),
        direct.in_write_transaction(insert("second")),
        direct.in_write_transaction(insert("third")),
        return_exceptions=True,
    )
    assert isinstance(results[0], Boom)
    assert all(isinstance(r, int) for r in results[1:])
    assert reader("first-%") == 0 and reader("warm") == 1
    assert reader("second") == 1 and reader("third") == 1
    assert direct.handed_off == 0


@ON_SQLITE
async def test_sqlite_a_read_answers_at_once_and_sees_its_turns_writes(
    engine: AsyncEngine, reader: Callable[[str], int]
) -> None:
    """A ``SELECT`` waits for no COMMIT: it answers before the group transaction of its
    turn commits, and sees that group's writes (a gate read can only get stricter)."""
    direct = sqlite_direct(engine)
    await direct.in_write_transaction(insert("warm"))
    pending = asyncio.ensure_future(direct.in_write_transaction(insert("pending")))
    await asyncio.sleep(0)  # the insert ran in this turn's group; its COMMIT is scheduled
    count = Statement("SELECT count(*) AS n FROM probe WHERE who = :who")
    row = await direct.fetchrow(count, {"who": "pending"})
    assert row is not None and row["n"] == 1  # the group's write, seen
    assert not pending.done() and reader("pending") == 0  # and not committed yet
    assert await pending > 0
    assert reader("pending") == 1
    # With no group open, a read is its own: nothing is left open behind it.
    assert (await direct.fetchrow(count, {"who": "warm"}) or {})["n"] == 1
    assert direct._group is None


@ON_SQLITE
async def test_sqlite_a_failed_single_statement_fails_alone(
    engine: AsyncEngine, reader: Callable[[str], int]
) -> None:
    """``fetchrow`` runs without a savepoint: SQLite undoes a failed statement itself,
    and the other operations of the turn still commit."""
    direct = sqlite_direct(engine)
    bad = Statement("INSERT INTO probe (id, who) VALUES (1, :who)")  # id 1 taken below
    results = await asyncio.gather(
        direct.in_write_transaction(insert("first")),  # gets id 1
        direct.fetchrow(bad, {"who": "duplicate-id"}),
        direct.fetchrow(
            Statement("INSERT INTO probe (who) VALUES (:who) RETURNING id"), {"who": "x"}
        ),
        return_exceptions=True,
    )
    assert results[0] == 1
    assert isinstance(results[1], sqlite3.IntegrityError)
    assert isinstance(results[2], sqlite3.Row) and results[2]["id"] == 2
    assert reader("first") == 1 and reader("x") == 1 and reader("duplicate-id") == 0


@ON_SQLITE
async def test_sqlite_an_error_that_ends_the_transaction_fails_the_whole_group(
    engine: AsyncEngine, reader: Callable[[str], int]
) -> None:
    """When an error takes the whole transaction with it (SQLite does that on I/O errors
    or a full disk; here the work ends it itself), the earlier operations of the group
    are undone too: their callers must hear so, not be told they committed."""
    direct = sqlite_direct(engine)

    def ends_the_transaction(conn: sqlite3.Connection) -> int:
        conn.execute("INSERT INTO probe (who) VALUES ('lost-too')")
        conn.execute("ROLLBACK")
        raise Boom("the transaction is gone")

    earlier = asyncio.ensure_future(direct.in_write_transaction(insert("earlier")))
    failing = asyncio.ensure_future(direct.in_write_transaction(ends_the_transaction))
    results = await asyncio.gather(earlier, failing, return_exceptions=True)
    assert isinstance(results[0], Boom) and isinstance(results[1], Boom)
    assert reader("earlier") == 0 and reader("lost-too") == 0
    # The next operation opens a new group and commits.
    assert await direct.in_write_transaction(insert("after")) > 0
    assert reader("after") == 1


@ON_SQLITE
async def test_sqlite_hand_off_while_the_engine_holds_the_write_lock(
    engine: AsyncEngine, store: LeaseStore, sqlite_path: Path, reader: Callable[[str], int]
) -> None:
    direct = sqlite_direct(engine)
    await direct.in_write_transaction(insert("warm"))  # the inline connection is open
    before = direct.handed_off

    def failing(conn: sqlite3.Connection) -> int:
        conn.execute("INSERT INTO probe (who) VALUES ('off-doomed')")
        raise Boom("handed off and failed")

    async with store.backend.transaction() as conn:
        await conn.execute(sa.text("INSERT INTO probe (who) VALUES ('engine')"))
        tasks = [
            asyncio.ensure_future(direct.in_write_transaction(insert(f"off-{i}"))) for i in range(3)
        ]
        doomed = asyncio.ensure_future(direct.in_write_transaction(failing))
        await asyncio.sleep(0.3)  # the event loop is free meanwhile
        # The first waits on the thread for the lock, the others behind it, on the loop.
        assert direct.handed_off == before + 1
        assert not any(task.done() for task in [*tasks, doomed])
        assert reader("off-%") == 0 and reader("engine") == 0
    ids = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    with pytest.raises(Boom):
        await asyncio.wait_for(doomed, 10)
    assert reader("off-%") == 3 and reader("engine") == 1 and reader("off-doomed") == 0
    with closing(sqlite3.connect(sqlite_path)) as check:
        engine_id = check.execute("SELECT id FROM probe WHERE who = 'engine'").fetchone()[0]
        stored = dict(check.execute("SELECT who, id FROM probe WHERE who LIKE 'off-%'").fetchall())
    assert stored == {f"off-{i}": ids[i] for i in range(3)}
    assert all(row_id > engine_id for row_id in ids)  # they waited for the engine's COMMIT
    # The lock is free again: operations run inline, nothing more is handed off.
    handed = direct.handed_off
    assert await direct.in_write_transaction(insert("inline-again")) > max(ids)
    assert direct.handed_off == handed


@ON_SQLITE
async def test_sqlite_operations_queue_behind_one_waiting_on_the_thread(
    engine: AsyncEngine, sqlite_path: Path
) -> None:
    """Once an operation waits on the thread for the lock, later ones queue behind it
    instead of taking the freed lock inline first (which, under steady load, kept the
    waiting one waiting until its busy timeout)."""
    direct = sqlite_direct(engine)
    await direct.in_write_transaction(insert("warm"))
    with closing(sqlite3.connect(sqlite_path, isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")  # another process's writer
        first = asyncio.ensure_future(direct.in_write_transaction(insert("first")))
        await asyncio.sleep(0.05)
        assert not first.done()
        other.execute("COMMIT")
        # The lock is free now, but "first" has not been answered yet.
        later = [
            asyncio.ensure_future(direct.in_write_transaction(insert(f"later-{i}")))
            for i in range(5)
        ]
        ids = await asyncio.wait_for(asyncio.gather(first, *later), 10)
    assert ids[0] < min(ids[1:])  # nothing overtook the waiting operation
    assert direct.handed_off >= 1


@ON_SQLITE
async def test_sqlite_writers_without_a_pause_go_back_inline_after_a_hand_off(
    engine: AsyncEngine, sqlite_path: Path, reader: Callable[[str], int]
) -> None:
    """Operations wait behind the one on the thread only until the thread has answered
    it, then run inline. Sent to the thread behind it instead, writers that never pause
    kept one another there: every operation after a single busy moment went to the
    thread, one transaction each, for as long as the load lasted."""
    direct = sqlite_direct(engine)
    await direct.in_write_transaction(insert("warm"))
    before = direct.handed_off

    with closing(sqlite3.connect(sqlite_path, isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")  # another process's writer, for a moment
        writers = asyncio.ensure_future(write_load(direct, "load", 100))
        await asyncio.sleep(0.05)
        other.execute("COMMIT")
    await asyncio.wait_for(writers, 30)
    handed = direct.handed_off - before
    assert handed == 1, f"{handed} of 1,600 operations went to the thread"  # the first
    assert reader("load-%") == 1600


@ON_SQLITE
async def test_sqlite_hand_off_of_a_gateway_admission(
    engine: AsyncEngine, store: LeaseStore, gstore: GatewayStore, sqlite_path: Path
) -> None:
    """Another process's writer holds the lock: the first admission waits on the
    database thread, the others behind it, while the event loop goes on; all of them
    land once it commits."""
    direct = sqlite_direct(engine)
    token = await lease(store, "j")
    with closing(sqlite3.connect(sqlite_path, isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")
        pending = [asyncio.ensure_future(gstore.admit(write(token, f"k{i}"))) for i in range(4)]
        await asyncio.sleep(0.1)
        assert not any(task.done() for task in pending)
        other.execute("COMMIT")
    results = await asyncio.wait_for(asyncio.gather(*pending), 10)
    assert all(a.claimed for a in results)
    assert direct.handed_off >= 1
    assert set(await record_rows(store)) == {("j", f"k{i}") for i in range(4)}


@ON_SQLITE
async def test_sqlite_reads_never_hold_up_an_operation(
    engine: AsyncEngine, store: LeaseStore, gstore: GatewayStore
) -> None:
    """The SQLAlchemy engine only reads, in DEFERRED transactions: an open read (the
    dashboard, the audit, a listing) never takes the write lock, so operations run
    inline meanwhile, and the read keeps its snapshot."""
    direct = sqlite_direct(engine)
    token = await lease(store, "j")
    before = direct.handed_off
    async with store.backend.transaction() as conn:
        assert (await conn.execute(sa.select(sa.func.count()).select_from(requests))).scalar() == 0
        admitted = await asyncio.wait_for(gstore.admit(write(token, "k")), 5)
        assert admitted.claimed
        assert (await conn.execute(sa.select(sa.func.count()).select_from(requests))).scalar() == 0
    assert direct.handed_off == before
    assert set(await record_rows(store)) == {("j", "k")}


def main_file(path: Path) -> bytes:
    return path.read_bytes()


@ON_SQLITE
async def test_sqlite_a_checkpoint_is_queued_every_checkpoint_every_operations(
    engine: AsyncEngine, sqlite_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(direct_module, "CHECKPOINT_EVERY", 5)
    direct = sqlite_direct(engine)
    # Opening switches the file to WAL (its header changes).
    await direct.in_write_transaction(insert("warm"))
    before = main_file(sqlite_path)
    for i in range(3):
        await direct.in_write_transaction(insert(f"r{i}", b"x" * 8192))
    await asyncio.sleep(0.2)
    assert direct._thread is None  # four operations: no checkpoint yet
    assert main_file(sqlite_path) == before  # everything is still in the log
    for i in range(3, 12):
        await direct.in_write_transaction(insert(f"r{i}", b"x" * 8192))
    thread = direct._thread
    assert thread is not None and thread.is_alive()
    deadline = time.monotonic() + 5
    # The thread copies the log into the database file: at least the first five rows.
    while len(main_file(sqlite_path)) <= len(before) + 4 * 8192:
        assert time.monotonic() < deadline, "no checkpoint reached the database file"
        await asyncio.sleep(0.02)
    with closing(sqlite3.connect(sqlite_path)) as check:
        assert check.execute("SELECT count(*) FROM probe").fetchone()[0] == 13


@ON_SQLITE
async def test_sqlite_no_checkpoint_before_checkpoint_every(
    engine: AsyncEngine, sqlite_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(direct_module, "CHECKPOINT_EVERY", 10**9)
    direct = sqlite_direct(engine)
    await direct.in_write_transaction(insert("warm"))
    before = main_file(sqlite_path)
    for i in range(12):
        await direct.in_write_transaction(insert(f"r{i}", b"x" * 8192))
    await asyncio.sleep(0.3)
    assert direct._thread is None
    assert main_file(sqlite_path) == before  # the inline connection never checkpoints


@ON_SQLITE
@pytest.mark.parametrize("sync_seconds", [0, 0.2], ids=["disk", "slow-disk"])
async def test_sqlite_the_log_stays_bounded_under_writes_without_a_pause(
    engine: AsyncEngine,
    sqlite_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sync_seconds: float,
) -> None:
    """A passive checkpoint copies the log but cannot restart it while the event loop
    keeps writing: under load without a pause the log grew past a gigabyte in the
    benchmark's soak. Past ``WAL_LIMIT_BYTES`` the database thread restarts it (writers
    wait behind that), and the file is cut back to that size. The bound holds however
    long the thread's checkpoints take: on a busy machine (slow-disk: each passive
    checkpoint takes 0.2 s longer) the log once grew to three times the limit while
    the loop waited for the thread's reading of its size."""
    limit = 2 * 1024 * 1024
    monkeypatch.setattr(direct_module, "CHECKPOINT_EVERY", 10)
    monkeypatch.setattr(direct_module, "WAL_LIMIT_BYTES", limit)
    checkpoint = direct_module._checkpoint

    def slow_sync(conn: sqlite3.Connection, *, restart: bool) -> object:
        if not restart:
            time.sleep(sync_seconds)
        return checkpoint(conn, restart=restart)

    monkeypatch.setattr(direct_module, "_checkpoint", slow_sync)
    direct = sqlite_direct(engine)
    wal = Path(f"{sqlite_path}-wal")
    largest = 0
    done = 0

    def measure() -> None:
        nonlocal largest, done
        done += 1
        if wal.exists():
            largest = max(largest, wal.stat().st_size)

    await write_load(direct, "w", 250, b"x" * 4000, after=measure)
    assert done == 4000  # 4,000 rows of 4 KB: about 16 MB through the log
    # The limit, plus what ten operations and one turn's group (sixteen writers) write
    # between two readings of the size; without the restart, all of it.
    assert largest < limit + 512 * 1024, f"the log reached {largest:,} bytes"
    with closing(sqlite3.connect(sqlite_path)) as check:
        assert check.execute("SELECT count(*) FROM probe").fetchone()[0] == 4000


@ON_SQLITE
async def test_sqlite_every_connection_cuts_the_log_file_back_to_the_limit(
    engine: AsyncEngine, sqlite_path: Path
) -> None:
    """The loop reads the log file's size to decide on a restart, and the file is cut
    back by whichever connection writes first after one: SQLAlchemy's (migrations,
    listings) need the limit as much as ours, or the file keeps its size and looks past
    the limit until the next restart."""
    direct = sqlite_direct(engine)
    await direct.in_write_transaction(insert("warm"))
    limit = direct_module.WAL_LIMIT_BYTES
    assert direct._connection().execute("PRAGMA journal_size_limit").fetchone()[0] == limit
    async with engine.connect() as conn:
        assert (await conn.exec_driver_sql("PRAGMA journal_size_limit")).scalar_one() == limit


@ON_SQLITE
async def test_sqlite_a_read_holding_the_log_delays_its_restart_never_a_write(
    engine: AsyncEngine, sqlite_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart waits for the log's readers: one holding its snapshot makes it give up
    (writes wait only ``WAL_RESTART_WAIT_MS`` for it), and once that read ends the next
    restart takes the log back to its beginning and the file back to the limit."""
    monkeypatch.setattr(direct_module, "CHECKPOINT_EVERY", 20)
    monkeypatch.setattr(direct_module, "WAL_LIMIT_BYTES", 256 * 1024)
    monkeypatch.setattr(direct_module, "WAL_RESTART_WAIT_MS", 20)
    direct = sqlite_direct(engine)
    wal = Path(f"{sqlite_path}-wal")
    blob = b"x" * 4000
    await direct.in_write_transaction(insert("warm"))
    with closing(sqlite3.connect(sqlite_path, isolation_level=None)) as other:
        other.execute("BEGIN")
        assert other.execute("SELECT count(*) FROM probe").fetchone()[0] == 1  # a snapshot
        # 640 rows of 4 KB: about 2.6 MB of log that the read keeps.
        await write_load(direct, "held", 40, blob)
        assert other.execute("SELECT count(*) FROM probe").fetchone()[0] == 1
        held = wal.stat().st_size
        assert held > 2 * 1024 * 1024  # the restarts gave up: the read still needs it all
        other.execute("COMMIT")
    # The next restart comes once the log has grown by the limit again; the file is cut
    # back at the first commit after it.
    rounds = 0
    while wal.stat().st_size >= held:
        rounds += 1
        assert rounds <= 5, "the log was never restarted after the read ended"
        await write_load(direct, f"after{rounds}", 40, blob)
    with closing(sqlite3.connect(sqlite_path)) as check:
        assert check.execute("SELECT count(*) FROM probe").fetchone()[0] == 1 + 640 * (1 + rounds)


@ON_SQLITE
async def test_sqlite_close_commits_an_open_group_transaction(
    engine: AsyncEngine, sqlite_path: Path, reader: Callable[[str], int]
) -> None:
    direct = sqlite_direct(engine)
    await direct.in_write_transaction(insert("first"))
    task = asyncio.ensure_future(direct.in_write_transaction(insert("pending")))
    await asyncio.sleep(0)  # the operation ran; its COMMIT is scheduled, not done
    assert not task.done()
    assert reader("pending") == 0
    await direct.close()
    assert reader("pending") == 1
    assert isinstance(await asyncio.wait_for(task, 5), int)
    await asyncio.sleep(0)  # the COMMIT that was scheduled finds nothing to do
    # Used again after close: it opens again.
    await direct.in_write_transaction(insert("reopened"))
    assert reader("reopened") == 1


@pytest.mark.parametrize("path", ["", ":memory:", "file::memory:?cache=shared"])
async def test_sqlite_in_memory_is_refused(path: str) -> None:
    direct = SqliteDirect(path)
    with pytest.raises(ValueError, match="in memory is not supported"):
        await direct.fetchrow(Statement("SELECT 1"), {})
    with pytest.raises(ValueError, match="in memory is not supported"):
        await direct.in_write_transaction(lambda conn: None)
    await direct.close()


@pytest.mark.parametrize("url", ["sqlite+aiosqlite://", "sqlite+aiosqlite:///:memory:"])
async def test_create_engine_refuses_in_memory_sqlite_clearly(url: str) -> None:
    with pytest.raises(ValueError, match="in memory is not supported"):
        engine = create_engine(url)
        try:
            await engine.direct.fetchrow(Statement("SELECT 1"), {})
        finally:
            await engine.dispose()


# -- engine lifecycle ----------------------------------------------------------------------------


async def test_create_engine_carries_the_backends_direct(database_url: str, backend: str) -> None:
    engine = create_engine(database_url, pool_size=4)
    try:
        assert isinstance(engine, Engine)
        assert direct_of(engine) is engine.direct
        if backend == "sqlite":
            assert isinstance(engine.direct, SqliteDirect) and engine.direct.sqlite
        else:
            assert isinstance(engine.direct, PostgresDirect) and not engine.direct.sqlite
    finally:
        await engine.dispose()


async def test_direct_of_a_plain_async_engine_is_a_type_error(database_url: str) -> None:
    plain = create_async_engine(database_url)
    try:
        with pytest.raises(TypeError, match=r"lease_core\.db\.create_engine"):
            direct_of(plain)
        with pytest.raises(TypeError):
            LeaseStore(plain)
    finally:
        await plain.dispose()


async def _backends(engine: AsyncEngine) -> int:
    """Connections to this database other than the one asking."""
    async with engine.connect() as conn:
        value = await conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND backend_type = 'client backend'"
            )
        )
        count: int = value.scalar_one()
    return count


async def _until_backends(engine: AsyncEngine, want: int) -> int:
    deadline = time.monotonic() + 5
    while (count := await _backends(engine)) != want and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return count


@pytest.fixture
async def own_engine(database_url: str) -> AsyncIterator[Engine]:
    """An engine of the test's own (pool size 3), disposed at the end whatever happens."""
    engine = create_engine(database_url, pool_size=3)
    yield engine
    await engine.dispose()


@ON_POSTGRES
async def test_postgres_dispose_closes_the_pool(engine: AsyncEngine, own_engine: Engine) -> None:
    baseline = await _backends(engine)
    mine = own_engine
    direct = mine.direct
    assert isinstance(direct, PostgresDirect)
    sleep = Statement("SELECT pg_sleep(0.3) AS slept, CAST(:i AS integer) AS i")
    calls = asyncio.gather(*(direct.fetchrow(sleep, {"i": i}) for i in range(9)))
    peak = 0
    while not calls.done():
        peak = max(peak, await _backends(engine) - baseline)
        await asyncio.sleep(0.02)
    rows = await calls
    assert [row["i"] for row in rows if row is not None] == list(range(9))
    assert peak == 3  # the pool is the engine's size, and no larger
    pool = direct._pool
    assert pool is not None
    await mine.dispose()
    assert direct._pool is None and pool.is_closing()
    assert await _until_backends(engine, baseline) == baseline
    # Used after dispose, it connects again; disposing again closes that too.
    again = await direct.fetchrow(Statement("SELECT 1 AS one"), {})
    assert again is not None and again["one"] == 1
    assert direct._pool is not None and direct._pool is not pool
    await mine.dispose()
    await mine.dispose()  # twice is harmless
    assert await _until_backends(engine, baseline) == baseline
    del pool, direct
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert not [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


@ON_POSTGRES
async def test_postgres_the_sqlalchemy_statement_cache_setting_reaches_asyncpg(
    database_url: str,
) -> None:
    url = sa.make_url(database_url).update_query_dict({"prepared_statement_cache_size": "0"})
    engine = create_engine(url)
    try:
        row = await engine.direct.fetchrow(Statement("SELECT :a::int AS a"), {"a": 3})
        assert row is not None and row["a"] == 3
    finally:
        await engine.dispose()


@ON_SQLITE
async def test_sqlite_dispose_closes_every_connection_and_the_thread(
    own_engine: Engine, sqlite_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(direct_module, "CHECKPOINT_EVERY", 1)  # starts the thread
    engine = own_engine
    direct = engine.direct
    assert isinstance(direct, SqliteDirect)
    await direct.in_write_transaction(insert("x"))
    async with engine.begin() as conn:  # the SQLAlchemy side has its connection too
        assert (await conn.execute(sa.text("SELECT count(*) FROM probe"))).scalar_one() == 1
    inline, thread = direct._inline, direct._thread
    assert inline is not None and thread is not None
    deadline = time.monotonic() + 5
    while direct._checkpoint_queued:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    wal = Path(f"{sqlite_path}-wal")
    assert wal.exists()
    await engine.dispose()
    assert not thread.is_alive()
    assert direct._inline is None and direct._thread is None
    with pytest.raises(sqlite3.ProgrammingError):
        inline.execute("SELECT 1")
    assert not wal.exists()  # the last connection closed cleanly
    await engine.dispose()  # twice is harmless
    del inline, thread, direct
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert not [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


# -- StoreUnavailable ----------------------------------------------------------------------------


@pytest.fixture
async def missing_dir_engine(tmp_path: Path) -> AsyncIterator[Engine]:
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'missing' / 'fencegate.db'}")
    yield engine
    await engine.dispose()


async def test_sqlite_a_file_that_cannot_be_opened_is_store_unavailable(
    missing_dir_engine: Engine, tmp_path: Path, clock: FakeClock
) -> None:
    direct = missing_dir_engine.direct
    with pytest.raises(exc.StoreUnavailable):
        await direct.fetchrow(Statement("SELECT 1 AS one"), {})
    with pytest.raises(exc.StoreUnavailable):
        await direct.in_write_transaction(lambda conn: None)
    store = LeaseStore(missing_dir_engine, clock=clock)
    with pytest.raises(exc.StoreUnavailable):
        await store.claim(queue="q", owner="w", ttl=10)
    assert store_errors(store) == 1
    # The directory appears: the next call opens the file.
    (tmp_path / "missing").mkdir()
    row = await direct.fetchrow(Statement("SELECT 1 AS one"), {})
    assert row is not None and row["one"] == 1


@pytest.fixture
async def closed_port_store(clock: FakeClock) -> AsyncIterator[LeaseStore]:
    engine = create_engine("postgresql+asyncpg://postgres@127.0.0.1:1/test")
    yield LeaseStore(engine, clock=clock)
    await engine.dispose()


@pytest.mark.postgres
async def test_postgres_a_closed_port_is_store_unavailable_quickly(
    closed_port_store: LeaseStore,
) -> None:
    store = closed_port_store
    started = time.monotonic()
    with pytest.raises(exc.StoreUnavailable):
        await asyncio.wait_for(store.claim(queue="q", owner="w", ttl=10), 10)
    assert time.monotonic() - started < 5
    token = tokens.new_token()[0]
    with pytest.raises(exc.StoreUnavailable):
        await store.renew(token)
    gstore = GatewayStore(store)
    with pytest.raises(exc.StoreUnavailable):
        await gstore.check_lease(tokens.hash_token(token))
    # A whole batch of admissions and one of settles: every caller is told.
    admitted = await asyncio.gather(
        *(gstore.admit(write(token, f"k{i}")) for i in range(12)), return_exceptions=True
    )
    assert all(isinstance(r, exc.StoreUnavailable) for r in admitted), admitted
    settled = await asyncio.gather(
        *(
            gstore.settle(
                "j",
                f"k{i}",
                "a" * 32,
                state=RecordState.COMPLETED,
                status=200,
                headers=[],
                body=b"",
            )
            for i in range(5)
        ),
        return_exceptions=True,
    )
    assert all(isinstance(r, exc.StoreUnavailable) for r in settled), settled
    assert store_errors(store) == 3 + 12 + 5
    assert time.monotonic() - started < 10


# -- claims --------------------------------------------------------------------------------------


async def test_concurrent_claims_over_two_queues_each_get_their_own_job(
    backend: str, store: LeaseStore, statements: FetchAllCounter
) -> None:
    """Concurrent claims (one shared statement per batch on PostgreSQL): every job goes
    to one caller at most, earlier jobs first, each queue's callers only get that
    queue's jobs, and callers beyond a queue's supply get nothing."""
    for i in range(40):
        await store.enqueue(queue="wide", job_id=f"w{i:02d}")
    for i in range(10):
        await store.enqueue(queue="narrow", job_id=f"n{i:02d}")
    callers = [("wide" if i % 2 else "narrow", f"worker-{i}") for i in range(60)]
    leases = await asyncio.gather(
        *(store.claim(queue=q, owner=owner, ttl=30) for q, owner in callers)
    )
    got = {
        q: [lease for (cq, _), lease in zip(callers, leases, strict=True) if cq == q]
        for q in ("wide", "narrow")
    }
    wide = [lease for lease in got["wide"] if lease is not None]
    narrow = [lease for lease in got["narrow"] if lease is not None]
    assert len(wide) == 30 and len(narrow) == 10
    assert sorted(lease.job_id for lease in wide) == [f"w{i:02d}" for i in range(30)]
    assert sorted(lease.job_id for lease in narrow) == [f"n{i:02d}" for i in range(10)]
    granted = [lease for lease in leases if lease is not None]
    assert len({lease.lease_token for lease in granted}) == 40
    for (_, owner), lease in zip(callers, leases, strict=True):
        if lease is not None:
            assert lease.owner == owner and lease.generation == 1 and lease.ttl_seconds == 30
            # The token works: the grant and its record were written together.
            assert (await store.renew(lease.lease_token or "")).job_id == lease.job_id
    if backend == "postgres":
        assert max(statements.sizes) > 1  # batches formed
        assert statements.failed == 0


# -- renewals ------------------------------------------------------------------------------------


async def test_concurrent_renewals_each_renew_their_own_lease(
    backend: str, store: LeaseStore, clock: FakeClock, statements: FetchAllCounter
) -> None:
    """Concurrent renewals (one shared statement per batch on PostgreSQL): each caller
    gets its own lease with its own ttl; a token asked for twice in one batch is renewed
    for both callers; an ended, an expired and a never-granted token next to them are
    refused alone with the reason a lone renewal gets."""
    tokens_ = [await lease(store, f"r{i:02d}", ttl=60) for i in range(30)]
    ended = await lease(store, "ended", ttl=60)
    await store.release(ended)
    expiring = await lease(store, "expiring", ttl=1)
    clock.advance(2)
    calls = [(token, float(10 + i)) for i, token in enumerate(tokens_)]
    calls.append((tokens_[0], 500.0))  # the same token twice in one batch
    results = await asyncio.gather(
        *(store.renew(token, ttl) for token, ttl in calls),
        store.renew(ended),
        store.renew(expiring),
        store.renew(tokens.new_token()[0]),
        return_exceptions=True,
    )
    renewed, refused = results[: len(calls)], results[len(calls) :]
    for (token, ttl), got in zip(calls[1:-1], renewed[1:-1], strict=True):
        assert not isinstance(got, BaseException), got
        assert got.job_id == f"r{tokens_.index(token):02d}"
        assert got.ttl_seconds == ttl and got.expires_at == pytest.approx(clock() + ttl)
        assert got.generation == 1
    # Both renewals of r00 succeed and land on the same job; the lease ends with one
    # of the two ttls (on PostgreSQL's shared statement, the later caller's).
    first, again = renewed[0], renewed[-1]
    assert not isinstance(first, BaseException) and not isinstance(again, BaseException)
    assert first.job_id == again.job_id == "r00"
    job = await store.get_job("r00")
    assert job.lease_expires_at in (clock() + 10.0, clock() + 500.0)
    assert isinstance(refused[0], exc.LeaseEnded)
    assert isinstance(refused[1], exc.LeaseExpired)
    assert isinstance(refused[2], exc.InvalidLeaseToken)
    # The renewals were written: a later lone renewal without a ttl keeps the new one.
    assert (await store.renew(tokens_[5])).ttl_seconds == 15.0
    if backend == "postgres":
        assert max(statements.sizes) > 1  # batches formed
        assert statements.failed == 0
