"""The recording upstream of a verification run, run as its own process::

    python -m verify.upstream --port P [--hosts 127.0.0.1,10.213.3.1] --ledger FILE [--seed S]

It stands in for a payment API that checks nothing: every write (POST, PUT, PATCH,
DELETE) to any path is applied, even the same key twice (duplicates must show). Applying
means: ``seq`` grows by one and a line goes to the ledger (``verify.events.LedgerEntry``:
the job and generation from ``Fencing-Job``/``Fencing-Generation``, the key from
``Idempotency-Key``, the body's sha256, plus ``status``, ``answer_sha256``, ``seq`` and the
``answer`` itself, which the run's operator resolves unknown outcomes with), flushed
*before* the answer goes out. The answer is ``201`` with ``{"seq", "job", "key",
"generation"}``, so two applications give two different answer bodies. A write without
``Fencing-Job`` is refused with 400 and not applied.

Faults, set while it runs with ``POST /__faults`` ``{"mode", "probability",
"slow_seconds"}``, drawn per write:

- ``cut``: applied, then the connection is aborted without an answer;
- ``slow``: applied, then answered after up to ``slow_seconds`` (longer than the gateway's
  upstream timeout, sometimes);
- ``5xx``: answered ``503`` without applying (the gateway frees the key on 503);
- ``none``: answered at once.

A write with ``Verify-Apply-Delay: S`` (the workers' ``overlap``) waits S seconds (at
most 5) before it is applied: a write in flight at the upstream while the job's next
generation is granted and writes.

``GET /__state``: counts. It prints ``upstream listening on PORT`` when ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from verify.events import JsonlWriter, LedgerEntry, sha256_hex

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
MODES = ("none", "cut", "slow", "5xx")


@dataclass
class Faults:
    mode: str = "none"
    probability: float = 0.0
    slow_seconds: float = 2.0

    def update(self, doc: dict[str, Any]) -> None:
        mode = str(doc.get("mode", self.mode))
        if mode not in MODES:
            raise ValueError(f"mode: one of {', '.join(MODES)}, not {mode!r}")
        probability = float(doc.get("probability", self.probability))
        slow = float(doc.get("slow_seconds", self.slow_seconds))
        if not 0.0 <= probability <= 1.0 or not 0.0 <= slow <= 60.0:
            raise ValueError("probability: 0..1, slow_seconds: 0..60")
        self.mode, self.probability, self.slow_seconds = mode, probability, slow


def _delay(text: str) -> float:
    """``Verify-Apply-Delay``'s seconds (0 when absent or not a number; at most 5)."""
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return min(value, 5.0) if value > 0 else 0.0


class Upstream:
    def __init__(self, ledger: JsonlWriter, seed: int | None) -> None:
        self.ledger = ledger
        self.faults = Faults()
        self.random = random.Random(seed)
        self.seq = 0
        self.counts: dict[str, int] = {"applied": 0, "cut": 0, "slow": 0, "5xx": 0}

    def draw(self) -> str:
        faults = self.faults
        if faults.mode != "none" and self.random.random() < faults.probability:
            return faults.mode
        return "none"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method not in WRITES:
            return web.json_response({"seq": self.seq})
        job = request.headers.get("Fencing-Job", "")
        try:
            generation = int(request.headers.get("Fencing-Generation", ""))
        except ValueError:
            generation = -1
        if not job or generation < 0:
            return web.json_response(
                {"error": "Fencing-Job and Fencing-Generation are required"}, status=400
            )
        delay = _delay(request.headers.get("Verify-Apply-Delay", ""))
        if delay:
            await asyncio.sleep(delay)  # a write that takes its time before it lands
        fault = self.draw()
        if fault == "5xx":
            self.counts["5xx"] += 1
            return web.json_response({"error": "try again later"}, status=503)
        key = request.headers.get("Idempotency-Key", "")
        self.seq += 1
        answer = json.dumps(
            {"seq": self.seq, "job": job, "key": key, "generation": generation},
            separators=(",", ":"),
        )
        self.ledger.write(
            LedgerEntry(
                time=time.time(),
                job=job,
                generation=generation,
                key=key,
                body_sha256=sha256_hex(body),
                answer_sha256=sha256_hex(answer.encode()),
                extra={
                    "status": 201,
                    "seq": self.seq,
                    "answer": answer,
                    "method": request.method,
                    "path": request.path,
                    "fault": fault,
                },
            )
        )
        self.counts["applied"] += 1
        if fault == "cut":
            self.counts["cut"] += 1
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError  # nothing more to write on this connection
        if fault == "slow":
            self.counts["slow"] += 1
            await asyncio.sleep(self.random.uniform(0.0, self.faults.slow_seconds))
        return web.Response(status=201, text=answer, content_type="application/json")

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            self.faults.update(await request.json())
        except (ValueError, TypeError) as error:
            return web.json_response({"error": str(error)}, status=400)
        return web.json_response(self.state())

    def state(self) -> dict[str, Any]:
        return {"seq": self.seq, "counts": self.counts, "faults": vars(self.faults)}

    async def get_state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state())


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m verify.upstream", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--hosts", default="127.0.0.1", help="comma list of addresses")
    parser.add_argument("--ledger", required=True, help="ledger.jsonl (appended to)")
    parser.add_argument("--seed", type=int, default=None)
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    with JsonlWriter(args.ledger) as ledger:
        upstream = Upstream(ledger, args.seed)
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_get("/__state", upstream.get_state)
        app.router.add_post("/__faults", upstream.set_faults)
        app.router.add_route("*", "/{tail:.*}", upstream.handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=True)
        await runner.setup()
        try:
            for host in args.hosts.split(","):
                await web.TCPSite(runner, host.strip(), args.port, backlog=1024).start()
            print(f"upstream listening on {args.port}", flush=True)
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    try:
        asyncio.run(serve(parse_args(sys.argv[1:] if argv is None else argv)))
    except (KeyboardInterrupt, web.GracefulExit):
        pass


if __name__ == "__main__":
    main()
