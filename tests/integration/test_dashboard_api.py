"""The dashboard's own JSON reads and its files, on SQLite and PostgreSQL: refusals per
time bucket and reason (made by real requests through the gateway), bucket boundaries,
a job's timeline, bad parameters, and the admin token on every path under /admin/ui.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

from gateway.service import dashboard
from tests.support import FakeClock, Upstream, upstream_config

PROBLEM = "application/problem+json"
OVER_TIME = "/admin/ui/api/refusals-over-time"
T0 = 1_800_000_000.0  # the FakeClock's start: a multiple of 60, 300 and 3600
ADMIN = "a" * 20
WORKER = "w" * 20


def epoch(text: str) -> float:
    assert text.endswith("Z"), text
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@pytest.fixture
async def make_stack(make_stack: Any) -> AsyncIterator[Any]:
    """The shared factory, plus closing each replica's apps before the engine is disposed."""
    stacks: list[Any] = []

    async def make(**overrides: Any) -> Any:
        stack = await make_stack(**overrides)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        await stack.control.close()
        await stack.proxy.close()


async def get_json(stack: Any, path: str, status: int = 200, **query: Any) -> Any:
    resp = await stack.control.get(path, params={k: str(v) for k, v in query.items()})
    text = await resp.text()
    assert resp.status == status, text
    return await resp.json(content_type=None)


async def over_time(stack: Any, **query: Any) -> dict[str, Any]:
    doc: dict[str, Any] = await get_json(stack, OVER_TIME, **query)
    return doc


async def refuse(stack: Any) -> None:
    """One refusal that needs no lease: a fenced write without a token."""
    resp = await stack.write("/pay/charges", None)
    assert resp.status == 428, await resp.text()


async def held_key(stack: Any, job_id: str, key: str) -> None:
    """Wait until the gateway has recorded the key's outcome as unknown (the answer can
    reach the client a moment before its record is settled)."""
    for _ in range(200):
        items = (await get_json(stack, "/admin/unknown-outcomes"))["items"]
        if any(i["job_id"] == job_id and i["key"] == key for i in items):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{job_id}/{key} never became an unknown outcome")


# -- refusals over time ------------------------------------------------------------------


async def test_counts_per_bucket_match_the_audit_of_real_refusals(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    first = await stack.lease("job-1", owner="a", ttl=300)
    assert (await stack.write("/pay/charges", first, key="k1")).status == 201  # forwarded
    clock.advance(5)
    second = await stack.lease("job-1", owner="a", ttl=300)  # re-acquired: gen 1 is stale
    assert (await stack.write("/pay/charges", first, key="k2")).status == 409
    assert (await stack.write("/pay/charges", second, key=None)).status == 400
    assert (await stack.write("/pay/charges", first, key="k3")).status == 409
    clock.advance(60)  # the next minute
    assert (await stack.write("/pay/charges", None)).status == 428
    bad = {"Fencing-Token": "fgl_" + "x" * 32}
    assert (await stack.write("/pay/charges", None, headers=bad)).status == 403
    assert (await stack.write("/pay/charges", second, key="k1")).status == 201  # replay
    other = {"amount": 2}
    assert (await stack.write("/pay/charges", second, key="k1", body=other)).status == 422
    clock.advance(200)  # outside the window asked for below
    assert (await stack.write("/pay/charges", None)).status == 428

    entries = await stack.audit(limit="500")
    expected: dict[int, Counter[str]] = {}
    for entry in entries:
        at = epoch(entry["at"])
        if T0 <= at < T0 + 120:
            expected.setdefault(int((at - T0) // 60), Counter())[entry["reason"]] += 1
    assert expected == {
        0: Counter({"stale-generation": 2, "missing-idempotency-key": 1}),
        1: Counter(
            {
                "missing-fencing-token": 1,
                "invalid-fencing-token": 1,
                "idempotent-replay": 1,
                "idempotency-key-reused": 1,
            }
        ),
    }

    # Replays are not refusals: counted apart, never among the charted reasons.
    replays = {i: c.pop("idempotent-replay", 0) for i, c in expected.items()}
    assert replays == {0: 0, 1: 1}
    doc = await over_time(stack, since=T0, until=T0 + 120, bucket_seconds=60)
    assert doc["bucket_seconds"] == 60
    assert (doc["since"], doc["until"]) == (rfc3339(T0), rfc3339(T0 + 120))
    assert [b["start"] for b in doc["buckets"]] == [rfc3339(T0), rfc3339(T0 + 60)]
    assert [b["end"] for b in doc["buckets"]] == [rfc3339(T0 + 60), rfc3339(T0 + 120)]
    for index, bucket in enumerate(doc["buckets"]):
        assert bucket["counts"] == dict(expected[index])
        assert bucket["total"] == sum(expected[index].values())
        assert bucket["replays"] == replays[index]
    assert doc["totals"] == dict(expected[0] + expected[1])
    assert "idempotent-replay" not in doc["reasons"]
    assert doc["replays"] == 1
    # Reasons in the gateway's table order, the same order every time (stable colours).
    assert doc["reasons"] == [r for r in doc["known_reasons"] if r in doc["totals"]]
    assert {"stale-generation", "outcome-unknown", "idempotent-replay"} <= set(doc["known_reasons"])

    # Filters: one upstream, one job.
    # (An upstream neither configured nor audited is a typo: 400 naming the configured ones.)
    resp = await stack.control.get(OVER_TIME, params={"upstream": "nope"})
    assert resp.status == 400 and "configured: pay" in await resp.text()
    empty = await over_time(stack, since=T0 + 1000, until=T0 + 1060, upstream="pay")
    assert empty["totals"] == {}
    job = await over_time(stack, since=T0, until=T0 + 120, bucket_seconds=60, job_id="job-1")
    # (A missing key is refused before the token is looked at: no job in that entry.)
    assert job["totals"] == {"stale-generation": 2, "idempotency-key-reused": 1}
    assert job["replays"] == 1

    # No window named: the last day up to the store's clock, every entry in it.
    clock.advance(1)
    default = await over_time(stack)
    assert epoch(default["until"]) == pytest.approx(clock.now, abs=0.01)
    assert epoch(default["since"]) == pytest.approx(clock.now - 86400, abs=0.01)
    assert default["bucket_seconds"] == 900
    replayed = sum(1 for e in entries if e["reason"] == "idempotent-replay")
    assert replayed == default["replays"] == 1
    assert sum(default["totals"].values()) == len(entries) - replayed
    assert len(default["buckets"]) <= 120
    assert sum(b["total"] for b in default["buckets"]) == len(entries) - replayed
    assert sum(b["replays"] for b in default["buckets"]) == replayed
    recent = await over_time(stack, window_seconds=60)
    assert recent["totals"] == {"missing-fencing-token": 1}


async def test_the_audit_table_shows_the_owner(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    """The dashboard's table reads ``/admin/rejections`` (as app.js does) and shows each
    entry's owner: the lease's owner where a lease was behind it, none where not."""
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    first = await stack.lease("job-o", owner="worker-a", ttl=5)
    assert (await stack.write("/pay/charges", first, key="k1")).status == 201
    clock.advance(10)
    second = await stack.lease("job-o", owner="worker-b", ttl=300)  # reclaimed: first is stale
    assert (await stack.write("/pay/charges", first, key="k2")).status == 409
    assert (await stack.write("/pay/charges", second, key="k1")).status == 201  # replay
    assert (await stack.write("/pay/charges", None)).status == 428
    resp = await stack.control.get("/admin/rejections", params={"limit": "10"})
    assert resp.status == 200
    owners = {(i["reason"], i["owner"]) for i in (await resp.json())["items"]}
    assert owners == {
        ("stale-generation", "worker-a"),
        ("idempotent-replay", "worker-b"),
        ("missing-fencing-token", None),
    }
    ui = dashboard.UI
    html = (ui / "index.html").read_text(encoding="utf-8")
    header = re.findall(r"<th[^>]*>([^<]+)</th>", html[html.index('id="refusals-table"') :])
    script = (ui / "app.js").read_text(encoding="utf-8")
    # The refusals table: one header per cell app.js fills in, the owner and the replica
    # among them.
    table = header[: header.index("Replica") + 1]
    assert "Owner" in table and "clip(item.owner)" in script
    assert "replicaButton(item.replica)" in script
    row = script[script.index("async function loadRefusals") :]
    row = row[: row.index("state.rows +=")]
    assert len(re.findall(r'el\(\s*"td"', row)) == len(table)
    assert f'colSpan: {len(table)}, className: "empty"' in script


async def test_forwarded_replayed_and_refused_per_upstream(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    """Per upstream in the window: writes forwarded (from the idempotency records, so
    every replica's), replayed and refused (from the audit); the configured upstreams
    always listed, refusals that named none counted under null; the replicas seen."""
    upstreams = [upstream_config(upstream), upstream_config(upstream, name="mail")]
    a = await make_stack(upstreams=upstreams, gateway={"replica_name": "gw-a"})
    b = await make_stack(upstreams=upstreams, gateway={"replica_name": "gw-b"})
    lease = await a.lease("job-1", owner="a", ttl=600)
    clock.advance(10)
    assert (await a.write("/pay/charges", lease, key="k1")).status == 201
    assert (await b.write("/pay/charges", lease, key="k2")).status == 201  # another replica
    assert (await b.write("/pay/charges", lease, key="k1")).status == 201  # a replay
    assert (await a.write("/pay/charges", lease, key=None)).status == 400
    assert (await a.write("/mail/send", lease, key="m1")).status == 201
    assert (await b.write("/mail/send", None, key="m2")).status == 428
    assert (await a.proxy.post("/nope/x", json={})).status == 404  # no such upstream
    clock.advance(10)
    assert (await a.write("/pay/charges", lease, key="k3")).status == 201  # after the window
    until = T0 + 15
    await a.audit()  # a replica's own entries are written before it reads; b reads a's

    doc = await over_time(b, since=T0, until=until)
    assert doc["upstream_counts"] == [
        {"upstream": "mail", "forwarded": 1, "replayed": 0, "refused": 1},
        {"upstream": "pay", "forwarded": 2, "replayed": 1, "refused": 1},
        {"upstream": None, "forwarded": 0, "replayed": 0, "refused": 1},
    ]
    assert doc["forwarded_since"] == rfc3339(T0)
    assert doc["replicas"] == ["gw-a", "gw-b"]
    # The same answer from either replica; filters apply to every count.
    assert (await over_time(a, since=T0, until=until))["upstream_counts"] == doc["upstream_counts"]
    pay = await over_time(a, since=T0, until=until, upstream="pay")
    assert pay["upstream_counts"] == [doc["upstream_counts"][1]]
    job = await over_time(a, since=T0, until=until, job_id="job-1")
    assert [(u["upstream"], u["forwarded"], u["refused"]) for u in job["upstream_counts"]] == [
        ("mail", 1, 0),
        ("pay", 2, 0),  # the missing key was refused before its job was known
    ]
    # Nothing in the window: every configured upstream, with zeros.
    empty = await over_time(a, since=T0 - 100, until=T0)
    assert empty["upstream_counts"] == [
        {"upstream": name, "forwarded": 0, "replayed": 0, "refused": 0} for name in ("mail", "pay")
    ]
    assert empty["replicas"] == []

    # The idempotency records are kept idempotency_retention_seconds: forwarded writes are
    # counted from then on only, and the answer says from when.
    clock.advance(86400 - 25)  # now = T0 + 86395: the records of T0 + 10 are still kept
    doc = await over_time(a, since=T0, until=until)
    assert doc["forwarded_since"] == rfc3339(T0)
    assert [u["forwarded"] for u in doc["upstream_counts"]] == [1, 2, 0]
    clock.advance(10)  # now = T0 + 86405: admissions before T0 + 5 may be gone
    doc = await over_time(a, since=T0, until=until)
    assert doc["forwarded_since"] == rfc3339(clock.now - 86400)
    assert [u["forwarded"] for u in doc["upstream_counts"]] == [1, 2, 0]
    clock.advance(10)  # now = T0 + 86415: those of T0 + 10 may be gone, none counted
    doc = await over_time(a, since=T0, until=until)
    assert [u["forwarded"] for u in doc["upstream_counts"]] == [0, 0, 0]
    assert [u["replayed"] for u in doc["upstream_counts"]] == [0, 1, 0]  # the audit's stay


async def test_bucket_boundaries(make_stack: Any, clock: FakeClock) -> None:
    # The refusals have no lease behind them: each its own audit row only with audit
    # buckets this short (a grouped row counts at its first request's time).
    stack = await make_stack(
        upstreams=[{"name": "pay", "url": "http://127.0.0.1:9"}],
        gateway={"audit_unauthenticated_bucket_seconds": 0.5},
    )
    for at in (T0, T0 + 59.999, T0 + 60, T0 + 120, T0 + 179.5):
        clock.now = at
        await refuse(stack)

    def counts(doc: dict[str, Any]) -> list[int]:
        return [b["total"] for b in doc["buckets"]]

    # since inclusive, until exclusive; an entry on a boundary opens the next bucket.
    doc = await over_time(stack, since=T0, until=T0 + 120, bucket_seconds=60)
    assert counts(doc) == [2, 1]
    doc = await over_time(stack, since=T0, until=T0 + 120.001, bucket_seconds=60)
    assert counts(doc) == [2, 1, 1]
    assert doc["buckets"][2]["start"] == rfc3339(T0 + 120)
    # Buckets are aligned to the epoch, not to since: a window that starts mid-bucket
    # has a first bucket that starts before it (and counts only what is inside).
    doc = await over_time(stack, since=T0 + 30, until=T0 + 150, bucket_seconds=60)
    assert [b["start"] for b in doc["buckets"]] == [
        rfc3339(T0),
        rfc3339(T0 + 60),
        rfc3339(T0 + 120),
    ]
    assert counts(doc) == [1, 1, 1]
    # Empty buckets are there, with nothing counted.
    doc = await over_time(stack, since=T0 - 120, until=T0 + 240, bucket_seconds=60)
    assert counts(doc) == [0, 0, 2, 1, 2, 0]
    assert doc["buckets"][0]["counts"] == {}
    # Buckets that are not a divisor of a minute, and one bucket for everything.
    doc = await over_time(stack, since=T0, until=T0 + 180, bucket_seconds=45)
    assert counts(doc) == [1, 2, 1, 1]  # [0,45) [45,90) [90,135) [135,180)
    doc = await over_time(stack, since=T0 - 3600, until=T0 + 3600, bucket_seconds=86400)
    assert counts(doc) == [5]
    assert doc["buckets"][0]["start"] == rfc3339(T0 - T0 % 86400)


async def test_the_first_entry_is_named_whatever_the_window(
    make_stack: Any, clock: FakeClock
) -> None:
    """``first_at``: the audit's oldest entry (the page's default window starts there),
    outside the window too; null while the audit is empty; the job filter applies."""
    stack = await make_stack(
        upstreams=[{"name": "pay", "url": "http://127.0.0.1:9"}],
        gateway={"audit_unauthenticated_bucket_seconds": 0.5},  # each refusal its own row
    )
    assert (await over_time(stack))["first_at"] is None
    clock.now = T0 - 3 * 86400
    await refuse(stack)
    clock.now = T0
    await refuse(stack)
    clock.now = T0 + 60  # the window ends at now, exclusive
    doc = await over_time(stack, window_seconds=3600)
    assert doc["first_at"] == rfc3339(T0 - 3 * 86400)
    assert sum(b["total"] for b in doc["buckets"]) == 1  # only the recent one is charted
    assert (await over_time(stack, job_id="job-none"))["first_at"] is None


async def test_timeline_of_a_job_in_time_order(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    first = await stack.lease("job-t", owner="worker-a", ttl=1.5)  # T0: grant 1
    clock.advance(1)
    assert (await stack.write("/pay/charges", first, key="k1")).status == 201  # forward
    clock.advance(1)
    second = await stack.lease("job-t", owner="worker-b", ttl=300)  # reclaimed: grant 2
    clock.advance(1)
    assert (await stack.write("/pay/charges", first, key="k2")).status == 409  # refusal
    clock.advance(1)
    assert (await stack.write("/pay/charges", second, key="k1")).status == 201  # replay
    clock.advance(1)
    upstream.status = 504
    assert (await stack.write("/pay/refunds", second, key="k3")).status == 504  # forward
    await held_key(stack, "job-t", "k3")
    clock.advance(1)
    assert (await stack.write("/pay/refunds", second, key="k3")).status == 409  # held
    # Another job's events stay out of this one's timeline.
    upstream.status = 201
    other = await stack.lease("job-other", owner="worker-c", ttl=300)
    assert (await stack.write("/pay/charges", other, key="k1")).status == 201

    doc = await get_json(stack, "/admin/ui/api/jobs/job-t/timeline")
    assert doc["job_id"] == "job-t" and doc["truncated"] is False
    assert doc["job"]["generation"] == 2 and doc["job"]["owner"] == "worker-b"
    assert doc["job"]["state"] == "leased"
    events = doc["events"]
    assert [e["kind"] for e in events] == [
        "grant",
        "forward",
        "grant",
        "refusal",
        "replay",
        "forward",
        "refusal",
    ]
    times = [epoch(e["at"]) for e in events]
    assert times == sorted(times)
    assert times == pytest.approx([T0 + i for i in range(7)], abs=0.01)
    grant1, forward1, grant2, stale, replay, forward2, held = events
    assert (grant1["generation"], grant1["owner"]) == (1, "worker-a")
    assert (grant2["generation"], grant2["owner"]) == (2, "worker-b")
    assert epoch(grant2["expires_at"]) == pytest.approx(T0 + 2 + 300, abs=0.01)
    assert forward1 | {"at": None, "settled_at": None} == {
        "at": None,
        "kind": "forward",
        "generation": 1,
        "upstream": "pay",
        "method": "POST",
        "path": "charges",
        "idempotency_key": "k1",
        "state": "completed",
        "status": 201,
        "note": None,
        "settled_at": None,
    }
    assert stale["reason"] == "stale-generation" and stale["status"] == 409
    assert (stale["generation"], stale["highest_generation"]) == (1, 2)
    assert stale["idempotency_key"] == "k2" and stale["path"] == "/pay/charges"
    assert replay["reason"] == "idempotent-replay" and replay["status"] == 201
    assert forward2["state"] == "unknown" and forward2["status"] == 504
    assert forward2["path"] == "refunds" and forward2["generation"] == 2
    assert held["reason"] == "outcome-unknown"

    # The newest events only, and a flag that says so.
    short = await get_json(stack, "/admin/ui/api/jobs/job-t/timeline", limit=3)
    assert [e["kind"] for e in short["events"]] == ["replay", "forward", "refusal"]
    assert short["truncated"] is True

    doc = await get_json(stack, "/admin/ui/api/jobs/job-other/timeline")
    assert [e["kind"] for e in doc["events"]] == ["grant", "forward"]

    # A job nobody has heard of: an empty timeline.
    doc = await get_json(stack, "/admin/ui/api/jobs/nobody/timeline")
    assert doc == {"job_id": "nobody", "job": None, "events": [], "truncated": False}


async def test_grant_comes_before_a_write_in_the_same_instant(
    make_stack: Any, upstream: Upstream
) -> None:
    stack = await make_stack(upstreams=[upstream_config(upstream)])
    lease = await stack.lease("job-s", ttl=300)
    await stack.lease("job-s", ttl=300)  # the same owner again: a new generation
    assert (await stack.write("/pay/charges", lease, key="a")).status == 409
    assert (await stack.write("/pay/charges", lease, key="b")).status == 409
    doc = await get_json(stack, "/admin/ui/api/jobs/job-s/timeline")
    assert [(e["kind"], e["generation"]) for e in doc["events"]] == [
        ("grant", 1),
        ("grant", 2),
        ("refusal", 1),
        ("refusal", 1),
    ]
    assert [e["idempotency_key"] for e in doc["events"][2:]] == ["a", "b"]


# -- bad parameters ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "query", "field"),
    [
        (OVER_TIME, {"bucket_seconds": "0"}, "bucket_seconds"),
        (OVER_TIME, {"bucket_seconds": "abc"}, "bucket_seconds"),
        (OVER_TIME, {"bucket_seconds": "-60"}, "bucket_seconds"),
        (OVER_TIME, {"bucket_seconds": "1.5"}, "bucket_seconds"),
        (OVER_TIME, {"bucket_seconds": "99999999999"}, "bucket_seconds"),
        (OVER_TIME, {"bucket_seconds": "1", "window_seconds": "86400"}, "bucket_seconds"),
        (OVER_TIME, {"since": "yesterday"}, "since"),
        (OVER_TIME, {"until": "2026-13-40T00:00:00Z"}, "until"),
        (OVER_TIME, {"until": "9" * 400}, "until"),
        (OVER_TIME, {"since": "1800000100", "until": "1800000000"}, "since"),
        (OVER_TIME, {"since": "1800000000", "until": "1800000000"}, "since"),
        (OVER_TIME, {"window_seconds": "0"}, "window_seconds"),
        (OVER_TIME, {"since": "1800000000", "window_seconds": "60"}, "window_seconds"),
        (OVER_TIME, {"job_id": "no spaces"}, "job_id"),
        ("/admin/ui/api/jobs/job-1/timeline", {"limit": "0"}, "limit"),
        ("/admin/ui/api/jobs/job-1/timeline", {"limit": "x"}, "limit"),
        ("/admin/ui/api/jobs/job-1/timeline", {"limit": "100000"}, "limit"),
        ("/admin/ui/api/jobs/bad!id/timeline", {}, "job_id"),
    ],
)
async def test_bad_parameters_are_a_400_naming_the_field(
    make_stack: Any, path: str, query: dict[str, str], field: str
) -> None:
    stack = await make_stack()
    resp = await stack.control.get(path, params=query)
    assert resp.status == 400, await resp.text()
    assert resp.content_type == PROBLEM
    doc = await resp.json(content_type=None)
    assert doc["reason"] == "invalid-request"
    assert doc["field"] == field
    assert doc["detail"].startswith(field)


async def test_rfc3339_times_are_accepted(make_stack: Any, clock: FakeClock) -> None:
    stack = await make_stack(upstreams=[{"name": "pay", "url": "http://127.0.0.1:9"}])
    await refuse(stack)
    doc = await over_time(
        stack, since=rfc3339(T0 - 60), until="2027-01-15T08:01:00+00:00", bucket_seconds=60
    )
    assert doc["since"] == rfc3339(T0 - 60) and doc["totals"] == {"missing-fencing-token": 1}


# -- the page and auth -------------------------------------------------------------------


async def test_page_and_its_files(make_stack: Any) -> None:
    stack = await make_stack()
    resp = await stack.control.get("/admin/ui")
    assert resp.status == 200
    assert resp.content_type == "text/html"
    html = await resp.text()
    assert '<canvas id="chart"' in html and "/admin/ui/app.js" in html
    assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
    assert resp.headers["Cache-Control"] == "no-store"
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    assert html.index("/admin/ui/chart.js") < html.index("/admin/ui/app.js")  # app.js uses it
    for name, kind in (
        ("app.js", "text/javascript"),
        ("chart.js", "text/javascript"),
        ("refresh.js", "text/javascript"),
        ("style.css", "text/css"),
    ):
        resp = await stack.control.get(f"/admin/ui/{name}")
        assert resp.status == 200 and resp.content_type == kind
        assert len(await resp.read()) > 500
    resp = await stack.control.get("/admin/ui/", allow_redirects=False)
    assert resp.status == 308 and resp.headers["Location"] == "/admin/ui"
    for missing in ("/admin/ui/other.js", "/admin/ui/index.html", "/admin/ui/..%2Fadmin.py"):
        resp = await stack.control.get(missing)
        assert resp.status == 404, missing
        assert resp.content_type == PROBLEM


@pytest.mark.parametrize(
    "path",
    [
        "/admin/ui",
        "/admin/ui/app.js",
        "/admin/ui/chart.js",
        "/admin/ui/refresh.js",
        "/admin/ui/style.css",
    ],
)
async def test_the_static_files_hold_no_data_and_open_without_a_token(
    make_stack: Any, path: str
) -> None:
    """A browser cannot send a bearer header when it opens a page: the page and its four
    files are open; every call for data needs the admin token the user types in."""
    stack = await make_stack(auth={"admin_tokens": [ADMIN], "worker_tokens": [WORKER]})
    resp = await stack.control.get(path)
    assert resp.status == 200
    text = await resp.text()
    assert ADMIN not in text and "job-1" not in text


@pytest.mark.parametrize(
    "path", [OVER_TIME, "/admin/ui/api/jobs/job-1/timeline", "/admin/rejections"]
)
async def test_every_dashboard_data_path_needs_the_admin_token(make_stack: Any, path: str) -> None:
    stack = await make_stack(auth={"admin_tokens": [ADMIN], "worker_tokens": [WORKER]})
    resp = await stack.control.get(path)
    assert resp.status == 401 and resp.content_type == PROBLEM
    assert (await resp.json(content_type=None))["reason"] == "unauthorized"
    resp = await stack.control.get(path, headers={"Authorization": "Bearer " + "x" * 20})
    assert resp.status == 401
    resp = await stack.control.get(path, headers={"Authorization": f"Bearer {WORKER}"})
    assert resp.status == 403 and resp.content_type == PROBLEM
    assert (await resp.json(content_type=None))["reason"] == "forbidden"
    resp = await stack.control.get(path, headers={"Authorization": f"Bearer {ADMIN}"})
    assert resp.status == 200, await resp.text()
