from typing import Any

from aiohttp.test_utils import TestClient

from tests.conftest import FakeClock


async def test_claim_then_reclaim_after_expiry(control: TestClient[Any, Any], clock: FakeClock) -> None:
    resp = await control.post("/v1/jobs", json={"queue": "q", "job_id": "j1"})
    assert resp.status == 201
    resp = await control.post("/v1/queues/q/claim", json={"owner": "a", "ttl_seconds": 10})
    first = await resp.json()
    assert resp.status == 200 and first["generation"] == 1
    clock.advance(11)
    resp = await control.post("/v1/queues/q/claim", json={"owner": "b", "ttl_seconds": 10})
    second = await resp.json()
    assert second["generation"] == 2
    resp = await control.post("/v1/leases/renew", json={"lease_token": first["lease_token"]})
    assert resp.status == 409
    assert (await resp.json())["reason"] == "stale-generation"
