"""Hostile input at the control listener (lease API, admin API), sent as raw bytes to a
real ``fencegate serve``: auth, SQL in ids and tokens, hostile numbers and strings in
JSON, control characters, malformed HTTP. After every case the process is up (the
``stays_up`` fixture) and nothing a refused request carried took effect.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from gateway.records import migrate
from tests.support import pg_admin, pg_url_of, postgres_unavailable

from ._support import (
    ADMIN_TOKEN,
    MAX_FIELD,
    MAX_HEADERS,
    WORKER_TOKEN,
    Response,
    Stack,
    bearer,
    build,
    exchange,
    request,
)

SQL = "x'; DROP TABLE jobs;--"


async def api(
    stack: Stack,
    method: str,
    path: str,
    body: Any = None,
    *,
    token: str | None = WORKER_TOKEN,
    raw: bytes | None = None,
) -> Response:
    headers = bearer(token) if token else []
    data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    if data:
        headers.append(("Content-Type", "application/json"))
    return await request(stack.control_port, method, path, headers, data)


def assert_problem(resp: Response, status: int, reason: str, field: str | None = None) -> Any:
    assert resp.status == status, resp
    assert resp.header("Content-Type") == "application/problem+json", resp
    doc = resp.json()
    assert doc["reason"] == reason and doc["status"] == status, doc
    if field is not None:
        assert doc.get("field") == field, doc
        assert doc["detail"].startswith(f"{field}:"), doc
    return doc


# -- who may call -------------------------------------------------------------------------

AUTH = {
    "no-token": ("GET", "/v1/jobs/x", [], 401),
    "wrong-token": ("GET", "/v1/jobs/x", bearer("not-a-configured-token-at-all"), 401),
    "empty-bearer": ("GET", "/v1/jobs/x", [("Authorization", "Bearer ")], 401),
    "basic-scheme": ("GET", "/v1/jobs/x", [("Authorization", f"Basic {WORKER_TOKEN}")], 401),
    "token-plus-junk": ("GET", "/v1/jobs/x", bearer(f"{WORKER_TOKEN} x"), 401),
    "token-prefix": ("GET", "/v1/jobs/x", bearer(WORKER_TOKEN[:-1]), 401),
    "sql-token": ("GET", "/v1/jobs/x", bearer("' OR '1'='1' --"), 401),
    "long-token": ("GET", "/v1/jobs/x", bearer("t" * 1000), 401),
    "non-ascii-token": ("GET", "/v1/jobs/x", [("Authorization", "Bearer t\xe4t")], 401),
    "no-token-metrics": ("GET", "/metrics", [], 401),
    "no-token-admin": ("GET", "/admin/rejections", [], 401),
    "worker-on-rejections": ("GET", "/admin/rejections", bearer(WORKER_TOKEN), 403),
    "worker-on-upstreams": ("GET", "/admin/upstreams", bearer(WORKER_TOKEN), 403),
    "worker-on-ui-data": (
        "GET",
        "/admin/ui/api/refusals-over-time",
        bearer(WORKER_TOKEN),
        403,
    ),
    "no-token-ui-data": ("GET", "/admin/ui/api/refusals-over-time", [], 401),
    "worker-on-metrics": ("GET", "/metrics", bearer(WORKER_TOKEN), 403),
    "worker-purges-job": ("DELETE", "/admin/jobs/x", bearer(WORKER_TOKEN), 403),
    "worker-resolves": ("POST", "/admin/unknown-outcomes/resolve", bearer(WORKER_TOKEN), 403),
}


@pytest.mark.parametrize(("method", "path", "headers", "status"), AUTH.values(), ids=AUTH.keys())
async def test_auth(
    stack: Stack, method: str, path: str, headers: list[tuple[str, str]], status: int
) -> None:
    resp = await request(stack.control_port, method, path, headers)
    assert_problem(resp, status, "unauthorized" if status == 401 else "forbidden")


async def test_auth_baseline(stack: Stack) -> None:
    """The same calls with the right token work, so the refusals above are about auth."""
    resp = await request(stack.control_port, "GET", "/admin/rejections", bearer(ADMIN_TOKEN))
    assert resp.status == 200, resp
    resp = await request(stack.control_port, "GET", "/v1/jobs", bearer(WORKER_TOKEN))
    assert resp.status == 200, resp
    resp = await request(stack.control_port, "GET", "/healthz")
    assert resp.status == 200, resp


PATH_TRICKS = {
    # no token: only /healthz and /readyz themselves are open
    "healthz-dotdot": ("/healthz/../admin/rejections", None),
    "healthz-encoded-dotdot": ("/healthz%2f..%2fadmin/rejections", None),
    "healthz-slash": ("/healthz/", None),
    "readyz-dotdot-metrics": ("/readyz/../metrics", None),
    "absolute-form-no-token": ("http://gateway.test/admin/rejections", None),
    # worker token: only /v1/
    "v1-dotdot": ("/v1/../admin/rejections", WORKER_TOKEN),
    "v1-encoded-dotdot": ("/v1/%2e%2e/admin/rejections", WORKER_TOKEN),
    "v1-encoded-slash": ("/v1/..%2fadmin/rejections", WORKER_TOKEN),
    "v1-deep-dotdot": ("/v1/jobs/x/%2e%2e/%2e%2e/../admin/rejections", WORKER_TOKEN),
    "double-slash": ("//admin/rejections", WORKER_TOKEN),
    "encoded-letter": ("/%61dmin/rejections", WORKER_TOKEN),
    "upper-case": ("/ADMIN/rejections", WORKER_TOKEN),
    "absolute-form-worker": ("http://evil.test/admin/rejections", WORKER_TOKEN),
}


@pytest.mark.parametrize(("target", "token"), PATH_TRICKS.values(), ids=PATH_TRICKS.keys())
async def test_path_tricks_do_not_bypass_auth(stack: Stack, target: str, token: str | None) -> None:
    resp = await request(stack.control_port, "GET", target, bearer(token) if token else [])
    assert resp.status in (401, 403, 404), resp
    assert b'"items"' not in resp.body


# -- SQL in ids and tokens ----------------------------------------------------------------

SQL_CASES = {
    "get-job": ("GET", f"/v1/jobs/{quote(SQL, safe='')}", None, 400, "job_id"),
    "acquire": ("PUT", f"/v1/jobs/{quote(SQL, safe='')}/lease", {"owner": "a"}, 400, "job_id"),
    "claim": ("POST", f"/v1/queues/{quote(SQL, safe='')}/claim", {"owner": "a"}, 400, "queue"),
    "enqueue-job-id": ("POST", "/v1/jobs", {"job_id": SQL}, 400, "job_id"),
    "enqueue-queue": ("POST", "/v1/jobs", {"queue": "q' OR '1'='1"}, 400, "queue"),
    "acquire-queue": ("PUT", "/v1/jobs/sql-q/lease", {"owner": "a", "queue": SQL}, 400, "queue"),
    "list-queue": ("GET", "/v1/jobs?queue=%27%20OR%201%3D1--", None, 400, "queue"),
    "list-state": ("GET", "/v1/jobs?state=leased%27%20OR%201%3D1--", None, 400, "state"),
    "list-limit": ("GET", "/v1/jobs?limit=1%20OR%201%3D1", None, 400, "limit"),
    "list-cursor": ("GET", "/v1/jobs?cursor=%27%20OR%201%3D1--", None, 400, "cursor"),
    "renew-token": ("POST", "/v1/leases/renew", {"lease_token": "fgl_' OR 1=1 --"}, 403, None),
    "complete-token": ("POST", "/v1/leases/complete", {"lease_token": SQL}, 403, None),
    "release-token": ("POST", "/v1/leases/release", {"lease_token": "' OR ''='"}, 403, None),
    "fail-token": ("POST", "/v1/leases/fail", {"lease_token": "fgl_" + "-" * 32}, 403, None),
}


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "field"), SQL_CASES.values(), ids=SQL_CASES.keys()
)
async def test_sql_in_ids_and_tokens(
    stack: Stack, method: str, path: str, body: Any, status: int, field: str | None
) -> None:
    resp = await api(stack, method, path, body)
    if status == 400:
        assert_problem(resp, 400, "invalid-request", field)
    else:
        assert_problem(resp, 403, "invalid-lease-token")


async def test_sql_in_admin_calls(stack: Stack) -> None:
    purge = await api(stack, "DELETE", f"/admin/jobs/{quote(SQL, safe='')}", token=ADMIN_TOKEN)
    assert_problem(purge, 400, "invalid-request", "job_id")
    resolve = await api(
        stack,
        "POST",
        "/admin/unknown-outcomes/resolve",
        {"job_id": SQL, "key": "k", "applied": False},
        token=ADMIN_TOKEN,
    )
    assert_problem(resolve, 400, "invalid-request", "job_id")
    since = await api(
        stack, "GET", "/admin/rejections?since=1%27%20OR%201%3D1--", token=ADMIN_TOKEN
    )
    assert_problem(since, 400, "invalid-request", "since")
    # A filter is a value: it matches nothing, and does not widen the query. A reason or
    # an upstream that is not one is refused, naming the field (issue 13).
    resp = await api(stack, "GET", "/admin/rejections?job_id=%27%20OR%201%3D1--", token=ADMIN_TOKEN)
    assert resp.status == 200, resp
    assert resp.json()["items"] == []
    for param in ("reason", "upstream"):
        resp = await api(
            stack, "GET", f"/admin/rejections?{param}=%27%20OR%201%3D1--", token=ADMIN_TOKEN
        )
        assert_problem(resp, 400, "invalid-request", param)


async def test_tables_survive_and_strings_are_stored_verbatim(stack: Stack) -> None:
    """After all the SQL above, the lease API works; SQL-looking text where free text is
    allowed (an owner, a payload) is stored and given back byte for byte."""
    resp = await api(stack, "POST", "/v1/jobs", {"job_id": "after-sql", "payload": {"q": SQL}})
    assert resp.status == 201, resp
    owner = "'; DROP TABLE jobs;-- \" OR 1=1"
    resp = await api(stack, "PUT", "/v1/jobs/after-sql/lease", {"owner": owner})
    assert resp.status == 201, resp
    job = (await api(stack, "GET", "/v1/jobs/after-sql")).json()
    assert (job["owner"], job["payload"], job["state"]) == (owner, {"q": SQL}, "leased")
    listed = await api(stack, "GET", "/v1/jobs?limit=500")
    assert "after-sql" in [j["job_id"] for j in listed.json()["items"]]


# -- numbers ------------------------------------------------------------------------------

BIG = "1" + "0" * 400  # 10**400: parses as an int, overflows a double
NUMBERS = {
    "nan": ("PUT", "/v1/jobs/n/lease", '{"owner": "a", "ttl_seconds": NaN}', "body", "NaN"),
    "infinity": ("PUT", "/v1/jobs/n/lease", '{"owner": "a", "ttl_seconds": Infinity}', "body", ""),
    "minus-infinity": (
        "PUT",
        "/v1/jobs/n/lease",
        '{"owner": "a", "ttl_seconds": -Infinity}',
        "body",
        "",
    ),
    "1e999": ("PUT", "/v1/jobs/n/lease", '{"owner": "a", "ttl_seconds": 1e999}', "body", "1e999"),
    "minus-zero-int": (
        "PUT",
        "/v1/jobs/n/lease",
        '{"owner": "a", "ttl_seconds": -0}',
        "ttl_seconds",
        "",
    ),
    "minus-zero-float": (
        "PUT",
        "/v1/jobs/n/lease",
        '{"owner": "a", "ttl_seconds": -0.0}',
        "ttl_seconds",
        "",
    ),
    "tiny-underflow": (
        "PUT",
        "/v1/jobs/n/lease",
        '{"owner": "a", "ttl_seconds": 1e-400}',
        "ttl_seconds",
        "",
    ),
    "10**400-ttl": (
        "PUT",
        "/v1/jobs/n/lease",
        f'{{"owner": "a", "ttl_seconds": {BIG}}}',
        "ttl_seconds",
        "",
    ),
    "1e308-ttl": (
        "PUT",
        "/v1/jobs/n/lease",
        '{"owner": "a", "ttl_seconds": 1e308}',
        "ttl_seconds",
        "",
    ),
    "5000-digits": (
        "PUT",
        "/v1/jobs/n/lease",
        '{"owner": "a", "ttl_seconds": ' + "9" * 5000 + "}",
        "body",
        "digits",
    ),
    "string-ttl": (
        "PUT",
        "/v1/jobs/n/lease",
        '{"owner": "a", "ttl_seconds": "30"}',
        "ttl_seconds",
        "",
    ),
    "bool-ttl": (
        "PUT",
        "/v1/jobs/n/lease",
        '{"owner": "a", "ttl_seconds": true}',
        "ttl_seconds",
        "",
    ),
    "10**400-attempts": ("POST", "/v1/jobs", f'{{"max_attempts": {BIG}}}', "max_attempts", ""),
    "minus-zero-attempts": ("POST", "/v1/jobs", '{"max_attempts": -0}', "max_attempts", ""),
    "float-attempts": ("POST", "/v1/jobs", '{"max_attempts": 2.5}', "max_attempts", ""),
    "nan-in-payload": ("POST", "/v1/jobs", '{"payload": {"x": NaN}}', "body", "NaN"),
    "1e999-in-payload": ("POST", "/v1/jobs", '{"payload": [1e999]}', "body", ""),
    "10**400-renew-ttl": (
        "POST",
        "/v1/leases/renew",
        f'{{"lease_token": "fgl_x", "ttl_seconds": {BIG}}}',
        "ttl_seconds",
        "",
    ),
    "nan-retry": (
        "POST",
        "/v1/leases/fail",
        '{"lease_token": "fgl_x", "retry_in_seconds": NaN}',
        "body",
        "",
    ),
    "negative-retry": (
        "POST",
        "/v1/leases/fail",
        '{"lease_token": "fgl_x", "retry_in_seconds": -1}',
        "retry_in_seconds",
        "",
    ),
    "1e308-retry": (
        "POST",
        "/v1/leases/fail",
        '{"lease_token": "fgl_x", "retry_in_seconds": 1e308}',
        "retry_in_seconds",
        "",
    ),
    "10**400-status": (
        "POST",
        "/admin/unknown-outcomes/resolve",
        f'{{"job_id": "j", "key": "k", "applied": true, "status": {BIG}}}',
        "status",
        "",
    ),
    "deep-nesting": (
        "POST",
        "/v1/jobs",
        '{"payload": ' + "[" * 5000 + "]" * 5000 + "}",
        "body",
        "",
    ),
}


@pytest.mark.parametrize(
    ("method", "path", "raw", "field", "mentions"), NUMBERS.values(), ids=NUMBERS.keys()
)
async def test_hostile_numbers_in_json(
    stack: Stack, method: str, path: str, raw: str, field: str, mentions: str
) -> None:
    """400 naming the field; a body that is not JSON at all (NaN, Infinity, a number out
    of a double's range, too many digits, too deep) is named ``body``."""
    token = ADMIN_TOKEN if path.startswith("/admin/") else WORKER_TOKEN
    resp = await api(stack, method, path, raw=raw.encode(), token=token)
    doc = assert_problem(resp, 400, "invalid-request", field)
    assert mentions in doc["detail"]
    assert (await api(stack, "GET", "/v1/jobs/n")).status == 404  # nothing was created


# -- strings and ids -----------------------------------------------------------------------

STRINGS = {
    "owner-10000": ("PUT", "/v1/jobs/s/lease", {"owner": "o" * 10_000}, "owner"),
    "owner-201": ("PUT", "/v1/jobs/s/lease", {"owner": "o" * 201}, "owner"),
    "owner-nul": ("PUT", "/v1/jobs/s/lease", {"owner": "a\u0000b"}, "owner"),
    "owner-newline": ("PUT", "/v1/jobs/s/lease", {"owner": "a\nb"}, "owner"),
    "owner-escape": ("PUT", "/v1/jobs/s/lease", {"owner": "a\u001b[31mb"}, "owner"),
    "owner-del": ("PUT", "/v1/jobs/s/lease", {"owner": "a\u007fb"}, "owner"),
    "owner-line-separator": ("PUT", "/v1/jobs/s/lease", {"owner": "a\u2028b"}, "owner"),
    "owner-empty": ("PUT", "/v1/jobs/s/lease", {"owner": ""}, "owner"),
    "owner-number": ("PUT", "/v1/jobs/s/lease", {"owner": 7}, "owner"),
    "job-id-nul": ("POST", "/v1/jobs", {"job_id": "s\u0000"}, "job_id"),
    "job-id-newline": ("POST", "/v1/jobs", {"job_id": "s\r\nX: y"}, "job_id"),
    "job-id-201": ("POST", "/v1/jobs", {"job_id": "s" * 201}, "job_id"),
    "job-id-leading-dot": ("POST", "/v1/jobs", {"job_id": ".s"}, "job_id"),
    "job-id-slash": ("POST", "/v1/jobs", {"job_id": "s/../t"}, "job_id"),
    "job-id-non-ascii": ("POST", "/v1/jobs", {"job_id": "s\u00e4"}, "job_id"),
    "queue-space": ("POST", "/v1/jobs", {"queue": "a b"}, "queue"),
    "unknown-field": ("POST", "/v1/jobs", {"job_id": "s", "admin": True}, "admin"),
    "error-10001": (
        "POST",
        "/v1/leases/fail",
        {"lease_token": "fgl_x", "error": "e" * 10_001},
        "error",
    ),
    "token-201": ("POST", "/v1/leases/renew", {"lease_token": "t" * 201}, "lease_token"),
}


@pytest.mark.parametrize(("method", "path", "body", "field"), STRINGS.values(), ids=STRINGS.keys())
async def test_hostile_strings_in_json(
    stack: Stack, method: str, path: str, body: Any, field: str
) -> None:
    resp = await api(stack, method, path, body)
    assert_problem(resp, 400, "invalid-request", field)
    for job in ("s", "s\u0000", "s" * 201):
        assert (await api(stack, "GET", f"/v1/jobs/{quote(job, safe='')}")).status in (400, 404)


async def test_id_and_owner_boundaries(stack: Stack) -> None:
    """The limits are where they are said to be: 200 characters pass, 201 do not."""
    job = "j" + "d" * 199
    resp = await api(stack, "PUT", f"/v1/jobs/{job}/lease", {"owner": "o" * 200})
    assert resp.status == 201, resp
    resp = await api(stack, "GET", f"/v1/jobs/{job}d")
    assert_problem(resp, 400, "invalid-request", "job_id")


@pytest.mark.parametrize(
    "encoded",
    [
        "%00",
        "a%00b",
        "%0a",
        "a%0d%0aSet-Cookie:%20x",
        "%1b%5b31m",
        "a%7f",
        "%09",
        "a%20b",
        "a%2fb",
        "%c3%a4",
        "%2e%2e",
        "%ff",
        SQL.replace(" ", "%20").replace(";", "%3B"),
    ],
)
async def test_control_characters_in_path_ids(stack: Stack, encoded: str) -> None:
    for method, path, body, field in (
        ("GET", f"/v1/jobs/{encoded}", None, "job_id"),
        ("PUT", f"/v1/jobs/{encoded}/lease", {"owner": "a"}, "job_id"),
        ("POST", f"/v1/queues/{encoded}/claim", {"owner": "a"}, "queue"),
    ):
        assert_problem(await api(stack, method, path, body), 400, "invalid-request", field)


# -- malformed HTTP -----------------------------------------------------------------------


def _smuggled_acquire(job: str) -> bytes:
    body = b'{"owner": "smuggler"}'
    return build(
        "PUT",
        f"/v1/jobs/{job}/lease",
        [*bearer(WORKER_TOKEN), ("Content-Type", "application/json")],
        body,
    )


AUTHZ = b"Authorization: Bearer " + WORKER_TOKEN.encode() + b"\r\n"
MALFORMED = {
    "cl-and-te": b"POST /v1/jobs HTTP/1.1\r\nHost: a\r\n"
    + AUTHZ
    + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "duplicate-cl": b"POST /v1/jobs HTTP/1.1\r\nHost: a\r\n"
    + AUTHZ
    + b"Content-Length: 0\r\nContent-Length: 2\r\n\r\n{}",
    "te-space-before-colon": b"POST /v1/jobs HTTP/1.1\r\nHost: a\r\n"
    + AUTHZ
    + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "bare-lf": b"GET /v1/jobs HTTP/1.1\nHost: a\n" + AUTHZ.replace(b"\r\n", b"\n") + b"\n",
    "bare-lf-one-header": b"GET /v1/jobs HTTP/1.1\r\nHost: a\nX-A: b\r\n" + AUTHZ + b"\r\n",
    "duplicate-host": b"GET /v1/jobs HTTP/1.1\r\nHost: a\r\nHost: b\r\n" + AUTHZ + b"\r\n",
    "missing-host": b"GET /v1/jobs HTTP/1.1\r\n" + AUTHZ + b"\r\n",
    "obs-fold": b"GET /v1/jobs HTTP/1.1\r\nHost: a\r\nX-A: a\r\n b\r\n" + AUTHZ + b"\r\n",
    "nul-in-target": b"GET /v1/jobs/a\x00b HTTP/1.1\r\nHost: a\r\n" + AUTHZ + b"\r\n",
    "header-too-long": b"GET /v1/jobs HTTP/1.1\r\nHost: a\r\nX-Pad: "
    + b"a" * 2000
    + b"\r\n"
    + AUTHZ
    + b"\r\n",
    "request-line-too-long": b"GET /v1/jobs/"
    + b"a" * 2000
    + b" HTTP/1.1\r\nHost: a\r\n"
    + AUTHZ
    + b"\r\n",
    "too-many-headers": b"GET /v1/jobs HTTP/1.1\r\nHost: a\r\n"
    + b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_HEADERS + 8))
    + AUTHZ
    + b"\r\n",
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
async def test_malformed_messages_refused(stack: Stack, data: bytes) -> None:
    """400 from the parser, the connection closed: the request smuggled behind the bad
    one (an acquire) never runs."""
    job = f"smuggled-{uuid.uuid4().hex[:8]}"
    answers = await exchange(
        stack.control_port, data + _smuggled_acquire(job), responses=2, timeout=5
    )
    assert answers and answers[0].status in (400, 431), answers
    assert len(answers) == 1, answers
    assert_problem(await api(stack, "GET", f"/v1/jobs/{job}"), 404, "job-not-found")


@pytest.mark.parametrize(("size", "status"), [(1000, 200), (2000, 400)])
async def test_header_field_limit(stack: Stack, size: int, status: int) -> None:
    assert MAX_FIELD == 1024
    resp = await request(stack.control_port, "GET", "/healthz", [("X-Pad", "a" * size)])
    assert resp.status == status, resp


async def test_body_limit(stack: Stack) -> None:
    """1 MiB on the control listener, declared or chunked."""
    payload = b'{"payload": "' + b"x" * (1024 * 1024) + b'"}'
    resp = await api(stack, "POST", "/v1/jobs", raw=payload)
    assert_problem(resp, 413, "http-error")
    head = build(
        "POST",
        "/v1/jobs",
        [
            *bearer(WORKER_TOKEN),
            ("Content-Type", "application/json"),
            ("Transfer-Encoding", "chunked"),
        ],
    )
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(payload[i : i + 65536]), payload[i : i + 65536])
        for i in range(0, len(payload), 65536)
    )
    [resp] = await exchange(stack.control_port, head + chunks + b"0\r\n\r\n")
    assert_problem(resp, 413, "http-error")


async def test_a_thousand_pipelined_unauthenticated_calls(stack: Stack) -> None:
    one = build(
        "PUT", "/v1/jobs/pipelined/lease", [("Content-Type", "application/json")], b'{"owner": "a"}'
    )
    answers = await exchange(stack.control_port, one * 1000, responses=1000, timeout=60)
    assert len(answers) == 1000
    assert {a.status for a in answers} == {401}
    assert_problem(await api(stack, "GET", "/v1/jobs/pipelined"), 404, "job-not-found")


# -- NUL in free text reaching PostgreSQL -------------------------------------------------


@pytest.fixture(scope="module")
def pg_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The same server on its own PostgreSQL database (migrated first, as in production)."""
    name = f"fencegate_security_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        asyncio.run(asyncio.wait_for(pg_admin(f'CREATE DATABASE "{name}"'), 10))
    except Exception as error:  # any failure to reach the server
        postgres_unavailable(f"{type(error).__name__}: {error}")
    url = pg_url_of(name)
    srv = Stack(Path(tmp_path_factory.mktemp("security-pg")), database_url=url)
    try:
        migrate.upgrade(url)
        srv.start()
        yield srv
    finally:
        srv.stop()
        asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


NUL_CASES = {
    "enqueue-payload": "enqueue-payload",
    "acquire-payload": "acquire-payload",
    "fail-error": "fail-error",
    "complete-result": "complete-result",
    "resolve-key": "resolve-key",
    "rejections-filter": "rejections-filter",
}


async def _nul_case(srv: Stack, case: str) -> Response:
    nul = "a\u0000b"
    job = f"nul-{case}-{uuid.uuid4().hex[:6]}"
    if case == "enqueue-payload":
        return await api(srv, "POST", "/v1/jobs", {"job_id": job, "payload": {"s": nul}})
    if case == "acquire-payload":
        return await api(srv, "PUT", f"/v1/jobs/{job}/lease", {"owner": "a", "payload": [nul]})
    if case == "resolve-key":
        body = {"job_id": job, "key": nul, "applied": False}
        return await api(srv, "POST", "/admin/unknown-outcomes/resolve", body, token=ADMIN_TOKEN)
    if case == "rejections-filter":
        return await api(srv, "GET", "/admin/rejections?job_id=a%00b", token=ADMIN_TOKEN)
    lease = await srv.lease(job)
    if case == "fail-error":
        body = {"lease_token": lease["lease_token"], "error": nul}
        return await api(srv, "POST", "/v1/leases/fail", body)
    body = {"lease_token": lease["lease_token"], "result": {"r": nul}}
    return await api(srv, "POST", "/v1/leases/complete", body)


# Where the NUL comes back when it is stored: (field of the answer, value).
NUL_ECHO: dict[str, tuple[str, Any]] = {
    "enqueue-payload": ("payload", {"s": "a\u0000b"}),
    "acquire-payload": ("payload", ["a\u0000b"]),
    "fail-error": ("error", "a\u0000b"),
    "complete-result": ("result", {"r": "a\u0000b"}),
}


@pytest.mark.parametrize("case", NUL_CASES.values(), ids=NUL_CASES.keys())
async def test_nul_in_free_text_sqlite(stack: Stack, case: str) -> None:
    """Stored and given back unchanged, or refused with a 4xx: never a 5xx."""
    resp = await _nul_case(stack, case)
    assert resp.status < 500, resp
    if resp.status < 300 and case in NUL_ECHO:
        field, value = NUL_ECHO[case]
        assert resp.json()[field] == value


@pytest.mark.postgres
@pytest.mark.parametrize("case", NUL_CASES.values(), ids=NUL_CASES.keys())
async def test_nul_in_free_text_postgres(pg_stack: Stack, case: str) -> None:
    resp = await _nul_case(pg_stack, case)
    pg_stack.assert_alive()
    assert resp.status < 500, resp
