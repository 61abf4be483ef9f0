#!/usr/bin/env python3
"""Fencing a queue's own leases with signed tokens (a ``kind = "jwt"`` lease source).

The queue signs one token per grant of a job (``fencegate_client.signed.mint_token``):
the job, its generation (here the message's receive count) and an expiry. A worker sends
it as ``Fencing-Token: queue:<JWS>`` with an ``Idempotency-Key``. This script plays both
sides: the queue grants order-… to worker A (generation 1), A charges; the visibility
timeout passes while A stalls, the queue grants the job again (generation 2) to worker
B, which repeats the charge (replayed, not sent again) and sends the receipt; then A
wakes up and sends its receipt: refused ``409 stale-generation``.

Run against ``fencegate serve --config examples/lease_sources.toml`` and an upstream on
127.0.0.1:9000 (examples/README.md). The queue signs with examples/queue_demo_key.pem, a
DEMO key whose private half is public: never use it for anything real.

    python examples/signed_token_worker.py [GATEWAY_URL]
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx

from fencegate_client.signed import mint_token

# DEMO KEY, NEVER USE IT: its private half is in this repository. Its public half is the
# one in examples/lease_sources.toml; a real queue keeps its own private key secret.
DEMO_KEY = Path(__file__).with_name("queue_demo_key.pem")


def grant(job: str, generation: int) -> str:
    """The queue's side: one signed token per grant of ``job`` ("queue:<JWS>")."""
    return mint_token(
        DEMO_KEY.read_text(encoding="utf-8"),
        source="queue",  # the [[lease_sources]] name in the gateway's config
        issuer="billing-queue",
        job=job,
        generation=generation,
        ttl_seconds=30,
    )


def write(
    http: httpx.Client, worker: str, token: str, path: str, key: str, body: dict[str, Any]
) -> httpx.Response:
    """The worker's side: a write through the gateway, fenced by the token."""
    answer = http.post(path, json=body, headers={"Fencing-Token": token, "Idempotency-Key": key})
    if answer.is_success:
        replayed = " (replayed)" if answer.headers.get("Idempotent-Replayed") == "true" else ""
        print(f"{worker}: POST {path} -> {answer.status_code}{replayed}")
    else:
        print(f"{worker}: POST {path} -> {answer.status_code} {answer.json()['reason']}")
    return answer


def main() -> int:
    parser = argparse.ArgumentParser(description="Signed tokens of a queue, fenced.")
    parser.add_argument("gateway_url", nargs="?", default="http://127.0.0.1:8080")
    args = parser.parse_args()
    job = f"order-{uuid.uuid4().hex[:8]}"  # a fresh job on every run
    order = {"order": job, "amount": 4200}
    print(f"job {job} (fenced as queue/{job})")
    with httpx.Client(base_url=args.gateway_url, timeout=10) as http:
        a = grant(job, generation=1)  # first delivery, to worker A
        a_charge = write(http, "A (generation 1)", a, "/payments/charges", "charge", order)
        # A stalls past the visibility timeout; the queue delivers the job again, to B.
        b = grant(job, generation=2)
        b_charge = write(http, "B (generation 2)", b, "/payments/charges", "charge", order)
        b_receipt = write(http, "B (generation 2)", b, "/payments/receipts", "receipt", order)
        # A wakes up and carries on: generation 2 has written, so generation 1 is refused.
        a_receipt = write(http, "A (generation 1)", a, "/payments/receipts", "receipt", order)
    fenced = a_receipt.status_code == 409 and a_receipt.json()["reason"] == "stale-generation"
    if a_charge.is_success and b_charge.is_success and b_receipt.is_success and fenced:
        return 0
    print("expected three writes and then 409 stale-generation", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
