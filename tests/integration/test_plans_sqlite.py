"""SQLite's side of the plans: every statement of its catalogue reaches its tables
through an index, the upkeep's (once per purge interval) too.

SQLite plans without statistics here (nothing runs ``ANALYZE``), so a plan depends only
on the schema and the SQL: ``EXPLAIN QUERY PLAN`` on a migrated database says what every
call will do. A full scan ("SCAN <table>" with no index) under SQLite's one write lock
holds up every write for as long as the table is large."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from lease_core import catalogue
from lease_core.statement import parameter_names

# What a statement names in its own FROM that is not a table (its CTEs), and the table
# of the writes in flight: as many rows as writes are in flight (SQLite reuses a deleted
# row's space), which the resolver's "in flight past the deadline" reads whole rather
# than cost every admission an index entry.
NOT_TABLES = {"clock", "one", "writes_in_flight"}
_FULL_SCAN = re.compile(r"SCAN (\w+)")


def full_scans(database: Path) -> set[tuple[str, str]]:
    found = set()
    with sqlite3.connect(database) as conn:
        for name, operation in catalogue.load("sqlite").items():
            for statement in operation.statements:
                params = dict.fromkeys(parameter_names(statement.sqlite))
                for row in conn.execute("EXPLAIN QUERY PLAN " + statement.sqlite, params):
                    match = _FULL_SCAN.fullmatch(row[3])
                    if match and match.group(1) not in NOT_TABLES:
                        found.add((name, match.group(1)))
    return found


def test_sqlite_statements_reach_their_tables_through_an_index(sqlite_template: Path) -> None:
    # The resolver's claim (every resolve round, 2 s by default) once scanned every
    # record: its "unknown, or in flight and overdue" now comes from the unknown
    # records' partial index and writes_in_flight (as small as the writes in flight).
    # The upkeep once scanned every job (fail_exhausted), every grant (purge_grants) and
    # the whole audit (purge_audit), once a minute, under the write lock.
    assert full_scans(sqlite_template) == set()


def test_the_ordering_look_searches_its_jobs_writes(sqlite_template: Path) -> None:
    """writes_in_flight is left out above for the resolver's scan; the waiters' look (the
    job's lowest generation in flight) must not scan it: it searches the primary key by
    ``job_id``."""
    statement = catalogue.load("sqlite")["lowest_in_flight"].statements[0].sqlite
    with sqlite3.connect(sqlite_template) as conn:
        params = dict.fromkeys(parameter_names(statement))
        details = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + statement, params)]
    assert any(
        re.fullmatch(r"SEARCH o USING (COVERING )?INDEX \w+ \(job_id=\?\)", d) for d in details
    ), details
    assert not any(_FULL_SCAN.fullmatch(d) for d in details), details
