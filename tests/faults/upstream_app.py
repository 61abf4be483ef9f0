"""The fault-injection upstream, run as its own process:

    python upstream_app.py --log FILE [--port 0] [--delay MIN:MAX] [--hang P] [--reset P]
                           [--slow P] [--apply-before-fault P] [--seed N]

Every knob also reads an environment variable (``FAULT_UPSTREAM_DELAY``,
``FAULT_UPSTREAM_HANG``, ...); the command line wins. It prints ``upstream listening on
PORT`` when ready.

It stands in for a payment API that applies writes. Every write it receives is appended
to the JSONL log as one line *before* it answers (or fails to answer)::

    {"seq", "event", "job", "key", "generation", "path", "body_sha256", "status",
     "answer", "fault", "pid", "t"}

``event`` is ``applied`` (the side effect happened; ``answer`` is the body it gave, or
would have given had the fault not eaten it), ``duplicate`` (the ``/dedupe`` prefix: a key
it had applied already, answered with the first answer and not applied again) or
``dropped`` (a reset before applying: nothing happened).

Faults, drawn per request (or forced with the request header ``X-Fault``):

- ``delay``: the answer comes after a pause drawn from ``--delay`` (``X-Fault: delay=1.5``);
- ``hang``: applied, then never answered (the connection stays open until the gateway
  gives up);
- ``reset``: applied, then the connection is closed without an answer
  (``reset-before-apply``: closed without applying);
- ``slow``: the answer's body dribbles out in pieces over about half a second;
- ``none``: answered at once.

Paths: ``/hold/...`` and anything else apply every write they get; ``/dedupe/...``
deduplicates by (Fencing-Job, Idempotency-Key), as an upstream behind the ``retry``
unknown-outcome policy must. ``GET /__state`` tells what it has seen; ``POST /__knobs``
(JSON) changes the knobs of a running upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import sys
import time
import uuid
from typing import Any

from aiohttp import web

HANG_SECONDS = 60.0


class Knobs:
    def __init__(self, args: argparse.Namespace) -> None:
        low, _, high = args.delay.partition(":")
        self.delay = (float(low), float(high or low))
        self.hang = args.hang
        self.reset = args.reset
        self.slow = args.slow
        self.apply_before_fault = args.apply_before_fault

    def update(self, doc: dict[str, Any]) -> None:
        if "delay" in doc:
            low, high = doc["delay"] if isinstance(doc["delay"], list) else (doc["delay"],) * 2
            self.delay = (float(low), float(high))
        for name in ("hang", "reset", "slow", "apply_before_fault"):
            if name in doc:
                setattr(self, name, float(doc[name]))

    def to_json(self) -> dict[str, Any]:
        return {
            "delay": list(self.delay),
            "hang": self.hang,
            "reset": self.reset,
            "slow": self.slow,
            "apply_before_fault": self.apply_before_fault,
        }


class Upstream:
    def __init__(self, args: argparse.Namespace) -> None:
        self.knobs = Knobs(args)
        self.random = random.Random(args.seed)
        self.log = open(args.log, "a", encoding="utf-8")  # lives as long as the process
        self.seq = 0
        self.first_answer: dict[tuple[str, str], tuple[int, str]] = {}
        self.in_flight: dict[str, int] = {}
        self.received = 0

    def record(self, **entry: Any) -> None:
        self.seq += 1
        line = {"seq": self.seq, **entry, "pid": os.getpid(), "t": time.time()}
        self.log.write(json.dumps(line) + "\n")
        self.log.flush()

    def draw(self, forced: str | None) -> tuple[str, float]:
        """(fault, delay) for one request."""
        knobs, rnd = self.knobs, self.random
        delay = rnd.uniform(*knobs.delay) if knobs.delay[1] > 0 else 0.0
        if forced:
            name, _, value = forced.partition("=")
            if name == "delay":
                return "delay", float(value)
            return name, 0.0
        roll = rnd.random()
        for name, chance in (("hang", knobs.hang), ("reset", knobs.reset), ("slow", knobs.slow)):
            if roll < chance:
                if name == "reset" and rnd.random() >= knobs.apply_before_fault:
                    return "reset-before-apply", delay
                return name, delay
            roll -= chance
        return ("delay" if delay else "none"), delay

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received += 1
        prefix = request.path.strip("/").partition("/")[0]
        job = request.headers.get("Fencing-Job", "")
        key = request.headers.get("Idempotency-Key", "")
        generation = int(request.headers.get("Fencing-Generation", "0") or 0)
        fault, delay = self.draw(request.headers.get("X-Fault"))
        common = {
            "job": job,
            "key": key,
            "generation": generation,
            "path": request.path_qs,
            "method": request.method,
            "body_sha256": hashlib.sha256(body).hexdigest(),
            "fault": fault,
        }
        first = self.first_answer.get((job, key)) if prefix == "dedupe" else None
        if fault == "reset-before-apply":
            self.record(event="dropped", status=None, answer=None, **common)
            return self.reset(request)
        if first is not None:
            status, answer = first
            self.record(event="duplicate", status=status, answer=answer, **common)
        else:
            status = 201
            answer = json.dumps(
                {
                    "job": job,
                    "key": key,
                    "generation": generation,
                    "receipt": uuid.uuid4().hex,
                    "path": request.path,
                },
                separators=(",", ":"),
            )
            self.first_answer.setdefault((job, key), (status, answer))
            self.record(event="applied", status=status, answer=answer, **common)
        self.in_flight[job] = self.in_flight.get(job, 0) + 1
        try:
            if fault == "reset":
                return self.reset(request)
            if fault == "hang":
                await asyncio.sleep(HANG_SECONDS)
                return self.reset(request)
            if delay:
                await asyncio.sleep(delay)
            headers = {"Content-Type": "application/json"}
            if fault != "slow":
                return web.Response(status=status, body=answer.encode(), headers=headers)
            out = web.StreamResponse(status=status, headers=headers)
            await out.prepare(request)
            raw = answer.encode()
            pieces = [raw[i : i + 16] for i in range(0, len(raw), 16)]
            for piece in pieces:
                await out.write(piece)
                await asyncio.sleep(0.5 / len(pieces))
            await out.write_eof()
            return out
        finally:
            self.in_flight[job] -= 1

    @staticmethod
    def reset(request: web.Request) -> web.Response:
        """Close the connection without an answer."""
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError  # nothing more to write on this connection

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "received": self.received,
                "in_flight": {job: n for job, n in self.in_flight.items() if n},
                "knobs": self.knobs.to_json(),
            }
        )

    async def set_knobs(self, request: web.Request) -> web.Response:
        self.knobs.update(await request.json())
        return web.json_response(self.knobs.to_json())


def parse_args(argv: list[str]) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", default=env("FAULT_UPSTREAM_LOG"), required=False)
    parser.add_argument("--port", type=int, default=int(env("FAULT_UPSTREAM_PORT", "0")))
    parser.add_argument("--delay", default=env("FAULT_UPSTREAM_DELAY", "0"))
    parser.add_argument("--hang", type=float, default=float(env("FAULT_UPSTREAM_HANG", "0")))
    parser.add_argument("--reset", type=float, default=float(env("FAULT_UPSTREAM_RESET", "0")))
    parser.add_argument("--slow", type=float, default=float(env("FAULT_UPSTREAM_SLOW", "0")))
    parser.add_argument(
        "--apply-before-fault",
        type=float,
        default=float(env("FAULT_UPSTREAM_APPLY_BEFORE_FAULT", "0.5")),
        help="chance that a reset happens after the write was applied (default 0.5)",
    )
    parser.add_argument("--seed", type=int, default=int(env("FAULT_UPSTREAM_SEED", "0")) or None)
    args = parser.parse_args(argv)
    if not args.log:
        parser.error("--log (or FAULT_UPSTREAM_LOG) is required")
    return args


async def main(argv: list[str]) -> None:
    args = parse_args(argv)
    upstream = Upstream(args)
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_get("/__state", upstream.state)
    app.router.add_post("/__knobs", upstream.set_knobs)
    app.router.add_route("*", "/{tail:.*}", upstream.handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=1024)
    await site.start()
    port = runner.addresses[0][1]
    print(f"upstream listening on {port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    try:
        asyncio.run(main(sys.argv[1:]))
    except (KeyboardInterrupt, web.GracefulExit):
        pass
