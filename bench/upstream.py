"""The benchmark's upstream: a tiny aiohttp server that reads the request and answers
201 with a small JSON body, as a payment API's "create charge" would.

Run alone: ``python -m bench.upstream --port 9000``.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web

if __package__ in (None, ""):  # run as a file: python bench/upstream.py
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import serve_main

BODY = b'{"id":"ch_bench","object":"charge","status":"succeeded","amount":1250}'


async def answer(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(status=201, body=BODY, content_type="application/json")


def create_app() -> web.Application:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    serve_main(__doc__, create_app, argv)


if __name__ == "__main__":
    main()
