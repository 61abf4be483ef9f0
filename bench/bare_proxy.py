"""The floor for any aiohttp gateway: a bare pass-through proxy with no checks at all.

One aiohttp server and one ``ClientSession`` (configured as the gateway's is): read the
request body, forward method, path, headers (minus hop-by-hop ones) and body to the
upstream, stream the answer back (an answer in one piece goes back in one write, as
the gateway sends it). Whatever Fencegate adds on top of this is the cost of
fencing.

Run alone: ``python -m bench.bare_proxy --upstream http://127.0.0.1:9000 --port 8090``.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Sequence

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

if __package__ in (None, ""):  # run as a file: python bench/bare_proxy.py
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import run, serve_app

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-connection",
    }
)
DROP_FROM_CLIENT = HOP_BY_HOP | {"host", "content-length", "expect"}
DROP_FROM_UPSTREAM = HOP_BY_HOP | {"content-length"}

SESSION = web.AppKey("session", aiohttp.ClientSession)


def create_app(upstream: str, timeout_seconds: float = 10.0) -> web.Application:
    upstream = upstream.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=timeout_seconds, sock_connect=5.0)
    app = web.Application()

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession(
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=256),
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )
        yield
        await app[SESSION].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers: CIMultiDict[str] = CIMultiDict(
            (k, v) for k, v in request.headers.items() if k.lower() not in DROP_FROM_CLIENT
        )
        try:
            upstream_response = await request.app[SESSION].request(
                request.method,
                upstream + request.raw_path,
                headers=headers,
                data=body or None,
                allow_redirects=False,
                timeout=timeout,
            )
        except (TimeoutError, aiohttp.ClientError):
            return web.Response(status=502, text="upstream unavailable")
        async with upstream_response:
            answer_headers: CIMultiDict[str] = CIMultiDict(
                (k, v)
                for k, v in upstream_response.headers.items()
                if k.lower() not in DROP_FROM_UPSTREAM
            )
            first = await upstream_response.content.readany()
            if upstream_response.content.at_eof() and first:
                # In one piece: head and body in one write, as the gateway answers.
                return web.Response(
                    status=upstream_response.status,
                    reason=upstream_response.reason,
                    body=first,
                    headers=answer_headers,
                )
            out = web.StreamResponse(
                status=upstream_response.status,
                reason=upstream_response.reason,
                headers=answer_headers,
            )
            await out.prepare(request)
            await out.write(first)
            async for chunk in upstream_response.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--upstream", required=True, help="base URL of the upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    run(serve_app(create_app(args.upstream), args.host, args.port))


if __name__ == "__main__":
    main()
