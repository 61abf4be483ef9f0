"""``fencegate demo``: the problem and its fix, in one terminal, with nothing else running.

A local "payments" upstream, the gateway on a throw-away SQLite file, two workers on one
job. The first stalls past its lease, the second takes over; the first wakes up and
tries to write. Every claim the demo makes about the outcome is checked, and the exit
status says whether all of them held.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from fencegate_client import FencedResponse, LeaseClient
from fencegate_client.aio import Lease
from fencegate_client.reasons import Reason
from gateway.config import Settings
from gateway.service.server import serve

JOB = "order-42"
TTL = 1.5


class DemoUpstream:
    """A tiny payments API that applies every request it receives and remembers it."""

    def __init__(self) -> None:
        self.applied: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        entry = {
            "path": request.path,
            "generation": int(request.headers.get("Fencing-Generation", "0")),
            "key": request.headers.get("Idempotency-Key"),
            "body": body,
        }
        self.applied.append(entry)
        return web.json_response({"id": f"ch_{len(self.applied)}", **body}, status=201)


class Report:
    def __init__(self, out: Callable[[str], None]) -> None:
        self.out = out
        self.failures: list[str] = []

    def step(self, text: str) -> None:
        self.out(f"\n== {text}")

    def say(self, text: str) -> None:
        self.out(f"   {text}")

    def check(self, ok: bool, text: str) -> None:
        self.out(f"   [{'ok' if ok else 'FAILED'}] {text}")
        if not ok:
            self.failures.append(text)


async def run_demo(out: Callable[[str], None] = print) -> int:
    report = Report(out)
    upstream = DemoUpstream()
    app = web.Application()
    app.router.add_post("/{tail:.*}", upstream.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    up_port = runner.addresses[0][1]
    ready: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    with tempfile.TemporaryDirectory(prefix="fencegate-demo-") as tmp:
        settings = Settings(
            database_url=f"sqlite+aiosqlite:///{Path(tmp) / 'demo.db'}",
            proxy_listen="127.0.0.1:0",
            control_listen="127.0.0.1:0",
            upstreams=[{"name": "payments", "url": f"http://127.0.0.1:{up_port}"}],
            lease={"default_ttl_seconds": TTL},
        )
        server = asyncio.get_running_loop().create_task(
            serve(settings, on_ready=ready.set_result, stop=stop, announce=False),
            name="fencegate:demo-server",
        )
        try:
            addresses = await asyncio.wait_for(ready, 30)
            urls = {a.split("=")[0]: "http://" + a.split("=")[1] for a in addresses}
            await _story(report, upstream, urls["control"], urls["proxy"])
        finally:
            stop.set()
            await server
            await runner.cleanup()
    out("")
    if report.failures:
        out(f"demo FAILED: {len(report.failures)} check(s) did not hold")
        return 1
    out("demo passed: the stale worker's write never reached the upstream")
    return 0


async def _story(report: Report, upstream: DemoUpstream, control: str, proxy: str) -> None:
    async with LeaseClient(control, gateway_url=proxy) as client:
        a, b, charge_b = await _takeover(report, client)
        await _late_write(report, client, proxy, a, b)
        await b.complete({"charged": charge_b.json()["id"]})
        report.say("worker B completed the job")
        _show_applied(report, upstream)
        await _show_audit(report, client)


async def _takeover(report: Report, client: LeaseClient) -> tuple[Lease, Lease, FencedResponse]:
    """Worker A charges, stalls past its lease; worker B takes the job over and retries
    the charge, which replays A's answer. A's lease, B's and B's answer."""
    report.step(f"Worker A acquires job {JOB} (lease TTL {TTL:g}s)")
    a = await client.acquire(JOB, owner="worker-a", ttl=TTL)
    assert a is not None
    report.say(f"worker A holds generation {a.generation}")

    report.step("Worker A charges the customer through the gateway (step 'charge')")
    charge_a = await a.http.post("/payments/charges", step="charge", json={"amount": 4200})
    report.say(f"upstream answered {charge_a.status} {charge_a.json()}")
    report.check(charge_a.status == 201 and not charge_a.replayed, "the charge was forwarded")

    report.step(f"Worker A stalls (a GC pause, a stopped VM) for {TTL + 0.7:.1f}s ...")
    await asyncio.sleep(TTL + 0.7)

    report.step("Worker B finds the lease expired and takes the job over")
    b = await client.acquire(JOB, owner="worker-b", ttl=30)
    assert b is not None
    report.say(f"worker B holds generation {b.generation}")
    report.check(b.generation > a.generation, "the generation grew with the new grant")

    report.step("Worker B retries step 'charge' (it cannot know A already charged)")
    charge_b = await b.http.post("/payments/charges", step="charge", json={"amount": 4200})
    report.say(
        f"gateway answered {charge_b.status} {charge_b.json()} "
        f"(Idempotent-Replayed: {str(charge_b.replayed).lower()})"
    )
    report.check(
        charge_b.replayed and charge_b.body == charge_a.body,
        "the retried step got A's stored answer; the customer was not charged twice",
    )
    return a, b, charge_b


async def _late_write(report: Report, client: LeaseClient, proxy: str, a: Lease, b: Lease) -> None:
    """Worker B sends the receipt; worker A wakes up and sends it too, and is refused."""
    report.step("Worker B sends the receipt (step 'receipt')")
    receipt = await b.http.post("/payments/receipts", step="receipt", json={"to": "ann"})
    report.check(receipt.status == 201, f"forwarded: upstream answered {receipt.status}")

    report.step("Worker A wakes up, still believing it owns the job, and sends the receipt")
    # Sent by hand, as any HTTP client would: the Python client would already refuse
    # locally, but a VM that was stopped does not see its monotonic clock advance.
    async with client.session.post(
        proxy + "/payments/receipts",
        json={"to": "ann"},
        headers={"Fencing-Token": a.token, "Idempotency-Key": "receipt-from-a"},
    ) as resp:
        problem = json.loads(await resp.read())
    report.say(f"gateway answered {resp.status} {resp.content_type}")
    report.say(json.dumps(problem))
    report.check(
        resp.status == 409 and problem.get("reason") == Reason.STALE_GENERATION,
        "worker A's late write was refused (stale-generation) and never reached the upstream",
    )


def _show_applied(report: Report, upstream: DemoUpstream) -> None:
    report.step("What the payments upstream applied")
    for entry in upstream.applied:
        report.say(f"{entry['path']:<12} generation {entry['generation']}  {entry['body']}")
    paths = [e["path"] for e in upstream.applied]
    gens = [e["generation"] for e in upstream.applied]
    report.check(paths == ["/charges", "/receipts"], "one write per step")
    report.check(gens == sorted(gens), "writes arrived in generation order")


async def _show_audit(report: Report, client: LeaseClient) -> None:
    report.step("The gateway's audit (requests it answered itself)")
    entries = await _audit(client)
    for e in entries:
        report.say(
            f"{e['reason']:<18} {e['status']}  job {e['job_id']}  generation "
            f"{e['generation']} (highest {e['highest_generation']})  {e['method']} {e['path']}"
        )
    reasons = {e["reason"] for e in entries}
    report.check(
        {Reason.STALE_GENERATION, Reason.IDEMPOTENT_REPLAY} <= reasons,
        "the refusal and the replay are both in the audit",
    )


async def _audit(client: LeaseClient) -> list[dict[str, Any]]:
    async with client.session.get(client.control_url + "/admin/rejections") as resp:
        doc: dict[str, Any] = json.loads(await resp.read())
    items: list[dict[str, Any]] = doc["items"]
    return items
