"""HTTP and batched SQL, nothing else: the least a lease API over HTTP that batches the
store's renewals can cost (PostgreSQL).

One aiohttp server (uvloop, no access log, no middleware) whose renewals do only what
no lease API can skip: parse the body, hash the token, send the renewal in the store's
own batched statement (the catalogue's ``renew (many)``, batched by ``lease_core``'s
``Coalescer`` as the gateway batches it, through asyncpg), and answer the lease document
(its own ``LeaseRecord``). No validation, no checks, no metrics, no problem documents.
``PUT /v1/jobs/{job_id}/lease`` is passed on to a real gateway (``--leases-from``), so
the driver's ``renewals`` mode runs against it unchanged and renews real leases.

Beside the gateway's renewals and the raw SQL floor, in the same run, it says how close
an HTTP API with this statement can come to that floor on this machine, and so how much
of the gap is the gateway's own handling (``docs/performance.md``).

Run alone: ``python -m bench.lean_lease --database-url postgresql://... --leases-from
http://127.0.0.1:8081``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web

if __package__ in (None, ""):  # run as a file: python bench/lean_lease.py
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import run, serve_app
from lease_core import catalogue, tokens
from lease_core.coalesce import Coalescer
from lease_core.statement import MAX_BATCH
from lease_core.store import LeaseRecord

RENEWALS = web.AppKey("renewals", Coalescer)
SESSION = web.AppKey("session", aiohttp.ClientSession)
GATEWAY = web.AppKey("gateway", str)


async def _no_reset(_conn: Any) -> None:
    return None


def renew_many() -> tuple[str, int]:
    """The store's batched renewal as the gateway sends it (the server's clock), and how
    many of its batches the gateway runs at once."""
    batched = catalogue.load("postgresql")["renew"].batched
    assert batched is not None
    text, names = batched.many.postgres(False)
    assert names == ("token_hash", "ttl"), names
    return text, batched.lanes


async def acquire(request: web.Request) -> web.Response:
    """Passed on to the gateway: a real job and a real lease to renew."""
    async with request.app[SESSION].put(
        request.app[GATEWAY] + request.path,
        data=await request.read(),
        headers={"Content-Type": "application/json"},
    ) as answer:
        return web.Response(
            body=await answer.read(), status=answer.status, content_type="application/json"
        )


async def renew(request: web.Request) -> web.Response:
    body = json.loads(await request.read())
    token_hash = tokens.hash_token(body["lease_token"])
    row = await request.app[RENEWALS].submit((token_hash, body.get("ttl_seconds")))
    if row is None:
        return web.json_response({"title": "lease lost"}, status=409)
    return web.json_response(LeaseRecord.from_row(row).to_json())


def create_app(dsn: str, gateway: str, *, pool_size: int = 4) -> web.Application:
    app = web.Application()
    app[GATEWAY] = gateway.rstrip("/")
    statement, lanes = renew_many()

    async def resources(app: web.Application) -> Any:
        import asyncpg  # type: ignore[import-untyped]

        pool = await asyncpg.create_pool(
            dsn, min_size=pool_size, max_size=pool_size, reset=_no_reset
        )

        async def batch(calls: list[tuple[str, float | None]]) -> list[Any]:
            async with pool.acquire() as conn:
                rows = await conn.fetch(statement, [h for h, _ in calls], [ttl for _, ttl in calls])
            answers: list[Any] = [None] * len(calls)
            for row in rows:
                answers[row["n"] - 1] = row
            return answers

        app[RENEWALS] = Coalescer(batch, lanes=lanes, max_batch=MAX_BATCH)
        async with aiohttp.ClientSession() as session:
            app[SESSION] = session
            yield
        await pool.close()

    app.cleanup_ctx.append(resources)
    app.router.add_put("/v1/jobs/{job_id}/lease", acquire)
    app.router.add_post("/v1/leases/renew", renew)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--database-url", required=True, help="postgresql://user@host/db")
    parser.add_argument("--leases-from", required=True, help="the gateway's control URL")
    args = parser.parse_args(argv)
    run(serve_app(create_app(args.database_url, args.leases_from), args.host, args.port))


if __name__ == "__main__":
    main()
