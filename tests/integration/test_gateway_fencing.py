"""The gateway's fencing checks, over real HTTP, on SQLite and PostgreSQL.

The rows of the SPEC's gateway table up to ``body-too-large`` (in table order), the
problem documents, header hygiene in both directions, path safety, and large bodies. The
upstream is a real HTTP server that records what it receives: a refused write must never
show up there.
"""

from __future__ import annotations

import asyncio
import io
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from multidict import CIMultiDict

from gateway.config import load_settings, resolve_secrets
from tests.gateway_helpers import PROBLEM, ok, problem
from tests.support import FakeClock, Upstream, upstream_config


async def raw_request(
    client: TestClient[Any, Any],
    method: str,
    target: str,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
) -> tuple[int, dict[str, str], bytes]:
    """Send a request target exactly as written (aiohttp's client would normalise
    dot-segments away before they reached the gateway)."""
    assert client.host is not None and client.port is not None
    reader, writer = await asyncio.open_connection(client.host, client.port)
    lines = [
        f"{method} {target} HTTP/1.1",
        f"Host: {client.host}:{client.port}",
        "Connection: close",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in headers or []),
    ]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    await writer.wait_closed()
    head, _, payload = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    response_headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        response_headers[name.strip().lower()] = value.strip()
    return int(status_line.split(" ")[1]), response_headers, payload


def unknown_token() -> str:
    token = "fgl_" + secrets.token_urlsafe(24)
    assert len(token) == 36
    return token


# -- stale, expired, ended --------------------------------------------------------------


async def test_delayed_worker_is_refused_after_reclaim(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    first = await stack.lease("job-1", owner="a", ttl=10)
    resp = await stack.write("/pay/charges", first, key="step-1")
    await ok(resp)
    assert len(upstream.received) == 1

    # Worker a stalls past its lease; b reclaims the job.
    clock.advance(11)
    second = await stack.lease("job-1", owner="b", ttl=10)
    assert second["generation"] == 2

    # a wakes up and carries on before b has written anything: refused.
    resp = await stack.write("/pay/charges", first, key="step-2", body={"amount": 2})
    doc = await problem(resp, 409, "stale-generation")
    assert doc["job_id"] == "job-1"
    assert doc["generation"] == 1
    assert doc["highest_generation"] == 2
    assert len(upstream.received) == 1

    # b writes, then a tries again: still refused, and b's write was the only one.
    resp = await stack.write("/pay/charges", second, key="step-2", body={"amount": 2})
    await ok(resp)
    resp = await stack.write("/pay/charges", first, key="step-3", body={"amount": 3})
    doc = await problem(resp, 409, "stale-generation")
    assert (doc["generation"], doc["highest_generation"]) == (1, 2)
    assert [r["generation"] for r in upstream.received] == ["1", "2"]

    # Even repeating its own completed step gets the lease refusal, not the replay: the
    # lease rows of the table come before the idempotency rows.
    resp = await stack.write("/pay/charges", first, key="step-1")
    await problem(resp, 409, "stale-generation")
    # Every method the upstream fences is refused the same way.
    for method in ("PUT", "PATCH", "DELETE"):
        resp = await stack.write("/pay/charges/1", first, key=f"m-{method}", method=method)
        await problem(resp, 409, "stale-generation")
    assert len(upstream.received) == 2


async def test_same_owner_reacquiring_fences_off_its_predecessor(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    old = await stack.lease("job-1", owner="svc")
    new = await stack.lease("job-1", owner="svc")
    assert new["generation"] > old["generation"]
    doc = await problem(await stack.write("/pay/x", old, key="k"), 409, "stale-generation")
    assert doc["highest_generation"] == new["generation"]
    assert upstream.received == []
    await ok(await stack.write("/pay/x", new, key="k"))


async def test_the_token_of_a_purged_job_is_still_stale(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    old = await stack.lease("job-1")
    await ok(await stack.write("/pay/x", old, key="k"))
    resp = await stack.control.post("/v1/leases/complete", json={"lease_token": old["lease_token"]})
    assert resp.status == 200
    resp = await stack.control.delete("/admin/jobs/job-1")
    assert resp.status in (200, 204), await resp.text()
    doc = await problem(await stack.write("/pay/x", old, key="k2"), 409, "stale-generation")
    assert (doc["job_id"], doc["generation"]) == ("job-1", 1)
    # The job created again under the same id continues above the old generation.
    new = await stack.lease("job-1")
    assert new["generation"] == 2
    await ok(await stack.write("/pay/x", new, key="k3"))
    await problem(await stack.write("/pay/x", old, key="k4"), 409, "stale-generation")
    assert [r["generation"] for r in upstream.received] == ["1", "2"]


async def test_lease_expired_when_nobody_newer(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1", ttl=10)
    clock.advance(9.5)
    resp = await stack.write("/pay/charges", lease, key="before")
    await ok(resp)
    clock.advance(0.5)  # exactly at expiry: no longer current
    doc = await problem(await stack.write("/pay/charges", lease, key="after"), 409, "lease-expired")
    assert doc["job_id"] == "job-1"
    assert doc["generation"] == 1 and doc["highest_generation"] == 1
    assert len(upstream.received) == 1


async def test_lease_ended(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    for action in ("complete", "release", "fail"):
        lease = await stack.lease(f"job-{action}")
        resp = await stack.control.post(
            f"/v1/leases/{action}", json={"lease_token": lease["lease_token"]}
        )
        assert resp.status == 200, await resp.text()
        doc = await problem(await stack.write("/pay/charges", lease), 409, "lease-ended")
        assert doc["job_id"] == f"job-{action}" and doc["generation"] == 1
        assert doc["highest_generation"] == 1
    assert upstream.received == []


# -- the token ----------------------------------------------------------------------------


async def test_malformed_tokens_are_invalid(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    real = (await stack.lease("job-1"))["lease_token"]
    for token in (
        "garbage",
        "fgl_short",
        "fgl_" + "a" * 31 + "!",
        "fgl_" + "a" * 33,
        "FGL_" + "a" * 32,
        real + "x",
        " " + real[1:],
        f"Bearer {real}",
    ):
        resp = await stack.write("/pay/charges", {"lease_token": token})
        doc = await problem(resp, 403, "invalid-fencing-token")
        assert "job_id" not in doc and "generation" not in doc
        bearer = token.startswith("Bearer ")
        assert ("Send the lease token bare" in doc["detail"]) is bearer, doc
    assert upstream.received == []


async def test_unknown_and_forged_tokens_are_invalid(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    real = lease["lease_token"]
    forged = real[:-1] + ("A" if real[-1] != "A" else "B")
    for token in (unknown_token(), forged):
        resp = await stack.write("/pay/charges", {"lease_token": token})
        doc = await problem(resp, 403, "invalid-fencing-token")
        assert "job_id" not in doc
    assert upstream.received == []
    # Two Fencing-Token headers are not a way around the check either.
    resp = await stack.proxy.post(
        "/pay/charges",
        json={},
        headers=CIMultiDict([("Fencing-Token", real), ("Fencing-Token", unknown_token())]),
    )
    assert resp.status in (400, 403), await resp.text()
    assert resp.content_type == PROBLEM
    assert upstream.received == []


async def test_missing_fencing_token(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        resp = await stack.write("/pay/charges", None, method=method)
        doc = await problem(resp, 428, "missing-fencing-token")
        assert "job_id" not in doc
    assert upstream.received == []


# -- the idempotency key ------------------------------------------------------------------


async def test_missing_or_malformed_idempotency_key(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    for keys in (
        [],
        ["has space"],
        ["a,b"],
        ['"unterminated'],
        ['"a"b'],
        ['""'],
        [""],
        ["k" * 256],
        ['"' + "k" * 256 + '"'],
        ["one", "two"],
        ["same", "same"],
    ):
        headers = CIMultiDict([("Fencing-Token", lease["lease_token"])])
        for key in keys:
            headers.add("Idempotency-Key", key)
        resp = await stack.proxy.post("/pay/charges", json={"amount": 1}, headers=headers)
        await problem(resp, 400, "missing-idempotency-key")
    assert upstream.received == []
    # Refused before the lease was looked up: counted in grouped audit rows.
    entries = await stack.audit(reason="missing-idempotency-key")
    assert sum(e["count"] for e in entries) == 11


async def test_well_formed_keys_are_accepted(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    # Each key as sent, and the one form the upstream gets for it: bare where the key is
    # made of token characters, else a structured-field string.
    keys = [
        ('"quoted"', "quoted"),
        ('"with space and \\"escapes\\""', '"with space and \\"escapes\\""'),
        ("123e4567-e89b-12d3-a456-426614174000", "123e4567-e89b-12d3-a456-426614174000"),
        ("0", "0"),
        ("k" * 255, "k" * 255),
        ('"' + "j" * 255 + '"', "j" * 255),
        ("!#$%&'*+-.^_`|~", "!#$%&'*+-.^_`|~"),
    ]
    for n, (key, forwarded) in enumerate(keys, start=1):
        resp = await stack.write("/pay/charges", lease, key=key)
        assert await ok(resp) == b'{"applied": %d}' % n
        assert upstream.received[-1]["key"] == forwarded
        # And the key is tracked: the same request again is a replay.
        resp = await stack.write("/pay/charges", lease, key=key)
        assert resp.headers.get("Idempotent-Replayed") == "true"
        assert await resp.json() == {"applied": n}
    assert len(upstream.received) == len(keys)


async def test_upstream_without_required_key_forwards_keyless_writes(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream, require_idempotency_key=False)])
    lease = await stack.lease("job-1")
    for _ in range(2):
        resp = await stack.write("/pay/charges", lease, key=None)
        await ok(resp)
        assert "Idempotent-Replayed" not in resp.headers
    # Without a key nothing is replayed: both went through, without an invented key.
    assert len(upstream.received) == 2
    for record in upstream.received:
        assert "Idempotency-Key" not in record["headers"]
        assert record["generation"] == "1"
    # A malformed key is still refused: the key is optional, not unchecked.
    resp = await stack.write("/pay/charges", lease, key="not a key")
    await problem(resp, 400, "missing-idempotency-key")
    assert len(upstream.received) == 2


# -- upstreams and unfenced methods ---------------------------------------------------------


async def test_unknown_upstream(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    for token in (lease, None):
        await problem(await stack.write("/nope/charges", token), 404, "unknown-upstream")
    await problem(await stack.proxy.get("/nope/charges"), 404, "unknown-upstream")
    await problem(await stack.proxy.get("/pa/charges"), 404, "unknown-upstream")
    await problem(await stack.proxy.get("/"), 404, "unknown-upstream")
    assert upstream.received == []


async def test_an_unknown_upstream_says_what_was_meant(make_stack: Any, upstream: Upstream) -> None:
    """A lease call sent to the proxy listener is told where the lease API is; a misspelt
    upstream, the nearest configured name; both audited as any unknown upstream."""
    stack = await make_stack(upstreams=[upstream_config(upstream)], control_listen="127.0.0.1:9191")
    lease = await stack.lease("job-1")
    doc = await problem(await stack.proxy.post("/v1/jobs", json={}), 404, "unknown-upstream")
    assert doc["detail"] == (
        "No upstream named 'v1'. This is the proxy listener (/<upstream>/<path>); /v1/... is "
        "on the control listener, 127.0.0.1:9191 (control_listen)."
    )
    doc = await problem(await stack.write("/pya/charges", lease), 404, "unknown-upstream")
    assert doc["detail"] == "No upstream named 'pya'. Did you mean 'pay'?"
    doc = await problem(await stack.proxy.get("/zzzzzz/x"), 404, "unknown-upstream")
    assert doc["detail"] == "No upstream named 'zzzzzz'."
    assert upstream.received == []


async def test_unfenced_methods_pass_through_without_a_token(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    upstream.status = 200
    resp = await stack.proxy.get("/pay/charges/1?expand=true")
    assert resp.status == 200
    assert await resp.json() == {"applied": 1}
    assert upstream.received[0]["method"] == "GET"
    assert upstream.received[0]["path"] == "/charges/1?expand=true"
    assert "Fencing-Generation" not in upstream.received[0]["headers"]
    # A GET that carries a token still never forwards it.
    lease = await stack.lease("job-1")
    resp = await stack.proxy.get("/pay/charges/1", headers={"Fencing-Token": lease["lease_token"]})
    assert resp.status == 200
    assert "Fencing-Token" not in upstream.received[1]["headers"]
    assert lease["lease_token"] not in repr(upstream.received[1])
    resp = await stack.proxy.head("/pay/charges/1")
    assert resp.status == 200
    assert len(upstream.received) == 3


async def test_upstream_chooses_its_fenced_methods(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream, fenced_methods=["post", "GET"])])
    await problem(await stack.proxy.get("/pay/files/1"), 428, "missing-fencing-token")
    resp = await stack.proxy.delete("/pay/files/1")  # not fenced here
    assert resp.status == 201
    assert [r["method"] for r in upstream.received] == ["DELETE"]


async def test_head_is_fenced_wherever_get_is(make_stack: Any, upstream: Upstream) -> None:
    """Most frameworks run the GET handler for HEAD: with GET fenced, a HEAD without a
    token must not go around the fence."""
    stack = await make_stack(upstreams=[upstream_config(upstream, fenced_methods=["GET"])])
    resp = await stack.proxy.head("/pay/files/1")  # a HEAD answer has no body to read
    assert (resp.status, resp.content_type) == (428, PROBLEM)
    [entry] = await stack.audit()
    assert (entry["reason"], entry["method"]) == ("missing-fencing-token", "HEAD")
    lease = await stack.lease("job-1")
    resp = await stack.proxy.head(
        "/pay/files/1", headers={"Fencing-Token": lease["lease_token"], "Idempotency-Key": "h1"}
    )
    assert resp.status == 201
    assert [(r["method"], r["generation"]) for r in upstream.received] == [("HEAD", "1")]


@pytest.mark.parametrize(
    "header", ["X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override", "X_HTTP_Method"]
)
async def test_a_method_override_on_an_unfenced_method_is_refused(
    make_stack: Any, upstream: Upstream, header: str
) -> None:
    """``GET`` with ``X-HTTP-Method-Override: DELETE`` is a DELETE to many frameworks: it
    would be a write with the upstream's credentials and no fence."""
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    resp = await stack.proxy.get("/pay/files/1", headers={header: "DELETE"})
    doc = await problem(resp, 400, "invalid-request")
    assert "override" in doc["detail"]
    resp = await stack.proxy.post("/pay/files/1", data=b"x", headers={header: "DELETE"})
    await problem(resp, 428, "missing-fencing-token")
    assert upstream.received == []


async def test_a_method_override_on_a_fenced_write_is_part_of_the_request(
    make_stack: Any, upstream: Upstream
) -> None:
    """On a fenced write the override goes on, and the same key with another override is
    another request (422), never a replay of the first."""
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    headers = {"X-HTTP-Method-Override": "PUT"}
    await ok(await stack.write("/pay/files/1", lease, key="k", headers=headers))
    assert upstream.received[0]["headers"]["X-HTTP-Method-Override"] == "PUT"
    resp = await stack.write("/pay/files/1", lease, key="k", headers={"X-HTTP-Method": "DELETE"})
    await problem(resp, 422, "idempotency-key-reused")
    await problem(await stack.write("/pay/files/1", lease, key="k"), 422, "idempotency-key-reused")


async def test_headers_that_retell_the_request_are_not_passed_on(
    make_stack: Any, upstream: Upstream
) -> None:
    """``Forwarded``, ``X-Original-URL`` and ``X-Rewrite-URL`` (which some servers route
    by), and headers named like the gateway's own with ``_`` for ``-`` (which CGI-style
    upstreams read as the same header), do not reach the upstream as the worker sent
    them."""
    stack = await make_stack(
        upstreams=[upstream_config(upstream, set_headers={"X-Api-Key": "k-123"})]
    )
    lease = await stack.lease("job-1")
    spoofed = {
        "Forwarded": "for=10.0.0.1;host=evil.example",
        "X-Original-URL": "/admin/delete-everything",
        "X-Rewrite-URL": "/admin/delete-everything",
        "Fencing_Job": "someone-elses-job",
        "Fencing_Generation": "99",
        "Fencing_Token": "fgl_x",
        "Idempotency_Key": "other-key",
        "X_Forwarded_For": "10.9.8.7",
        "X_Request_Id": "spoofed",
        "X_Api_Key": "worker-key",
        "X-Custom_Header": "kept",
    }
    for method in ("POST", "GET"):
        if method == "POST":
            await ok(await stack.write("/pay/files/1", lease, key="k", headers=spoofed))
        else:
            resp = await stack.proxy.get("/pay/files/1", headers=spoofed)
            assert resp.status == 201
        sent = upstream.received[-1]["headers"]
        for name in spoofed:
            if name != "X-Custom_Header":
                assert name not in sent, (method, name, sent)
        assert sent["X-Custom_Header"] == "kept"
        assert sent["X-Api-Key"] == "k-123"
    assert upstream.received[0]["headers"]["Fencing-Job"] == "job-1"
    assert upstream.received[0]["headers"]["Idempotency-Key"] == "k"


# -- body size ----------------------------------------------------------------------------


async def test_body_too_large_by_content_length(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream, max_body_bytes=100)])
    lease = await stack.lease("job-1")
    headers = {"Fencing-Token": lease["lease_token"], "Idempotency-Key": "big"}
    resp = await stack.proxy.post("/pay/upload", data=b"x" * 101, headers=headers)
    doc = await problem(resp, 413, "body-too-large")
    assert doc["job_id"] == "job-1" and doc["generation"] == 1
    assert upstream.received == []
    # Exactly at the limit is fine, and the refused key was not used up.
    resp = await stack.proxy.post("/pay/upload", data=b"x" * 100, headers=headers)
    await ok(resp)
    assert upstream.received[0]["body"] == b"x" * 100
    # Unfenced methods have the same limit.
    await problem(
        await stack.proxy.put("/pay/upload", data=b"y" * 500), 428, "missing-fencing-token"
    )
    resp = await stack.proxy.request("OPTIONS", "/pay/upload", data=b"y" * 500)
    await problem(resp, 413, "body-too-large")
    assert len(upstream.received) == 1


async def test_body_too_large_by_bytes_read(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream, max_body_bytes=100)])
    lease = await stack.lease("job-1")

    def chunked(size: int, count: int) -> AsyncIterator[bytes]:
        async def gen() -> AsyncIterator[bytes]:
            for _ in range(count):
                yield b"z" * size

        return gen()

    headers = {"Fencing-Token": lease["lease_token"], "Idempotency-Key": "chunked"}
    resp = await stack.proxy.post("/pay/upload", data=chunked(40, 5), headers=headers)
    assert resp.request_info.headers.get("Transfer-Encoding") == "chunked"
    doc = await problem(resp, 413, "body-too-large")
    assert doc["job_id"] == "job-1"
    assert upstream.received == []
    resp = await stack.proxy.post("/pay/upload", data=chunked(25, 4), headers=headers)
    await ok(resp)
    assert upstream.received[0]["body"] == b"z" * 100


async def test_lease_refusals_come_before_body_too_large(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream, max_body_bytes=10)])
    old = await stack.lease("job-1", owner="a", ttl=10)
    clock.advance(11)
    expired = await stack.lease("job-2", owner="a", ttl=5)
    await stack.lease("job-1", owner="b", ttl=10)
    clock.advance(6)
    big = b"x" * 1000

    def headers(token: str, key: str | None = "k") -> dict[str, str]:
        return {"Fencing-Token": token, **({"Idempotency-Key": key} if key else {})}

    resp = await stack.proxy.post("/pay/u", data=big, headers=headers(old["lease_token"]))
    doc = await problem(resp, 409, "stale-generation")
    assert (doc["generation"], doc["highest_generation"]) == (1, 2)
    resp = await stack.proxy.post("/pay/u", data=big, headers=headers(expired["lease_token"]))
    await problem(resp, 409, "lease-expired")
    resp = await stack.proxy.post("/pay/u", data=big, headers=headers(unknown_token()))
    await problem(resp, 403, "invalid-fencing-token")
    # The key row comes before the lease rows.
    resp = await stack.proxy.post("/pay/u", data=big, headers=headers(old["lease_token"], None))
    await problem(resp, 400, "missing-idempotency-key")
    resp = await stack.proxy.post("/pay/u", data=big, headers=headers("fgl_bad", None))
    await problem(resp, 403, "invalid-fencing-token")
    assert upstream.received == []


# -- header hygiene -----------------------------------------------------------------------


async def test_header_hygiene_towards_the_upstream(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(
        upstreams=[
            upstream_config(
                upstream,
                set_headers={"Authorization": "Bearer xyz", "X-Api-Key": "k-123"},
            )
        ]
    )
    lease = await stack.lease("job-1")
    token = lease["lease_token"]
    headers = CIMultiDict(
        [
            ("Fencing-Token", token),
            ("Idempotency-Key", "step-1"),
            ("Connection", "keep-alive, X-Hop-Secret"),
            ("X-Hop-Secret", "drop me"),
            ("Keep-Alive", "timeout=5"),
            ("Proxy-Authorization", "Basic Zm9vOmJhcg=="),
            ("TE", "trailers"),
            ("Trailer", "X-Checksum"),
            ("Proxy-Connection", "keep-alive"),
            ("Fencing-Generation", "99"),
            ("Fencing-Job", "someone-elses-job"),
            ("Authorization", "Bearer worker-should-not-reach"),
            ("X-Forwarded-For", "10.9.8.7"),
            ("X-Forwarded-Proto", "https"),
            ("X-Forwarded-Host", "evil.example"),
            ("X-Request-Id", "req-42"),
            ("Content-Type", "application/json"),
        ]
    )
    resp = await stack.proxy.post("/pay/charges?currency=eur", data=b'{"a":1}', headers=headers)
    await ok(resp)
    [record] = upstream.received
    sent = CIMultiDict(record["headers"])
    for gone in (
        "Fencing-Token",
        "X-Hop-Secret",
        "Keep-Alive",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Proxy-Connection",
        "X-Forwarded-Host",
    ):
        assert gone not in sent, (gone, dict(sent))
    assert token not in repr(record)
    assert sent["Idempotency-Key"] == "step-1"
    assert sent.getall("Fencing-Job") == ["job-1"]
    assert sent.getall("Fencing-Generation") == ["1"]
    assert sent.getall("Authorization") == ["Bearer xyz"]
    assert sent["X-Api-Key"] == "k-123"
    assert sent.getall("X-Forwarded-For") == ["10.9.8.7, 127.0.0.1"]
    assert sent.getall("X-Forwarded-Proto") == ["http"]
    assert sent["X-Request-Id"] == "req-42"
    assert sent["Content-Type"] == "application/json"
    assert record["path"] == "/charges?currency=eur"
    assert record["body"] == b'{"a":1}'


async def test_forwarded_for_without_a_client_header(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    await ok(await stack.write("/pay/x", lease))
    sent = upstream.received[0]["headers"]
    assert sent["X-Forwarded-For"] == "127.0.0.1"
    assert sent["X-Forwarded-Proto"] == "http"


async def test_connection_may_not_strip_protected_headers(
    make_stack: Any, upstream: Upstream
) -> None:
    """Naming the credential or the key in Connection must not let either slip past."""
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    for named in ("Idempotency-Key", "fencing-token"):
        resp = await stack.write("/pay/x", lease, headers={"Connection": named})
        assert resp.status == 400, await resp.text()
        assert resp.content_type == PROBLEM
    assert upstream.received == []


async def test_set_headers_from_the_environment(
    make_stack: Any, upstream: Upstream, tmp_path: Path
) -> None:
    config = tmp_path / "fencegate.toml"
    config.write_text(
        "[[upstreams]]\n"
        'name = "pay"\n'
        f'url = "{upstream.url}"\n'
        'set_headers = { Authorization = "Bearer ${PAY_API_KEY}", X-Tenant = "t-${TENANT}" }\n'
    )
    settings = resolve_secrets(
        load_settings(config, environ={}), environ={"PAY_API_KEY": "sk_live_123", "TENANT": "acme"}
    )
    stack = await make_stack(upstreams=list(settings.upstreams))
    lease = await stack.lease("job-1")
    resp = await stack.write("/pay/x", lease, headers={"Authorization": "Bearer mine"})
    await ok(resp)
    sent = upstream.received[0]["headers"]
    assert sent["Authorization"] == "Bearer sk_live_123"
    assert sent["X-Tenant"] == "t-acme"
    # Pass-through requests get them too: workers never hold the upstream's key.
    resp = await stack.proxy.get("/pay/x")
    assert upstream.received[1]["headers"]["Authorization"] == "Bearer sk_live_123"


async def test_hop_by_hop_headers_of_the_answer_are_dropped(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    upstream.headers = {"X-Charge-Id": "ch_1", "Keep-Alive": "timeout=99", "Trailer": "X-Sum"}
    lease = await stack.lease("job-1")
    resp = await stack.write("/pay/x", lease)
    assert await ok(resp) == b'{"applied": 1}'
    assert resp.headers["X-Charge-Id"] == "ch_1"
    assert "Keep-Alive" not in resp.headers
    assert "Trailer" not in resp.headers


async def test_headers_named_in_the_answers_connection_header_are_dropped(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    upstream.headers = {
        "X-Charge-Id": "ch_1",
        "Connection": "keep-alive, X-Resp-Hop",
        "X-Resp-Hop": "meant for the gateway's hop only",
    }
    lease = await stack.lease("job-1")
    resp = await stack.write("/pay/x", lease)
    await ok(resp)
    assert resp.headers["X-Charge-Id"] == "ch_1"
    assert "X-Resp-Hop" not in resp.headers


# -- paths --------------------------------------------------------------------------------


async def test_dot_segments_are_refused(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    for target in (
        "/pay/../x",
        "/pay/a/../../x",
        "/pay/a/%2e%2e/x",
        "/pay/a/%2E%2E/x",
        "/pay/a/.%2e/x",
        "/pay/./x",
        "/pay/a/%2e/x",
        "/pay/a/..",
        "/pay/a/..?q=1",
    ):
        for method, headers in (
            ("POST", [("Fencing-Token", lease["lease_token"]), ("Idempotency-Key", "k")]),
            ("GET", []),
        ):
            status, response_headers, body = await raw_request(
                stack.proxy, method, target, headers, b"{}"
            )
            assert status == 400, (target, method, status, body)
            assert response_headers["content-type"].startswith(PROBLEM)
    assert upstream.received == []


async def test_ordinary_paths_and_queries_reach_the_upstream(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    status, _, _ = await raw_request(
        stack.proxy,
        "POST",
        "/pay/v1/files/a%20b..c/.hidden/...?x=1&y=a+b&z=%26",
        [("Fencing-Token", lease["lease_token"]), ("Idempotency-Key", "k")],
        b"{}",
    )
    assert status == 201
    assert upstream.received[0]["path"] == "/v1/files/a%20b..c/.hidden/...?x=1&y=a+b&z=%26"


async def test_percent_encoding_reaches_the_upstream_unchanged(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    target = "/v1/a%3Ab/%40c?sig=%2F%3F%40&raw=%zz"
    status, _, _ = await raw_request(
        stack.proxy,
        "POST",
        "/pay" + target,
        [("Fencing-Token", lease["lease_token"]), ("Idempotency-Key", "k")],
        b"{}",
    )
    assert status == 201
    assert upstream.received[0]["path"] == target


# -- large bodies -------------------------------------------------------------------------


async def test_large_request_body_is_forwarded_intact(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    request_body = os.urandom(3 * 1024 * 1024)
    headers = {
        "Fencing-Token": lease["lease_token"],
        "Idempotency-Key": "put-blob",
        "Content-Type": "application/octet-stream",
    }
    resp = await stack.proxy.post(
        "/pay/objects/blob", data=io.BytesIO(request_body), headers=headers
    )
    await ok(resp)
    assert upstream.received[0]["body"] == request_body
    # Unfenced methods forward large bodies the same way.
    resp = await stack.proxy.request("OPTIONS", "/pay/objects/blob", data=io.BytesIO(request_body))
    await ok(resp)
    assert upstream.received[1]["body"] == request_body


async def test_large_response_body_is_streamed_back_intact(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    upstream.body = os.urandom(3 * 1024 * 1024 + 17)
    resp = await stack.write("/pay/objects/blob", lease, key="get-blob")
    assert resp.headers.get("Transfer-Encoding") == "chunked"  # streamed, not buffered
    assert await ok(resp) == upstream.body
    resp = await stack.proxy.get("/pay/objects/blob")
    assert await ok(resp, 201) == upstream.body
    assert len(upstream.received) == 2


async def test_a_duplicate_of_a_large_answer_is_never_a_truncated_replay(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-1")
    upstream.body = os.urandom(2 * 1024 * 1024)
    first = await stack.write("/pay/objects", lease, key="big-answer")
    assert await ok(first) == upstream.body
    again = await stack.write("/pay/objects", lease, key="big-answer")
    body = await again.read()
    assert len(upstream.received) == 1  # never a second side effect
    if again.status == 201:
        # A replay must be the stored answer, not a truncated one.
        assert again.headers.get("Idempotent-Replayed") == "true"
        assert body == upstream.body
    else:
        # Or the gateway says it cannot replay it, as a problem document.
        assert again.content_type == PROBLEM
