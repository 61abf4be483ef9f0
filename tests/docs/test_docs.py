"""The documentation agrees with the code.

- every gateway reason (``gateway.fencing.fence.GATEWAY_REASONS`` / ``REASONS``) and
  every lease-service reason (``lease_core.exceptions``) is in docs/protocol.md's
  reason tables with the code's status and title (and a gateway reason with its
  ``sent``), and those tables name no reason the code does not give;
- every complete TOML configuration in docs/*.md (a ```toml block preceded by
  ``<!-- check-config -->``) and every examples/*.toml passes ``fencegate check-config``;
  every other ```toml block must be marked ``<!-- fragment -->`` and still parse;
- every ``fencegate COMMAND`` named in the docs, README.md and examples/README.md exists
  (from ``fencegate --help``), and so does every ``--option`` and sub-action given with it;
- the configuration reference in docs/operations.md documents exactly the fields of
  ``gateway.config.Settings`` (walked recursively), with the code's defaults, bounds and
  types;
- every metric series is listed in docs/operations.md;
- every relative link in docs/*.md, README.md and examples/README.md resolves (anchors
  included), and every page in docs/ is linked from docs/README.md or README.md.

The sample outputs of commands are held to the real ones by test_outputs.py.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
import tomllib
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any

import annotated_types
import pytest
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from fencegate_client.reasons import Sent
from gateway.config import Settings
from gateway.fencing import fence
from lease_core import exceptions as lease_exc
from lease_core import problems
from lease_core.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PROTOCOL = DOCS / "protocol.md"
OPERATIONS = DOCS / "operations.md"
EXAMPLES = ROOT / "examples"
FENCEGATE = str(Path(sys.executable).with_name("fencegate"))

# The pages this test holds to the code (others may exist in docs/ too).
OWN_PAGES = ("README.md", "concepts.md", "protocol.md", "operations.md", "limits.md")


def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


# -- Markdown, just enough ------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """A fenced code block: its info string, text, first line number and the marker
    comment (the nearest non-blank line before the fence, when it is an HTML comment)."""

    lang: str
    text: str
    line: int
    marker: str | None


@dataclass(frozen=True)
class Table:
    heading: str  # the nearest heading above the table
    header: list[str]
    rows: list[list[str]]
    line: int


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")


def split_markdown(text: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """Fenced blocks, and the other lines (number, text)."""
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        fence_chars, info = match.group(2), match.group(3).strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence_chars):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        before = [line for line in lines[:start] if line.strip()]
        marker = before[-1].strip() if before and before[-1].strip().startswith("<!--") else None
        blocks.append(Block(info.split()[0] if info else "", "\n".join(body), start + 1, marker))
    return blocks, prose


def split_cells(line: str) -> list[str]:
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", inner)]


def tables(text: str) -> list[Table]:
    _, prose = split_markdown(text)
    found: list[Table] = []
    heading = ""
    current: list[tuple[int, str]] = []

    def flush() -> None:
        if len(current) >= 2 and re.fullmatch(r"[\s|:-]+", current[1][1]):
            found.append(
                Table(
                    heading,
                    split_cells(current[0][1]),
                    [split_cells(line) for _, line in current[2:]],
                    current[0][0],
                )
            )
        current.clear()

    for number, line in prose:
        if line.lstrip().startswith("|"):
            current.append((number, line))
            continue
        flush()
        match = HEADING.match(line)
        if match:
            heading = match.group(2)
    flush()
    return found


OUTPUT_MARKER = re.compile(r"<!--\s*output:\s*(fencegate\b.*?)\s*-->")


def code_snippets(text: str) -> Iterator[str]:
    """The text of every fenced block (backslash-continued lines joined) and every code
    span outside them. A command's sample output (a block marked ``<!-- output: fencegate
    COMMAND -->``, checked by test_outputs.py) stands for its command line instead."""
    blocks, prose = split_markdown(text)
    for block in blocks:
        output = OUTPUT_MARKER.fullmatch(block.marker or "")
        yield output.group(1) if output else block.text.replace("\\\n", " ")
    for _, line in prose:
        for match in CODE_SPAN.finditer(line):
            yield match.group(2)


def backticked(cell: str) -> str | None:
    match = re.fullmatch(r"`([^`]+)`", cell.strip())
    return match.group(1) if match else None


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    _, prose = split_markdown(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in prose:
        match = HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


def run_fencegate(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Any:
    return subprocess.run(
        [FENCEGATE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=cwd,
        check=False,
    )


def clean_env() -> dict[str, str]:
    """The environment without FENCEGATE_* settings of the developer's own."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}


# -- (a) reasons ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ReasonRow:
    heading: str
    reason: str
    status: str
    title: str
    sent: str | None  # the ``sent`` column's cell, in a table that has one


def reason_rows() -> list[ReasonRow]:
    rows = []
    for table in tables(PROTOCOL.read_text(encoding="utf-8")):
        header = [c.lower() for c in table.header]
        if header[:3] != ["reason", "status", "title"]:
            continue
        sent_at = header.index("sent") if "sent" in header else None
        for cells in table.rows:
            reason = backticked(cells[0])
            assert reason is not None, f"protocol.md:{table.line}: reason not in backticks"
            sent = cells[sent_at] if sent_at is not None else None
            rows.append(ReasonRow(table.heading, reason, cells[1], cells[2], sent))
    return rows


def exception_reasons() -> dict[str, type[lease_exc.LeaseError]]:
    """Every reason the lease service's exceptions define (on the class itself)."""
    out: dict[str, type[lease_exc.LeaseError]] = {}
    for obj in vars(lease_exc).values():
        if (
            inspect.isclass(obj)
            and issubclass(obj, lease_exc.LeaseError)
            and "reason" in obj.__dict__
        ):
            out[obj.reason] = obj
    return out


def problem_middleware_reasons() -> set[str]:
    """Reasons that lease_core/problems.py names itself (``reason=Reason.X``)."""
    tree = ast.parse(inspect.getsource(problems))
    return {
        fence.Reason[node.value.attr].value
        for node in ast.walk(tree)
        if isinstance(node, ast.keyword)
        and node.arg == "reason"
        and isinstance(node.value, ast.Attribute)
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "Reason"
    }


def rows_under(word: str) -> dict[str, ReasonRow]:
    found = {row.reason: row for row in reason_rows() if word in row.heading.lower()}
    assert found, f"protocol.md has no reason table under a heading with {word!r}"
    return found


def test_every_gateway_reason_is_documented_with_its_status_and_title() -> None:
    documented = rows_under("proxy listener")
    for reason in fence.GATEWAY_REASONS:
        assert reason.value in documented, f"protocol.md lacks gateway reason {reason.value}"
        row = documented[reason.value]
        info = fence.PROBLEMS.get(reason)
        if info is None:  # not a problem document (idempotent-replay: the stored status)
            assert not row.status.isdigit(), row
            assert "stored" in row.status, row
            continue
        assert row.status == str(info.status), (reason.value, row.status, info.status)
        assert row.title == info.title, (reason.value, row.title, info.title)


def test_every_gateway_reason_is_documented_with_its_sent() -> None:
    """The proxy listener's table says of every reason what ``REASONS`` says: whether the
    write was sent (``never``, ``maybe``, ``yes``); the audit's own reasons, which are no
    problem document, say nothing ("—")."""
    documented = rows_under("proxy listener")
    for reason in fence.GATEWAY_REASONS:
        row = documented[reason.value]
        info = fence.PROBLEMS.get(reason)
        sent = info.sent if info is not None else None
        expected = f"`{sent.value}`" if sent is not None else "—"
        assert row.sent == expected, (reason.value, row.sent, expected)
    # The page's table of what each value asks of a worker names each value once.
    [table] = [t for t in tables(PROTOCOL.read_text(encoding="utf-8")) if t.header[0] == "`sent`"]
    assert [backticked(cells[0]) for cells in table.rows] == [s.value for s in Sent]


def test_every_lease_service_reason_is_documented_with_its_status_and_title() -> None:
    documented = rows_under("control listener")
    for reason, cls in exception_reasons().items():
        assert reason in documented, f"protocol.md lacks control-listener reason {reason}"
        row = documented[reason]
        assert row.status == str(cls.status), (reason, row.status, cls.status)
        assert row.title == cls.title, (reason, row.title, cls.title)
    for reason in problem_middleware_reasons():
        assert reason in documented, f"protocol.md lacks control-listener reason {reason}"


def test_the_reason_tables_name_only_reasons_the_code_gives() -> None:
    gateway = {r.value for r in fence.GATEWAY_REASONS}
    control = set(exception_reasons()) | problem_middleware_reasons()
    for row in reason_rows():
        heading = row.heading.lower()
        known = gateway if "proxy listener" in heading else control
        assert row.reason in known, f"protocol.md documents {row.reason!r}, unknown to the code"
        if not row.status.isdigit():
            # Only reasons without a fixed status may say so in words.
            fixed = {r.value for r in fence.PROBLEMS} | set(exception_reasons())
            assert row.reason not in fixed, row


def test_the_title_of_a_problem_document_matches_the_table() -> None:
    """The example problem document in protocol.md is what the gateway sends."""
    blocks, _ = split_markdown(PROTOCOL.read_text(encoding="utf-8"))
    docs = [json.loads(b.text) for b in blocks if b.lang == "json" and '"type"' in b.text]
    assert docs, "protocol.md shows no problem document"
    for doc in docs:
        reason = fence.Reason(doc["reason"])
        info = fence.PROBLEMS[reason]
        assert doc["type"] == problems.PROBLEM_TYPE_BASE + doc["reason"]
        assert (doc["status"], doc["title"], doc["detail"]) == (
            info.status,
            info.title,
            info.detail,
        )
        assert doc.get("sent") == (info.sent.value if info.sent is not None else None)


# -- (b) configurations -----------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigBlock:
    where: str
    text: str
    env: dict[str, str]


def doc_config_blocks() -> tuple[list[ConfigBlock], list[ConfigBlock]]:
    """(blocks to check with check-config, fragments)."""
    checked: list[ConfigBlock] = []
    fragments: list[ConfigBlock] = []
    for page in doc_pages():
        blocks, _ = split_markdown(page.read_text(encoding="utf-8"))
        for block in blocks:
            if block.lang != "toml":
                continue
            where = f"{page.name}:{block.line}"
            marker = block.marker or ""
            check = re.fullmatch(r"<!--\s*check-config\b(.*?)-->", marker)
            if check is not None:
                env = dict(pair.split("=", 1) for pair in check.group(1).split())
                checked.append(ConfigBlock(where, block.text, env))
            elif re.fullmatch(r"<!--\s*fragment\s*-->", marker):
                fragments.append(ConfigBlock(where, block.text, {}))
            else:
                pytest.fail(
                    f"{where}: mark the toml block with <!-- check-config --> (a complete "
                    "configuration) or <!-- fragment -->"
                )
    return checked, fragments


def config_cases() -> list[Any]:
    checked, _ = doc_config_blocks()
    cases = [pytest.param(block, id=block.where) for block in checked]
    for path in sorted(EXAMPLES.glob("*.toml")):
        block = ConfigBlock(f"examples/{path.name}", path.read_text(encoding="utf-8"), {})
        cases.append(pytest.param(block, id=block.where))
    return cases


def test_the_docs_show_a_checked_configuration() -> None:
    checked, _ = doc_config_blocks()
    assert any(block.where.startswith("operations.md") for block in checked)


@pytest.mark.parametrize("block", config_cases())
def test_configuration_passes_check_config(block: ConfigBlock, tmp_path: Path) -> None:
    tomllib.loads(block.text)  # a clear error first, if it is not even TOML
    config = tmp_path / "fencegate.toml"
    config.write_text(block.text, encoding="utf-8")
    env = clean_env()
    for name in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", block.text):
        env[name] = f"test-value-for-{name.lower()}"
    env.update(block.env)
    result = run_fencegate("check-config", "--config", str(config), env=env, cwd=tmp_path)
    assert result.returncode == 0, f"{block.where}:\n{result.stdout}{result.stderr}"
    assert "configuration is valid" in result.stdout


def test_configuration_fragments_are_toml() -> None:
    _, fragments = doc_config_blocks()
    for block in fragments:
        tomllib.loads(block.text)


# -- (c) commands -----------------------------------------------------------------------------


@cache
def cli_commands() -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """command -> (its --options, its positional choices), from the --help texts."""
    top = run_fencegate("--help", env=clean_env())
    assert top.returncode == 0, top.stderr
    section = top.stdout.split("positional arguments:", 1)[1].split("options:", 1)[0]
    names = re.findall(r"^ {4}([a-z][a-z-]*)(?:\s|$)", section, re.MULTILINE)
    assert "serve" in names and "check-config" in names, top.stdout
    out = {}
    for name in names:
        result = run_fencegate(name, "--help", env=clean_env())
        assert result.returncode == 0, (name, result.stderr)
        options = frozenset(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", result.stdout))
        choices = frozenset(
            choice
            for group in re.findall(r"\{([a-z,-]+)\}", result.stdout)
            for choice in group.split(",")
        )
        out[name] = (options, choices)
    return out


MENTION = re.compile(r"(?<![\w.-])fencegate\s+([a-z][a-z-]*)([^\n]*)")


def test_every_command_and_option_named_in_the_docs_exists() -> None:
    commands = cli_commands()
    pages = [*doc_pages(), ROOT / "README.md", EXAMPLES / "README.md"]
    mentioned = set()
    for page in pages:
        for snippet in code_snippets(page.read_text(encoding="utf-8")):
            for match in MENTION.finditer(snippet):
                name, rest = match.group(1), match.group(2)
                where = f"{page.name}: `fencegate {name}{rest}`"
                assert name in commands, f"{where}: no such command"
                mentioned.add(name)
                rest = re.split(r"\s(?:\||;|&&|#)\s|\s#", rest)[0]
                options, choices = commands[name]
                for option in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest):
                    assert option in options, f"{where}: {option} is not an option of {name}"
                words = rest.split()
                if choices and words:
                    action = words[0].strip("[]")
                    if re.fullmatch(r"[a-z]+", action):
                        assert action in choices, f"{where}: {action} is not one of {choices}"
    # The operations page lists every command.
    operations = OPERATIONS.read_text(encoding="utf-8")
    for name in commands:
        assert f"fencegate {name}" in operations, f"operations.md does not list {name}"


def test_the_command_table_lists_every_option_of_each_command() -> None:
    """operations.md's command table: the rows of each command name every option its
    ``--help`` shows (``audit --source`` and ``--replica`` were once missing); ``--config``
    is said once, below the table."""
    operations = OPERATIONS.read_text(encoding="utf-8")
    assert "Every command except `demo` takes `--config FILE`" in operations
    start = operations.index("| command | what it does |")
    rows = [line for line in operations[start:].splitlines()[2:] if line.startswith("| `")]
    for name, (options, _) in cli_commands().items():
        listed = {
            option
            for row in rows
            if row.startswith(f"| `fencegate {name}")
            for option in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", row.split("` |")[0])
        }
        wanted = options - {"--help", "--config"}
        assert wanted <= listed, (name, sorted(wanted - listed))


# -- (d) the configuration reference ----------------------------------------------------------


def nested_model(annotation: Any) -> type[BaseModel] | None:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # an optional table
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return nested_model(inner[0]) if len(inner) == 1 else None
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if inspect.isclass(item) and issubclass(item, BaseModel):
            return item
    return None


def model_fields(model: type[BaseModel], prefix: str = "") -> dict[str, FieldInfo]:
    out: dict[str, FieldInfo] = {}
    for name, info in model.model_fields.items():
        sub = nested_model(info.annotation)
        if sub is not None:
            out.update(model_fields(sub, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = info
    return out


def reference_rows() -> dict[str, dict[str, str]]:
    """``section.key`` -> the row's cells by column name, from operations.md."""
    text = OPERATIONS.read_text(encoding="utf-8")
    start = text.index("### Configuration reference")
    end = re.search(r"^#{1,3} ", text[start + 4 :], re.MULTILINE)
    section = text[start : start + 4 + end.start()] if end else text[start:]
    out: dict[str, dict[str, str]] = {}
    for table in tables(section):
        if [c.lower() for c in table.header[:1]] != ["key"]:
            continue
        match = re.search(r"\[\[?([a-z_]+)\]\]?", table.heading)
        if match is not None:
            prefix = match.group(1) + "."
        else:
            assert "top level" in table.heading.lower(), table.heading
            prefix = ""
        for cells in table.rows:
            key = backticked(cells[0])
            assert key is not None, f"operations.md:{table.line}: key not in backticks"
            assert prefix + key not in out, f"{prefix}{key} is documented twice"
            out[prefix + key] = dict(zip([c.lower() for c in table.header], cells, strict=True))
    return out


def test_the_configuration_reference_documents_exactly_the_settings() -> None:
    documented = set(reference_rows())
    fields = set(model_fields(Settings))
    assert not fields - documented, f"undocumented settings: {sorted(fields - documented)}"
    assert not documented - fields, f"documented but unknown: {sorted(documented - fields)}"


def type_word(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal or (
        isinstance(annotation, type) and issubclass(annotation, StrEnum)
    ):
        return "string"
    if origin is list:
        return "list"
    if origin is dict:
        return "table"
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return type_word(inner)
    words = {bool: "boolean", int: "integer", float: "number", str: "string", SecretStr: "string"}
    return words[annotation]


def number_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


@pytest.mark.parametrize("key", sorted(model_fields(Settings)))
def test_each_setting_has_the_code_default_type_and_bounds(key: str) -> None:
    info = model_fields(Settings)[key]
    row = reference_rows().get(key)
    if row is None:
        pytest.fail(f"operations.md does not document {key}")
    default = row["default"].strip()
    if info.is_required():
        assert default == "required", (key, default)
    elif info.get_default(call_default_factory=True) is None:
        assert default.startswith("none"), (key, default)  # TOML has no null
    else:
        literal = backticked(default)
        assert literal is not None, f"{key}: write the default as a TOML literal in backticks"
        value = tomllib.loads(f"v = {literal}")["v"]
        expected = info.get_default(call_default_factory=True)
        if isinstance(expected, list | dict):  # SecretStr items print as secrets
            assert value == expected or (not value and not expected), (key, value, expected)
        else:
            assert value == expected, (key, value, expected)
    assert row["type"].startswith(type_word(info.annotation)), (key, row["type"])
    bounds = [
        getattr(meta, attr)
        for meta in info.metadata
        for attr in ("gt", "ge", "lt", "le")
        if isinstance(meta, annotated_types.BaseMetadata) and hasattr(meta, attr)
    ]
    for bound in bounds:
        text = number_text(bound)
        pattern = rf"(?<![\d.]){re.escape(text)}(?![\d.])"
        assert re.search(pattern, row["limits"]), f"{key}: bound {text} not in {row['limits']!r}"


# -- metrics ----------------------------------------------------------------------------------


def test_every_metric_is_listed() -> None:
    operations = OPERATIONS.read_text(encoding="utf-8")
    for family in Metrics().registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{name}`" in operations, f"operations.md does not list the metric {name}"


# -- (e) links --------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def link_cases() -> list[Any]:
    pages = [*doc_pages(), ROOT / "README.md", EXAMPLES / "README.md"]
    return [pytest.param(page, id=str(page.relative_to(ROOT))) for page in pages]


@pytest.mark.parametrize("page", link_cases())
def test_relative_links_resolve(page: Path) -> None:
    _, prose = split_markdown(page.read_text(encoding="utf-8"))
    broken = []
    for number, line in prose:
        line = CODE_SPAN.sub("", line)
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}:{number}: {target}"
            if not resolved.exists():
                broken.append(f"{where}: {resolved.relative_to(ROOT)} does not exist")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where}: no heading #{anchor}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_page_is_linked_from_an_index() -> None:
    """docs/README.md links the four pages; every other page in docs/ is linked from it
    or from the top-level README.md, which links docs/README.md."""
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/README.md)" in readme, "README.md does not link docs/README.md"
    for name in OWN_PAGES:
        assert (DOCS / name).is_file(), name
        if name != "README.md":
            assert f"]({name})" in index, f"docs/README.md does not link {name}"
    for page in doc_pages():
        if page.name != "README.md":
            linked = f"]({page.name}" in index or f"](docs/{page.name}" in readme
            assert linked, f"neither docs/README.md nor README.md links docs/{page.name}"
