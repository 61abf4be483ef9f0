"""The verification's signed-token workers (``verify.signed``, issue 53): the run's key
pair makes a lease source the gateway's settings accept and whose tokens the gateway's
``jwt`` source reads as the history names them; and the history a stalled upload leaves
when the gateway admits it after the next generation wrote (invariants 1, 2 and 6), or
refuses it (clean)."""

from __future__ import annotations

import asyncio
import time
import tomllib
from pathlib import Path

from fencegate_client.signed import mint_token
from gateway.config import JwtSourceSettings
from gateway.sources.signed import JwtSource
from tests.unit.test_verify_check import Run, invariants, sha
from verify.check import check
from verify.signed import ISSUER, SOURCE, SigningKey


def test_the_run_key_signs_tokens_the_gateway_reads(tmp_path: Path) -> None:
    key = SigningKey(tmp_path / "signing.pem")
    table = tomllib.loads(key.source_config())["lease_sources"][0]
    source = JwtSource(JwtSourceSettings.model_validate(table))
    token = mint_token(
        key.path.read_bytes(),
        issuer=ISSUER,
        job="s-s0",
        generation=3,
        ttl_seconds=10,
        source=SOURCE,
        grant_id="abc",
    )
    assert token.startswith(f"{SOURCE}:")
    lease = asyncio.run(source.check(token.partition(":")[2]))
    assert lease is not None
    assert (lease.job_id, lease.generation, lease.holder) == ("signed/s-s0", 3, "abc")
    assert lease.expires_at <= time.time() + 10


def stalled_upload(admitted: bool) -> Run:
    """Generation 1's write invoked (its body held back), generation 2 signed and
    written, then 1's body sent: applied after 2's (``admitted``) or refused."""
    run = Run()
    job = "signed/s-s0"
    run.claim("s0", job, 1, ttl=60.0, holder="a")  # a signed token's holder (its jti)
    run.write("s0", job, 1, "a-step0")
    old = {"process": "s0/old", "f": "write", "job": job, "generation": 1, "key": "a-step1"}
    run.event(type="invoke", body_sha256=sha("body a-step1"), **old)
    run.claim("s0", job, 2, ttl=60.0, holder="b")
    run.write("s0", job, 2, "b-step0")
    if admitted:
        run.apply(job, 1, "a-step1", "answer")
        run.event(type="ok", status=201, body_sha256=sha("answer"), **old)
    else:
        run.event(type="fail", status=409, reason="stale-generation", body_sha256=sha("x"), **old)
    run.complete("s0", job, 2)
    return run


def test_a_stalled_upload_admitted_after_the_next_generation_wrote() -> None:
    run = stalled_upload(admitted=True)
    assert invariants(check(run.history, run.ledger)) == [1, 2, 6]


def test_a_stalled_upload_refused_is_clean() -> None:
    run = stalled_upload(admitted=False)
    assert invariants(check(run.history, run.ledger)) == []
