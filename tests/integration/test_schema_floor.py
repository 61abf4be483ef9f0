"""A schema migrated past the code, on both databases (migration 0009, ``schema_floor``).

A replica keeps serving a schema migrated ahead of it while the migrations since only add
(a rolling upgrade). One that older code cannot run beside raises the schema's floor to
itself; a replica whose code is below the floor:

- refuses to start (``prepare_database``), on SQLite too, which would otherwise try to
  migrate a file it cannot read the revision of;
- answers ``/readyz`` 503 saying to replace it;
- once it sees the floor while it serves (``check_schema``, every few seconds), refuses
  every operation, fenced writes and lease calls alike, ``store-unavailable``, and serves
  again when the schema serves its code again.

The newer migration is played by rewriting ``alembic_version`` and ``schema_floor`` to a
revision this code does not know, as a newer release's ``fencegate migrate`` would leave
them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.records import migrate
from gateway.service.server import SCHEMA_CHECK_INTERVAL_SECONDS, check_schema, prepare_database
from lease_core import api as lease_api
from lease_core.store import LeaseStore
from tests.gateway_helpers import ok, problem

NEWER = "9999_from_the_future"  # a revision this code does not know: a newer release's


@pytest.fixture
async def schema_at(engine: AsyncEngine) -> AsyncIterator[Callable[..., Any]]:
    """``await schema_at(revision, floor=...)``: the schema as a migration left it; the
    head and its floor again afterwards (the PostgreSQL database outlives the test)."""

    async def put(revision: str, *, floor: str | None) -> None:
        async with engine.begin() as conn:
            await conn.execute(
                sa.text("UPDATE alembic_version SET version_num = :r"), {"r": revision}
            )
            await conn.execute(sa.text("DELETE FROM schema_floor"))
            if floor is not None:
                await conn.execute(
                    sa.text("INSERT INTO schema_floor (revision) VALUES (:f)"), {"f": floor}
                )

    yield put
    await put(str(migrate.head_revision()), floor="0008")


def test_the_floor_decides_for_a_schema_ahead_of_the_code() -> None:
    head = migrate.head_revision()
    assert head is not None and head >= "0009"
    assert migrate.SchemaState(head).refusal() is None
    assert migrate.SchemaState(NEWER, ("0008",)).refusal() is None  # a rolling upgrade
    assert migrate.SchemaState(NEWER, ()).refusal() is None
    below = migrate.SchemaState(NEWER, (NEWER,)).refusal()
    assert below is not None and f"serves code from revision {NEWER} on" in below
    older = migrate.SchemaState("0008").refusal()
    assert older is not None and "run `fencegate migrate`" in older
    assert migrate.SchemaState(None).refusal() is not None
    assert migrate.SchemaState(head, (NEWER,)).below_floor() is None  # not ahead: no floor


async def test_a_migration_that_keeps_the_floor_leaves_the_replica_serving(
    make_stack: Any, upstream: Any, schema_at: Callable[..., Any]
) -> None:
    stack = await make_stack(upstreams=[{"name": "pay", "url": upstream.url}], use_clock=False)
    lease = await stack.lease("job-1")
    await schema_at(NEWER, floor="0008")
    ready = await stack.control.get("/readyz")
    assert ready.status == 200, await ready.text()
    assert (await ready.json())["schema"] == NEWER
    await ok(await stack.write("/pay/charges", lease, key="pay-1"))


async def test_a_replica_below_the_floor_refuses_to_start(
    engine: AsyncEngine, make_settings: Callable[..., Any], schema_at: Callable[..., Any]
) -> None:
    await schema_at(NEWER, floor=NEWER)
    with pytest.raises(SystemExit) as refused:
        await prepare_database(make_settings(), LeaseStore(engine))
    assert f"serves code from revision {NEWER} on" in str(refused.value)
    assert "replace it with the newer version" in str(refused.value)


@pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_a_replica_on_an_older_schema_refuses_to_start_naming_both_revisions(
    engine: AsyncEngine, make_settings: Callable[..., Any], schema_at: Callable[..., Any]
) -> None:
    """PostgreSQL is migrated by ``fencegate migrate``, never by serve (SQLite migrates
    itself at start)."""
    await schema_at("0008", floor=None)
    with pytest.raises(SystemExit) as refused:
        await prepare_database(make_settings(), LeaseStore(engine))
    assert str(refused.value) == (
        f"fencegate: The database schema is at 0008, this version needs "
        f"{migrate.head_revision()}: run `fencegate migrate`."
    )


async def test_a_replica_starts_on_a_schema_ahead_within_its_floor(
    engine: AsyncEngine, make_settings: Callable[..., Any], schema_at: Callable[..., Any]
) -> None:
    """On SQLite too: the file is served as it is, not migrated (this code does not
    know its revision, so alembic could not)."""
    await schema_at(NEWER, floor="0008")
    await prepare_database(make_settings(), LeaseStore(engine))
    assert (await migrate.schema_state(engine)).revision == NEWER


async def test_a_replica_below_the_floor_turns_away_until_the_schema_serves_it_again(
    make_stack: Any, upstream: Any, schema_at: Callable[..., Any]
) -> None:
    stack = await make_stack(upstreams=[{"name": "pay", "url": upstream.url}], use_clock=False)
    store: LeaseStore = stack.control.app[lease_api.STORE]
    lease = await stack.lease("job-1")
    await ok(await stack.write("/pay/charges", lease, key="pay-1"))

    await schema_at(NEWER, floor=NEWER)
    ready = await stack.control.get("/readyz")
    assert ready.status == 503
    assert f"serves code from revision {NEWER} on" in (await ready.json())["detail"]
    await check_schema(store)  # what the replica does every few seconds
    await problem(await stack.write("/pay/charges", lease, key="pay-2"), 503, "store-unavailable")
    claimed = await stack.control.post("/v1/queues/default/claim", json={"owner": "w"})
    assert claimed.status == 503, await claimed.text()
    assert len(upstream.received) == 1  # nothing more reached the upstream

    await schema_at(str(migrate.head_revision()), floor="0008")
    await check_schema(store)
    await ok(await stack.write("/pay/charges", lease, key="pay-2"))
    assert len(upstream.received) == 2


async def test_a_serving_replica_finds_the_floor_by_itself(
    make_stack: Any, upstream: Any, schema_at: Callable[..., Any]
) -> None:
    """The check runs in the background (every ``SCHEMA_CHECK_INTERVAL_SECONDS``): no
    call from outside turns the replica away."""
    stack = await make_stack(upstreams=[{"name": "pay", "url": upstream.url}], use_clock=False)
    store: LeaseStore = stack.control.app[lease_api.STORE]
    await schema_at(NEWER, floor=NEWER)
    deadline = time.monotonic() + 3 * SCHEMA_CHECK_INTERVAL_SECONDS
    while store.backend.refused is None:
        assert time.monotonic() < deadline, "the replica did not find the floor by itself"
        await asyncio.sleep(0.1)
    assert f"serves code from revision {NEWER} on" in store.backend.refused
