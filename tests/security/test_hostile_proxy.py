"""Hostile input at the proxy listener, sent as raw bytes to a real ``fencegate serve``.

Every case checks what the client gets (a 4xx from the gateway or from aiohttp's
parser), that nothing new reached the recording upstream, and (the ``stays_up`` fixture)
that the process is still up and serving both listeners.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import importlib
import os
import resource
import subprocess
import sys
import time
from typing import Any

import aiohttp
import aiohttp.http_parser
import aiohttp.web_protocol
import pytest

from ._support import (
    ADMIN_TOKEN,
    KEEPALIVE,
    MAX_BODY,
    MAX_CONCURRENT,
    MAX_FIELD,
    MAX_HEADERS,
    MAX_KEY,
    MAX_LINE,
    PAY_KEY,
    UPSTREAM_TIMEOUT,
    WELL_FORMED_UNKNOWN_TOKEN,
    Response,
    Stack,
    bearer,
    build,
    environment,
    exchange,
    headers_of,
    read_response,
    request,
)
from ._upstream import GZIP_ANSWER

HOST = b"Host: gateway.test\r\n"
SMUGGLED = b"GET /pay/smuggled HTTP/1.1\r\nHost: gateway.test\r\n\r\n"


def assert_problem(resp: Response, status: int, reason: str) -> dict[str, Any]:
    assert resp.status == status, resp
    assert resp.header("Content-Type") == "application/problem+json", resp
    doc: dict[str, Any] = resp.json()
    assert doc["reason"] == reason and doc["status"] == status, doc
    return doc


def assert_parser_refused(answers: list[Response]) -> None:
    """aiohttp's parser answered 400 (431 would do too) and closed the connection: the
    bytes after the bad message were never read as another request."""
    assert answers, "the connection was closed without an answer"
    assert answers[0].status in (400, 431), answers
    assert len(answers) == 1, answers


def fenced(token: str, key: str = "k1") -> list[tuple[str, str]]:
    return [("Fencing-Token", token), ("Idempotency-Key", key)]


# -- the parser --------------------------------------------------------------------------


def test_aiohttp_c_parser_is_in_use() -> None:
    """The llhttp-based C parser (strict framing) parses requests, not the pure-Python
    fallback: in this process and in one started the way the server is started."""
    c_parser = importlib.import_module("aiohttp._http_parser").HttpRequestParser
    assert "AIOHTTP_NO_EXTENSIONS" not in os.environ
    assert vars(aiohttp.http_parser)["HttpRequestParser"] is c_parser
    # What the server's RequestHandler instantiates:
    assert vars(aiohttp.web_protocol)["HttpRequestParser"] is c_parser
    assert vars(aiohttp.http_parser)["HttpRequestParserPy"] is not c_parser
    probe = (
        "import aiohttp._http_parser as c, aiohttp.web_protocol as p;"
        "print(p.HttpRequestParser is c.HttpRequestParser)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "True", out


# -- request smuggling ------------------------------------------------------------------

SMUGGLING = {
    "cl-and-te": b"POST /pay/a HTTP/1.1\r\n" + HOST + b"Content-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "te-and-cl": b"GET /pay/a HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n"
    b"Content-Length: 48\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "duplicate-cl": b"POST /pay/a HTTP/1.1\r\n" + HOST + b"Content-Length: 0\r\n"
    b"Content-Length: 48\r\n\r\n" + SMUGGLED,
    "cl-list": b"POST /pay/a HTTP/1.1\r\n" + HOST + b"Content-Length: 0, 0\r\n\r\n" + SMUGGLED,
    "cl-plus-sign": b"POST /pay/a HTTP/1.1\r\n" + HOST + b"Content-Length: +0\r\n\r\n" + SMUGGLED,
    "cl-negative": b"POST /pay/a HTTP/1.1\r\n" + HOST + b"Content-Length: -1\r\n\r\n" + SMUGGLED,
    "te-space-before-colon": b"GET /pay/a HTTP/1.1\r\n"
    + HOST
    + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n"
    + SMUGGLED,
    "te-unknown-coding": b"GET /pay/a HTTP/1.1\r\n"
    + HOST
    + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n"
    + SMUGGLED,
    "te-chunked-not-last": b"GET /pay/a HTTP/1.1\r\n"
    + HOST
    + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n"
    + SMUGGLED,
    "te-twice": b"GET /pay/a HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "te-obs-fold": b"GET /pay/a HTTP/1.1\r\n"
    + HOST
    + b"Transfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n"
    + SMUGGLED,
    "chunk-size-overflow": b"POST /pay/a HTTP/1.1\r\n"
    + HOST
    + b"Transfer-Encoding: chunked\r\n\r\nfffffffffffffffffff\r\n"
    + SMUGGLED,
    "chunk-size-0x": b"POST /pay/a HTTP/1.1\r\n"
    + HOST
    + b"Transfer-Encoding: chunked\r\n\r\n0x2\r\n{}\r\n0\r\n\r\n"
    + SMUGGLED,
    "chunk-bare-lf": b"POST /pay/a HTTP/1.1\r\n"
    + HOST
    + b"Transfer-Encoding: chunked\r\n\r\n2\n{}\n0\n\n"
    + SMUGGLED,
}


@pytest.mark.parametrize("data", SMUGGLING.values(), ids=SMUGGLING.keys())
async def test_smuggling_refused(stack: Stack, data: bytes) -> None:
    mark = stack.mark()
    answers = await exchange(stack.proxy_port, data, responses=2, timeout=5)
    assert_parser_refused(answers)
    assert stack.since(mark) == []


async def test_http10_transfer_encoding_does_not_desync(stack: Stack) -> None:
    smuggled = b"GET /pay/smuggled HTTP/1.1\r\n" + HOST + b"Connection: close\r\n\r\n"
    data = (
        b"GET /pay/a HTTP/1.0\r\n" + HOST + b"Connection: keep-alive\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled
    )
    mark = stack.mark()
    answers = await exchange(stack.proxy_port, data, responses=2, linger=2)
    assert "/smuggled" not in [e["target"] for e in stack.since(mark)]
    assert answers and answers[0].status == 400, answers


async def test_unsupported_transfer_coding_refused(stack: Stack) -> None:
    packed = gzip.compress(b"{}", mtime=0)
    body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(packed), packed)
    head = b"GET /pay/coded HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: gzip, chunked\r\n\r\n"
    mark = stack.mark()
    answers = await exchange(stack.proxy_port, head + body)
    assert stack.since(mark) == []
    assert answers and answers[0].status in (400, 501), answers


# -- targets: not an open proxy -----------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "http://127.0.0.1:{up}/x",
        "http://127.0.0.1:{up}/pay/x",
        "http://gateway.test/pay/x",
        "https://evil.test/pay/x",
        "//127.0.0.1:{up}/x",
    ],
)
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_absolute_form_refused(stack: Stack, method: str, target: str) -> None:
    mark = stack.mark()
    resp = await request(
        stack.proxy_port,
        method,
        target.format(up=stack.upstream_port),
        fenced(WELL_FORMED_UNKNOWN_TOKEN),
        b"{}",
    )
    assert 400 <= resp.status < 500, resp
    if target.startswith("http"):
        doc = assert_problem(resp, 400, "invalid-request")
        assert "Absolute-form" in doc["detail"]
    assert stack.since(mark) == []


CONNECTS = {
    "authority-upstream": "CONNECT 127.0.0.1:{up} HTTP/1.1\r\nHost: 127.0.0.1:{up}\r\n\r\n",
    "authority-name": "CONNECT pay:80 HTTP/1.1\r\nHost: pay:80\r\n\r\n",
    "origin-form": "CONNECT /pay/x HTTP/1.1\r\nHost: gateway.test\r\n\r\n",
    "asterisk-form": "OPTIONS * HTTP/1.1\r\nHost: gateway.test\r\n\r\n",
}


@pytest.mark.parametrize("head", CONNECTS.values(), ids=CONNECTS.keys())
async def test_connect_and_asterisk_refused(stack: Stack, head: str) -> None:
    """No tunnel: a 4xx, and what follows on the connection is not relayed anywhere."""
    up = stack.upstream_port
    tunnelled = f"GET /redirect-target HTTP/1.1\r\nHost: 127.0.0.1:{up}\r\n\r\n"
    mark = stack.mark()
    answers = await exchange(
        stack.proxy_port,
        (head + tunnelled).format(up=up).encode(),
        responses=2,
        linger=0.5,
    )
    assert answers and 400 <= answers[0].status < 500, answers
    assert all(a.status >= 400 for a in answers), answers
    assert stack.since(mark) == []


@pytest.mark.parametrize("head", CONNECTS.values(), ids=CONNECTS.keys())
async def test_connect_answered_by_the_gateway(stack: Stack, head: str) -> None:
    answers = await exchange(stack.proxy_port, head.format(up=stack.upstream_port).encode())
    assert_problem(answers[0], 400, "invalid-request")


DOT_SEGMENTS = [
    "/pay/../x",
    "/pay/a/../../x",
    "/pay/./x",
    "/pay/..",
    "/pay/a/..",
    "/pay/%2e%2e/x",
    "/pay/%2E%2e/x",
    "/pay/.%2e/x",
    "/pay/a/%2e/b",
    "/pay/%2e%2e%2fx",
    "/pay/a%2f..%2fb",
    "/pay/x%2F..",
    "/pay/..%5cx",
    "/pay/%5c..%5cx",
    # A generated client's encoding of the whole {path} parameter: an encoded slash is a
    # slash to the gateway, and so are the dot-segments it would reveal.
    "/pay/v1%2F..%2F..%2Fadmin",
    "/pay/v1%2F%2e%2e%2Fadmin",
    "/pay/..%2F",
    "/pay/%2F..",
]


@pytest.mark.parametrize("target", DOT_SEGMENTS)
async def test_dot_segments_refused(stack: Stack, target: str) -> None:
    mark = stack.mark()
    for method in ("GET", "POST"):
        resp = await request(
            stack.proxy_port, method, target, fenced(WELL_FORMED_UNKNOWN_TOKEN), b"{}"
        )
        assert_problem(resp, 400, "invalid-request")
    assert stack.since(mark) == []


async def test_an_encoded_slash_reaches_the_upstream_as_a_slash(stack: Stack) -> None:
    """What a generated client sends for the nested path v1/charges (the parameter
    percent-encoded whole) reaches the upstream's /v1/charges; a double-encoded slash is
    data and stays encoded once more, as it came."""
    lease = await stack.lease("job-nested-path")
    mark = stack.mark()
    resp = await request(
        stack.proxy_port, "POST", "/pay/v1%2Fcharges%2fch_1?x=%2F", fenced(lease["lease_token"]),
        b"{}",
    )  # fmt: skip
    assert resp.status == 201, resp
    resp = await request(stack.proxy_port, "GET", "/pay/files/a%252Fb")
    assert resp.status == 201, resp
    targets = [entry["target"] for entry in stack.since(mark)]
    assert targets == ["/v1/charges/ch_1?x=%2F", "/files/a%252Fb"]


async def test_sql_in_upstream_name_is_just_an_unknown_name(stack: Stack) -> None:
    mark = stack.mark()
    resp = await request(stack.proxy_port, "POST", "/pay'%20OR%201=1--/x", body=b"{}")
    assert_problem(resp, 404, "unknown-upstream")
    assert stack.since(mark) == []


# -- sizes: the configured limits apply --------------------------------------------------


@pytest.mark.parametrize(("size", "passes"), [(1000, True), (2000, False)])
async def test_header_field_limit(stack: Stack, size: int, passes: bool) -> None:
    assert MAX_FIELD == 1024
    mark = stack.mark()
    answers = await exchange(
        stack.proxy_port, build("POST", "/pay/x", [("X-Pad", "a" * size)], b"{}")
    )
    if passes:  # through the parser, then the gateway's own first refusal
        assert_problem(answers[0], 428, "missing-fencing-token")
    else:
        assert_parser_refused(answers)
    assert stack.since(mark) == []


@pytest.mark.parametrize(("size", "passes"), [(1000, True), (2000, False)])
async def test_request_line_limit(stack: Stack, size: int, passes: bool) -> None:
    assert MAX_LINE == 1024
    target = "/pay/" + "a" * (size - len("POST /pay/ HTTP/1.1"))
    mark = stack.mark()
    answers = await exchange(stack.proxy_port, build("POST", target, body=b"{}"))
    if passes:
        assert_problem(answers[0], 428, "missing-fencing-token")
    else:
        assert_parser_refused(answers)
    assert stack.since(mark) == []


@pytest.mark.parametrize(("count", "passes"), [(MAX_HEADERS - 4, True), (MAX_HEADERS + 8, False)])
async def test_header_count_limit(stack: Stack, count: int, passes: bool) -> None:
    mark = stack.mark()
    extra = [(f"X-H{i}", "v") for i in range(count)]
    answers = await exchange(stack.proxy_port, build("POST", "/pay/x", extra, b"{}"))
    if passes:
        assert_problem(answers[0], 428, "missing-fencing-token")
    else:
        assert_parser_refused(answers)
    assert stack.since(mark) == []


async def test_body_limit(stack: Stack) -> None:
    lease = await stack.lease("job-body")
    token = lease["lease_token"]
    mark = stack.mark()
    # Declared over the limit.
    resp = await request(stack.proxy_port, "POST", "/pay/b", fenced(token, "b1"), b"x" * 4097)
    doc = assert_problem(resp, 413, "body-too-large")
    assert doc["max_body_bytes"] == MAX_BODY
    # Chunked, so only the bytes read tell.
    chunk = b"3e8\r\n" + b"x" * 1000 + b"\r\n"
    head = build("POST", "/pay/b", [*fenced(token, "b2"), ("Transfer-Encoding", "chunked")])
    [resp] = await exchange(stack.proxy_port, head + chunk * 5 + b"0\r\n\r\n")
    assert_problem(resp, 413, "body-too-large")
    # Not fenced: the same limit.
    resp = await request(stack.proxy_port, "GET", "/pay/b", body=b"x" * 5000)
    assert_problem(resp, 413, "body-too-large")
    assert stack.since(mark) == []
    # Exactly the limit goes through, intact.
    resp = await request(stack.proxy_port, "POST", "/pay/b", fenced(token, "b3"), b"y" * 4096)
    assert resp.status == 201, resp
    [sent] = stack.since(mark)
    assert sent["body"] == b"y" * 4096


# -- tokens and keys ----------------------------------------------------------------------

KEYS = {
    "10000-chars": ("k" * 10_000, None),
    "one-over-configured": ("k" * (MAX_KEY + 1), "missing-idempotency-key"),
    "control-char": ("a\x01b", None),
    "nul": ("a\x00b", None),
    "del": ("a\x7fb", None),
    "quoted-control-char": ('"a\\\x01"', None),
    "tab-inside": ("a\tb", "missing-idempotency-key"),
    "space-inside": ("a b", "missing-idempotency-key"),
    "non-ascii": ("a\xffb", "missing-idempotency-key"),
    "empty-quoted": ('""', "missing-idempotency-key"),
    "sql": ("x';DROP TABLE idempotency_records;--", "missing-idempotency-key"),
}


@pytest.mark.parametrize(("key", "reason"), KEYS.values(), ids=KEYS.keys())
async def test_hostile_idempotency_keys(stack: Stack, key: str, reason: str | None) -> None:
    """Refused by the parser (reason None) or by the gateway before any database work."""
    mark = stack.mark()
    answers = await exchange(
        stack.proxy_port,
        build("POST", "/pay/x", fenced(WELL_FORMED_UNKNOWN_TOKEN, key), b"{}"),
    )
    if reason is None:
        assert_parser_refused(answers)
    else:
        assert_problem(answers[0], 400, reason)
    assert stack.since(mark) == []


async def test_key_length_limit_is_the_configured_one(stack: Stack) -> None:
    mark = stack.mark()
    two = [("Idempotency-Key", "a"), ("Idempotency-Key", "b")]
    resp = await request(
        stack.proxy_port, "POST", "/pay/x", [("Fencing-Token", WELL_FORMED_UNKNOWN_TOKEN), *two]
    )
    assert_problem(resp, 400, "missing-idempotency-key")
    # MAX_KEY characters pass the key check; the unknown token is what is refused then.
    resp = await request(
        stack.proxy_port, "POST", "/pay/x", fenced(WELL_FORMED_UNKNOWN_TOKEN, "k" * MAX_KEY)
    )
    assert_problem(resp, 403, "invalid-fencing-token")
    assert stack.since(mark) == []


@pytest.mark.parametrize(
    "token",
    [
        "fgl_' OR 1=1 --",
        "' OR '1'='1",
        "fgl_AAAA'; DROP TABLE jobs;--",
        "fgl_" + "-" * 32,  # well-formed: looked up by its hash, found nowhere
        "fgl_" + "A" * 32 + "' OR 1=1 --",
        WELL_FORMED_UNKNOWN_TOKEN + ", " + WELL_FORMED_UNKNOWN_TOKEN,
    ],
)
async def test_sql_in_tokens(stack: Stack, token: str) -> None:
    mark = stack.mark()
    resp = await request(stack.proxy_port, "POST", "/pay/x", fenced(token), b"{}")
    assert_problem(resp, 403, "invalid-fencing-token")
    assert stack.since(mark) == []
    await stack.lease("job-after-sql")  # the tables are all still there


async def test_repeated_fencing_token_headers(stack: Stack) -> None:
    lease = await stack.lease("job-repeat")
    token = lease["lease_token"]
    mark = stack.mark()
    for second in (token, WELL_FORMED_UNKNOWN_TOKEN):
        headers = [("Fencing-Token", token), ("Fencing-Token", second), ("Idempotency-Key", "r")]
        resp = await request(stack.proxy_port, "POST", "/pay/x", headers, b"{}")
        doc = assert_problem(resp, 400, "invalid-request")
        assert "exactly one Fencing-Token" in doc["detail"]
    resp = await request(stack.proxy_port, "POST", "/pay/x", fenced(f"{token},{token}", "r"), b"{}")
    assert_problem(resp, 403, "invalid-fencing-token")
    assert stack.since(mark) == []


@pytest.mark.parametrize("named", ["Fencing-Token", "close, Idempotency-Key", "FENCING-TOKEN"])
async def test_connection_header_naming_protected_headers(stack: Stack, named: str) -> None:
    lease = await stack.lease("job-connection")
    mark = stack.mark()
    headers = [*fenced(lease["lease_token"], "c1"), ("Connection", named)]
    resp = await request(stack.proxy_port, "POST", "/pay/x", headers, b"{}")
    doc = assert_problem(resp, 400, "invalid-request")
    assert "Connection" in doc["detail"]
    assert stack.since(mark) == []


# -- malformed messages -------------------------------------------------------------------

MALFORMED = {
    "missing-host": b"POST /pay/x HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
    "duplicate-host": b"POST /pay/x HTTP/1.1\r\nHost: a\r\nHost: b\r\nContent-Length: 2\r\n\r\n{}",
    "duplicate-host-same": b"GET /pay/x HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n",
    "missing-host-get": b"GET /pay/x HTTP/1.1\r\n\r\n",
    "bare-lf-everywhere": b"POST /pay/x HTTP/1.1\nHost: a\nContent-Length: 2\n\n{}",
    "bare-lf-request-line": b"GET /pay/x HTTP/1.1\nHost: a\r\n\r\n",
    "bare-lf-one-header": b"GET /pay/x HTTP/1.1\r\nHost: a\nX-A: b\r\n\r\n",
    "bare-lf-end-of-head": b"GET /pay/x HTTP/1.1\r\nHost: a\r\n\n",
    "bare-cr-in-value": b"GET /pay/x HTTP/1.1\r\nHost: a\r\nX-A: a\rX-B: b\r\n\r\n",
    "obs-fold": b"GET /pay/x HTTP/1.1\r\nHost: a\r\nX-A: a\r\n b\r\n\r\n",
    "nul-in-value": b"GET /pay/x HTTP/1.1\r\nHost: a\r\nX-A: a\x00b\r\n\r\n",
    "bad-header-name": b"GET /pay/x HTTP/1.1\r\nHost: a\r\nX(A): b\r\n\r\n",
    "nul-in-target": b"GET /pay/x\x00y HTTP/1.1\r\nHost: a\r\n\r\n",
    "raw-non-ascii-target": b"GET /pay/\xc3\xa4 HTTP/1.1\r\nHost: a\r\n\r\n",
    "space-in-target": b"GET /pay/x y HTTP/1.1\r\nHost: a\r\n\r\n",
    "h2-prior-knowledge": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
async def test_malformed_messages_refused(stack: Stack, data: bytes) -> None:
    mark = stack.mark()
    answers = await exchange(stack.proxy_port, data + SMUGGLED, responses=2, timeout=5)
    assert_parser_refused(answers)
    assert stack.since(mark) == []


async def test_upgrade_h2c_does_not_switch_protocols(stack: Stack) -> None:
    h2c = [
        ("Connection", "Upgrade, HTTP2-Settings"),
        ("Upgrade", "h2c"),
        ("HTTP2-Settings", "AAMAAABkAARAAAAAAAIAAAAA"),
    ]
    mark = stack.mark()
    # A fenced write without a token: refused as ever, nothing upgraded.
    resp = await request(stack.proxy_port, "POST", "/pay/x", h2c, b"{}")
    assert_problem(resp, 428, "missing-fencing-token")
    assert stack.since(mark) == []
    # A read: an ordinary HTTP/1.1 answer, not 101; the upstream sees no upgrade request,
    # and what follows on that connection (an h2 frame, a request) is never relayed.
    frame = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    data = build("GET", "/pay/h2c", h2c) + frame + build("GET", "/pay/after-h2c")
    answers = await exchange(stack.proxy_port, data, responses=2, linger=0.5)
    assert answers and answers[0].status == 201, answers
    assert all(a.status != 101 for a in answers), answers
    [sent] = stack.since(mark)
    assert sent["target"] == "/h2c" and sent["body"] == b""
    for name in ("upgrade", "http2-settings", "connection"):
        assert name not in headers_of(sent)


EXPECTS = ["stale", "unknown", "missing", "too-large"]


@pytest.mark.parametrize("case", EXPECTS)
async def test_expect_continue_refused_before_the_body(stack: Stack, case: str) -> None:
    """The refusal comes without a 100 Continue and without the body; a body sent
    anyway afterwards is consumed as that body, never read as another request."""
    body = SMUGGLED
    length = len(body)
    if case == "stale":
        first = await stack.lease("job-expect")
        await stack.lease("job-expect")  # the same owner again: the first token is stale
        headers, status, reason = fenced(first["lease_token"]), 409, "stale-generation"
    elif case == "unknown":
        headers, status, reason = fenced(WELL_FORMED_UNKNOWN_TOKEN), 403, "invalid-fencing-token"
    elif case == "missing":
        headers, status, reason = [("Idempotency-Key", "k")], 428, "missing-fencing-token"
    else:
        lease = await stack.lease("job-expect-large")
        headers, status, reason = fenced(lease["lease_token"]), 413, "body-too-large"
        length = MAX_BODY + 1
        body = SMUGGLED + b" " * (length - len(SMUGGLED))
    head = build(
        "POST",
        "/pay/x",
        [*headers, ("Content-Length", str(length)), ("Expect", "100-continue")],
    )
    mark = stack.mark()
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.proxy_port)
    try:
        writer.write(head)
        answer = await asyncio.wait_for(read_response(reader), 5)
        assert answer is not None
        assert_problem(answer, status, reason)  # the first answer: no 100 Continue
        writer.write(body)
        with contextlib.suppress(TimeoutError, ConnectionError):
            late = await asyncio.wait_for(read_response(reader), 0.5)
            assert late is None, late
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    assert stack.since(mark) == []


# -- bodies are bytes: never inflated -----------------------------------------------------


async def test_gzip_request_body_forwarded_verbatim(stack: Stack) -> None:
    lease = await stack.lease("job-gzip-in")
    body = gzip.compress(b'{"amount": 5, "note": "' + b"n" * 300 + b'"}', mtime=0)
    mark = stack.mark()
    headers = [
        *fenced(lease["lease_token"], "gz-in"),
        ("Content-Encoding", "gzip"),
        ("Content-Type", "application/json"),
    ]
    resp = await request(stack.proxy_port, "POST", "/pay/zipped", headers, body)
    assert resp.status == 201, resp
    [sent] = stack.since(mark)
    assert headers_of(sent)["content-encoding"] == "gzip"
    assert sent["body"] == body


async def test_gzip_answer_relayed_unchanged(stack: Stack) -> None:
    lease = await stack.lease("job-gzip-out")
    accept = [("Accept-Encoding", "gzip")]
    for method, headers in (("GET", accept), ("POST", [*accept, *fenced(lease["lease_token"])])):
        resp = await request(stack.proxy_port, method, "/pay/gzip", headers, b"{}")
        assert resp.status == 200, resp
        assert resp.header("Content-Encoding") == "gzip"
        assert resp.body == GZIP_ANSWER


# -- volume ---------------------------------------------------------------------------------


async def test_a_thousand_pipelined_requests_in_one_write(stack: Stack) -> None:
    one = build("POST", "/pay/pipelined", [("Content-Type", "application/json")], b"{}")
    mark = stack.mark()
    answers = await exchange(stack.proxy_port, one * 1000, responses=1000, timeout=30)
    assert len(answers) == 1000
    for answer in answers:
        assert_problem(answer, 428, "missing-fencing-token")
    assert stack.since(mark) == []


async def test_slow_clients_do_not_starve_others(stack: Stack) -> None:
    """500 connections stall inside their request head; others are served at once, and
    the server closes the stalled ones after keepalive_timeout_seconds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 2048:
        wanted = 2048 if hard == resource.RLIM_INFINITY else min(2048, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    mark = stack.mark()
    try:
        for _ in range(500):
            reader, writer = await asyncio.open_connection("127.0.0.1", stack.proxy_port)
            writer.write(b"POST /pay/stalled HTTP/1.1\r\nHost: gateway.test\r\nFencing-To")
            conns.append((reader, writer))
        await asyncio.gather(*(w.drain() for _, w in conns))
        started = time.monotonic()
        resp = await request(stack.proxy_port, "POST", "/pay/x", body=b"{}")
        assert_problem(resp, 428, "missing-fencing-token")
        resp = await request(stack.proxy_port, "GET", "/pay/served")
        assert resp.status == 201, resp
        assert time.monotonic() - started < 3
        assert [e["target"] for e in stack.since(mark)] == ["/served"]

        async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
            return await reader.read()

        leftovers = await asyncio.wait_for(
            asyncio.gather(*(closed_by_server(r) for r, _ in conns)), KEEPALIVE + 10
        )
        assert all(b"201" not in data for data in leftovers)
    finally:
        for _, writer in conns:
            writer.close()
        await asyncio.gather(*(w.wait_closed() for _, w in conns), return_exceptions=True)
    assert [e["target"] for e in stack.since(mark)] == ["/served"]


async def test_concurrency_limit_and_upstream_timeout(stack: Stack) -> None:
    """max_concurrent_unfenced_requests in flight: the next one gets 503 at once without
    reaching the upstream; the ones in flight get 504 after the upstream's timeout_seconds."""
    mark = stack.mark()
    started = time.monotonic()
    slow = [
        asyncio.create_task(request(stack.proxy_port, "GET", "/pay/slow"))
        for _ in range(MAX_CONCURRENT)
    ]
    try:
        while len(stack.since(mark)) < MAX_CONCURRENT:
            assert time.monotonic() - started < 5, "the slow requests never arrived"
            await asyncio.sleep(0.02)
        resp = await request(stack.proxy_port, "GET", "/pay/one-too-many")
        assert_problem(resp, 503, "gateway-overloaded")
        assert resp.header("Retry-After") == "1"
    finally:
        answers = await asyncio.gather(*slow)
    elapsed = time.monotonic() - started
    for answer in answers:
        assert_problem(answer, 504, "upstream-timeout")
    assert UPSTREAM_TIMEOUT * 0.9 <= elapsed < UPSTREAM_TIMEOUT + 4  # the upstream takes 10 s
    assert [e["target"] for e in stack.since(mark)] == ["/slow"] * MAX_CONCURRENT


# -- what the upstream is sent and what comes back -----------------------------------------


async def test_redirect_to_localhost_not_followed(stack: Stack) -> None:
    lease = await stack.lease("job-redirect")
    location = f"http://127.0.0.1:{stack.upstream_port}/redirect-target"
    mark = stack.mark()
    for method, headers in (("GET", []), ("POST", fenced(lease["lease_token"], "rd"))):
        resp = await request(stack.proxy_port, method, "/pay/redirect", headers, b"{}")
        assert resp.status == 302, resp
        assert resp.header("Location") == location
    assert [e["target"] for e in stack.since(mark)] == ["/redirect", "/redirect"]


async def test_gateway_headers_cannot_be_spoofed(stack: Stack) -> None:
    lease = await stack.lease("job-spoof")
    spoofed = [
        ("Fencing-Job", "someone-else"),
        ("Fencing-Generation", "999"),
        ("Authorization", "Bearer stolen"),
        ("X-Forwarded-Proto", "https"),
        ("X-Forwarded-Host", "evil.test"),
    ]
    mark = stack.mark()
    resp = await request(
        stack.proxy_port, "POST", "/pay/x", [*fenced(lease["lease_token"], "sp"), *spoofed], b"{}"
    )
    assert resp.status == 201, resp
    resp = await request(
        stack.proxy_port, "GET", "/pay/x", [("Fencing-Token", lease["lease_token"]), *spoofed]
    )
    assert resp.status == 201, resp
    post, get = stack.since(mark)
    for sent, job, generation in ((post, "job-spoof", "1"), (get, None, None)):
        headers = headers_of(sent)
        assert "fencing-token" not in headers
        assert headers.get("fencing-job") == job
        assert headers.get("fencing-generation") == generation
        assert headers["authorization"] == f"Bearer {PAY_KEY}"
        assert headers["x-forwarded-proto"] == "http"
        assert "x-forwarded-host" not in headers
        assert [v for k, v in sent["headers"] if k.lower() == "authorization"] == [
            f"Bearer {PAY_KEY}"
        ]


async def test_lease_tokens_never_leak(stack: Stack) -> None:
    """Not to the upstream, the log or the audit: forwarded, passed through, refused."""
    first = await stack.lease("job-leak")
    token = first["lease_token"]
    for method, key in (("POST", "l1"), ("GET", "l2")):
        resp = await request(stack.proxy_port, method, "/pay/leak", fenced(token, key), b"{}")
        assert resp.status == 201, resp
    await stack.lease("job-leak")  # now the first token is stale
    resp = await request(stack.proxy_port, "POST", "/pay/leak", fenced(token, "l3"), b"{}")
    assert_problem(resp, 409, "stale-generation")
    audit = await request(stack.control_port, "GET", "/admin/rejections", bearer(ADMIN_TOKEN))
    assert audit.status == 200 and b"stale-generation" in audit.body
    assert token.encode() not in audit.body
    assert token not in stack.output()
    assert token not in stack.record_file.read_text()


async def test_token_in_a_malformed_request_not_logged(stack: Stack) -> None:
    lease = await stack.lease("job-leak-malformed")
    token = lease["lease_token"]
    data = f"POST /pay/x HTTP/1.1\nHost: a\nFencing-Token: {token}\nIdempotency-Key: k\n\n"
    mark = stack.mark()
    answers = await exchange(stack.proxy_port, data.encode())
    assert_parser_refused(answers)
    assert stack.since(mark) == []
    await asyncio.sleep(0.2)  # let the log line land
    assert token not in stack.output()


MALFORMED = {
    "bad-header-value": b"POST /pay/a HTTP/1.1\r\n"
    + HOST
    + b"Authorization: Bearer sk_live_TOPSECRET\x01\r\n\r\n",
    "bad-header-line": b"POST /pay/a HTTP/1.1\r\n"
    + HOST
    + b"Fencing-Token: fgl_TOPSECRET\r\nno colon TOPSECRET here\r\n\r\n",
    "bad-request-line": b"GET /pay/a?api_key=TOPSECRET HTTP/1.1 extra\r\n" + HOST + b"\r\n",
}


@pytest.mark.parametrize("listener", ["proxy", "control"])
@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
async def test_a_malformed_request_gets_a_problem_document_that_echoes_nothing(
    stack: Stack, data: bytes, listener: str
) -> None:
    """aiohttp's own answer to bytes its parser refuses repeats the offending line, and
    a credential with it, as text; its log line carries a traceback. The gateway answers
    with its own problem document, repeats none of the request's bytes, and logs one
    warning line."""
    start = len(stack.output())
    port = stack.proxy_port if listener == "proxy" else stack.control_port
    answers = await exchange(port, data + SMUGGLED, responses=2, timeout=5)
    assert_parser_refused(answers)
    doc = assert_problem(answers[0], 400, "invalid-request")
    assert "TOPSECRET" not in answers[0].body.decode("latin-1"), answers[0].body
    assert doc["detail"].startswith("The request could not be parsed as HTTP/1.1")
    await asyncio.sleep(0.2)
    lines = [line for line in stack.log_lines(start) if line.get("logger") == "aiohttp.server"]
    assert lines == [], lines  # not aiohttp's error line with its traceback
    [warning] = [
        line for line in stack.log_lines(start) if "malformed request" in str(line.get("msg"))
    ]
    assert warning["level"] == "warning" and "TOPSECRET" not in str(warning), warning
    assert "error" not in warning and "Traceback" not in str(warning), warning
