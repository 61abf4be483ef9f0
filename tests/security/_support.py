"""The real thing for the hostile-input tests: ``fencegate serve`` as a process on SQLite,
a recording upstream as another process, and a raw HTTP/1.1 client that sends exactly
the bytes a test writes and reads exactly what comes back.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FENCEGATE = str(Path(sys.executable).parent / "fencegate")
UPSTREAM_SCRIPT = str(Path(__file__).with_name("_upstream.py"))
WORKER_TOKEN = "worker-token-sec-0123456789"
ADMIN_TOKEN = "admin-token-sec-0123456789ab"
PAY_KEY = "sk_security_upstream_secret"

# The limits the server runs with (small, so the oversize cases are cheap).
MAX_LINE = 1024
MAX_FIELD = 1024
MAX_HEADERS = 32
MAX_KEY = 64
MAX_BODY = 4096
MAX_CONCURRENT = 8
UPSTREAM_TIMEOUT = 1.0
KEEPALIVE = 3.0

WELL_FORMED_UNKNOWN_TOKEN = "fgl_" + "A" * 32


LISTENING = re.compile(r"fencegate listening: .*?control=([^\s\",]+).*?proxy=([^\s\",]+)")
"""fencegate's start line: the control and proxy listeners' addresses, ports resolved."""


def environment() -> dict[str, str]:
    """A clean environment: no FENCEGATE_* overrides from the developer's shell. An
    ``AIOHTTP_NO_EXTENSIONS`` is kept, so the C-parser test sees what the server sees."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    env["SEC_PAY_KEY"] = PAY_KEY
    env["PYTHONUNBUFFERED"] = "1"
    return env


# -- raw HTTP ---------------------------------------------------------------------------


@dataclass
class Response:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes = b""

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def problem_reason(self) -> str | None:
        if (self.header("Content-Type") or "").startswith("application/problem+json"):
            return str(self.json().get("reason"))
        return None

    def __repr__(self) -> str:
        return f"<{self.status} {self.reason} {self.body[:300]!r}>"


async def read_response(reader: asyncio.StreamReader, method: str = "GET") -> Response | None:
    """One response (an interim 1xx too), or None when the server closed first."""
    try:
        line = await reader.readuntil(b"\r\n")
    except asyncio.IncompleteReadError:
        return None
    version, _, rest = line.decode("latin-1").rstrip("\r\n").partition(" ")
    assert version.startswith("HTTP/"), line
    code, _, reason = rest.partition(" ")
    headers: list[tuple[str, str]] = []
    while True:
        raw = (await reader.readuntil(b"\r\n")).decode("latin-1").rstrip("\r\n")
        if not raw:
            break
        name, _, value = raw.partition(":")
        headers.append((name.strip(), value.strip()))
    response = Response(int(code), reason, headers)
    if response.status < 200 or response.status in (204, 304) or method == "HEAD":
        return response
    length = response.header("Content-Length")
    if length is not None:
        response.body = await reader.readexactly(int(length))
    elif (response.header("Transfer-Encoding") or "").lower() == "chunked":
        chunks = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                break
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)
        response.body = b"".join(chunks)
    else:
        response.body = await reader.read()
    return response


async def exchange(
    port: int,
    data: bytes,
    *,
    responses: int = 1,
    timeout: float = 10.0,
    linger: float | None = None,
) -> list[Response]:
    """Write ``data`` in one go and read up to ``responses`` final answers (fewer when
    the server closes the connection); interim 1xx answers are returned too. Each
    answer may take ``timeout`` seconds. With ``linger``, the answers after the first
    are waited for only that long, and then what has arrived is returned."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2**20)
    out: list[Response] = []
    try:
        writer.write(data)
        finals = 0
        while finals < responses:
            wait = timeout if linger is None or finals == 0 else linger
            try:
                response = await asyncio.wait_for(read_response(reader), wait)
            except TimeoutError:
                if linger is None or finals == 0:
                    raise
                break
            if response is None:
                break
            out.append(response)
            if response.status >= 200:
                finals += 1
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return out


def build(
    method: str,
    target: str,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    *,
    host: bool = True,
    length: bool = True,
) -> bytes:
    """An HTTP/1.1 request as bytes: a Host unless ``host=False``, a Content-Length for a
    body unless ``length=False``."""
    lines = [f"{method} {target} HTTP/1.1"]
    if host:
        lines.append("Host: gateway.test")
    lines += [f"{k}: {v}" for k, v in headers or []]
    if body and length:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def request(
    port: int,
    method: str,
    target: str,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    **kw: bool,
) -> Response:
    answers = await exchange(port, build(method, target, headers, body, **kw))
    assert answers, f"no answer to {method} {target}: the connection was closed"
    return answers[-1]


def bearer(token: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {token}")]


# -- the processes ----------------------------------------------------------------------


@dataclass
class Stack:
    home: Path
    database_url: str = "sqlite+aiosqlite:///fencegate.db"
    # Each process binds port 0 and says which port it got (the upstream on its stdout,
    # fencegate in its listening line): a port picked free and bound later can be taken
    # by another process in between. Known once ``start`` has returned.
    proxy_port: int = 0
    control_port: int = 0
    upstream_port: int = 0
    gateway: subprocess.Popen[bytes] | None = None
    upstream: subprocess.Popen[bytes] | None = None

    @property
    def record_file(self) -> Path:
        return self.home / "upstream.jsonl"

    @property
    def log_file(self) -> Path:
        return self.home / "serve.log"

    @property
    def upstream_url(self) -> str:
        return f"http://127.0.0.1:{self.upstream_port}"

    def config_text(self) -> str:
        return f"""\
database_url = "{self.database_url}"
proxy_listen = "127.0.0.1:{self.proxy_port}"
control_listen = "127.0.0.1:{self.control_port}"

[auth]
worker_tokens = ["{WORKER_TOKEN}"]
admin_tokens = ["{ADMIN_TOKEN}"]

[gateway]
ordering_wait_seconds = 0.5
max_idempotency_key_length = {MAX_KEY}
max_request_line_bytes = {MAX_LINE}
max_header_field_bytes = {MAX_FIELD}
max_headers = {MAX_HEADERS}
max_concurrent_requests = {MAX_CONCURRENT}
max_concurrent_unfenced_requests = {MAX_CONCURRENT}
keepalive_timeout_seconds = {KEEPALIVE}
shutdown_timeout_seconds = 1

[[upstreams]]
name = "pay"
url = "{self.upstream_url}"
timeout_seconds = {UPSTREAM_TIMEOUT}
max_body_bytes = {MAX_BODY}
set_headers = {{ Authorization = "Bearer ${{SEC_PAY_KEY}}" }}
"""

    def start(self) -> None:
        self.record_file.touch()
        env = environment()
        with (self.home / "upstream.log").open("wb") as upstream_log:
            self.upstream = subprocess.Popen(
                [sys.executable, UPSTREAM_SCRIPT, "0", str(self.record_file)],
                stdout=subprocess.PIPE,
                stderr=upstream_log,
                env=env,
            )
        assert self.upstream.stdout is not None
        ready = self.upstream.stdout.readline().decode()  # "upstream ready PORT"
        assert ready.startswith("upstream ready "), f"the upstream did not start: {ready!r}"
        self.upstream_port = int(ready.split()[-1])
        self.proxy_port = self.control_port = 0
        config = self.home / "fencegate.toml"
        config.write_text(self.config_text())
        with self.log_file.open("wb") as log:
            self.gateway = subprocess.Popen(
                [
                    *(FENCEGATE, "serve", "--config", str(config)),
                    *("--log-format", "json", "--access-log"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.home,
            )
        deadline = time.monotonic() + 30
        while (found := LISTENING.search(self.output())) is None:
            assert self.gateway.poll() is None, f"fencegate exited:\n{self.output()}"
            assert time.monotonic() < deadline, f"fencegate never listened:\n{self.output()}"
            time.sleep(0.05)
        self.control_port, self.proxy_port = (int(found[i].rsplit(":", 1)[1]) for i in (1, 2))
        while not self._healthy():
            assert self.gateway.poll() is None, f"fencegate exited:\n{self.output()}"
            assert self.upstream.poll() is None, "the upstream exited"
            assert time.monotonic() < deadline, f"fencegate never got healthy:\n{self.output()}"
            time.sleep(0.1)

    def stop(self) -> None:
        for proc in (self.gateway, self.upstream):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        if self.upstream is not None and self.upstream.stdout is not None:
            self.upstream.stdout.close()

    def output(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def log_lines(self, start: int = 0) -> list[dict[str, Any]]:
        """The server's JSON log lines from character ``start`` on."""
        out = []
        for line in self.output()[start:].splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def _healthy(self) -> bool:
        url = f"http://127.0.0.1:{self.control_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def assert_alive(self) -> None:
        """Both processes running, /healthz answers, the proxy listener answers."""
        assert self.gateway is not None and self.upstream is not None
        assert self.gateway.poll() is None, f"fencegate died:\n{self.output()[-4000:]}"
        assert self.upstream.poll() is None, "the upstream died"
        assert self._healthy(), f"/healthz does not answer:\n{self.output()[-4000:]}"
        with socket.create_connection(("127.0.0.1", self.proxy_port), timeout=5) as sock:
            sock.sendall(b"GET /no-such-upstream/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert sock.recv(64).startswith(b"HTTP/1.1 404"), "the proxy listener is down"

    # -- what the upstream received ---------------------------------------------------

    def received(self) -> list[dict[str, Any]]:
        lines = self.record_file.read_text(encoding="utf-8").splitlines()
        entries = [json.loads(line) for line in lines if line.strip()]
        for entry in entries:
            entry["body"] = base64.b64decode(entry.pop("body_b64"))
        return entries

    def mark(self) -> int:
        return len(self.received())

    def since(self, mark: int) -> list[dict[str, Any]]:
        return self.received()[mark:]

    # -- leases -------------------------------------------------------------------------

    async def lease(self, job_id: str, owner: str = "worker-a") -> dict[str, Any]:
        body = json.dumps({"owner": owner, "ttl_seconds": 120}).encode()
        resp = await request(
            self.control_port,
            "PUT",
            f"/v1/jobs/{job_id}/lease",
            [*bearer(WORKER_TOKEN), ("Content-Type", "application/json")],
            body,
        )
        assert resp.status == 201, resp
        lease: dict[str, Any] = resp.json()
        return lease


def headers_of(entry: dict[str, Any]) -> dict[str, str]:
    """A recorded request's headers, lower-cased names (the last one wins)."""
    return {k.lower(): v for k, v in entry["headers"]}
