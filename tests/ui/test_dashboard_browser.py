"""The dashboard in a real browser: a real ``fencegate serve`` process (SQLite, an admin
token, one upstream), real refusals and a held unknown outcome made through its proxy,
then Debian's Chromium driven by Playwright (never a downloaded browser).

The page is under /admin/, so the browser sends the admin token on every request
(``extra_http_headers``): the page request and the page's own calls alike, which is
how an operator behind a header-adding proxy uses it. The token field stays empty.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import struct
import subprocess
import sys
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from playwright.async_api import Page, async_playwright, expect

from tests.support import IN_CI

ROOT = Path(__file__).resolve().parents[2]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
FENCEGATE = str(Path(sys.executable).with_name("fencegate"))
LISTENING = re.compile(r"fencegate listening: .*?control=([\w.:\[\]]+).*?proxy=([\w.:\[\]]+)")
ADMIN = "admin-token-" + "a" * 20
WORKER = "worker-token-" + "w" * 20
AUTH = {"Authorization": f"Bearer {ADMIN}"}

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def chromium() -> str:
    if not Path(CHROMIUM).is_file():
        message = f"{CHROMIUM} is missing: install Debian's chromium package"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return CHROMIUM


# -- the upstream and the gateway process ------------------------------------------------


@asynccontextmanager
async def upstream_server() -> AsyncIterator[str]:
    """A payment API stand-in: ``/flaky`` answers 504 (outcome unknown), the rest 201."""

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        status = 504 if request.path.startswith("/flaky") else 201
        return web.json_response({"ok": status == 201}, status=status)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def write_config(folder: Path, upstream_url: str, replica: str) -> Path:
    path = folder / "fencegate.toml"
    path.write_text(
        'database_url = "sqlite+aiosqlite:///fencegate.db"\n'
        'proxy_listen = "127.0.0.1:0"\n'
        'control_listen = "127.0.0.1:0"\n'
        "[gateway]\n"
        f'replica_name = "{replica}"\n'
        "[auth]\n"
        f'admin_tokens = ["{ADMIN}"]\n'
        f'worker_tokens = ["{WORKER}"]\n'
        "[[upstreams]]\n"
        'name = "pay"\n'
        f'url = "{upstream_url}"\n'
        'unknown_outcome = "hold"\n'
        "timeout_seconds = 5\n",
        encoding="utf-8",
    )
    return path


@asynccontextmanager
async def fencegate(config: Path) -> AsyncIterator[tuple[str, str]]:
    """``fencegate serve`` until it says where it listens; killed at the end."""
    log = config.parent / "fencegate.log"
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("FENCEGATE_")}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [FENCEGATE, "serve", "--config", str(config)],
            cwd=config.parent,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while (match := LISTENING.search(log.read_text(errors="replace"))) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"fencegate serve did not start:\n{log.read_text(errors='replace')}")
            await asyncio.sleep(0.05)
        yield f"http://{match[1]}", f"http://{match[2]}"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


# -- what the dashboard will show -----------------------------------------------------------


class Gate:
    def __init__(self, session: aiohttp.ClientSession, control: str, proxy: str) -> None:
        self.session = session
        self.control = control
        self.proxy = proxy

    async def lease(self, job_id: str, owner: str) -> str:
        async with self.session.put(
            f"{self.control}/v1/jobs/{job_id}/lease",
            json={"owner": owner, "ttl_seconds": 300},
            headers={"Authorization": f"Bearer {WORKER}"},
        ) as resp:
            assert resp.status == 201, await resp.text()
            token: str = (await resp.json())["lease_token"]
            return token

    async def write(self, path: str, token: str | None, key: str | None, body: Any = None) -> int:
        headers = {}
        if token is not None:
            headers["Fencing-Token"] = token
        if key is not None:
            headers["Idempotency-Key"] = key
        async with self.session.post(
            self.proxy + path, json=body or {"amount": 1}, headers=headers
        ) as resp:
            await resp.read()
            return resp.status

    async def audit(self) -> list[dict[str, Any]]:
        """The audit as the replica reads it (its own entries written first)."""
        async with self.session.get(self.control + "/admin/rejections", headers=AUTH) as r:
            assert r.status == 200, await r.text()
            items: list[dict[str, Any]] = (await r.json())["items"]
            return items

    async def unknown(self) -> list[dict[str, Any]]:
        async with self.session.get(self.control + "/admin/unknown-outcomes", headers=AUTH) as r:
            assert r.status == 200, await r.text()
            items: list[dict[str, Any]] = (await r.json())["items"]
            return items


async def make_history(gate: Gate) -> None:
    first = await gate.lease("job-1", "worker-a")
    assert await gate.write("/pay/charges", first, "k1") == 201  # forwarded
    second = await gate.lease("job-1", "worker-a")  # a new generation: first is stale
    assert await gate.write("/pay/charges", first, "k2") == 409  # stale-generation
    assert await gate.write("/pay/charges", second, "k1") == 201  # idempotent-replay
    assert await gate.write("/pay/charges", second, None) == 400  # missing-idempotency-key
    assert await gate.write("/pay/charges", None, "k3") == 428  # missing-fencing-token
    assert await gate.write("/pay/charges", "fgl_" + "x" * 32, "k3") == 403  # invalid token

    held = await gate.lease("job-2", "worker-b")
    assert await gate.write("/pay/flaky", held, "u1") == 504  # forwarded; outcome unknown
    for _ in range(200):  # the answer can arrive just before the record is settled
        if any(i["key"] == "u1" for i in await gate.unknown()):
            break
        await asyncio.sleep(0.02)
    assert await gate.write("/pay/flaky", held, "u1") == 409  # outcome-unknown


REASONS = {
    "stale-generation",
    "idempotent-replay",
    "missing-idempotency-key",
    "missing-fencing-token",
    "invalid-fencing-token",
    "outcome-unknown",
}
# What the chart draws: the refusals, not the replays (stored answers of forwarded writes).
REPLAY = "idempotent-replay"
CHARTED = REASONS - {REPLAY}


# -- PNG, read with the standard library ---------------------------------------------------


def png_colours(data: bytes) -> Counter[tuple[int, int, int]]:
    """How many pixels of each RGB colour an 8-bit, non-interlaced PNG has."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, bytearray()
    width = height = bpp = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
            assert depth == 8 and colour_type in (2, 6) and interlace == 0
            bpp = 3 if colour_type == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        elif kind == b"IEND":
            break
    raw = zlib.decompress(bytes(idat))
    stride = width * bpp
    previous = bytearray(stride)
    counts: Counter[tuple[int, int, int]] = Counter()
    for y in range(height):
        start = y * (stride + 1)
        kind_of_filter = raw[start]
        line = bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = previous[i]
            c = previous[i - bpp] if i >= bpp else 0
            if kind_of_filter == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind_of_filter == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind_of_filter == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind_of_filter == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 0xFF
        for x in range(0, stride, bpp):
            counts[(line[x], line[x + 1], line[x + 2])] += 1
        previous = line
    return counts


def rgb(hex_colour: str) -> tuple[int, int, int]:
    value = hex_colour.lstrip("#")
    return int(value[0:2], 16), int(value[2:4], 16), int(value[4:6], 16)


def near(counts: Counter[tuple[int, int, int]], colour: tuple[int, int, int]) -> int:
    """Pixels within 3 per channel of ``colour`` (screenshots may round colours a little)."""
    return sum(
        n for c, n in counts.items() if all(abs(x - y) <= 3 for x, y in zip(c, colour, strict=True))
    )


CANVAS_COUNTS = """(colours) => {
  const canvas = document.getElementById("chart");
  const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  const wanted = colours.map((h) => [1, 3, 5].map((i) => parseInt(h.slice(i, i + 2), 16)));
  const counts = wanted.map(() => 0);
  let painted = 0;
  for (let p = 0; p < data.length; p += 4) {
    if (!(data[p] === 255 && data[p + 1] === 255 && data[p + 2] === 255)) painted++;
    wanted.forEach((w, k) => {
      if (data[p] === w[0] && data[p + 1] === w[1] && data[p + 2] === w[2]) counts[k]++;
    });
  }
  return { counts, painted };
}"""


async def rows_of(page: Page, selector: str, attribute: str) -> list[str]:
    values: list[str] = await page.locator(selector).evaluate_all(
        f"rows => rows.map(r => r.dataset.{attribute})"
    )
    return values


# -- the test -----------------------------------------------------------------------------


async def test_dashboard_in_chromium(tmp_path: Path, chromium: str) -> None:
    """Two replicas, one after the other on one database: gw-a makes the history, gw-b
    refuses one request more and serves the page."""
    async with upstream_server() as upstream_url, aiohttp.ClientSession() as session:
        async with fencegate(write_config(tmp_path, upstream_url, "gw-a")) as (control, proxy):
            gate = Gate(session, control, proxy)
            await make_history(gate)
            assert [(i["job_id"], i["key"]) for i in await gate.unknown()] == [("job-2", "u1")]
            assert {e["replica"] for e in await gate.audit()} == {"gw-a"}
        async with fencegate(write_config(tmp_path, upstream_url, "gw-b")) as (control, proxy):
            gate = Gate(session, control, proxy)
            assert await gate.write("/pay/charges", None, "k4") == 428  # missing-fencing-token
            assert Counter(e["replica"] for e in await gate.audit()) == {"gw-a": 6, "gw-b": 1}
            await drive_browser(chromium, control, gate, tmp_path)
            assert await gate.unknown() == []


async def drive_browser(chromium: str, control: str, gate: Gate, tmp_path: Path) -> None:
    async with async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_ARGS,
            extra_http_headers=AUTH,
            viewport={"width": 1280, "height": 1000},
        )
        try:
            page = await context.new_page()
            problems: list[str] = []
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            page.on(
                "console",
                lambda msg: (
                    problems.append(f"console: {msg.text}") if msg.type == "error" else None
                ),
            )
            # The page's clock is Playwright's, stopped: its auto-refresh runs only when
            # the test moves the clock on (check_auto_refresh), never in the middle of a
            # check, however slow the machine.
            await page.clock.install()
            await page.clock.pause_at(datetime.now(UTC) + timedelta(seconds=1))
            response = await page.goto(control + "/admin/ui")
            assert response is not None and response.status == 200
            await expect(page.locator("body[data-loaded]")).to_have_count(1)
            await expect(page.locator("#status")).to_have_class("ok")

            await check_window_from_data(page)
            # The refusals table lists every reason; a filter shrinks it.
            rows = page.locator("#refusals-table tbody tr[data-reason]")
            await expect(rows).to_have_count(len(REASONS) + 1)  # gw-b's refusal too
            assert set(await rows_of(page, "#refusals-table tbody tr", "reason")) == REASONS
            await check_replicas(page, rows)
            await check_upstreams(page)
            await page.select_option("#filter-reason", "stale-generation")
            await expect(rows).to_have_count(1)
            assert await rows_of(page, "#refusals-table tbody tr", "reason") == ["stale-generation"]
            # The table shows the owner of the lease behind the entry.
            header = page.locator("#refusals-table thead th")
            owner_column = (await header.all_inner_texts()).index("Owner")
            owner = rows.first.locator("td").nth(owner_column)
            await expect(owner).to_have_text("worker-a")

            # A job's timeline, from the job in that row.
            await rows.first.get_by_role("button", name="job-1").click()
            timeline = page.locator("#timeline-table tbody tr[data-kind]")
            await expect(timeline).to_have_count(5)
            assert await rows_of(page, "#timeline-table tbody tr", "kind") == [
                "grant",
                "forward",
                "grant",
                "refusal",
                "replay",
            ]
            await expect(timeline.nth(1)).to_contain_text("completed 201")
            await expect(timeline.nth(3)).to_contain_text("stale-generation")
            await expect(page.locator("#timeline-job-summary")).to_contain_text("generation 2")

            # The held key: "applied" needs a status; "not applied" resolves it.
            held = page.locator('#unknown-table tbody tr[data-job="job-2"][data-key="u1"]')
            await expect(held).to_have_count(1)
            await held.locator("button.resolve-applied").click()
            await expect(page.locator("#status")).to_have_class("error")
            await expect(held).to_have_count(1)
            await held.locator("button.resolve-not-applied").click()
            await expect(held).to_have_count(0)
            await expect(page.locator("#status")).to_contain_text("not-applied")
            await expect(page.locator("#unknown-table tbody")).to_contain_text("Nothing held")

            await check_chart(page, tmp_path)
            await check_time_labels(page)
            await check_auto_refresh(page, gate)
            await check_table_fits(page, gate)
            assert problems == []
        finally:
            await context.close()


async def loads(page: Page) -> int:
    """How many times the page has loaded its data (app.js counts them)."""
    return int(await page.locator("body").get_attribute("data-loaded") or "0")


async def check_auto_refresh(page: Page, gate: Gate) -> None:
    """On by default: new entries show without a click, every 30 s (the page's clock is
    Playwright's, stopped, moved on by the test). Paused by the control, and still paused after a
    reload; resumed, it loads at once. A field typed in and not used holds it back."""
    await page.reload()
    control = page.locator("#auto-refresh")
    rows = page.locator("#refusals-table tbody tr[data-reason]")
    await expect(page.locator("body[data-loaded='1']")).to_have_count(1)
    await expect(control).to_have_attribute("data-state", "on")
    await expect(control).to_be_visible()
    await expect(page.locator("#auto-refresh-state")).to_have_text("Refreshing every 30 s")
    before = await rows.count()

    assert await gate.write("/pay/refunds", None, "r1") == 428  # a new grouped entry
    await page.clock.fast_forward(29_000)
    await asyncio.sleep(0.3)
    assert await loads(page) == 1  # not yet
    await page.clock.fast_forward(2_000)
    await expect(page.locator("body[data-loaded='2']")).to_have_count(1)
    await expect(rows).to_have_count(before + 1)
    await expect(page.locator("#refusals-table tbody")).to_contain_text("/pay/refunds")

    # Paused: kept across a reload, nothing loads however long one waits.
    await control.click()
    await expect(control).to_have_attribute("data-state", "paused")
    await expect(control).to_have_text("Resume auto-refresh")
    await expect(page.locator("#auto-refresh-state")).to_have_text("Auto-refresh paused")
    await page.reload()
    await expect(page.locator("body[data-loaded='1']")).to_have_count(1)
    await expect(control).to_have_attribute("data-state", "paused")
    assert await page.evaluate("() => localStorage.getItem('fencegate.autoRefresh')") == "paused"
    assert await gate.write("/pay/returns", None, "r2") == 428
    await page.clock.fast_forward(120_000)
    await asyncio.sleep(0.5)
    assert await loads(page) == 1
    await expect(rows).to_have_count(before + 1)

    # Resumed: at once, and every 30 s again.
    await control.click()
    await expect(control).to_have_attribute("data-state", "on")
    await expect(page.locator("body[data-loaded='2']")).to_have_count(1)
    await expect(rows).to_have_count(before + 2)
    assert await page.evaluate("() => localStorage.getItem('fencegate.autoRefresh')") is None

    # A filter typed and not applied: the refresh waits rather than apply it half-typed.
    await page.fill("#filter-job", "job-")
    await page.clock.fast_forward(31_000)
    await asyncio.sleep(0.5)
    assert await loads(page) == 2
    await page.click("#filter-clear")  # used (cleared): the next period refreshes
    await page.clock.fast_forward(31_000)
    await expect(page.locator("body[data-loaded='3']")).to_have_count(1)


async def check_window_from_data(page: Page) -> None:
    """The default window runs from the audit's first entry to now, in whole hours, at
    least one: this history is seconds old, so one hour in 30 s buckets, not a day's
    one bar."""
    window = page.locator("#window")
    await expect(window).to_have_value("auto")
    await expect(window).to_have_attribute("data-seconds", "3600")
    summary = page.locator("#chart-summary")
    await expect(summary).to_contain_text("the last 1 hour(s), since the first entry")
    await expect(summary).to_contain_text("buckets of 30 s")
    pick = "([f, u, m]) => window.FencegateChart.windowFromData(f, u, m)"
    now = "2026-12-07T12:00:00Z"
    for first, expected in (
        (None, 3600),  # an empty audit: an hour
        ("2026-12-07T11:59:00Z", 3600),  # minutes: an hour
        ("2026-12-07T10:30:00Z", 2 * 3600),  # 1.5 hours: two
        ("2026-12-06T09:00:00Z", 27 * 3600),  # 27 hours
        ("2025-01-01T00:00:00Z", 366 * 86400),  # at most the longest window
    ):
        assert await page.evaluate(pick, [first, now, 366 * 86400]) == expected, first


async def check_table_fits(page: Page, gate: Gate) -> None:
    """The audit table fits 1,400 px, the Replica column in view, with a 200-character
    key and a long path in it (cut, shown whole in their title); under 1,200 px the
    Client column is left out and it still fits."""
    path = "/pay/" + "/".join(["a-long-path-segment"] * 12)
    key = "key-" + "x" * 200
    assert await gate.write(path, "fgl_not-a-token", key) == 403  # the key is audited
    measure = """() => {
        const table = document.getElementById('refusals-table');
        const wrap = table.parentElement;
        const heads = Array.from(table.tHead.rows[0].cells);
        const replica = heads.find((th) => th.textContent === 'Replica');
        return {scroll: wrap.scrollWidth, client: wrap.clientWidth,
                replica: replica.getBoundingClientRect().right,
                width: document.documentElement.clientWidth,
                client_shown: getComputedStyle(heads.find(
                    (th) => th.textContent === 'Client')).display !== 'none'};
    }"""
    for width, client_shown in ((1400, True), (1100, False)):
        await page.set_viewport_size({"width": width, "height": 1000})
        await page.reload()
        await expect(page.locator("#refusals-table tbody")).to_contain_text("key-xxxx")
        seen = await page.evaluate(measure)
        assert seen["scroll"] <= seen["client"], (width, seen)  # no horizontal scroll
        assert seen["replica"] <= seen["width"], (width, seen)
        assert seen["client_shown"] is client_shown, (width, seen)
    cut = page.locator("#refusals-table td .clip", has_text="key-xxxx")
    await expect(cut).to_have_attribute("title", key)


async def check_upstreams(page: Page) -> None:
    """Per upstream in the window: pay had two writes forwarded (k1, then u1 whose outcome
    is unknown), by gw-a, one replay, and every refusal of the history."""
    pay = page.locator('#upstream-table tbody tr[data-upstream="pay"]')
    await expect(pay).to_have_count(1)
    cells = await pay.locator("td").all_inner_texts()
    assert cells == ["pay", "2", "1", str(len(CHARTED) + 1)]
    await expect(page.locator("#upstream-table tbody tr")).to_have_count(1)
    await expect(page.locator("#upstream-note")).to_have_text("")
    # A window longer than the records are kept: the forwarded counts say from when.
    await page.select_option("#window", "604800")
    await expect(page.locator("#upstream-note")).to_contain_text("writes admitted since")
    assert await pay.locator("td").all_inner_texts() == cells
    await page.select_option("#window", "86400")
    await expect(page.locator("#upstream-note")).to_have_text("")
    # The replicas of the window are offered to the table's filter.
    offered = await page.locator("#replicas option").evaluate_all("os => os.map(o => o.value)")
    assert offered == ["gw-a", "gw-b"]


async def check_replicas(page: Page, rows: Any) -> None:
    """The Replica column names the replica that answered; the filter keeps one
    replica's entries, typed or by a click on a name."""
    header = await page.locator("#refusals-table thead th").all_inner_texts()
    column = header.index("Replica")
    names = await rows.evaluate_all(
        f"rows => rows.map(r => r.querySelectorAll('td')[{column}].textContent)"
    )
    assert Counter(names) == {"gw-a": len(REASONS), "gw-b": 1}
    await page.fill("#filter-replica", "gw-b")
    await page.click("#filters button[type=submit]")
    await expect(rows).to_have_count(1)
    assert await rows_of(page, "#refusals-table tbody tr", "reason") == ["missing-fencing-token"]
    await page.click("#filter-clear")
    await expect(rows).to_have_count(len(REASONS) + 1)
    await page.locator("td.replica button", has_text="gw-a").first.click()
    await expect(rows).to_have_count(len(REASONS))
    await expect(page.locator("#filter-replica")).to_have_value("gw-a")
    await page.click("#filter-clear")
    await expect(rows).to_have_count(len(REASONS) + 1)


# (window, bucket, plot width in CSS pixels) -> the step between two time labels: the
# smallest round step whose labels are 90 px apart at least. A day of 15-minute buckets
# over 1,160 px had a label every 7 buckets (1 h 45 min): now every 2 hours.
TICK_CASES = [
    (86400, 900, 1160, 2 * 3600),
    (86400, 900, 600, 6 * 3600),
    (86400, 900, 3000, 3600),
    (900, 10, 1160, 120),
    (3600, 30, 1160, 300),
    (21600, 300, 1160, 1800),
    (604800, 3600, 1160, 86400),
    (2592000, 21600, 1160, 7 * 86400),
    (60, 1, 1160, 5),
]
ROUND_STEPS = {1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800}
ROUND_STEPS |= {3600 * h for h in (1, 2, 3, 6, 12)} | {86400 * d for d in (1, 2, 7, 14, 28)}


async def check_time_labels(page: Page) -> None:
    """Time labels at round UTC times: chart.js's choice for windows and widths, then
    the labels the canvas was drawn with."""
    until = 1_800_003_700  # not a round time: the labels are, whatever the window's end
    for window, bucket, width, expected in TICK_CASES:
        ticks = await page.evaluate(
            "([s, e, w, b]) => window.FencegateChart.timeTicks(s, e, w, 90, b)",
            [until - window, until, width, bucket],
        )
        assert ticks["step"] == expected, (window, bucket, width, ticks["step"])
        times = ticks["times"]
        assert times and all(t % expected == 0 for t in times)
        assert all(b - a == expected for a, b in itertools.pairwise(times))
        assert until - window <= times[0] < until - window + expected
        assert expected * width / window >= 90  # never crowded
    label = "([t, step, span]) => window.FencegateChart.tickLabel(t, step, span)"
    assert await page.evaluate(label, [1_800_010_800, 10800, 86400]) == "11:00"
    assert await page.evaluate(label, [1_800_000_000 - 1_800_000_000 % 86400, 10800, 86400]) == (
        "01-15 00:00"
    )
    assert await page.evaluate(label, [1_800_000_030, 15, 900]) == "08:00:30"
    assert await page.evaluate(label, [1_800_057_600, 86400, 604800]) == "01-16"

    # The drawn chart: its labels at multiples of one round step, in order.
    chart = page.locator("#chart")
    step = int(await chart.get_attribute("data-tick-step") or "0")
    assert step in ROUND_STEPS
    drawn = (await chart.get_attribute("data-ticks") or "").split()
    assert len(drawn) >= 3
    seconds = [epoch_of(t) for t in drawn]
    assert all(t % step == 0 for t in seconds)
    assert all(b - a == step for a, b in itertools.pairwise(seconds))


def epoch_of(iso: str) -> int:
    return int(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp())


async def check_chart(page: Page, tmp_path: Path) -> None:
    chart = page.locator("#chart")
    await expect(chart).not_to_have_attribute("data-drawn", "0")
    legend = page.locator("#legend li[data-reason]")
    await expect(legend).to_have_count(len(CHARTED))
    colours: dict[str, str] = dict(
        await legend.evaluate_all("items => items.map(i => [i.dataset.reason, i.dataset.colour])")
    )
    assert set(colours) == CHARTED  # no replay among the refusals
    assert len(set(colours.values())) == len(CHARTED)  # one colour per reason
    summary = page.locator("#chart-summary")
    await expect(summary).to_contain_text(f"{len(CHARTED) + 1} refusal(s); 1 replay(s)")
    # The replay's colour (app.js COLOURS) is painted nowhere on the canvas.
    replay_colour = "#7f7f7f"
    assert replay_colour in (ROOT / "gateway" / "ui" / "app.js").read_text(encoding="utf-8")
    assert (await page.evaluate(CANVAS_COUNTS, [replay_colour]))["counts"] == [0]

    # The canvas itself: every reason's colour is painted.
    reasons = sorted(colours)
    drawn = await page.evaluate(CANVAS_COUNTS, [colours[r] for r in reasons])
    for reason, count in zip(reasons, drawn["counts"], strict=True):
        assert count >= 20, f"{reason}: only {count} pixel(s) of {colours[reason]}"

    # The screenshot: it shows the bars, and it is not what an empty canvas looks like.
    shot = tmp_path / "chart.png"
    png = await chart.screenshot(path=shot)
    assert shot.stat().st_size == len(png) > 1000
    pixels = png_colours(png)
    for reason in reasons:
        assert near(pixels, rgb(colours[reason])) >= 20, f"{reason} not in the screenshot"
    await page.evaluate(
        "() => { const c = document.getElementById('chart');"
        " c.getContext('2d').clearRect(0, 0, c.width, c.height); }"
    )
    blank = await chart.screenshot(path=tmp_path / "blank.png")
    assert blank != png and len(blank) < len(png)
    blank_pixels = png_colours(blank)
    assert all(near(blank_pixels, rgb(colours[r])) == 0 for r in reasons)
    assert len(blank_pixels) <= 2 < len(pixels)
