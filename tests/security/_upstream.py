"""A recording upstream for the security tests, run as its own process:

    python _upstream.py PORT RECORD_FILE   (PORT 0: any free one, printed)

Every request it receives is appended to RECORD_FILE as one JSON line (method, raw
target, headers in order, the raw body in base64) before it answers. It never inflates a
body (``auto_decompress=False``), so what is recorded is what the gateway sent.

Answers by path: ``/redirect`` a 302 to ``/redirect-target`` on this same server,
``/gzip`` a gzip-encoded JSON body, ``/slow`` after 10 s, anything else 201 JSON.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import sys

from aiohttp import web

GZIP_ANSWER = gzip.compress(b'{"zipped": true, "pad": "' + b"z" * 200 + b'"}', mtime=0)


async def main(port: int, record_file: str) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        entry = {
            "method": request.method,
            "target": request.raw_path,
            "version": f"{request.version.major}.{request.version.minor}",
            "headers": [[k, v] for k, v in request.headers.items()],
            "body_b64": base64.b64encode(body).decode(),
        }
        with open(record_file, "a", encoding="utf-8") as out:
            out.write(json.dumps(entry) + "\n")
        path = request.path
        if path == "/redirect":
            location = f"http://127.0.0.1:{port}/redirect-target"
            return web.Response(status=302, headers={"Location": location})
        if path == "/gzip":
            return web.Response(
                status=200,
                body=GZIP_ANSWER,
                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
            )
        if path == "/slow":
            await asyncio.sleep(10)
        return web.json_response({"ok": True, "path": path}, status=201)

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None, auto_decompress=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    if port == 0:  # the port the system chose, for the redirect and the caller
        port = runner.addresses[0][1]
    print(f"upstream ready {port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
