"""``GET /admin/rejections?source=`` (and ``fencegate audit --source``): the entries of
one lease source, ``fencegate`` for the gateway's own leases, on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

from fencegate_client.signed import mint_token
from tests.gateway_helpers import PROBLEM, problem
from tests.integration.test_source_jwt import PRIVATE, PUBLIC
from tests.support import FakeClock, Upstream, upstream_config


def jwt_source(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "kind": "jwt",
        "algorithms": ["EdDSA"],
        "public_keys": [PUBLIC],
        "issuer": "billing-queue",
    }


def signed(source: str, job: str, clock: FakeClock) -> dict[str, Any]:
    token = mint_token(
        PRIVATE,
        source=source,
        issuer="billing-queue",
        job=job,
        generation=1,
        ttl_seconds=30,
        now=clock.now - 60,  # expired: refused lease-expired, and audited
    )
    return {"lease_token": token}


async def test_the_source_filter(make_stack: Any, upstream: Upstream, clock: FakeClock) -> None:
    # "a_c" and "abc": a LIKE pattern whose "_" were not escaped would mix them up.
    stack = await make_stack(
        upstreams=[upstream_config(upstream)],
        lease_sources=[jwt_source("a_c"), jwt_source("abc")],
    )
    one = await stack.lease("job-1", ttl=600)
    await stack.lease("job-1", ttl=600)  # the same owner again: `one` is now stale
    await problem(await stack.write("/pay/x", one), 409, "stale-generation")
    await problem(await stack.write("/pay/x", signed("a_c", "j", clock)), 409, "lease-expired")
    await problem(await stack.write("/pay/x", signed("abc", "j", clock)), 409, "lease-expired")
    await problem(await stack.write("/pay/x", None), 428, "missing-fencing-token")

    async def seen(**query: str) -> list[tuple[str | None, str | None]]:
        items = await stack.audit(**query)
        return [(e["source"], e["job_id"]) for e in items]

    assert await seen(source="a_c") == [("a_c", "a_c/j")]
    assert await seen(source="abc") == [("abc", "abc/j")]
    # The gateway's own leases; an entry without a job belongs to no source.
    assert await seen(source="fencegate") == [("fencegate", "job-1")]
    assert await seen(source="abc", reason="stale-generation") == []
    assert len(await seen()) == 4

    # A source neither configured nor in the audit can never match: 400, naming the
    # configured ones. A source removed from the config stays searchable while the audit
    # holds its entries.
    for bad in ("nope", "a%", "A_C", ""):
        resp = await stack.control.get("/admin/rejections", params={"source": bad})
        assert resp.status == 400, (bad, await resp.text())
        assert resp.content_type == PROBLEM
        doc = await resp.json(content_type=None)
        assert "a_c" in doc["detail"] and "fencegate" in doc["detail"], doc
    later = await make_stack(
        upstreams=[upstream_config(upstream)], lease_sources=[jwt_source("a_c")]
    )
    assert [e["job_id"] for e in await later.audit(source="abc")] == ["abc/j"]
    assert upstream.received == []
