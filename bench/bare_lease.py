"""HTTP alone: what any aiohttp lease API pays before it does a thing of its own.

One aiohttp server (uvloop, no access log, as ``fencegate serve`` runs) that answers the
benchmark's renewals as the lease API does, with no database, no batching, no checks:
read the JSON body, parse it, answer a lease document of the same shape and size (its
expiry moved on by the asked TTL). ``PUT /v1/jobs/{job_id}/lease`` hands out a token so
the driver's ``renewals`` mode runs against it unchanged. Beside the gateway's renewals
its CPU per request is aiohttp's and the loop's share of the gateway's, and what is left
is the lease API's own work (``docs/performance.md``).

Run alone: ``python -m bench.bare_lease --port 8091``.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

if __package__ in (None, ""):  # run as a file: python bench/bare_lease.py
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import serve_main
from lease_core.store import LeaseRecord


def _lease(job_id: str, body: bytes, token: str | None = None) -> dict[str, Any]:
    """The lease document the lease API answers (its own ``LeaseRecord``)."""
    ttl = float(json.loads(body).get("ttl_seconds") or 60.0)
    return LeaseRecord(
        job_id=job_id,
        generation=1,
        owner=f"bench-{job_id}",
        expires_at=time.time() + ttl,
        ttl_seconds=ttl,
        payload=None,
        lease_token=token,
    ).to_json()


async def acquire(request: web.Request) -> web.Response:
    token = "fgl_" + secrets.token_urlsafe(24)
    lease = _lease(request.match_info["job_id"], await request.read(), token)
    return web.json_response(lease, status=201)


async def renew(request: web.Request) -> web.Response:
    # Which job a token belongs to is the database's to say; every answer names one.
    return web.json_response(_lease("bench-job", await request.read()))


def create_app() -> web.Application:
    app = web.Application()
    app.router.add_put("/v1/jobs/{job_id}/lease", acquire)
    app.router.add_post("/v1/leases/renew", renew)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    serve_main(__doc__, create_app, argv)


if __name__ == "__main__":
    main()
