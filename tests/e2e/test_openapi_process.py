"""The OpenAPI document against a real ``fencegate serve`` process: served as committed,
a client generated from it (openapi-python-client) doing a worker's job, and Schemathesis
fuzzing every operation of the control listener with admin and worker tokens.

This module is where the suite and ``.ci/run`` (which runs the suite) run Schemathesis.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openapi_spec_validator import validate

from tests.e2e.test_gateway_process import (
    ADMIN_TOKEN,
    WORKER_TOKEN,
    Server,
    environment,
    free_port,
    start,
)
from tests.support import Upstream

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DOCUMENT = ROOT / "docs" / "openapi.json"
# Schemathesis's bound: test cases per operation and phase, so that both runs (admin and
# worker tokens) take under two minutes on two cores.
MAX_EXAMPLES = 60
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "problem_document_on_4xx",  # tests/e2e/openapi_checks.py
)


@pytest.fixture
def gateway(tmp_path: Path, upstream: Upstream) -> Iterator[Server]:
    home = tmp_path / "site"
    (home / "state").mkdir(parents=True)
    proxy, control = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = home / "fencegate.toml"
    config.write_text(
        f"""\
database_url = "sqlite+aiosqlite:///state/fencegate.db"
proxy_listen = "{proxy}"
control_listen = "{control}"

[auth]
worker_tokens = ["{WORKER_TOKEN}"]
admin_tokens = ["{ADMIN_TOKEN}"]

[[upstreams]]
name = "pay"
url = "{upstream.url}"
timeout_seconds = 5
"""
    )
    srv = Server(config, tmp_path / "serve.log", proxy, control)
    try:
        yield srv
    finally:
        if srv.process is not None and srv.process.poll() is None:
            srv.process.kill()
            srv.process.wait(timeout=10)


async def run(
    *argv: str, env: dict[str, str] | None = None, cwd: Path = ROOT, timeout: float
) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        cwd=cwd,
    )
    out, _ = await asyncio.wait_for(process.communicate(), timeout)
    assert process.returncode is not None
    return process.returncode, out.decode(errors="replace")


async def test_the_served_document_is_the_committed_one(gateway: Server) -> None:
    await start(gateway)
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://{gateway.control}/openapi.json") as resp,
    ):
        assert resp.status == 200  # no token: open, like /healthz
        assert resp.content_type == "application/json"
        served = await resp.read()
    assert served == DOCUMENT.read_bytes()
    validate(json.loads(served))


@pytest.mark.timeout(180)
async def test_a_generated_client_claims_writes_replays_and_completes(
    gateway: Server, upstream: Upstream, tmp_path: Path
) -> None:
    """openapi-python-client turns docs/openapi.json into a typed client (attrs models,
    one module per operation); a worker written with it alone does its job."""
    code, out = await run(
        str(BIN / "openapi-python-client"),
        "generate",
        "--path",
        str(DOCUMENT),
        "--meta",
        "none",
        "--output-path",
        str(tmp_path / "fencegate_openapi"),
        timeout=120,
    )
    assert code == 0, out
    sys.path.insert(0, str(tmp_path))
    try:
        await worker_with_the_generated_client(gateway, upstream)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("fencegate_openapi")]:
            del sys.modules[name]


async def worker_with_the_generated_client(gateway: Server, upstream: Upstream) -> None:
    def load(name: str) -> Any:
        return importlib.import_module(f"fencegate_openapi.{name}")

    client_mod, models, types = load("client"), load("models"), load("types")
    enqueue, claim = load("api.lease.post_v1_jobs"), load("api.lease.post_v1_queues_queue_claim")
    complete, get_job = (
        load("api.lease.post_v1_leases_complete"),
        load("api.lease.get_v1_jobs_job_id"),
    )
    write = load("api.proxy.proxy_post")

    await start(gateway)
    worker = client_mod.AuthenticatedClient(
        base_url=f"http://{gateway.control}", token=WORKER_TOKEN
    )
    proxy = client_mod.Client(base_url=f"http://{gateway.proxy}")
    async with worker, proxy:
        job = await enqueue.asyncio(
            client=worker, body=models.EnqueueBody(queue="mail", job_id="order-9")
        )
        assert isinstance(job, models.Job) and job.state == "pending"

        lease = await claim.asyncio("mail", client=worker, body=models.ClaimBody(owner="w-1"))
        assert isinstance(lease, models.LeaseGrant), lease
        assert (lease.job_id, lease.generation) == ("order-9", 1)

        charge = types.File(payload=b'{"amount": 5}')
        first = await write.asyncio_detailed(
            "pay", "charges", client=proxy, body=charge,
            fencing_token=lease.lease_token, idempotency_key="charge-1",
        )  # fmt: skip
        assert first.status_code == 201, first.content
        assert first.parsed == {"applied": 1}
        assert "Idempotent-Replayed" not in first.headers
        sent = upstream.received[0]
        assert (sent["headers"]["Fencing-Job"], sent["generation"]) == ("order-9", "1")
        assert "Fencing-Token" not in sent["headers"]

        again = await write.asyncio_detailed(
            "pay", "charges", client=proxy, body=types.File(payload=b'{"amount": 5}'),
            fencing_token=lease.lease_token, idempotency_key="charge-1",
        )  # fmt: skip
        assert again.status_code == 201
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.parsed == {"applied": 1}
        assert len(upstream.received) == 1  # the upstream was not called again

        keyless = await write.asyncio(
            "pay", "charges", client=proxy, body=types.File(payload=b"{}"),
            fencing_token=lease.lease_token,
        )  # fmt: skip
        assert isinstance(keyless, models.Problem)
        assert (keyless.status, keyless.reason) == (400, "missing-idempotency-key")

        done = await complete.asyncio(
            client=worker, body=models.CompleteBody(lease_token=lease.lease_token)
        )
        assert isinstance(done, models.Job) and done.state == "completed"
        assert (await get_job.asyncio("order-9", client=worker)).state == "completed"

        late = await write.asyncio(
            "pay", "charges", client=proxy, body=types.File(payload=b'{"amount": 6}'),
            fencing_token=lease.lease_token, idempotency_key="charge-2",
        )  # fmt: skip
        assert isinstance(late, models.Problem)
        assert (late.status, late.reason) == (409, "lease-ended")
        assert len(upstream.received) == 1
    await audit_conforms(gateway)


async def audit_conforms(gateway: Server) -> None:
    """The audit's entries as served (the refusals above, with every field the audit
    keeps) conform to the document's ``AuditPage``, which forbids fields it does not
    name: a field added to the answer and not to the document fails here."""
    from jsonschema import Draft202012Validator

    document = json.loads(DOCUMENT.read_text(encoding="utf-8"))
    schema = {"$ref": "#/components/schemas/AuditPage", "components": document["components"]}
    async with aiohttp.ClientSession() as session:
        async with session.get(
            f"http://{gateway.control}/admin/rejections",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        ) as resp:
            assert resp.status == 200
            page = await resp.json()
    assert {item["reason"] for item in page["items"]} >= {"lease-ended", "idempotent-replay"}
    Draft202012Validator(schema).validate(page)


@pytest.mark.timeout(420)
async def test_schemathesis_finds_no_server_error_and_no_answer_off_the_schema(
    gateway: Server, tmp_path: Path
) -> None:
    """Every operation of the control listener (the proxy's are another listener's),
    fuzzed with an admin token and with a worker token: no 5xx, every answer's status,
    media type, headers and body as the document says, every 4xx a problem document."""
    await start(gateway)
    env = environment() | {
        "SCHEMATHESIS_HOOKS": "tests.e2e.openapi_checks",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "client")]),
    }
    for token in (ADMIN_TOKEN, WORKER_TOKEN):
        code, out = await run(
            str(BIN / "schemathesis"), "run", f"http://{gateway.control}/openapi.json",
            "--exclude-tag", "proxy",
            "--header", f"Authorization: Bearer {token}",
            "--checks", ",".join(CHECKS),
            "--phases", "examples,coverage,fuzzing",
            "--max-examples", str(MAX_EXAMPLES),
            # One worker: with two, Hypothesis's ast.parse of a lambda in another thread
            # now and then fails in CPython 3.11 ("AST constructor recursion depth
            # mismatch"), a runtime error of the tool, not of the gateway.
            "--workers", "1",
            "--request-timeout", "10",
            "--output-sanitize", "false",
            env=env, cwd=tmp_path, timeout=360,  # its cache (.schemathesis/) goes there
        )  # fmt: skip
        summary = out[out.rfind("SUMMARY") :]
        assert code == 0, out
        tested = re.search(r"Tested: (\d+)", summary)
        assert tested is not None and int(tested.group(1)) >= 22, summary
        cases = re.search(r"Test cases:\s+(\d+) generated", summary)
        print(f"schemathesis: {tested.group(1)} operations, {cases and cases.group(1)} cases")
    assert "Traceback" not in gateway.output()
