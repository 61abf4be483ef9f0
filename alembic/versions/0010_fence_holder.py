"""A generation names one holder: ``fences.holder`` keeps who was admitted under a lease
source's generation (issue 44), so a lock service that lost its counter and hands the
same generation to another holder is refused ``generation-reissued``.

Only adds a nullable column: code of ``0008``/``0009`` runs beside it (the floor stays at
``0008``). Such a replica does not read nor write the holder: until the last one is
replaced, a second holder of a bound generation could be admitted through it, as before
this revision. The binding begins with the first admission by the new code (a NULL
holder is bound by the next admission of its generation).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06 08:40:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("fences", sa.Column("holder", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("fences") as batch:
        batch.drop_column("holder")
