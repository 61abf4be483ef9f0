"""The recording upstream of a verification run and of the fault suite (``tests/faults``),
run as its own process::

    python -m verify.upstream --port P [--hosts 127.0.0.1,10.213.3.1] --ledger FILE
                              [--received FILE] [--seed S]

It stands in for a payment API that checks nothing: every write (POST, PUT, PATCH,
DELETE) to any path is applied, even the same key twice (duplicates must show). Applying
means: ``seq`` grows by one and a line goes to the ledger (``verify.events.LedgerEntry``:
the job and generation from ``Fencing-Job``/``Fencing-Generation``, the key from
``Idempotency-Key``, the body's sha256, plus ``status``, ``answer_sha256``, ``seq`` and the
``answer`` itself, which the run's operator resolves unknown outcomes with), flushed
*before* the answer goes out. The answer is ``201`` with ``{"seq", "job", "key",
"generation"}``, so two applications give two different answer bodies. A write without
``Fencing-Job`` is refused with 400 and not applied. ``--port 0`` takes a free port (one
host only).

Paths under ``/dedupe/`` deduplicate by (``Fencing-Job``, ``Idempotency-Key``), as an
upstream behind the gateway's ``retry`` unknown-outcome policy must: a key applied
already is answered with its first answer and not applied again. ``--dedup-window S``:
a key is remembered S seconds from its application, then forgotten (a request with it
afterwards is applied again), as a payment API's key expires; the gateway's resolver
(``unknown_outcome = "resolve"``) must re-send a held write only inside that window.
Behind such an upstream the gateway sends its own key (``upstream_key(job, key)``, a
digest) in ``Idempotency-Key``; a write that also carries ``Verify-Key: K`` (the worker's
key) with that digest for K is recorded in the ledger under K, so the ledger's keys are
the history's (a digest that is not K's stays the ledger's key: a write nobody sent
under it). ``--received FILE``
keeps every write received, in the order received, applied or not: the ledger's fields
and ``event``, ``applied``, ``duplicate`` (``/dedupe/``, not applied again) or ``dropped``
(cut before applying).

Faults, set while it runs with ``POST /__faults``, drawn per write. The nemesis sets one
``mode`` for a share of the writes (``{"mode", "probability", "slow_seconds"}``):

- ``cut``: applied, then the connection is aborted without an answer;
- ``slow``: applied, then answered after up to ``slow_seconds`` (longer than the gateway's
  upstream timeout, sometimes);
- ``5xx``: answered ``503`` without applying (the gateway frees the key on 503);
- ``none``: answered at once.

The fault suite sets a mix besides (``{"delay": [MIN, MAX], "hang": P, "cut": P,
"dribble": P, "apply_before_cut": P}``): every answer after a pause drawn from ``delay``;
``hang``: applied, never answered (the connection stays open until the gateway gives up);
``cut``: as above, or (``1 - apply_before_cut`` of them) ``cut-before-apply``, closed
without applying; ``dribble``: the answer's body comes in pieces over about half a
second. A write with ``Verify-Fault: delay=S|hang|cut|cut-before-apply|dribble|none``
gets that fault, drawn from nothing.

A write with ``Verify-Apply-Delay: S`` (the workers' ``overlap``) waits S seconds (at
most 5) before it is applied: a write in flight at the upstream while the job's next
generation is granted and writes.

``--let-go FILE``: every write whose connection the sender closed gracefully (a FIN: the
connection lost without an error) before it was answered, seen once it was applied or
when its answer was due, as a ledger line (its ``time`` when seen, ``seen``: ``applied``
or ``answer``). A sender that lets go of a write it has sent must reset the connection
(the gateway's ``SO_LINGER`` 0): a graceful close leaves the kernel retransmitting the
write's unacknowledged bytes, and a partition that heals delivers it after the sender
gave up on it (invariant 16, ``verify.check``).

``GET /__state``: counts, and ``handling``: the requests received and not yet answered
(0: every write received so far is in the ledger). It prints ``upstream listening on
PORT`` when ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.fencing.profiles import upstream_key
from verify.events import JsonlWriter, LedgerEntry, sha256_hex

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
MODES = ("none", "cut", "slow", "5xx")
MIX = ("hang", "cut", "dribble", "apply_before_cut")
FORCED = frozenset({"none", "hang", "cut", "cut-before-apply", "dribble", "slow", "5xx"})
HANG_SECONDS = 60.0  # a hanging answer: the gateway gives up long before
# --let-go: a connection closed gracefully is remembered this long (past any answer's
# delay), looked through once more than CLOSED_PRUNE are remembered
CLOSED_KEPT = 120.0
CLOSED_PRUNE = 1000


@dataclass
class Faults:
    mode: str = "none"
    probability: float = 0.0
    slow_seconds: float = 2.0
    # the fault suite's mix, drawn besides the mode
    delay: tuple[float, float] = (0.0, 0.0)
    hang: float = 0.0
    cut: float = 0.0
    dribble: float = 0.0
    apply_before_cut: float = 0.5

    def update(self, doc: dict[str, Any]) -> None:
        mode = str(doc.get("mode", self.mode))
        if mode not in MODES:
            raise ValueError(f"mode: one of {', '.join(MODES)}, not {mode!r}")
        probability = float(doc.get("probability", self.probability))
        slow = float(doc.get("slow_seconds", self.slow_seconds))
        if not 0.0 <= probability <= 1.0 or not 0.0 <= slow <= 60.0:
            raise ValueError("probability: 0..1, slow_seconds: 0..60")
        delay = doc.get("delay", self.delay)
        low, high = (float(d) for d in (delay if isinstance(delay, list | tuple) else [delay] * 2))
        mix = {name: float(doc.get(name, getattr(self, name))) for name in MIX}
        if not 0.0 <= low <= high <= 60.0 or not all(0.0 <= p <= 1.0 for p in mix.values()):
            raise ValueError(
                "delay: [min, max] in 0..60, hang, cut, dribble, apply_before_cut: 0..1"
            )
        self.mode, self.probability, self.slow_seconds = mode, probability, slow
        self.delay = (low, high)
        for name, chance in mix.items():
            setattr(self, name, chance)

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "delay": list(self.delay)}


def _delay(text: str) -> float:
    """``Verify-Apply-Delay``'s seconds (0 when absent or not a number; at most 5)."""
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return min(value, 5.0) if value > 0 else 0.0


def _forced(text: str) -> tuple[str, float] | None:
    """``Verify-Fault``'s (fault, delay), or None when absent or unknown."""
    name, _, value = text.strip().partition("=")
    if name == "delay":
        return "delay", min(max(float(value or 0), 0.0), 60.0)
    return (name, 0.0) if name in FORCED else None


class Upstream:
    def __init__(
        self,
        ledger: JsonlWriter,
        seed: int | None,
        received: JsonlWriter | None,
        dedup_window: float | None = None,
        let_go: JsonlWriter | None = None,
    ) -> None:
        self.ledger = ledger
        self.received = received
        self.let_go = let_go
        # the connections (their protocols) the sender closed without an error, and when
        # (held, so that no other connection takes the id; forgotten after CLOSED_KEPT,
        # or once told)
        self.closed_gracefully: dict[web.RequestHandler, float] = {}
        self.faults = Faults()
        self.random = random.Random(seed)
        self.seq = 0
        self.dedup_window = dedup_window  # /dedupe/: seconds a key is kept (None: forever)
        # /dedupe/: (job, key) -> the first answer and when it was applied
        self.first: dict[tuple[str, str], tuple[str, float]] = {}
        self.counts: dict[str, int] = {"applied": 0, "cut": 0, "slow": 0, "5xx": 0}
        self.handling = 0  # writes received and not yet answered (or cut)

    def draw(self) -> tuple[str, float]:
        """(fault, seconds before the answer) of one write."""
        faults, rng = self.faults, self.random
        if faults.mode != "none" and rng.random() < faults.probability:
            return faults.mode, 0.0
        if not (faults.delay[1] > 0 or faults.hang or faults.cut or faults.dribble):
            return "none", 0.0
        delay = rng.uniform(*faults.delay) if faults.delay[1] > 0 else 0.0
        roll = rng.random()
        for name in ("hang", "cut", "dribble"):
            chance = float(getattr(faults, name))
            if roll < chance:
                if name == "cut" and rng.random() >= faults.apply_before_cut:
                    return "cut-before-apply", delay
                return name, delay
            roll -= chance
        return ("delay" if delay else "none"), delay

    def watch(self, server: web.Server) -> None:
        """Tell a connection closed by a FIN from one reset: aiohttp's handler gets the
        connection's end from the transport (None: end of file) and hands it on as a
        reset either way."""
        lost = server.connection_lost

        def connection_lost(handler: web.RequestHandler, exc: BaseException | None = None) -> None:
            if exc is None:
                now = time.monotonic()
                if len(self.closed_gracefully) > CLOSED_PRUNE:
                    old = [h for h, at in self.closed_gracefully.items() if at < now - CLOSED_KEPT]
                    for gone in old:
                        del self.closed_gracefully[gone]
                self.closed_gracefully[handler] = now
            lost(handler, exc)

        server.connection_lost = connection_lost  # type: ignore[method-assign]

    def check_let_go(self, request: web.Request, entry: LedgerEntry, seen: str) -> None:
        """``--let-go``: the write's connection was closed gracefully before its answer."""
        if self.let_go is None:
            return
        # one request at most on a connection lost: told once
        if self.closed_gracefully.pop(request.protocol, None) is not None:
            extra = {**entry.extra, "seen": seen}
            self.let_go.write({**entry.to_json(), "time": time.time(), **extra})

    def note(self, event: str, entry: LedgerEntry) -> None:
        """A write received, in ``--received``."""
        if self.received is not None:
            self.received.write({**entry.to_json(), "event": event})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.handling += 1
        try:
            return await self._handle(request)
        finally:
            self.handling -= 1

    async def _handle(self, request: web.Request) -> web.StreamResponse:
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
        fault, wait = _forced(request.headers.get("Verify-Fault", "")) or self.draw()
        if fault == "5xx":
            self.counts["5xx"] += 1
            return web.json_response({"error": "try again later"}, status=503)
        key = request.headers.get("Idempotency-Key", "")
        first = self.remembered(job, key) if request.path.startswith("/dedupe/") else None
        answer = first or json.dumps(
            {"seq": self.seq + 1, "job": job, "key": key, "generation": generation},
            separators=(",", ":"),
        )
        entry = LedgerEntry(
            time=time.time(),
            job=job,
            generation=generation,
            key=_worker_key(job, key, request.headers.get("Verify-Key")),
            body_sha256=sha256_hex(body),
            answer_sha256=sha256_hex(answer.encode()),
            extra={
                "status": 201,
                "seq": self.seq + (first is None),
                "answer": answer,
                "method": request.method,
                "path": request.path,
                "fault": fault,
            },
        )
        if fault == "cut-before-apply":
            self.note("dropped", entry)
            return self.cut(request)
        if first is not None:
            self.note("duplicate", entry)
        else:
            self.seq += 1
            self.first[job, key] = (answer, entry.time)
            self.ledger.write(entry)
            self.note("applied", entry)
            self.counts["applied"] += 1
        await asyncio.sleep(0)  # an end of the connection read with the request, handled
        self.check_let_go(request, entry, "applied")
        return await self.answer(request, fault, wait, answer, entry)

    def remembered(self, job: str, key: str) -> str | None:
        """``/dedupe/``: the first answer to (job, key), while the key is kept."""
        first = self.first.get((job, key))
        if first is None:
            return None
        answer, applied = first
        if self.dedup_window is not None and time.time() - applied > self.dedup_window:
            return None  # forgotten: the next request with it is applied again
        return answer

    async def answer(
        self, request: web.Request, fault: str, wait: float, answer: str, entry: LedgerEntry
    ) -> web.StreamResponse:
        if fault != "none":
            self.counts[fault] = self.counts.get(fault, 0) + 1
        if fault == "cut":
            return self.cut(request)
        if fault == "hang":
            await self.hang(request, entry)
            return self.cut(request)
        if fault == "slow":
            await asyncio.sleep(self.random.uniform(0.0, self.faults.slow_seconds))
        if wait:
            await asyncio.sleep(wait)
        self.check_let_go(request, entry, "answer")
        if fault != "dribble":
            return web.Response(status=201, text=answer, content_type="application/json")
        out = web.StreamResponse(status=201, headers={"Content-Type": "application/json"})
        await out.prepare(request)
        raw = answer.encode()
        pieces = [raw[i : i + 16] for i in range(0, len(raw), 16)]
        for piece in pieces:
            await out.write(piece)
            await asyncio.sleep(0.5 / len(pieces))
        await out.write_eof()
        return out

    async def hang(self, request: web.Request, entry: LedgerEntry) -> None:
        """No answer for ``HANG_SECONDS``, or until the connection ends (the sender gave
        up: how it closed is looked at then)."""
        ended = time.monotonic() + HANG_SECONDS
        while time.monotonic() < ended and request.transport is not None:
            await asyncio.sleep(0.1)
        self.check_let_go(request, entry, "answer")

    @staticmethod
    def cut(request: web.Request) -> web.Response:
        """Abort the connection without an answer."""
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError  # nothing more to write on this connection

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            self.faults.update(await request.json())
        except (ValueError, TypeError) as error:
            return web.json_response({"error": str(error)}, status=400)
        return web.json_response(self.state())

    def state(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "counts": self.counts,
            "handling": self.handling,
            "faults": self.faults.to_json(),
        }

    async def get_state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state())


def _worker_key(job: str, key: str, named: str | None) -> str:
    """The ledger's key: the worker's (``Verify-Key``) when the gateway's digest in
    ``Idempotency-Key`` is that key's, else ``Idempotency-Key`` as received."""
    if named and key == upstream_key(job, named):
        return named
    return key


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m verify.upstream", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--hosts", default="127.0.0.1", help="comma list of addresses")
    parser.add_argument("--ledger", required=True, help="ledger.jsonl (appended to)")
    parser.add_argument(
        "--received", default=None, help="every write received, applied or not (appended to)"
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--let-go",
        default=None,
        help="every write whose connection was closed gracefully before its answer (appended to)",
    )
    parser.add_argument(
        "--second-port",
        type=int,
        default=None,
        help="also listen on this port (the same upstream; verify's resolving upstream "
        "is reached there, out of the partition nemesis's reach)",
    )
    parser.add_argument(
        "--dedup-window",
        type=float,
        default=None,
        help="/dedupe/: seconds a key is kept after its application (default: forever)",
    )
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    with contextlib.ExitStack() as files:
        ledger = files.enter_context(JsonlWriter(args.ledger))
        received = files.enter_context(JsonlWriter(args.received)) if args.received else None
        let_go = files.enter_context(JsonlWriter(args.let_go)) if args.let_go else None
        upstream = Upstream(ledger, args.seed, received, args.dedup_window, let_go)
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_get("/__state", upstream.get_state)
        app.router.add_post("/__faults", upstream.set_faults)
        app.router.add_route("*", "/{tail:.*}", upstream.handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=True)
        await runner.setup()
        assert runner.server is not None
        upstream.watch(runner.server)
        try:
            for host in args.hosts.split(","):
                await web.TCPSite(runner, host.strip(), args.port, backlog=1024).start()
                if args.second_port:
                    await web.TCPSite(runner, host.strip(), args.second_port).start()
            print(f"upstream listening on {args.port or runner.addresses[0][1]}", flush=True)
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
