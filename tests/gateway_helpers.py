"""Assertions and waits shared by the gateway's integration tests."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.records.schema import requests
from tests.support import Upstream

PROBLEM = "application/problem+json"


async def problem(resp: Any, status: int, reason: str) -> dict[str, Any]:
    """Check that ``resp`` is the gateway's own RFC 9457 answer and return it."""
    text = await resp.text()
    assert resp.status == status, text
    assert resp.content_type == PROBLEM, (resp.content_type, text)
    doc: dict[str, Any] = await resp.json(content_type=None)
    assert doc["reason"] == reason, doc
    assert doc["status"] == status
    assert doc["type"].endswith(reason) and doc["type"].startswith("http")
    assert isinstance(doc["title"], str) and doc["title"]
    assert isinstance(doc["detail"], str) and doc["detail"]
    return doc


async def ok(resp: Any, status: int = 201) -> bytes:
    """The body of a forwarded answer, read to the end. Its record may still be being
    stored (behind the answer): a duplicate sent after this to the same replica waits
    for it and gets the replay."""
    body: bytes = await resp.read()
    assert resp.status == status, body
    assert "Idempotent-Replayed" not in resp.headers
    return body


async def replayed(resp: Any, status: int = 201) -> bytes:
    """The body of an answer the gateway replayed from the key's record."""
    body: bytes = await resp.read()
    assert resp.status == status, body
    assert resp.headers.get("Idempotent-Replayed") == "true"
    return body


async def until_in_flight(upstream: Upstream, count: int = 1, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while upstream.in_flight < count:
        assert time.monotonic() < deadline, "the write never reached the upstream"
        await asyncio.sleep(0.005)


async def until_admitted(engine: AsyncEngine, job_id: str, key: str) -> None:
    """Wait until a gateway has admitted the write with this key (its record exists)."""
    stmt = sa.select(sa.func.count()).where(requests.c.job_id == job_id, requests.c.key == key)
    deadline = time.monotonic() + 5
    while True:
        async with engine.connect() as conn:
            if (await conn.execute(stmt)).scalar():
                return
        assert time.monotonic() < deadline, f"write {key} was never admitted"
        await asyncio.sleep(0.005)
