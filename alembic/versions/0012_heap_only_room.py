"""Room on the page for the hot tables' updates on PostgreSQL, so they stay heap-only
(HOT): the records' fillfactor goes from 50 to 25, and the fences get one (70).

A settle stores the answer in the record, so the settled version of a row is several
times its size in flight (214 bytes in flight, 880 settled with a 530-byte answer and
its headers). A HOT update needs the new version on the old one's page. Inserts fill a
page up to its fillfactor, then go to a new page (with autovacuum off nothing tells them
of space elsewhere), and the page must then take the settled versions of the rows
inserted there: at 50 it could for answers up to about 200 bytes (the benchmark's 70,
and 85 % of the settles HOT in a soak where the old versions could not always be pruned
in time), at 25 for answers up to about 550 bytes (docs/performance.md, "Heap-only
settles"). A fence row is rewritten when a new generation of its job is admitted.

Only storage parameters: they apply to pages written from now on, nothing is rewritten,
and code of ``0008`` to ``0011`` runs beside it (the floor stays at ``0008``). SQLite has
no fillfactor: nothing to do there.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 12:25:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# table: (its fillfactor from this revision, before it; None: the default, 100)
FILLFACTORS: dict[str, tuple[int, int | None]] = {
    "idempotency_records": (25, 50),
    "fences": (70, None),
}


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    for table, (fillfactor, _) in FILLFACTORS.items():
        op.execute(f"ALTER TABLE {table} SET (fillfactor = {fillfactor})")


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    for table, (_, before) in FILLFACTORS.items():
        if before is None:
            op.execute(f"ALTER TABLE {table} RESET (fillfactor)")
        else:
            op.execute(f"ALTER TABLE {table} SET (fillfactor = {before})")
