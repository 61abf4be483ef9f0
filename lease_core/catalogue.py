"""The catalogue of state changes: every write Fencegate makes, by name, its SQL written
once: in ``lease_core/sql/common.sql`` when it is the same on every dialect, else once
per dialect in ``lease_core/sql/<dialect>.sql``.

The SQL decides (each change is conditional, so a lost race matches no row); the Python
that runs an operation only reads its answer, and explains a refusal. ``Backend`` runs
the operations and is the only writer; SQLAlchemy keeps the schema, the migrations and
the read-only listings (jobs, the audit, the dashboard).

A rule that several statements share (the lease is current, an outcome is unknown or
overdue, ...) is a fragment, ``-- fragment: <name>``, written once per dialect (or once
in ``common.sql``) and used as ``{name}``; the loader substitutes it, and refuses at load
time an unknown fragment, one defined twice, one never used, and braces left over. A
fragment about a row of whatever alias its statement gives it names that alias as a
parameter, ``-- fragment: <name>(row)``, writes it ``{row}`` (``{row}.deadline``), and
is used as ``{name(r)}``.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import cache, cached_property
from pathlib import Path

from fencegate_client.reasons import Reason

from .rules import RecordState, State
from .statement import BATCH_LANES, Batched, Statement

SQL_DIR = Path(__file__).parent / "sql"
DIALECTS = ("postgresql", "sqlite")

# The states the SQL may name, and the reasons of a verdict it gives: "{State.LEASED}"
# becomes 'leased', "{Reason.LEASE_ENDED}" that reason's value.
CONSTANTS: dict[str, type[StrEnum]] = {"State": State, "RecordState": RecordState, "Reason": Reason}

_HEADER = re.compile(
    r"^-- name: ([a-z_]+)(?: \((?:(many)(, one at a time)?|(rows))\))?\s*$", re.MULTILINE
)
_NAMES = r"([a-z][a-z0-9_]*(?:, ?[a-z][a-z0-9_]*)*)"  # a fragment's aliases: "r, j"
_FRAGMENT = re.compile(rf"^-- fragment: ([a-z][a-z0-9_]*)(?:\({_NAMES}\))?\s*$", re.MULTILINE)
_ANY_HEADER = re.compile(r"^-- (?:name|fragment):.*$", re.MULTILINE)
# A fragment, with the aliases it is given; "{now}" is statement.Statement's.
_USE = re.compile(rf"\{{([a-z][a-z0-9_]*)(?:\({_NAMES}\))?\}}")
_CONSTANT = re.compile(r"\{(\w+)\.(\w+)\}")
_PLACEHOLDER = re.compile(r"\{(?!now\})[^{}]*\}")
_LONE_BRACE = re.compile(r"\{(?!now\})|(?<!\{now)\}")
_INDENT = re.compile(r"[ \t]*")
_END = re.compile(r";\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Operation:
    """A named state change: ``statements`` run in order in one transaction (each one's
    first row merged into the answer, its columns parameters of the ones after it);
    ``many``: the form concurrent callers share on PostgreSQL; ``one_at_a_time``: its
    batches are sent one after another, never two at once; ``rows``: a listing, one
    read whose answer is every row it found (``{"rows": [...]}``); ``source``: the file
    that defines it."""

    name: str
    doc: str
    statements: tuple[Statement, ...]
    many: Statement | None = None
    one_at_a_time: bool = False
    source: str = ""
    rows: bool = False

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


@dataclass(frozen=True)
class Fragment:
    """A rule that several statements share (``-- fragment: <name>``), written once:
    ``{name}`` in a statement or in another fragment stands for ``text``. It takes no
    arguments: the aliases it names (``r.state``, ``clock.now``) are the ones its
    statements must use, and its comment (``doc``) says so; or it names them as its
    ``params`` (``{row}`` in ``text``), and each use gives its own (``{name(r)}``)."""

    name: str
    doc: str
    text: str
    source: str
    params: tuple[str, ...] = ()


class CatalogueError(ValueError):
    pass


class Catalogue(Mapping[str, Operation]):
    """The operations of one dialect, by name, and the fragments they were written with."""

    def __init__(
        self,
        dialect: str,
        operations: dict[str, Operation],
        fragments: Mapping[str, Fragment] | None = None,
    ) -> None:
        self.dialect = dialect
        self._operations = operations
        self.fragments: Mapping[str, Fragment] = dict(fragments or {})

    def __getitem__(self, name: str) -> Operation:
        return self._operations[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._operations)

    def __len__(self) -> int:
        return len(self._operations)


COMMON = "common"  # the operations and fragments that are the same on every dialect


@cache
def load(dialect: str) -> Catalogue:
    """The catalogue of ``dialect`` ("postgresql" or "sqlite"): its own file's operations
    and the common ones; an operation, and a fragment, is written in exactly one of the
    two, and every fragment either defines is used by the two together."""
    if dialect not in DIALECTS:
        raise CatalogueError(f"no SQL for the {dialect!r} dialect; one of {DIALECTS}")
    files = {}
    for name in (COMMON, dialect):
        path = SQL_DIR / f"{name}.sql"
        files[f"{SQL_DIR.parent.name}/{SQL_DIR.name}/{path.name}"] = path.read_text("utf-8")
    operations, fragments = assemble(files)
    return Catalogue(dialect, operations, fragments)


def parse(text: str, source: str = "<sql>") -> dict[str, Operation]:
    """The operations of one self-contained SQL text (format: the header of
    postgresql.sql), written with the fragments it defines."""
    return assemble({source: text})[0]


def assemble(files: Mapping[str, str]) -> tuple[dict[str, Operation], dict[str, Fragment]]:
    """The operations of SQL files loaded together (source name: text), and the fragments
    they share: a fragment of any of them may be used in any of them. Refused: an
    operation or a fragment defined twice (in one file or in two), an unknown fragment,
    one that uses itself, one that nothing uses, and braces left over."""
    fragments: dict[str, Fragment] = {}
    sections: list[_Section] = []
    for source, text in files.items():
        own_fragments, own_sections = _split(text, source)
        for name, fragment in own_fragments.items():
            if name in fragments:
                raise CatalogueError(
                    f"{fragments[name].source} and {source} both define the fragment {{{name}}}"
                )
            fragments[name] = fragment
        sections += own_sections
    expander = _Expander(fragments)
    operations: dict[str, Operation] = {}
    for source in files:
        own = _operations(source, [s for s in sections if s.source == source], expander)
        for name, operation in list(own.items()):
            earlier = operations.get(name)
            if earlier is not None and _adds_shared_form(earlier, operation):
                # A dialect's shared form of an operation another file writes once.
                operations[name] = replace(
                    earlier, many=operation.many, one_at_a_time=operation.one_at_a_time
                )
                del own[name]
        both = sorted(set(operations) & set(own))
        if both:
            first = operations[both[0]].source
            raise CatalogueError(f"{source} and {first} both define {', '.join(both)}")
        operations.update(own)
    unused = [f for f in fragments.values() if f.name not in expander.used]
    if unused:
        names = ", ".join(f"{{{f.name}}} ({f.source})" for f in unused)
        raise CatalogueError(f"fragment never used by {' or '.join(files)}: {names}")
    return operations, fragments


def _adds_shared_form(earlier: Operation, later: Operation) -> bool:
    """``later`` is only the ``(many)`` form of ``earlier``, which has none: a dialect's
    way to share an operation that ``common.sql`` writes once for every dialect."""
    return (
        not later.statements
        and later.many is not None
        and earlier.many is None
        and len(earlier.statements) == 1
    )


@dataclass(frozen=True)
class _Section:
    """One ``-- name:`` block of a file, its SQL not yet expanded."""

    source: str
    name: str
    many: bool
    one_at_a_time: bool
    rows: bool
    doc: str
    sql: str


def _split(text: str, source: str) -> tuple[dict[str, Fragment], list[_Section]]:
    """The fragments and the operations' blocks of one file, in order."""
    headers = list(_ANY_HEADER.finditer(text))
    fragments: dict[str, Fragment] = {}
    sections: list[_Section] = []
    for i, header in enumerate(headers):
        end = headers[i + 1].start() if i + 1 < len(headers) else len(text)
        doc, sql = _doc_and_sql(text[header.end() : end])
        if fragment := _FRAGMENT.fullmatch(header.group(0)):
            name = fragment.group(1)
            if name in fragments:
                raise CatalogueError(f"{source}: the fragment {{{name}}} is defined twice")
            params = _names(fragment.group(2))
            fragments[name] = _fragment(name, params, doc, sql, source)
        elif operation := _HEADER.fullmatch(header.group(0)):
            name, many, serial, rows = operation.groups()
            section = _Section(source, name, bool(many), bool(serial), bool(rows), doc, sql)
            sections.append(section)
        else:
            raise CatalogueError(f"{source}: not a header: {header.group(0)!r}")
    return fragments, sections


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",")) if text else ()


def _fragment(name: str, params: tuple[str, ...], doc: str, sql: str, source: str) -> Fragment:
    """A fragment's block, checked: SQL that is a part of one statement, each of its
    aliases named once and used."""
    where = f"{source}: the fragment {{{name}}}"
    if name == "now" or "now" in params:
        raise CatalogueError(f"{source}: {{now}} is the clock, not a fragment or an alias")
    if not sql:
        raise CatalogueError(f"{where} has no SQL")
    if _END.search(sql):
        raise CatalogueError(
            f"{where} ends a statement (';'): a fragment is a part of one statement"
        )
    if len(set(params)) != len(params):
        raise CatalogueError(f"{where} names an alias twice: {', '.join(params)}")
    for param in params:
        if f"{{{param}}}" not in sql:
            raise CatalogueError(f"{where} never uses its alias {{{param}}}")
    return Fragment(name, doc, textwrap.dedent(sql).strip(), source, params)


def _doc_and_sql(body: str) -> tuple[str, str]:
    """The comment lines at the top of a block (what it does) and its SQL lines."""
    doc_lines: list[str] = []
    sql_lines: list[str] = []
    for line in body.splitlines():
        if line.startswith("--"):
            if not sql_lines:
                doc_lines.append(line[2:].strip())
            continue
        if line.strip():
            sql_lines.append(line)
    return " ".join(doc_lines).strip(), "\n".join(sql_lines)


def _operations(source: str, sections: list[_Section], expander: _Expander) -> dict[str, Operation]:
    """The operations of one file's blocks, their fragments and states substituted."""
    singles: dict[str, tuple[str, tuple[Statement, ...]]] = {}
    manys: dict[str, Statement] = {}
    one_at_a_time: set[str] = set()
    listings: set[str] = set()
    for section in sections:
        name = section.name
        if section.one_at_a_time:
            one_at_a_time.add(name)
        where = f"{source}: {name}"
        statements = tuple(
            Statement(_constants(expander.expand(part.strip(), where), where))
            for part in _END.split(section.sql)
            if part.strip()
        )
        if not statements:
            raise CatalogueError(f"{source}: {name} has no statement")
        if section.rows:
            if len(statements) != 1 or not statements[0].reads_only:
                raise CatalogueError(f"{source}: {name} (rows) must be one SELECT")
            listings.add(name)
        if section.many:
            if name in manys or len(statements) != 1:
                raise CatalogueError(f"{source}: {name} (many) must be one statement, once")
            manys[name] = statements[0]
        else:
            if name in singles:
                raise CatalogueError(f"{source}: {name} is defined twice")
            singles[name] = (section.doc, statements)
    operations = {}
    for name in dict.fromkeys([*singles, *manys]):
        doc, statements = singles.get(name, ("", ()))
        operations[name] = Operation(
            name,
            doc,
            statements,
            manys.get(name),
            one_at_a_time=name in one_at_a_time,
            source=source,
            rows=name in listings,
        )
    return operations


class _Expander:
    """Substitutes the fragments into SQL, each one's own fragments first; remembers
    which were used. A fragment's lines after its first are indented as the line it is
    used on."""

    def __init__(self, fragments: Mapping[str, Fragment]) -> None:
        self.fragments = fragments
        self.used: set[str] = set()
        self._texts: dict[tuple[str, tuple[str, ...]], str] = {}

    def expand(self, sql: str, where: str, within: tuple[str, ...] = ()) -> str:
        def substitute(match: re.Match[str]) -> str:
            name, aliases = match.group(1), _names(match.group(2))
            if name == "now" and not aliases:
                return match.group(0)
            line = sql[sql.rfind("\n", 0, match.start()) + 1 :]
            indent = _INDENT.match(line)
            return self._text(name, aliases, where, within).replace(
                "\n", "\n" + (indent.group(0) if indent else "")
            )

        return _USE.sub(substitute, sql)

    def _text(
        self, name: str, aliases: tuple[str, ...], where: str, within: tuple[str, ...]
    ) -> str:
        fragment = self.fragments.get(name)
        if fragment is None:
            raise CatalogueError(f"{where}: unknown fragment {{{name}}}")
        if name in within:
            cycle = " -> ".join(f"{{{n}}}" for n in (*within, name))
            raise CatalogueError(f"{fragment.source}: a fragment uses itself: {cycle}")
        if len(aliases) != len(fragment.params):
            wanted = f"({', '.join(fragment.params)})" if fragment.params else "no alias"
            raise CatalogueError(f"{where}: the fragment {{{name}}} takes {wanted}")
        self.used.add(name)
        if (name, aliases) not in self._texts:
            inner = f"{fragment.source}: fragment {{{name}}}"
            text = fragment.text
            for param, alias in zip(fragment.params, aliases, strict=True):
                text = text.replace(f"{{{param}}}", alias)
            self._texts[name, aliases] = self.expand(text, inner, (*within, name))
        return self._texts[name, aliases]


def _constants(sql: str, where: str) -> str:
    def literal(match: re.Match[str]) -> str:
        enum = CONSTANTS.get(match.group(1))
        if enum is None or match.group(2) not in enum.__members__:
            raise CatalogueError(f"{where}: no such state {match.group(0)}")
        return f"'{enum[match.group(2)].value}'"

    sql = _CONSTANT.sub(literal, sql)
    leftover = _PLACEHOLDER.search(sql) or _LONE_BRACE.search(sql)
    if leftover is not None:
        raise CatalogueError(
            f"{where}: leftover braces {leftover.group(0)!r}: neither a fragment, a state"
            " nor {now}"
        )
    return sql
