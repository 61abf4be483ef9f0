"""docs/lease-sources.md shows the Redis lock recipe's Lua scripts for other languages:
they must be the very scripts of ``fencegate_client.redis_lock``, in order."""

from __future__ import annotations

import re
from pathlib import Path

from fencegate_client.redis_lock import ACQUIRE, EXTEND, RELEASE

PAGE = Path(__file__).resolve().parents[2] / "docs" / "lease-sources.md"


def test_the_docs_show_the_scripts_of_the_code() -> None:
    blocks = re.findall(r"^```lua\n(.*?)^```$", PAGE.read_text(encoding="utf-8"), re.M | re.S)
    assert blocks == [ACQUIRE, EXTEND, RELEASE]
