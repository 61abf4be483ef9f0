"""The catalogue of state changes: every write Fencegate makes, by name, its SQL written
once: in ``lease_core/sql/common.sql`` when it is the same on every dialect, else once
per dialect in ``lease_core/sql/<dialect>.sql``.

The SQL decides (each change is conditional, so a lost race matches no row); the Python
that runs an operation only reads its answer, and explains a refusal. ``Backend`` runs
the operations and is the only writer; SQLAlchemy keeps the schema, the migrations and
the read-only listings (jobs, the audit, the dashboard).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import cache, cached_property
from pathlib import Path

from .direct import BATCH_LANES, Batched, Statement
from .rules import RecordState, State

SQL_DIR = Path(__file__).parent / "sql"
DIALECTS = ("postgresql", "sqlite")

# The states the SQL may name: "{State.LEASED}" becomes 'leased'.
CONSTANTS: dict[str, type[StrEnum]] = {"State": State, "RecordState": RecordState}

_HEADER = re.compile(r"^-- name: ([a-z_]+)( \(many(, one at a time)?\))?\s*$", re.MULTILINE)
_CONSTANT = re.compile(r"\{(\w+)\.(\w+)\}")
_PLACEHOLDER = re.compile(r"\{(?!now\})[^}]*\}")
_END = re.compile(r";\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Operation:
    """A named state change: ``statements`` run in order in one transaction (each one's
    first row merged into the answer, its columns parameters of the ones after it);
    ``many``: the form concurrent callers share on PostgreSQL; ``one_at_a_time``: its
    batches are sent one after another, never two at once."""

    name: str
    doc: str
    statements: tuple[Statement, ...]
    many: Statement | None = None
    one_at_a_time: bool = False

    @cached_property
    def batched(self) -> Batched | None:
        """The operation as ``direct`` batches it; None when it has no shared form."""
        if self.many is None:
            return None
        if len(self.statements) > 1:
            raise ValueError(f"{self.name}: a batched operation is one statement")
        single = self.statements[0] if self.statements else None
        return Batched(self.many, single, lanes=1 if self.one_at_a_time else BATCH_LANES)

    def __hash__(self) -> int:
        return hash(self.name)


class CatalogueError(ValueError):
    pass


class Catalogue(Mapping[str, Operation]):
    """The operations of one dialect, by name."""

    def __init__(self, dialect: str, operations: dict[str, Operation]) -> None:
        self.dialect = dialect
        self._operations = operations

    def __getitem__(self, name: str) -> Operation:
        return self._operations[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._operations)

    def __len__(self) -> int:
        return len(self._operations)


COMMON = "common"  # the operations whose SQL is the same on every dialect


@cache
def load(dialect: str) -> Catalogue:
    """The catalogue of ``dialect`` ("postgresql" or "sqlite"): its own file's operations
    and the common ones; an operation is written in exactly one of the two."""
    if dialect not in DIALECTS:
        raise CatalogueError(f"no SQL for the {dialect!r} dialect; one of {DIALECTS}")
    operations = read(COMMON)
    own = read(dialect)
    both = sorted(set(operations) & set(own))
    if both:
        raise CatalogueError(f"{dialect}.sql and {COMMON}.sql both define {', '.join(both)}")
    return Catalogue(dialect, {**operations, **own})


def read(name: str) -> dict[str, Operation]:
    """The operations of one file of ``SQL_DIR``."""
    path = SQL_DIR / f"{name}.sql"
    return parse(path.read_text(encoding="utf-8"), str(path))


def parse(text: str, source: str = "<sql>") -> dict[str, Operation]:
    """The operations of one SQL file (format: the header of postgresql.sql)."""
    headers = list(_HEADER.finditer(text))
    singles: dict[str, tuple[str, tuple[Statement, ...]]] = {}
    manys: dict[str, Statement] = {}
    one_at_a_time: set[str] = set()
    for i, header in enumerate(headers):
        name, many = header.group(1), bool(header.group(2))
        if header.group(3):
            one_at_a_time.add(name)
        end = headers[i + 1].start() if i + 1 < len(headers) else len(text)
        body = text[header.end() : end]
        doc_lines: list[str] = []
        sql_lines: list[str] = []
        for line in body.splitlines():
            if line.startswith("--"):
                if not sql_lines:
                    doc_lines.append(line[2:].strip())
                continue
            if line.strip():
                sql_lines.append(line)
        statements = tuple(
            Statement(_constants(part.strip(), source, name))
            for part in _END.split("\n".join(sql_lines))
            if part.strip()
        )
        if not statements:
            raise CatalogueError(f"{source}: {name} has no statement")
        if many:
            if name in manys or len(statements) != 1:
                raise CatalogueError(f"{source}: {name} (many) must be one statement, once")
            manys[name] = statements[0]
        else:
            if name in singles:
                raise CatalogueError(f"{source}: {name} is defined twice")
            singles[name] = (" ".join(doc_lines).strip(), statements)
    operations = {}
    for name in dict.fromkeys([*singles, *manys]):
        doc, statements = singles.get(name, ("", ()))
        operations[name] = Operation(
            name, doc, statements, manys.get(name), one_at_a_time=name in one_at_a_time
        )
    return operations


def _constants(sql: str, source: str, name: str) -> str:
    def literal(match: re.Match[str]) -> str:
        enum = CONSTANTS.get(match.group(1))
        if enum is None or match.group(2) not in enum.__members__:
            raise CatalogueError(f"{source}: {name}: no such state {match.group(0)}")
        return f"'{enum[match.group(2)].value}'"

    sql = _CONSTANT.sub(literal, sql)
    unknown = _PLACEHOLDER.search(sql)
    if unknown is not None:
        raise CatalogueError(f"{source}: {name}: unknown placeholder {unknown.group(0)}")
    return sql
