"""docs/typescript.md shows the TypeScript examples word for word: each ``ts`` block is a
file of clients/typescript/examples/, which ``npm test`` compiles and runs against a real
gateway (clients/typescript/test/examples.test.ts); the README and the docs index point
to the page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "typescript.md"
EXAMPLES = ROOT / "clients" / "typescript" / "examples"


def test_each_ts_block_is_an_example_file_as_it_is() -> None:
    blocks = re.findall(r"^```ts\n(.*?)^```$", PAGE.read_text(encoding="utf-8"), re.M | re.S)
    files = [(EXAMPLES / name).read_text(encoding="utf-8") for name in
             ("worker.ts", "bullmq-worker.ts")]  # fmt: skip
    assert blocks == files
    assert sorted(p.name for p in EXAMPLES.iterdir()) == ["bullmq-worker.ts", "worker.ts"]


def test_the_readme_and_the_docs_index_point_to_it() -> None:
    assert "docs/typescript.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(typescript.md)" in (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
