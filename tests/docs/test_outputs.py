"""The sample outputs in the docs look like what the commands print.

A sample is a fenced block marked with the command that prints it:

    <!-- output: fencegate audit -->
    ```text
    AT    REASON ...
    ```

The command is run (``--config`` added when it names none) in a site made for this
test: examples/fencegate.toml with its upstreams pointed at a local stand-in, served by
a real ``fencegate serve`` on SQLite that was driven through a lease, a forwarded write,
refusals, a replay and an unknown outcome, so every table has rows. ``--config
bad.toml`` names a config of the site with the mistakes of the error sample in
operations.md. ``<!-- output: fencegate serve -->`` marks a log line of the server.

The output's shape is compared with the sample's, not its values:

- a table (the first line is a header of upper-case column names): the same columns in
  the same order, every row aligned under the header, columns two spaces apart at the
  narrowest (as ``fencegate``'s tables are, in the sample too);
- other output: the same sequence of line labels (the text before the first ``: `` or
  run of spaces, with its indentation; a label repeated on consecutive lines counts once);
- a JSON document: the same members (and, for a page, the same members of its first
  item);
- a JSON log line: the same fields as the server's line with the same logger and message.

Any block that looks like a command's output (a table header, ``fencegate: ...``,
``configuration is valid``) must be marked, and the table commands and ``check-config``
must each have a sample somewhere.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import socket
import subprocess
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.docs.test_docs import (
    EXAMPLES,
    FENCEGATE,
    OUTPUT_MARKER,
    ROOT,
    Block,
    clean_env,
    doc_pages,
    run_fencegate,
    split_markdown,
)

PAGES = [ROOT / "README.md", *doc_pages(), EXAMPLES / "README.md"]
COLUMN = r"[A-Z][A-Z/]*(?: [A-Z/]+)*"
HEADER = re.compile(rf"{COLUMN}(?: {{2,}}{COLUMN})+")
LOOKS_LIKE_OUTPUT = re.compile(
    rf"{COLUMN}(?: {{2,}}{COLUMN}){{2,}}\s*$|fencegate: |configuration is valid"
)
MUST_HAVE_SAMPLES = {"audit", "jobs", "upstreams", "outcomes", "check-config"}
API_KEY = "sk_test_docs_outputs"
# The two mistakes of the error sample in operations.md ("The file and the environment").
BAD_CONFIG = """\
[lease]
bogus = 1

[[upstreams]]
name = "payments"
url = "http://127.0.0.1:9000"
timeout_seconds = 0
"""


@dataclass(frozen=True)
class Sample:
    where: str
    command: str
    lang: str
    text: str


def blocks() -> Iterator[tuple[str, Block, str]]:
    """Every fenced block of the pages: where it is, the block, its text dedented."""
    for page in PAGES:
        found, _ = split_markdown(page.read_text(encoding="utf-8"))
        for block in found:
            text = textwrap.dedent(block.text).strip("\n")
            yield f"{page.relative_to(ROOT)}:{block.line}", block, text


def samples() -> list[Sample]:
    found = []
    for where, block, text in blocks():
        match = OUTPUT_MARKER.fullmatch(block.marker or "")
        if match is not None:
            found.append(Sample(where, match.group(1), block.lang, text))
    return found


def test_every_block_that_looks_like_output_is_marked() -> None:
    unmarked = [
        where
        for where, block, text in blocks()
        if block.lang in ("", "text", "console")
        and text
        and LOOKS_LIKE_OUTPUT.match(text.splitlines()[0])
        and not OUTPUT_MARKER.fullmatch(block.marker or "")
    ]
    assert not unmarked, (
        "these blocks look like a command's output: mark each with "
        f"<!-- output: fencegate COMMAND ... --> so that it is checked: {unmarked}"
    )


def test_the_docs_show_the_output_of_each_table_command_and_of_check_config() -> None:
    shown = {shlex.split(s.command)[1] for s in samples()}
    assert MUST_HAVE_SAMPLES <= shown, f"no sample output of {MUST_HAVE_SAMPLES - shown}"


# -- the site: a served config with rows in every table ---------------------------------------


class StandIn(BaseHTTPRequestHandler):
    """A payment API like examples/README.md's: 201 and a made-up charge; a refund is
    answered 504 (a proxy in front of it timed out), so its outcome is unknown."""

    count = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        StandIn.count += 1
        status = 504 if "refund" in self.path else 201
        answer = json.dumps({"id": f"ch_{StandIn.count}", "status": "succeeded"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Site:
    folder: Path
    control: str
    proxy: str
    log: Path
    last: Any = None  # the body of the latest answer

    def call(
        self, method: str, url: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> int:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=20) as resp:
                status: int = resp.status
                self.last = json.loads(resp.read() or b"null")
                return status
        except urllib.error.HTTPError as error:
            with error:
                self.last = json.loads(error.read() or b"null")
                return error.code


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    folder = tmp_path_factory.mktemp("docs-outputs")
    api = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=api.serve_forever, name="stand-in", daemon=True).start()
    base = f"http://127.0.0.1:{api.server_address[1]}"
    control, proxy = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    text = (EXAMPLES / "fencegate.toml").read_text(encoding="utf-8")
    for original, replacement in (
        ('"http://127.0.0.1:9000"', f'"{base}"'),
        ('"http://127.0.0.1:9001"', f'"{base}/mail"'),
        ('"http://127.0.0.1:9002"', f'"{base}/files"'),
        ('"127.0.0.1:8080"', f'"{proxy}"'),
        ('"127.0.0.1:8081"', f'"{control}"'),
    ):
        assert text.count(original) == 1, original
        text = text.replace(original, replacement)
    (folder / "fencegate.toml").write_text(text, encoding="utf-8")
    (folder / "bad.toml").write_text(BAD_CONFIG, encoding="utf-8")
    log = folder / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [FENCEGATE, "serve", "--config", "fencegate.toml", "--log-format", "json"],
            cwd=folder,
            env=clean_env() | {"PAYMENTS_API_KEY": API_KEY},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        s = Site(folder, f"http://{control}", f"http://{proxy}", log)
        deadline = time.monotonic() + 30
        while "fencegate listening" not in log.read_text(errors="replace"):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        drive(s)
        yield s
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        api.shutdown()
        api.server_close()


def drive(s: Site) -> None:
    """A lease, a forwarded charge, refusals, a takeover, a stale write, a replay, an
    unknown outcome and a pending job."""

    def lease(owner: str) -> str:
        body = {"owner": owner, "ttl_seconds": 300}
        assert s.call("PUT", f"{s.control}/v1/jobs/order-42/lease", body) == 201, s.last
        token: str = s.last["lease_token"]
        return token

    def write(path: str, token: str | None, key: str) -> int:
        headers = {"Idempotency-Key": key} | ({"Fencing-Token": token} if token else {})
        return s.call("POST", f"{s.proxy}/payments/{path}", {"amount": 4200}, headers)

    first = lease("worker-a")
    assert write("charges", first, "step-charge") == 201, s.last
    assert write("charges", None, "step-charge") == 428, s.last
    assert write("charges", "fgl_made-up-token-0123456789abcdef", "retry-1") == 403, s.last
    assert s.call("POST", f"{s.control}/v1/leases/release", {"lease_token": first}) == 200
    second = lease("worker-b")
    assert write("receipts", first, "step-receipt") == 409, s.last
    assert write("charges", second, "step-charge") == 201, s.last  # replayed
    assert write("refunds", second, "step-refund") == 504, s.last  # outcome unknown
    job = {"queue": "payments", "payload": {"amount": 500}}
    assert s.call("POST", f"{s.control}/v1/jobs", job) == 201, s.last


# -- shapes -----------------------------------------------------------------------------------


def table_shape(text: str, what: str) -> list[str]:
    """The header's columns, after checking that every row sits under them."""
    lines = text.splitlines()
    while lines and (lines[-1].startswith("more: --cursor") or not lines[-1].strip()):
        lines.pop()
    header = lines[0]
    columns = [(m.start(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", header)]
    starts = [start for start, _ in columns]
    assert len(lines) > 1, f"{what}: a table without rows"
    for line in lines[1:]:
        for start in starts[1:]:
            assert len(line) > start and line[start - 1] == " " and line[start] != " ", (
                f"{what}: this row is not aligned under the header:\n{header}\n{line}"
            )
    for (start, name), following in zip(columns, starts[1:], strict=False):
        ends = [len(line[start:following].rstrip()) + start for line in lines]
        assert following - max(ends) == 2, (
            f"{what}: column {name} is not two spaces from the next at its widest"
        )
    return [name for _, name in columns]


def line_shape(text: str) -> list[tuple[int, str]]:
    shape: list[tuple[int, str]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        label = re.split(r":\s| {2,}", line.strip(), maxsplit=1)[0]
        item = (len(line) - len(line.lstrip()), label)
        if not shape or shape[-1] != item:
            shape.append(item)
    return shape


def json_shape(doc: Any) -> tuple[list[str], list[str]]:
    """The members of a document, and those of its first item when it is a page."""
    items = doc.get("items") or [{}]
    return sorted(doc), sorted(items[0])


def output_cases() -> list[Any]:
    return [pytest.param(s, id=f"{s.where} {s.command}") for s in samples()]


@pytest.mark.parametrize("sample", output_cases())
def test_sample_output_has_the_shape_of_the_real_output(sample: Sample, site: Site) -> None:
    words = shlex.split(sample.command)[1:]
    if words[0] == "serve":
        check_log_line(sample, site)
        return
    if "--config" not in words and "-c" not in words:
        words += ["--config", "fencegate.toml"]
    result = run_fencegate(*words, env=clean_env() | {"PAYMENTS_API_KEY": API_KEY}, cwd=site.folder)
    real = (result.stdout + result.stderr).strip("\n")
    shown = f"{sample.where}: `{sample.command}`"
    assert real, f"{shown} printed nothing"
    if sample.lang == "json":
        assert json_shape(json.loads(sample.text)) == json_shape(json.loads(real)), (
            f"{shown}: the members differ\n{sample.text}\n--- the command prints:\n{real}"
        )
    elif HEADER.fullmatch(sample.text.splitlines()[0].rstrip()):
        documented = table_shape(sample.text, f"{sample.where} (the sample)")
        printed = table_shape(real, f"`{sample.command}` (the real output)")
        assert documented == printed, f"{shown}: columns differ\n{sample.text}\n---\n{real}"
    else:
        assert line_shape(sample.text) == line_shape(real), (
            f"{shown}: the lines differ\n{sample.text}\n--- the command prints:\n{real}"
        )


def check_log_line(sample: Sample, site: Site) -> None:
    shown = json.loads(sample.text)
    records = [
        json.loads(line)
        for line in site.log.read_text(errors="replace").splitlines()
        if line.startswith("{")
    ]
    same = [r for r in records if (r["logger"], r["msg"]) == (shown["logger"], shown["msg"])]
    assert same, f"{sample.where}: the server never logged {shown['msg']!r}"
    assert set(same[0]) == set(shown), f"{sample.where}: fields differ from {same[0]}"
