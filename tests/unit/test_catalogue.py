"""The catalogue of state changes: every dialect defines the same operations, with the
same parameters, documented; states are named through the enums, never spelled; a rule
several statements share is a fragment, written once."""

from __future__ import annotations

import re

import pytest

from lease_core import catalogue
from lease_core.catalogue import CatalogueError, assemble, parse
from lease_core.rules import RecordState, State
from lease_core.statement import BATCH_LANES, parameter_names

CATALOGUES = {dialect: catalogue.load(dialect) for dialect in catalogue.DIALECTS}


_RETURNING = re.compile(r"\bRETURNING\b(.*)", re.S)
_COLUMN = re.compile(r"(?:^|,)\s*(?:\w+\.)?(\w+)\s*(?=,|$)|\bAS\s+(\w+)")
_NAMED = re.compile(r"\bAS\s+(\w+)")


def parameters(operation: catalogue.Operation) -> set[str]:
    """What a caller passes: the names the statements read, less those an earlier
    statement of the operation returns or names (a chain reads them from its answer)."""
    statements = [*operation.statements, *([operation.many] if operation.many else [])]
    names: set[str] = set()
    returned: set[str] = set()
    for statement in statements:
        names |= set(parameter_names(statement.text)) - returned
        found = _RETURNING.search(statement.text)
        if found:
            returned |= {a or b for a, b in _COLUMN.findall(" ".join(found.group(1).split()))}
        returned |= set(_NAMED.findall(statement.text))
    return names - {"now"}


def test_every_dialect_defines_the_same_operations() -> None:
    names = {dialect: set(ops) for dialect, ops in CATALOGUES.items()}
    assert names["postgresql"] == names["sqlite"]
    assert len(names["sqlite"]) >= 25


@pytest.mark.parametrize("name", sorted(CATALOGUES["postgresql"]))
def test_an_operation_takes_the_same_parameters_in_every_dialect(name: str) -> None:
    assert parameters(CATALOGUES["postgresql"][name]) == parameters(CATALOGUES["sqlite"][name])


@pytest.mark.parametrize("name", sorted(CATALOGUES["sqlite"]))
def test_sqlite_runs_every_operation_for_one_caller(name: str) -> None:
    operation = CATALOGUES["sqlite"][name]
    assert operation.statements, "SQLite has no batched form: each operation needs its own"
    assert operation.many is None


@pytest.mark.parametrize("dialect", catalogue.DIALECTS)
def test_every_operation_says_what_it_does(dialect: str) -> None:
    for name, operation in CATALOGUES[dialect].items():
        if operation.statements:
            assert len(operation.doc) > 20, f"{dialect}: {name} has no comment"


@pytest.mark.parametrize("dialect", catalogue.DIALECTS)
def test_states_are_named_through_the_enums(dialect: str) -> None:
    """A state spelled as a literal in the SQL file would not follow a rename of the enum."""
    text = (catalogue.SQL_DIR / f"{dialect}.sql").read_text()
    text += (catalogue.SQL_DIR / "common.sql").read_text()
    spelled = {value for value in [*State, *RecordState] if f"'{value}'" in text}
    assert spelled == set()
    assert "{State.LEASED}" in text and "{RecordState.IN_FLIGHT}" in text
    # ... and the loader replaced every one of them.
    for operation in CATALOGUES[dialect].values():
        for statement in [*operation.statements, *([operation.many] if operation.many else [])]:
            assert not re.search(r"\{(?!now\})", statement.text)


def test_an_operation_is_written_in_one_file_only() -> None:
    """Common operations are not written again per dialect, and a dialect's own
    operation is not the same SQL as the other dialect's (it would belong in common)."""

    def source(op: catalogue.Operation) -> str:
        return op.source.rsplit("/", 1)[-1].removesuffix(".sql")

    common = {n for n, op in CATALOGUES["sqlite"].items() if source(op) == catalogue.COMMON}
    assert common, "common.sql defines the operations that are the same on every dialect"
    assert common == {
        n for n, op in CATALOGUES["postgresql"].items() if source(op) == catalogue.COMMON
    }
    own = {
        dialect: {n: op for n, op in ops.items() if source(op) == dialect}
        for dialect, ops in CATALOGUES.items()
    }
    for ops in own.values():
        assert common.isdisjoint(ops)
    same = [
        name
        for name, op in own["sqlite"].items()
        if op.many is None
        and own["postgresql"][name].many is None
        and [s.text for s in op.statements] == [s.text for s in own["postgresql"][name].statements]
    ]
    assert same == [], f"the same SQL in both dialect files, move it to common.sql: {same}"


def test_the_loader_reads_statements_docs_and_batched_forms() -> None:
    ops = parse(
        """
-- name: one
-- Does one thing.
UPDATE t SET a = :a WHERE s = {State.LEASED};
-- name: two
-- Two steps.
SELECT 1 AS x;
SELECT :x AS y;
-- name: one (many)
SELECT i.n FROM unnest(CAST(:a AS int[])) WITH ORDINALITY AS i(a, n);
"""
    )
    assert ops["one"].doc == "Does one thing."
    assert ops["one"].statements[0].text == "UPDATE t SET a = :a WHERE s = 'leased'"
    assert ops["one"].batched is not None and ops["one"].batched.single is ops["one"].statements[0]
    assert [s.text for s in ops["two"].statements] == ["SELECT 1 AS x", "SELECT :x AS y"]
    assert ops["two"].batched is None


def test_a_batched_form_may_go_one_batch_at_a_time() -> None:
    ops = parse(
        """
-- name: shared (many)
SELECT i.n FROM unnest(CAST(:a AS int[])) WITH ORDINALITY AS i(a, n);
-- name: serial (many, one at a time)
SELECT i.n FROM unnest(CAST(:a AS int[])) WITH ORDINALITY AS i(a, n);
"""
    )
    shared, serial = ops["shared"].batched, ops["serial"].batched
    assert shared is not None and shared.lanes == BATCH_LANES > 1
    assert serial is not None and serial.lanes == 1
    # The claim contends with itself (the same first rows of a queue); renewals gather
    # into fewer, larger batches one at a time (docs/performance.md).
    for name in ("claim", "renew"):
        batched = catalogue.load("postgresql")[name].batched
        assert batched is not None and batched.lanes == 1, name


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("-- name: a\nSELECT {State.NOPE};", "no such state"),
        ("-- name: a\nSELECT {Other.X};", "no such state"),
        ("-- name: a\nSELECT '{oops}';", r"unknown fragment \{oops\}"),
        ("-- name: a\nSELECT '{Oops!}';", r"leftover braces '\{Oops!\}'"),
        ("-- name: a\nSELECT '{' || :x;", "leftover braces '{'"),
        ("-- name: a\nSELECT 1 AS x};", "leftover braces '}'"),
        ("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;", "defined twice"),
        ("-- name: a (many)\nSELECT 1;\nSELECT 2;", "one statement"),
        ("-- name: a\n-- only a comment\n", "has no statement"),
    ],
)
def test_the_loader_refuses_what_it_cannot_run(text: str, message: str) -> None:
    with pytest.raises(CatalogueError, match=message):
        parse(text)


def test_an_unknown_dialect_is_named() -> None:
    with pytest.raises(CatalogueError, match="mysql"):
        catalogue.load("mysql")


FRAGMENTS = """
-- fragment: leased
-- The row is leased.
state = {State.LEASED}

-- fragment: current
-- Leased, and not expired: two lines, the second indented as the use.
{leased}
  AND lease_expires_at > {now}

-- name: renew
-- Uses a fragment that uses another.
UPDATE jobs SET updated_at = {now}
    WHERE job_id = :job_id AND {current};
-- name: purge
-- Uses one in parentheses.
DELETE FROM jobs WHERE NOT ({leased});
"""


def test_fragments_expand_where_they_are_used() -> None:
    ops = parse(FRAGMENTS)
    assert ops["renew"].statements[0].text == (
        "UPDATE jobs SET updated_at = {now}\n"
        "    WHERE job_id = :job_id AND state = 'leased'\n"
        "      AND lease_expires_at > {now}"
    )
    assert ops["purge"].statements[0].text == "DELETE FROM jobs WHERE NOT (state = 'leased')"


def test_a_fragment_of_one_file_serves_the_others_loaded_with_it() -> None:
    common = "-- fragment: leased\n-- The row is leased.\nstate = {State.LEASED}\n"
    own = "-- name: purge\n-- Uses common's.\nDELETE FROM jobs WHERE {leased};\n"
    operations, fragments = assemble({"common.sql": common, "sqlite.sql": own})
    assert operations["purge"].statements[0].text == "DELETE FROM jobs WHERE state = 'leased'"
    assert operations["purge"].source == "sqlite.sql"
    assert fragments["leased"].source == "common.sql"
    assert fragments["leased"].doc == "The row is leased."


def test_a_dialect_may_add_the_shared_form_of_a_common_operation() -> None:
    common = "-- name: note\n-- Writes a note.\nINSERT INTO notes (t) VALUES (:t);\n"
    many = "-- name: note (many)\nINSERT INTO notes (t) SELECT unnest(:t);\n"
    operations, _ = assemble({"common.sql": common, "postgresql.sql": many})
    note = operations["note"]
    assert note.source == "common.sql" and note.doc == "Writes a note."
    assert note.many is not None and note.many.text.startswith("INSERT INTO notes (t) SELECT")
    assert note.batched is not None
    # Only a shared form is added this way: a second one, or a one-caller form, is refused.
    twice = common + many
    with pytest.raises(CatalogueError, match="both define note"):
        assemble({"common.sql": twice, "postgresql.sql": many})
    with pytest.raises(CatalogueError, match="both define note"):
        assemble({"common.sql": common, "postgresql.sql": common})


USE = "-- name: a\nSELECT 1 WHERE {f};\n"
F = "-- fragment: f\nx = 1\n"


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"s.sql": "-- name: a\nSELECT 1 WHERE {nope};"}, r"s.sql: a: unknown fragment \{nope\}"),
        ({"s.sql": F + F + USE}, r"s.sql: the fragment \{f\} is defined twice"),
        ({"c.sql": F, "s.sql": F + USE}, r"c.sql and s.sql both define the fragment \{f\}"),
        ({"s.sql": F + "-- fragment: g\ny = 2\n" + USE}, r"never used .*\{g\} \(s.sql\)"),
        ({"c.sql": F, "s.sql": "-- name: a\nSELECT 1;"}, r"never used by c.sql or s.sql: \{f\}"),
        ({"s.sql": "-- fragment: f\nx = {f}\n" + USE}, r"uses itself: \{f\} -> \{f\}"),
        ({"s.sql": "-- fragment: f\nx = 1;\n" + USE}, "a part of one statement"),
        ({"s.sql": "-- fragment: f\n-- only a comment\n" + USE}, "has no SQL"),
        ({"s.sql": "-- fragment: now\nclock()\n" + USE}, "the clock, not a fragment"),
        ({"s.sql": "-- fragment: Bad-Name\nx\n" + USE}, "not a header"),
        ({"s.sql": "-- fragment: f\nx = {State.NOPE}\n" + USE}, r"no such state \{State.NOPE\}"),
        ({"s.sql": "-- fragment: f\nx = '{'\n" + USE}, "leftover braces '{'"),
        ({"c.sql": USE, "s.sql": F + USE}, "s.sql and c.sql both define a"),
    ],
)
def test_the_loader_refuses_a_fragment_it_cannot_use(files: dict[str, str], message: str) -> None:
    with pytest.raises(CatalogueError, match=message):
        assemble(files)


@pytest.mark.parametrize("dialect", catalogue.DIALECTS)
def test_every_fragment_says_what_it_is_and_is_used(dialect: str) -> None:
    """The rules the catalogue shares are fragments (the lease is current, an outcome is
    unknown or overdue, ...), each with its comment; the loader has checked that each is
    used, and none is left unexpanded."""
    fragments = CATALOGUES[dialect].fragments
    assert {"lease_current", "token_lease_current", "unknown_or_overdue"} <= set(fragments)
    for name, fragment in fragments.items():
        assert len(fragment.doc) > 20, f"{dialect}: the fragment {name} has no comment"
    current = (
        "lease_token_hash = :token_hash AND jobs.state = 'leased' AND jobs.lease_expires_at > {now}"
    )
    for name in ("fail", "renew", "complete", "release"):
        assert current in CATALOGUES[dialect][name].statements[0].text, name


ALIASED = """
-- fragment: past(row)
-- The row's deadline has passed.
{row}.deadline <= {now}

-- fragment: overdue(r)
-- In flight and past its deadline: a fragment handing its alias on.
{r}.state = {RecordState.IN_FLIGHT} AND {past({r})}

-- name: sweep
-- Uses a fragment under two aliases.
SELECT r.key FROM records AS r JOIN markers AS m ON m.key = r.key
WHERE {overdue(r)} OR {past(m)};
"""


def test_a_fragment_takes_the_aliases_of_its_rows() -> None:
    ops = parse(ALIASED)
    assert ops["sweep"].statements[0].text == (
        "SELECT r.key FROM records AS r JOIN markers AS m ON m.key = r.key\n"
        "WHERE r.state = 'in_flight' AND r.deadline <= {now} OR m.deadline <= {now}"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (ALIASED.replace("{past(m)}", "{past}"), r"\{past\} takes \(row\)"),
        (ALIASED.replace("{past(m)}", "{past(m, r)}"), r"\{past\} takes \(row\)"),
        (ALIASED.replace("{overdue(r)}", "{overdue}"), r"\{overdue\} takes \(r\)"),
        ("-- fragment: f(a)\nx = 1\n-- name: a\nSELECT {f(b)};", r"never uses its alias \{a\}"),
        ("-- fragment: f(a, a)\n{a}.x\n-- name: a\nSELECT {f(b, b)};", "an alias twice"),
        ("-- fragment: f(now)\n{now}.x\n-- name: a\nSELECT {f(b)};", "the clock"),
        ("-- fragment: f\nx = 1\n-- name: a\nSELECT {f(b)};", r"\{f\} takes no alias"),
    ],
)
def test_the_loader_refuses_aliases_that_do_not_fit(text: str, message: str) -> None:
    with pytest.raises(CatalogueError, match=message):
        parse(text)


def test_a_listing_answers_every_row_and_is_one_read() -> None:
    ops = parse("-- name: every (rows)\n-- Lists.\nSELECT key FROM records LIMIT :limit;\n")
    assert ops["every"].rows and ops["every"].batched is None
    assert not catalogue.load("sqlite")["record"].rows
    assert catalogue.load("postgresql")["list_unknown"].rows
    for text in ("DELETE FROM records;", "SELECT 1;\nSELECT 2;"):
        with pytest.raises(CatalogueError, match=r"\(rows\) must be one SELECT"):
            parse(f"-- name: every (rows)\n-- Lists.\n{text}\n")


def test_a_common_operation_may_take_a_shared_form_one_batch_at_a_time() -> None:
    common = "-- name: note\n-- Writes a note.\nINSERT INTO notes (t) VALUES (:t);\n"
    many = "-- name: note (many, one at a time)\nINSERT INTO notes (t) SELECT unnest(:t);\n"
    note = assemble({"common.sql": common, "postgresql.sql": many})[0]["note"]
    assert note.source == "common.sql" and note.one_at_a_time
    assert note.batched is not None and note.batched.lanes == 1


# The three rules every state change shares, each spelled in one fragment only: a
# write's deadline has passed (or not: it is in flight), and a lease is current (or has
# expired, its complement on a leased job). Anywhere else, a comparison of these columns
# is the rule written again.
RULES = {
    "past_deadline": re.compile(r"\bdeadline\s*(<=|>=|<|>)|(<=|>=|<|>)\s*(\w+\.)?deadline\b"),
    "lease_current": re.compile(
        r"\blease_expires_at\s*(<=|>=|<|>)|(<=|>=|<|>)\s*(\w+\.)?lease_expires_at\b"
    ),
}
SPELLED_IN = {
    "past_deadline": {"past_deadline", "in_flight"},
    "lease_current": {"lease_current", "lease_expired"},
}
_BLOCK = re.compile(r"^-- (name|fragment): ([a-z_]+)[^\n]*\n(.*?)(?=^-- (?:name|fragment):|\Z)")


@pytest.mark.parametrize("dialect", [catalogue.COMMON, *catalogue.DIALECTS])
def test_deadlines_and_current_leases_are_judged_by_their_fragments_only(dialect: str) -> None:
    text = (catalogue.SQL_DIR / f"{dialect}.sql").read_text()
    blocks = re.findall(_BLOCK.pattern, text, re.MULTILINE | re.DOTALL)
    assert len(blocks) > 10
    spelled = []
    for kind, name, body in blocks:
        sql = "\n".join(line for line in body.splitlines() if not line.startswith("--"))
        for rule, pattern in RULES.items():
            if pattern.search(sql) and not (kind == "fragment" and name in SPELLED_IN[rule]):
                spelled.append(f"{dialect}.sql: {kind} {name}: {rule}")
    assert spelled == []
    # ... and every operation that judges them reaches those fragments.
    fragments = catalogue.load("sqlite" if dialect == catalogue.COMMON else dialect).fragments
    assert {"past_deadline", "in_flight", "lease_current", "lease_expired"} <= set(fragments)


@pytest.mark.parametrize("dialect", catalogue.DIALECTS)
def test_the_admissions_give_their_verdict_in_a_column(dialect: str) -> None:
    """``refusal``: the reason, spelled through ``Reason`` in the SQL, never re-judged."""
    for name in ("admit", "lease_of_token", "external_lease", "admit_external"):
        operation = CATALOGUES[dialect][name]
        text = " ".join(s.text for s in [*operation.statements, *filter(None, [operation.many])])
        assert re.search(r"\bAS refusal\b|\brefusal,", text), name
        assert "'stale-generation'" in text, name
