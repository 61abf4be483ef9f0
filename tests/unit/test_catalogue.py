"""The catalogue of state changes: every dialect defines the same operations, with the
same parameters, documented; states are named through the enums, never spelled."""

from __future__ import annotations

import re

import pytest

from lease_core import catalogue
from lease_core.catalogue import CatalogueError, parse
from lease_core.direct import BATCH_LANES, parameter_names
from lease_core.rules import RecordState, State

CATALOGUES = {dialect: catalogue.load(dialect) for dialect in catalogue.DIALECTS}


def parameters(operation: catalogue.Operation) -> set[str]:
    statements = [*operation.statements, *([operation.many] if operation.many else [])]
    return {name for s in statements for name in parameter_names(s.text)} - {"now"}


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
    common = set(catalogue.read(catalogue.COMMON))
    assert common, "common.sql defines the operations that are the same on every dialect"
    own = {dialect: catalogue.read(dialect) for dialect in catalogue.DIALECTS}
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
        ("-- name: a\nSELECT '{oops}';", "unknown placeholder"),
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
