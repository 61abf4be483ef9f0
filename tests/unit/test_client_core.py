"""``fencegate_client.core``: the operations both clients drive, run here by hand, without
I/O (the requests they yield are read, the answers are made up)."""

from __future__ import annotations

import json
import threading

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from fencegate_client import core
from fencegate_client.errors import StaleGeneration
from fencegate_client.protocol import FENCING_TOKEN, IDEMPOTENCY_KEY, step_key
from fencegate_client.reasons import Reason


def lease() -> core.LeaseBase:
    client: core.ClientBase[None] = core.ClientBase(
        "http://control/", gateway_url="http://gateway", token="worker-token", retry_wait=5
    )
    return core.LeaseBase(
        client=client,
        lost=threading.Event(),
        gateway_url=client.gateway_url,
        job_id="job-1",
        generation=3,
        owner="w",
        token="fgl_secret",
        ttl_seconds=30.0,
        payload=None,
        expires_at="2026-12-05T00:00:00Z",
    )


def problem(reason: Reason, **headers: str) -> core.Answer:
    body = json.dumps({"reason": reason.value, "detail": "made up"}).encode()
    names = CIMultiDict({"Content-Type": "application/problem+json", **headers})
    return core.Answer(409, CIMultiDictProxy(names), body)


def test_a_fenced_write_waits_for_the_first_attempt_and_gets_its_answer() -> None:
    held = lease()
    run = core.Run(core.write(held, "POST", "/payments/charges", step="charge", json={"a": 1}))
    first = run.request
    assert first is not None
    assert (first.method, first.url, first.json) == (
        "POST",
        "http://gateway/payments/charges",
        {"a": 1},
    )
    assert first.headers[FENCING_TOKEN] == "fgl_secret"
    assert first.headers[IDEMPOTENCY_KEY] == step_key("job-1", "charge")
    assert "Prefer" not in first.headers
    run.answer(problem(Reason.REQUEST_IN_PROGRESS))
    again = run.request
    assert again is not None and again.headers["Prefer"].startswith("wait=")
    replayed = CIMultiDictProxy(CIMultiDict({"Idempotent-Replayed": "true"}))
    run.answer(core.Answer(201, replayed, b"{}"))
    assert run.request is None
    assert run.result.status == 201 and run.result.replayed


def test_a_refused_renewal_marks_the_lease_lost() -> None:
    held = lease()
    run = core.Run(held._renewal(None))
    call = run.request
    assert call is not None
    assert call.url == "http://control/v1/leases/renew"
    assert call.headers == {"Authorization": "Bearer worker-token"}
    assert call.json == {"lease_token": "fgl_secret"}
    with pytest.raises(StaleGeneration):
        run.answer(problem(Reason.STALE_GENERATION))
    assert held.lost.is_set() and not held.held
    # The next write is refused before anything is sent.
    with pytest.raises(StaleGeneration):
        core.Run(core.write(held, "POST", "/payments/charges"))


def test_leaving_a_block_fails_the_lease_with_the_error_or_releases_it() -> None:
    held = lease()
    failed = held._exit_call(ValueError("boom"), interrupt=KeyboardInterrupt)
    assert failed is not None and failed.path == "/v1/leases/fail"
    assert failed.body is not None and failed.body["error"] == "ValueError: boom"
    interrupted = held._exit_call(KeyboardInterrupt(), interrupt=KeyboardInterrupt)
    assert interrupted is not None and interrupted.path == "/v1/leases/release"
    held.ended = True
    assert held._exit_call(None, interrupt=KeyboardInterrupt) is None


def test_a_run_has_no_result_before_its_flow_returns() -> None:
    run = core.Run(core.write(lease(), "DELETE", "/files/a"))
    with pytest.raises(RuntimeError):
        _ = run.result
