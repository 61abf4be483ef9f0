#!/usr/bin/env python3
"""A payment worker that cannot charge a customer twice.

It claims jobs from the queue ``payments`` of a Fencegate lease service, charges each
one through the Fencegate gateway, and completes the job with the payment API's answer:

    fencegate serve --config examples/fencegate.toml          # in one terminal
    python examples/python_worker.py --owner worker-1         # in another

A job's payload is the charge, for example ``{"amount": 500, "currency": "EUR",
"customer": "cus_42"}``. Enqueue one with::

    curl -X POST http://127.0.0.1:8081/v1/jobs -H 'Content-Type: application/json' \\
         -d '{"queue": "payments", "payload": {"amount": 500, "currency": "EUR"}}'

What keeps the charge single:

* The lease renews itself in the background while the job runs. If this process
  stalls (GC pause, stopped VM, lost network) long enough for the job to go to
  another worker, the gateway refuses this worker's writes (stale generation), and the
  client raises ``LeaseLost`` instead of sending them. The worker then stops.
* The charge is sent as the job's step "charge": its ``Idempotency-Key`` is derived
  from the job id and the step name, so it is the same in every retry and in every
  generation. When a worker that took over the job repeats the step, the gateway
  answers with the stored response (``Idempotent-Replayed: true``) and the payment API
  is not called again.
* The payment API's credentials live in the gateway's config (``set_headers``), not
  here: this worker cannot go around the gateway.

Exit status: 0 when the queue is drained (or ``--max-jobs`` are done), 3 when a lease
was lost, 1 on a configuration or connection problem.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from typing import Any

import aiohttp

from fencegate_client import Lease, LeaseClient, LeaseError, LeaseLost

log = logging.getLogger("payment-worker")

EXIT_LEASE_LOST = 3


class RetryLater(Exception):
    """The charge did not get a final answer this time; the job should come back."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Charge payments from the 'payments' queue through the Fencegate gateway.",
    )
    parser.add_argument(
        "--control-url",
        default=os.environ.get("CONTROL_URL", "http://127.0.0.1:8081"),
        help="Fencegate control listener (lease API); env CONTROL_URL (default %(default)s)",
    )
    parser.add_argument(
        "--gateway-url",
        default=os.environ.get("GATEWAY_URL", "http://127.0.0.1:8080"),
        help="Fencegate proxy listener (the gateway); env GATEWAY_URL (default %(default)s)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("WORKER_TOKEN"),
        help="worker token for the control listener, when the server requires one "
        "(env WORKER_TOKEN)",
    )
    parser.add_argument(
        "--owner",
        default=f"payment-worker@{socket.gethostname()}:{os.getpid()}",
        help="this worker's name in leases (default: host and process id)",
    )
    parser.add_argument("--queue", default="payments", help="queue to claim from (%(default)s)")
    parser.add_argument(
        "--upstream",
        default="payments",
        help="name of the payment API's upstream in the gateway config (%(default)s)",
    )
    parser.add_argument(
        "--ttl", type=float, default=30.0, help="lease TTL in seconds (%(default)s)"
    )
    parser.add_argument(
        "--max-jobs",
        type=int,
        default=0,
        help="stop after this many jobs (default 0: until the queue is empty)",
    )
    parser.add_argument(
        "--forever",
        action="store_true",
        help="keep polling an empty queue instead of exiting",
    )
    parser.add_argument(
        "--poll-seconds", type=float, default=1.0, help="poll interval with --forever"
    )
    parser.add_argument(
        "--retry-seconds",
        type=float,
        default=30.0,
        help="when a charge gets no final answer, retry the job after this long (%(default)s)",
    )
    return parser.parse_args(argv)


async def charge(lease: Lease, upstream: str) -> dict[str, Any]:
    """Charge the job's payment once and return what to store as the job's result."""
    payment = lease.payload if isinstance(lease.payload, dict) else {}
    # step="charge": the same Idempotency-Key in every retry of this job, whoever runs it.
    answer = await lease.http.post(
        f"/{upstream}/charges",
        step="charge",
        json={
            "amount": payment.get("amount"),
            "currency": payment.get("currency", "EUR"),
            "customer": payment.get("customer"),
            "reference": lease.job_id,
        },
    )
    problem = answer.problem
    if problem is not None:
        # The gateway answered itself, e.g. request-in-progress (a duplicate is still in
        # flight) or outcome-unknown (an operator must resolve the key). Failing the job
        # makes it come back later; the retry uses the same key, so it cannot charge twice.
        raise RetryLater(f"gateway refused the charge: {problem['reason']}")
    if answer.status >= 500:
        raise RetryLater(f"payment API error {answer.status}: {answer.body[:200]!r}")
    # A 2xx is the charge; a 4xx (card declined, ...) is a final answer too.
    try:
        body: Any = answer.json()
    except ValueError:
        body = answer.body.decode(errors="replace")
    return {"status": answer.status, "charge": body, "replayed": answer.replayed}


async def work(args: argparse.Namespace) -> int:
    done = 0
    async with LeaseClient(
        args.control_url, gateway_url=args.gateway_url, token=args.token
    ) as client:
        while args.max_jobs <= 0 or done < args.max_jobs:
            try:
                # The lease renews itself while the block runs. Leaving the block without
                # complete() releases the job; an exception fails it with the error text.
                async with client.claim(args.queue, owner=args.owner, ttl=args.ttl) as lease:
                    if lease is None:
                        if not args.forever:
                            log.info("queue %s is empty; %d job(s) done", args.queue, done)
                            return 0
                        await asyncio.sleep(args.poll_seconds)
                        continue
                    log.info("claimed job %s (generation %d)", lease.job_id, lease.generation)
                    try:
                        result = await charge(lease, args.upstream)
                    except (RetryLater, aiohttp.ClientError, TimeoutError) as error:
                        # No final answer (a timeout may even have charged): give the job
                        # back for later. The retry sends the same key, so the gateway
                        # replays a stored charge or holds an unknown one for an operator.
                        await lease.fail(error=str(error), retry_in=args.retry_seconds)
                        log.warning("job %s will be retried: %s", lease.job_id, error)
                        continue
                    # complete() also refuses (LeaseLost) when the lease is no longer ours.
                    await lease.complete(result)
                    done += 1
                    log.info(
                        "job %s completed: HTTP %d%s",
                        lease.job_id,
                        result["status"],
                        " (stored answer replayed)" if result["replayed"] else "",
                    )
            except LeaseLost as lost:
                # Another worker owns the job now (this one stalled or was restarted).
                # Whatever this worker still had to do for it is no longer its business:
                # stop, and let a supervisor start a fresh process.
                log.error("lease lost (%s): stopping", lost.reason)
                return EXIT_LEASE_LOST
    log.info("done: %d job(s)", done)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        return asyncio.run(work(args))
    except (aiohttp.ClientError, OSError) as error:
        log.error("cannot reach Fencegate: %s", error)
        return 1
    except LeaseError as error:  # 401/403 (token), 400 (bad ttl), ...
        log.error("Fencegate refused: %s (%s)", error.detail, error.reason)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
