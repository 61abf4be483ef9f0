"""The audit of self-answered requests through ``GET /admin/rejections``, on SQLite and
PostgreSQL: what an entry holds, filters, pagination, bad input, what is not audited,
that the fencing token never appears whole, and retention.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import socket
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa

from gateway.config.gateway import hostname_replica
from gateway.fencing import fence
from gateway.service.admin import GATEWAY_STATE
from gateway.service.server import SETTINGS, upkeep
from lease_core.api import STORE
from tests.gateway_helpers import PROBLEM
from tests.support import FakeClock, Upstream, upstream_config

ENTRY_KEYS = {
    "id",
    "at",
    "reason",
    "status",
    "job_id",
    "source",
    "generation",
    "highest_generation",
    "owner",
    "upstream",
    "method",
    "path",
    "idempotency_key",
    "client",
    "replica",
    "fingerprint",
    "count",
    "last_at",
}
DAY = 86400.0


def epoch(text: str) -> float:
    assert text.endswith("Z"), text
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


async def page(stack: Any, **query: str) -> dict[str, Any]:
    resp = await stack.control.get("/admin/rejections", params=query)
    assert resp.status == 200, await resp.text()
    doc: dict[str, Any] = await resp.json()
    assert set(doc) == {"items", "next_cursor"}
    return doc


async def send(stack: Any, path: str, token: str | None, key: str | None, body: bytes) -> Any:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Fencing-Token"] = token
    if key is not None:
        headers["Idempotency-Key"] = key
    resp = await stack.proxy.post(path, data=body, headers=headers)
    await resp.read()
    return resp


async def test_every_self_answered_request_is_audited_with_its_details(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream, max_body_bytes=50)],
        gateway={"ordering_wait_seconds": 0.5},
    )
    a = await stack.lease("job-1", owner="worker-a", ttl=10)
    body = b'{"amount": 5}'
    # (path, token, key, body) -> the reason and status we expect in the audit
    await send(stack, "/pay/charges", a["lease_token"], "step-1", body)  # forwarded
    expected: list[tuple[str, int]] = []

    async def expect(reason: str, status: int, *args: Any) -> Any:
        resp = await send(stack, *args)
        assert resp.status == status, await resp.text()
        expected.append((reason, status))
        return resp

    await expect("unknown-upstream", 404, "/nope/charges", a["lease_token"], "k", body)
    await expect("missing-fencing-token", 428, "/pay/charges", None, "k", body)
    await expect("invalid-fencing-token", 403, "/pay/charges", "fgl_" + "x" * 32, "k", body)
    await expect("missing-idempotency-key", 400, "/pay/charges", a["lease_token"], None, body)
    await expect("body-too-large", 413, "/pay/charges", a["lease_token"], "big", b"x" * 51)
    await expect("idempotency-key-reused", 422, "/pay/charges", a["lease_token"], "step-1", b"{}")
    await expect("idempotent-replay", 201, "/pay/charges", a["lease_token"], "step-1", body)
    clock.advance(10)
    await expect("lease-expired", 409, "/pay/charges", a["lease_token"], "step-2", body)
    b = await stack.lease("job-1", owner="worker-b", ttl=10)
    await expect("stale-generation", 409, "/pay/charges?x=1", a["lease_token"], "step-2", body)
    await expect("idempotent-replay", 201, "/pay/charges", b["lease_token"], "step-1", body)
    upstream.status = 504
    await send(stack, "/pay/charges", b["lease_token"], "step-3", body)  # forwarded
    await expect("outcome-unknown", 409, "/pay/charges", b["lease_token"], "step-3", body)

    items = (await page(stack))["items"]
    assert [(e["reason"], e["status"]) for e in items] == expected[::-1]
    for entry in items:
        assert set(entry) == ENTRY_KEYS  # no bodies unless configured
        assert entry["client"] == "127.0.0.1"
        assert entry["method"] == "POST"
    ids = [e["id"] for e in items]
    assert ids == sorted(ids, reverse=True)

    by_reason = {e["reason"]: e for e in reversed(items)}  # the newest of each reason
    stale = by_reason["stale-generation"]
    assert epoch(stale["at"]) == pytest.approx(clock.now, abs=0.01)
    assert stale["job_id"] == "job-1"
    assert (stale["generation"], stale["highest_generation"]) == (1, 2)
    assert stale["owner"] == "worker-a"
    assert stale["upstream"] == "pay"
    assert stale["path"] == "/pay/charges"  # the query is not kept (see below)
    assert stale["idempotency_key"] == "step-2"
    assert stale["fingerprint"] == fence.fingerprint("POST", "pay", "charges", "x=1", body)

    replay = by_reason["idempotent-replay"]
    assert (replay["generation"], replay["owner"], replay["status"]) == (2, "worker-b", 201)
    assert replay["fingerprint"] == fence.fingerprint("POST", "pay", "charges", "", body)

    expired = by_reason["lease-expired"]
    assert (expired["generation"], expired["highest_generation"]) == (1, 1)
    assert epoch(expired["at"]) == pytest.approx(clock.now, abs=0.01)

    too_large = by_reason["body-too-large"]
    assert (too_large["job_id"], too_large["generation"]) == ("job-1", 1)
    assert too_large["idempotency_key"] == "big"

    for reason in ("unknown-upstream", "missing-fencing-token", "invalid-fencing-token"):
        entry = by_reason[reason]
        assert entry["job_id"] is None and entry["generation"] is None
        assert entry["owner"] is None and entry["highest_generation"] is None
    assert by_reason["missing-fencing-token"]["fingerprint"] is None
    assert by_reason["unknown-upstream"]["upstream"] is None
    assert by_reason["missing-fencing-token"]["upstream"] == "pay"
    assert by_reason["missing-idempotency-key"]["idempotency_key"] is None


async def test_upstream_failures_answered_by_the_gateway_are_audited(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(
        upstreams=[
            upstream_config(upstream, timeout_seconds=0.2),
            {"name": "down", "url": "http://127.0.0.1:9"},
        ],
        gateway={"ordering_wait_seconds": 0.5},
    )
    lease = await stack.lease("job-1")
    resp = await stack.write("/down/x", lease, key="k1")
    assert resp.status == 502
    upstream.delay = 0.5
    resp = await stack.write("/pay/x", lease, key="k2")
    assert resp.status == 504
    items = (await page(stack))["items"]
    assert [(e["reason"], e["status"], e["upstream"]) for e in items] == [
        ("upstream-timeout", 504, "pay"),
        ("upstream-unavailable", 502, "down"),
    ]


async def test_filters(make_stack: Any, upstream: Upstream, clock: FakeClock) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream), upstream_config(upstream, name="mail")]
    )
    one = await stack.lease("job-1", ttl=600)
    await stack.lease("job-1", ttl=600)  # the same owner again: `one` is now stale
    two = await stack.lease("job-2", ttl=600)
    await stack.lease("job-2", ttl=600)
    t0 = clock.now
    await stack.write("/pay/x", one)  # stale, job-1, pay, t0
    clock.advance(100)
    await stack.write("/mail/x", two)  # stale, job-2, mail, t0+100
    clock.advance(100)
    await stack.write("/mail/x", None)  # missing token, mail, t0+200
    clock.advance(100)
    await stack.write("/pay/x", {"lease_token": "fgl_nope"})  # invalid token, pay, t0+300

    async def seen(**query: str) -> list[tuple[str, str | None, str]]:
        items = (await page(stack, **query))["items"]
        return [(e["reason"], e["job_id"], e["path"]) for e in items]

    assert await seen(job_id="job-2") == [("stale-generation", "job-2", "/mail/x")]
    assert await seen(job_id="job-1") == [("stale-generation", "job-1", "/pay/x")]
    assert await seen(job_id="job-3") == []
    assert await seen(reason="stale-generation") == [
        ("stale-generation", "job-2", "/mail/x"),
        ("stale-generation", "job-1", "/pay/x"),
    ]
    assert await seen(reason="lease-expired") == []
    assert await seen(upstream="pay") == [
        ("invalid-fencing-token", None, "/pay/x"),
        ("stale-generation", "job-1", "/pay/x"),
    ]
    assert await seen(upstream="mail", reason="missing-fencing-token") == [
        ("missing-fencing-token", None, "/mail/x")
    ]
    # since is inclusive, until exclusive; epoch seconds or RFC 3339.
    window = await seen(since=str(t0 + 100), until=str(t0 + 300))
    assert window == [
        ("missing-fencing-token", None, "/mail/x"),
        ("stale-generation", "job-2", "/mail/x"),
    ]
    assert await seen(since=rfc3339(t0 + 100), until=rfc3339(t0 + 300)) == window
    assert len(await seen(since=str(t0 + 150))) == 2
    assert len(await seen(until=str(t0 + 150))) == 2
    assert await seen(since=str(t0 + 1000)) == []
    assert await seen(since=rfc3339(t0 + 50), upstream="mail", job_id="job-2") == [
        ("stale-generation", "job-2", "/mail/x")
    ]
    assert upstream.received == []


async def test_each_entry_names_the_replica_that_answered(
    make_stack: Any, upstream: Upstream
) -> None:
    """Two replicas on one database: every entry names the one that answered, the
    ``replica`` filter keeps one replica's entries, and a grouped row (requests without a
    lease) counts one replica's requests only. Unnamed, a replica is its hostname."""
    a = await make_stack(upstreams=[upstream_config(upstream)], gateway={"replica_name": "gw-a"})
    b = await make_stack(upstreams=[upstream_config(upstream)], gateway={"replica_name": "gw-b"})
    old = await a.lease("job-1", ttl=600)
    await a.lease("job-1", ttl=600)  # `old` is now stale
    assert (await a.write("/pay/x", old, key="s1")).status == 409
    assert (await b.write("/pay/x", old, key="s2")).status == 409
    for stack in (a, b, b):  # the same group on both replicas: a row per replica
        assert (await stack.write("/pay/charges", None)).status == 428
    await a.audit()  # each replica's own entries are written before it reads
    items = await b.audit()
    assert sorted((e["replica"], e["reason"], e["count"]) for e in items) == [
        ("gw-a", "missing-fencing-token", 1),
        ("gw-a", "stale-generation", 1),
        ("gw-b", "missing-fencing-token", 2),
        ("gw-b", "stale-generation", 1),
    ]
    only_a = await b.audit(replica="gw-a")
    assert {e["replica"] for e in only_a} == {"gw-a"} and len(only_a) == 2
    assert [e["idempotency_key"] for e in only_a if e["job_id"]] == ["s1"]
    # A name no entry holds cannot match: refused, naming those the audit holds.
    resp = await a.control.get("/admin/rejections", params={"replica": "gw-c"})
    assert resp.status == 400
    doc = await resp.json(content_type=None)
    assert doc["field"] == "replica"
    assert doc["detail"] == (
        "replica: 'gw-c' answered nothing in the audit; replicas in the audit: gw-a, gw-b."
    )
    assert await a.audit(replica="gw-b", reason="stale-generation", job_id="job-1") == [
        e for e in items if e["replica"] == "gw-b" and e["job_id"] == "job-1"
    ]
    for bad in ("", "-gw", "gw a", "g" * 101):
        resp = await a.control.get("/admin/rejections", params={"replica": bad})
        if bad == "":  # an empty filter is no filter, as for the others
            assert resp.status == 200
            continue
        assert resp.status == 400, bad
        doc = await resp.json(content_type=None)
        assert doc["field"] == "replica" and "replica name" in doc["detail"]

    unnamed = await make_stack(upstreams=[upstream_config(upstream)])
    assert (await unnamed.write("/pay/y", None)).status == 428
    [entry] = await unnamed.audit(upstream="pay", since="0", limit="1")
    assert entry["replica"] == hostname_replica(socket.gethostname())


async def test_pagination_newest_first(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    for i in range(7):
        resp = await stack.proxy.get(f"/nope/{i}")
        assert resp.status == 404

    seen: list[dict[str, Any]] = []
    cursor: str | None = None
    sizes = []
    while True:
        query = {"limit": "3", **({"cursor": cursor} if cursor else {})}
        doc = await page(stack, **query)
        sizes.append(len(doc["items"]))
        seen.extend(doc["items"])
        cursor = doc["next_cursor"]
        if cursor is None:
            break
        assert isinstance(cursor, str) and cursor
    assert sizes == [3, 3, 1]
    assert [e["path"] for e in seen] == [f"/nope/{i}" for i in reversed(range(7))]
    assert len({e["id"] for e in seen}) == 7
    # A page that holds exactly the rest has no next cursor.
    assert (await page(stack, limit="7"))["next_cursor"] is None
    doc = await page(stack, limit="6")
    rest = await page(stack, limit="6", cursor=doc["next_cursor"])
    assert [e["path"] for e in rest["items"]] == ["/nope/0"] and rest["next_cursor"] is None
    # Entries written after a cursor was handed out do not show up behind it.
    first = await page(stack, limit="2")
    await stack.proxy.get("/nope/new")
    after = await page(stack, limit="2", cursor=first["next_cursor"])
    assert [e["path"] for e in after["items"]] == ["/nope/4", "/nope/3"]
    # The default page holds them all.
    assert len((await page(stack))["items"]) == 8


async def test_bad_query_is_a_400_problem(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    await stack.proxy.get("/nope/x")
    for query in (
        {"cursor": "zzz"},
        {"cursor": "YTEyYQ"},  # "a12a"
        {"cursor": "%%%"},
        {"since": "yesterday"},
        {"until": "2026-13-45T00:00:00Z"},
        {"since": "nan"},
        {"limit": "0"},
        {"limit": "ten"},
        {"limit": "-1"},
    ):
        resp = await stack.control.get("/admin/rejections", params=query)
        assert resp.status == 400, (query, await resp.text())
        assert resp.content_type == PROBLEM
        doc = await resp.json(content_type=None)
        assert doc["status"] == 400 and doc["reason"] and doc["detail"]


async def test_forwarded_requests_are_not_audited(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream, require_idempotency_key=False)])
    lease = await stack.lease("job-1")
    for status in (201, 404, 500, 502):
        upstream.status = status
        resp = await stack.write("/pay/x", lease, key=f"k{status}")
        assert resp.status == status
        await resp.read()
    upstream.status = 200
    await (await stack.write("/pay/x", lease, key=None)).read()
    await (await stack.proxy.get("/pay/x")).read()
    await (await stack.proxy.delete("/pay/x", headers={"Fencing-Token": "nope"})).read()
    assert len(upstream.received) == 6
    [only] = (await page(stack))["items"]  # the one request answered by the gateway
    assert (only["reason"], only["method"]) == ("invalid-fencing-token", "DELETE")


async def test_the_fencing_token_never_appears_whole(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream, max_body_bytes=20)])
    old = await stack.lease("job-1", owner="a", ttl=10)
    await (await stack.write("/pay/x", old, key="k1")).read()
    clock.advance(11)
    new = await stack.lease("job-1", owner="b", ttl=10)
    expired = await stack.lease("job-2", owner="c", ttl=1)
    clock.advance(2)
    unknown = "fgl_" + secrets.token_urlsafe(24)
    tokens = [old["lease_token"], new["lease_token"], expired["lease_token"], unknown]
    answers = []
    for token, key, data in (
        (old["lease_token"], "k2", b"{}"),  # stale
        (new["lease_token"], "k1", b'{"amount": 1}'),  # replay
        (new["lease_token"], "k1", b"{}"),  # reused
        (new["lease_token"], None, b"{}"),  # missing key
        (new["lease_token"], "k9", b"x" * 100),  # too large
        (expired["lease_token"], "k1", b"{}"),  # expired
        (unknown, "k1", b"{}"),  # unknown
        (new["lease_token"] + "x", "k1", b"{}"),  # malformed, but holding a real one
    ):
        resp = await send(stack, "/pay/x", token, key, data)
        assert resp.status != 201 or resp.headers["Idempotent-Replayed"] == "true"
        answers.append(await resp.text())
    items = (await page(stack))["items"]
    # The unknown and the malformed token are one group (same reason, path and client).
    assert len(items) == 7 and sum(e["count"] for e in items) == 8
    dumped = json.dumps(items) + "".join(answers)
    for token in tokens:
        assert token not in dumped
        assert token[4:] not in dumped  # not even without its prefix
    # A redacted form may appear; the secret part may not.
    assert not re.search(r"fgl_[A-Za-z0-9_-]{32}", dumped)


async def test_bodies_are_audited_when_configured(make_stack: Any, upstream: Upstream) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)], gateway={"audit_bodies": True})
    lease = await stack.lease("job-1")
    await stack.lease("job-1")  # the first lease is now stale
    resp = await send(stack, "/pay/x", lease["lease_token"], "k", b'{"amount": 5}')
    assert resp.status == 409
    [entry] = (await page(stack))["items"]
    assert entry["body"] == "eyJhbW91bnQiOiA1fQ=="  # base64 of the request body


async def test_retention_purges_old_entries(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(
        upstreams=[upstream_config(upstream)], gateway={"audit_retention_days": 1}
    )
    app = stack.control.app
    old = await stack.lease("job-1", owner="a", ttl=10)
    clock.advance(11)
    new = await stack.lease("job-1", owner="b", ttl=600)
    await stack.write("/pay/x", old, key="first")  # stale, at t
    clock.advance(0.5 * DAY)
    await stack.write("/pay/x", old, key="second")  # stale, at t + 0.5 d
    clock.advance(0.4 * DAY)
    await upkeep(app[SETTINGS], app[STORE], app[GATEWAY_STATE])
    assert [e["idempotency_key"] for e in (await page(stack))["items"]] == ["second", "first"]
    # Within the audit's retention an old token is still recognised as stale.
    resp = await stack.write("/pay/x", old, key="third")
    assert (await resp.json())["reason"] == "stale-generation"

    clock.advance(0.2 * DAY)  # "first" is 1.1 days old, "second" 0.6, "third" 0.2
    await upkeep(app[SETTINGS], app[STORE], app[GATEWAY_STATE])
    assert [e["idempotency_key"] for e in (await page(stack))["items"]] == ["third", "second"]
    # Past retention the old grant may be forgotten (stale or invalid), never forwarded.
    resp = await stack.write("/pay/x", old, key="fourth")
    assert (await resp.json())["reason"] in ("stale-generation", "invalid-fencing-token")
    assert upstream.received == []

    # Audit.purge itself: everything older than a given age goes, and says how many.
    clock.advance(0.5 * DAY)
    assert await app[GATEWAY_STATE].audit.purge(0.8 * DAY) == 1  # "second"
    assert [e["idempotency_key"] for e in (await page(stack))["items"]] == ["fourth", "third"]
    assert await app[GATEWAY_STATE].audit.purge(0.8 * DAY) == 0
    assert new["generation"] == 2


async def test_the_audit_is_purged_in_batches(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    audit = stack.control.app[GATEWAY_STATE].audit
    old = await stack.lease("job-1", owner="a", ttl=10)
    clock.advance(11)
    await stack.lease("job-1", owner="b", ttl=600)
    for i in range(11):
        await stack.write("/pay/x", old, key=f"k{i}")  # stale: audited
    clock.advance(DAY)
    assert await audit.purge(0.5 * DAY, batch=3) == 11
    assert (await page(stack))["items"] == []


async def test_query_string_kept_out_of_the_audit_unless_allowed(
    make_stack: Any, upstream: Upstream
) -> None:
    """The query can carry credentials (``?api_key=``): the audit keeps the path only,
    plus the parameters an upstream names in ``audit_query_params``, in the order sent."""
    stack = await make_stack(
        upstreams=[
            upstream_config(upstream),
            upstream_config(upstream, name="mail", audit_query_params=["page", "to"]),
        ]
    )
    secret = "sk_live_" + secrets.token_hex(8)
    await stack.write(f"/pay/charges?api_key={secret}&page=2", None)
    await stack.write(f"/mail/send?api_key={secret}&to=x&page=2&page=3", None)
    await stack.write(f"/mail/send?api_key={secret}", None)
    await stack.write(f"/nope/x?api_key={secret}", None)
    items = await stack.audit()
    assert [e["path"] for e in items] == [
        "/nope/x",
        "/mail/send",
        "/mail/send?to=x&page=2&page=3",
        "/pay/charges",
    ]
    assert secret not in json.dumps(items)


@pytest.mark.timeout(600)  # 5,000 requests through the test client, slow on a busy machine
async def test_requests_without_a_lease_are_audited_in_bounded_rows(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    """5,000 requests without a valid lease (made-up tokens, none, varying paths): the
    audit holds at most ``audit_unauthenticated_groups`` rows per bucket plus one
    overflow row per reason, their counts add up to every request, and they are purged
    after ``audit_unauthenticated_retention_days`` while entries of real leases stay."""
    groups = 20
    stack = await make_stack(
        upstreams=[upstream_config(upstream)],
        gateway={
            "audit_unauthenticated_groups": groups,
            "audit_unauthenticated_bucket_seconds": 60,
            "audit_unauthenticated_retention_days": 1,
            "audit_retention_days": 30,
        },
    )
    old = await stack.lease("job-1", owner="a", ttl=600)
    await stack.lease("job-1", owner="a", ttl=600)  # `old` is now stale
    await stack.write("/pay/real", old, key="stale-1")  # a real lease's refusal: its own row

    def made_up() -> dict[str, str]:
        return {"lease_token": "fgl_" + secrets.token_urlsafe(24)}

    async def hostile(i: int) -> None:
        kind = i % 5
        if kind in (0, 1):
            resp = await stack.write("/pay/charges", made_up(), key=f"k{i}")
        elif kind == 2:
            resp = await stack.write("/pay/charges", None, key=f"k{i}")
        else:
            resp = await stack.write(f"/pay/p/{i}" + "x" * 3000, made_up(), key=f"k{i}")
        assert resp.status in (403, 428), await resp.text()
        await resp.read()

    total = 5000
    first = (0, 2)  # one of each /pay/charges kind first: they open their own groups
    for i in first:
        await hostile(i)
    for start in range(0, total, 100):
        batch = [i for i in range(start, start + 100) if i not in first]
        await asyncio.gather(*(hostile(i) for i in batch))

    items = await stack.audit(limit="500")
    grouped = [e for e in items if e["job_id"] is None]
    reasons = {e["reason"] for e in grouped}
    assert reasons == {"invalid-fencing-token", "missing-fencing-token"}
    assert len(grouped) <= groups + len(reasons), len(grouped)
    assert sum(e["count"] for e in grouped) == total
    assert all(len(e["path"]) <= 200 for e in grouped)
    by_path = {(e["reason"], e["path"]): e for e in grouped}
    assert by_path[("invalid-fencing-token", "/pay/charges")]["count"] == 2000
    assert by_path[("missing-fencing-token", "/pay/charges")]["count"] == 1000
    overflow = by_path[("invalid-fencing-token", "*")]
    assert overflow["method"] == "*" and overflow["count"] > 1000
    [real] = [e for e in items if e["job_id"] is not None]
    assert (real["reason"], real["count"], real["idempotency_key"]) == (
        "stale-generation",
        1,
        "stale-1",
    )

    # The next bucket starts new rows; the old ones keep their counts.
    clock.advance(60)
    await stack.write("/pay/charges", None)
    newest = (await stack.audit(limit="1"))[0]
    assert (newest["reason"], newest["count"]) == ("missing-fencing-token", 1)

    # Past the shorter retention they go; the real lease's entry stays.
    clock.advance(1.1 * DAY)
    app = stack.control.app
    await upkeep(app[SETTINGS], app[STORE], app[GATEWAY_STATE])
    assert [(e["reason"], e["job_id"]) for e in await stack.audit()] == [
        ("stale-generation", "job-1")
    ]


async def test_entries_given_at_once_are_written_in_order(engine: Any) -> None:
    """Entries written behind their answers keep the order they were given in, across
    runs of real leases' and grouped entries and past one batch (64) of them."""
    from gateway.records.audit import Audit, AuditEntry, AuditQuery
    from lease_core.store import LeaseStore

    audit = Audit(LeaseStore(engine))
    given = []
    for i in range(150):
        job = None if i % 50 == 49 else f"job-{i % 7}"  # a grouped one now and then
        entry = AuditEntry(
            reason="stale-generation",
            status=409,
            method="POST",
            path=f"/pay/{i}",
            job_id=job,
            generation=1 if job else None,
        )
        audit.record(entry)
        given.append(entry.path)
    items, cursor = await audit.query(AuditQuery(limit=500))
    assert cursor is None
    assert [item["path"] for item in items][::-1] == given
    await audit.close()


@pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_a_held_batch_of_entries_is_not_overtaken_by_the_next(engine: Any) -> None:
    """Two batches (64 each) of entries given at once stay in order even when the first
    one's statement is held up: the writer sends a run past one batch a batch at a time.
    The shared statement has two lanes, so the second batch could otherwise go out on
    another connection while the first waits, and take the ids (the audit's order)
    before the first one's rows.

    Held here: another transaction holds an uncommitted row with the id the audit's
    sequence gives next, so the batch whose insert takes that id waits on the row's
    primary key until it is rolled back. Sent a batch at a time, that is the first one,
    and nothing is written meanwhile; with both lanes in flight, the other batch is
    written while it waits, and its entries came before or among the first's."""
    from gateway.records.audit import Audit, AuditEntry, AuditQuery
    from lease_core.statement import MAX_BATCH
    from lease_core.store import LeaseStore

    async def scalar(sql: str, **params: Any) -> Any:
        async with engine.connect() as conn:
            return (await conn.execute(sa.text(sql), params)).scalar()

    audit = Audit(LeaseStore(engine))
    given = [f"/pay/{i}" for i in range(2 * MAX_BATCH)]
    async with engine.connect() as locker:
        pid = (await locker.execute(sa.text("SELECT pg_backend_pid()"))).scalar()
        await locker.execute(
            sa.text(
                "INSERT INTO audit_log (id, at, reason, status, method, path)"
                " VALUES (nextval(pg_get_serial_sequence('audit_log', 'id')) + 1,"
                " 0, 'held', 0, 'GET', '/held')"
            )
        )
        for path in given:
            audit.record(
                AuditEntry(
                    reason="stale-generation",
                    status=409,
                    method="POST",
                    path=path,
                    job_id="job-1",
                    generation=1,
                )
            )
        waiting = "SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"
        for _ in range(500):  # until the first batch's insert waits on the held row
            if await scalar(waiting, pid=pid):
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("no insert of the audit waited on the held row")
        for _ in range(100):  # a batch sent meanwhile has time to be written
            if await scalar("SELECT count(*) FROM audit_log"):
                break
            await asyncio.sleep(0.01)
        await locker.rollback()
    items, cursor = await audit.query(AuditQuery(limit=500))
    assert cursor is None
    assert [item["path"] for item in items][::-1] == given
    await audit.close()


@pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_entries_given_one_at_a_time_share_statements(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replays and refusals that come one after another, a millisecond apart, do not
    cost a round trip each for their audit: the writer gathers them (``GATHER_SECONDS``)
    into one statement of the shared form."""
    from gateway.records.audit import Audit, AuditEntry, AuditQuery
    from lease_core.db import direct_of
    from lease_core.store import LeaseStore

    direct = direct_of(engine)
    sent: list[int] = []  # each statement that wrote entries: how many
    shared, alone = direct._fetch_all, direct.fetchrow  # type: ignore[attr-defined]

    async def counting_shared(statement: Any, params: Any) -> Any:
        sent.append(len(params["reason"]))
        return await shared(statement, params)

    async def counting_alone(statement: Any, params: Any) -> Any:
        sent.append(1)
        return await alone(statement, params)

    monkeypatch.setattr(direct, "_fetch_all", counting_shared)
    monkeypatch.setattr(direct, "fetchrow", counting_alone)
    audit = Audit(LeaseStore(engine))
    for i in range(20):
        audit.record(
            AuditEntry(
                reason="idempotent-replay", status=200, method="POST", path=f"/{i}", job_id="j"
            )
        )
        await asyncio.sleep(0.001)
    items, _ = await audit.query(AuditQuery(limit=100))
    assert [item["path"] for item in items][::-1] == [f"/{i}" for i in range(20)]
    assert sum(sent) == 20 and len(sent) <= 5, sent
    await audit.close()


async def test_entries_past_the_pending_bound_are_dropped_and_logged(
    engine: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A database that cannot keep up must not make the gateway's memory grow: past
    ``MAX_PENDING`` entries waiting, a new one is dropped, with a warning."""
    from gateway.records import audit as audit_module
    from gateway.records.audit import Audit, AuditEntry, AuditQuery
    from lease_core.store import LeaseStore

    monkeypatch.setattr(audit_module, "MAX_PENDING", 30)
    audit = Audit(LeaseStore(engine))
    with caplog.at_level("WARNING", logger="fencegate.audit"):
        for i in range(35):  # given at once: none is written before the 31st
            audit.record(
                AuditEntry(
                    reason="stale-generation",
                    status=409,
                    method="POST",
                    path=f"/{i}",
                    job_id="j",
                    generation=1,
                )
            )
    items, _ = await audit.query(AuditQuery(limit=100))
    assert sorted(item["path"] for item in items) == sorted(f"/{i}" for i in range(30))
    lost = [r for r in caplog.records if "audit entry lost" in r.getMessage()]
    assert len(lost) == 5
    await audit.close()
