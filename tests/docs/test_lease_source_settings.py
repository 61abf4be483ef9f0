"""Every key of every ``[[lease_sources]]`` kind is in docs/lease-sources.md's
configuration tables (one per kind, after a "`kind = "…"`:" line) with the code's
default, type and bounds, as operations.md documents the top-level settings."""

from __future__ import annotations

import re
import tomllib
import typing
from typing import Any

import annotated_types
import pytest
from pydantic import BaseModel

from gateway.config import LeaseSourceSettings
from tests.docs.test_docs import ROOT, backticked, number_text, split_cells, type_word

PAGE = ROOT / "docs" / "lease-sources.md"
COMMON = {"name", "kind"}  # documented once, in the prose before the tables


def kinds() -> dict[str, type[BaseModel]]:
    union = typing.get_args(LeaseSourceSettings)[0]
    found = {}
    for model in typing.get_args(union):
        (kind,) = typing.get_args(model.model_fields["kind"].annotation)
        found[kind] = model
    return found


def documented() -> dict[str, dict[str, dict[str, str]]]:
    """kind -> key -> the row's cells by column name."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("\n## Configuration") :]
    out: dict[str, dict[str, dict[str, str]]] = {}
    kind: str | None = None
    header: list[str] | None = None
    for line in section.splitlines():
        match = re.fullmatch(r'`kind = "([a-z0-9_-]+)"`:', line.strip())
        if match:
            kind, header = match.group(1), None
            out[kind] = {}
            continue
        if kind is None:
            continue
        if not line.startswith("|"):
            if header is not None:
                kind, header = None, None
            continue
        cells = split_cells(line)
        if header is None:
            header = [c.lower() for c in cells]
        elif not re.fullmatch(r"[\s|:-]+", line):
            key = backticked(cells[0])
            assert key is not None, line
            out[kind][key] = dict(zip(header, cells, strict=True))
    return out


@pytest.mark.parametrize("kind", sorted(kinds()))
def test_each_kind_documents_its_keys_defaults_and_bounds(kind: str) -> None:
    model = kinds()[kind]
    rows = documented().get(kind)
    assert rows is not None, f'lease-sources.md has no "`kind = "{kind}"`:" table'
    fields = {k: v for k, v in model.model_fields.items() if k not in COMMON}
    assert set(rows) == set(fields), (kind, sorted(rows), sorted(fields))
    for key, info in fields.items():
        row = rows[key]
        default = row["default"].strip()
        if info.is_required():
            assert default == "required", (kind, key, default)
        elif info.get_default() is None:
            assert default.startswith("none"), (kind, key, default)
        else:
            literal = backticked(default)
            assert literal is not None, f"{kind}.{key}: the default as a TOML literal"
            value: Any = tomllib.loads(f"v = {literal}")["v"]
            assert value == info.get_default(), (kind, key, value)
        assert row["type"].startswith(type_word(info.annotation)), (kind, key, row["type"])
        for meta in info.metadata:
            for attr in ("gt", "ge", "lt", "le"):
                if isinstance(meta, annotated_types.BaseMetadata) and hasattr(meta, attr):
                    text = number_text(getattr(meta, attr))
                    pattern = rf"(?<![\d.]){re.escape(text)}(?![\d.])"
                    assert re.search(pattern, row["limits"]), (kind, key, text, row["limits"])
