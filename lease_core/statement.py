"""Statements as the catalogue (``lease_core.catalogue``) writes them, and as the
driver-level executors (``lease_core.direct``) send them: ``Statement``, one SQL text with
``:name`` parameters, in each dialect's form; ``Batched``, the form concurrent callers
share on PostgreSQL.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cached_property
from typing import Any

Row = Mapping[str, Any]

_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")
_SERVER_NOW = "CAST(extract(epoch FROM now()) AS double precision)"


def parameter_names(text: str) -> list[str]:
    """The ``:name`` parameters of a statement's text, in order (``::`` casts are not)."""
    return _PARAM.findall(text)


class Statement:
    """One SQL statement written once, with ``:name`` parameters and ``{now}`` where
    the authoritative time goes: a ``:now`` parameter (SQLite, or an injected clock)
    or PostgreSQL's own clock."""

    def __init__(self, text: str) -> None:
        self.text = text

    @cached_property
    def reads_only(self) -> bool:
        """A plain ``SELECT``: it changes nothing (SQLite runs it without joining a
        group transaction's commit)."""
        return _first_word(self.text) == "SELECT"

    @cached_property
    def sqlite(self) -> str:
        return self.text.replace("{now}", ":now")

    def postgres(self, injected_now: bool) -> tuple[str, tuple[str, ...]]:
        return self._postgres[injected_now]

    @cached_property
    def _postgres(self) -> dict[bool, tuple[str, tuple[str, ...]]]:
        variants = {}
        for injected in (False, True):
            text = self.text.replace(
                "{now}", "CAST(:now AS double precision)" if injected else _SERVER_NOW
            )
            names: list[str] = []

            def number(match: re.Match[str], names: list[str] = names) -> str:
                name = match.group(1)
                if name not in names:
                    names.append(name)
                return f"${names.index(name) + 1}"

            variants[injected] = (_PARAM.sub(number, text), tuple(names))
        return variants


def _first_word(sql: str) -> str:
    for line in sql.splitlines():
        words = line.split("--", 1)[0].split()
        if words:
            return words[0].upper()
    return ""


# Batched statements: at most this many of one kind in flight at once; callers arriving
# meanwhile wait and go together in the next one (up to MAX_BATCH).
BATCH_LANES = 2
MAX_BATCH = 64


class Batched:
    """A statement that concurrent callers share on PostgreSQL: ``many`` runs over
    arrays (``:name`` is then the list of every caller's ``name``, in order) and
    returns a column ``n``, the 1-based position of the caller a row answers.
    ``single`` is the same for one caller's plain parameters (SQLite runs only that);
    without it a lone caller is sent ``many`` over arrays of one. ``lanes``: how many
    of its batches may be in flight at once (1 for a statement whose batches would
    contend for the same rows)."""

    def __init__(
        self, many: Statement, single: Statement | None = None, *, lanes: int = BATCH_LANES
    ) -> None:
        self.many = many
        self.single = single
        self.lanes = lanes
