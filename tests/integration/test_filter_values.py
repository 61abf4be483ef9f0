"""A filter that can never match is a mistake, answered with the valid values (400
``invalid-request`` naming the field), never an empty list."""

from __future__ import annotations

from typing import Any

from gateway.records.audit import REASON_VALUES
from tests.gateway_helpers import PROBLEM
from tests.support import Upstream, upstream_config


async def refused(resp: Any, field: str) -> str:
    text = await resp.text()
    assert resp.status == 400, text
    assert resp.content_type == PROBLEM
    doc = await resp.json(content_type=None)
    assert doc["reason"] == "invalid-request"
    assert doc["field"] == field
    detail: str = doc["detail"]
    return detail


async def test_audit_reason_must_be_one(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    for bogus in ("bogus", "stale_generation", "STALE-GENERATION"):
        resp = await stack.control.get("/admin/rejections", params={"reason": bogus})
        detail = await refused(resp, "reason")
        assert f"{bogus!r} is not a reason" in detail
        for reason in REASON_VALUES:
            assert reason in detail
    assert "stale-generation" in REASON_VALUES and "idempotent-replay" in REASON_VALUES
    for reason in REASON_VALUES:
        resp = await stack.control.get("/admin/rejections", params={"reason": reason})
        assert resp.status == 200, await resp.text()


async def test_audit_upstream_must_be_configured_or_audited(
    make_stack: Any, upstream: Upstream
) -> None:
    old = await make_stack(upstreams=[upstream_config(upstream, name="legacy")])
    await old.write("/legacy/x", None)  # audited under "legacy"
    # The audit is written behind the answer; a read of the old replica's audit waits for
    # its entries (the new replica's reads wait only for its own).
    resp = await old.control.get("/admin/rejections", params={"upstream": "legacy"})
    assert len((await resp.json())["items"]) == 1
    stack = await make_stack(upstreams=[upstream_config(upstream)])  # "legacy" removed
    resp = await stack.control.get("/admin/rejections", params={"upstream": "paymnets"})
    detail = await refused(resp, "upstream")
    assert "'paymnets'" in detail and "configured: pay" in detail
    resp = await stack.control.get(
        "/admin/ui/api/refusals-over-time", params={"upstream": "paymnets"}
    )
    assert "'paymnets'" in await refused(resp, "upstream")
    for name, count in (("pay", 0), ("legacy", 1)):
        resp = await stack.control.get("/admin/rejections", params={"upstream": name})
        assert resp.status == 200, await resp.text()
        assert len((await resp.json())["items"]) == count
        resp = await stack.control.get(
            "/admin/ui/api/refusals-over-time", params={"upstream": name}
        )
        assert resp.status == 200, await resp.text()


async def test_audit_replica_must_be_in_the_audit(make_stack: Any, upstream: Upstream) -> None:
    """Replicas are configured nowhere: a replica filter is refused unless an entry names
    it (a typo, or a replica that answered nothing), the answer naming those that do."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], gateway={"replica_name": "gw-1"}
    )
    resp = await stack.control.get("/admin/rejections", params={"replica": "gw-1"})
    assert "'gw-1' answered nothing" in await refused(resp, "replica")  # not yet
    assert (
        "replicas in the audit: none."
        in await (await stack.control.get("/admin/rejections", params={"replica": "gw-1"})).text()
    )
    await stack.write("/pay/x", None)
    resp = await stack.control.get("/admin/rejections", params={"replica": "gw-1"})
    assert resp.status == 200 and len((await resp.json())["items"]) == 1
    resp = await stack.control.get("/admin/rejections", params={"replica": "gw1"})
    assert "replicas in the audit: gw-1." in await refused(resp, "replica")
    resp = await stack.control.get("/admin/rejections", params={"replica": "gw 1"})
    assert "not a replica name" in await refused(resp, "replica")


async def test_job_state_must_be_one(control: Any) -> None:
    resp = await control.get("/v1/jobs", params={"state": "done"})
    detail = await refused(resp, "state")
    for state in ("pending", "leased", "completed", "failed"):
        assert state in detail
