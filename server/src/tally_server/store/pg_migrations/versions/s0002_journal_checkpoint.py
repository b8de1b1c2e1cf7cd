"""Each journaled writer's checkpoint as a column, so one checkpoint's writers can be read alone.

Revision ID: s0002
Revises: s0001
Create Date: 2026-12-05

Until now a writer's checkpoint was only inside its ``opened`` bytes (``store.journal.encode_opened``),
so bringing back the writers of one checkpoint meant reading every journal. The column is filled for
the rows already there by decoding those bytes (a store holds as many rows as live writers), and
written with every new row from now on.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from tally_server.store.journal import decode_opened

revision: str = "s0002"
down_revision: str | None = "s0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``journal_writers.checkpoint`` and fill it from each row's ``opened`` bytes."""
    op.add_column("journal_writers", sa.Column("checkpoint", sa.Text(), nullable=True))
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT handle, opened FROM journal_writers")).all()
    for handle, opened in rows:
        conn.execute(
            sa.text("UPDATE journal_writers SET checkpoint = :checkpoint WHERE handle = :handle"),
            {"checkpoint": decode_opened(bytes(opened)).checkpoint, "handle": handle},
        )
    op.create_index("ix_journal_writers_checkpoint", "journal_writers", ["checkpoint"])


def downgrade() -> None:
    """Drop the column (the ``opened`` bytes still hold every writer's checkpoint)."""
    op.drop_index("ix_journal_writers_checkpoint", table_name="journal_writers")
    op.drop_column("journal_writers", "checkpoint")
