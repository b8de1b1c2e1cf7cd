"""The PostgreSQL store as Tally created it before schema revisions: every table, as ``create_all`` made it.

Revision ID: s0001
Revises:
Create Date: 2026-12-05

The tables are a frozen copy (not an import of ``pg_schema``, which moves on with later revisions).
``checkfirst``: a store made by a Tally of before revisions holds some of these tables already
(``store_epoch`` alone, on a database that only ever had a coordinator waiting on it), and gets only
those it lacks; ``pg_revisions`` has checked that the ones it has are these.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "s0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

metadata = sa.MetaData()

_Time = sa.Double[float]()

sa.Table(
    "completed",
    metadata,
    sa.Column("checkpoint", sa.Text(), primary_key=True),
    sa.Column("source_id", postgresql.BYTEA(), primary_key=True),
    sa.Column("origin", sa.Text(), primary_key=True),
)
sa.Table(
    "completion_checkpoints",
    metadata,
    sa.Column("checkpoint", sa.Text(), primary_key=True),
    sa.Column("created_at", _Time, nullable=False),
)
sa.Table(
    "completed_trash",
    metadata,
    sa.Column("checkpoint", sa.Text(), primary_key=True),
    sa.Column("stamp", sa.Text(), primary_key=True),
    sa.Column("source_id", postgresql.BYTEA(), primary_key=True),
    sa.Column("origin", sa.Text(), primary_key=True),
    sa.Column("trashed_at", _Time, nullable=False),
)
sa.Table(
    "store_probe",
    metadata,
    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("at", _Time, nullable=False),
)
sa.Table(
    "journal_writers",
    metadata,
    sa.Column("handle", sa.Text(), primary_key=True),
    sa.Column("opened", postgresql.BYTEA(), nullable=False),
)
sa.Table(
    "journal_entries",
    metadata,
    sa.Column("handle", sa.Text(), primary_key=True),
    sa.Column("idx", sa.BigInteger(), primary_key=True, autoincrement=False),
    sa.Column("entry", postgresql.BYTEA(), nullable=False),
)
sa.Table(
    "store_epoch",
    metadata,
    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("epoch", sa.BigInteger(), nullable=False),
    sa.Column("holder", sa.Text(), nullable=False),
    sa.Column("since", _Time, nullable=False),
    sa.Column("renewed_at", _Time, nullable=True),
)
sa.Table(
    "store_replicas",
    metadata,
    sa.Column("name", sa.Text(), primary_key=True),
    sa.Column("instance", sa.Text(), nullable=False),
    sa.Column("grpc_address", sa.Text(), nullable=False),
    sa.Column("http_address", sa.Text(), nullable=False),
    sa.Column("started_at", _Time, nullable=False),
    sa.Column("renewed_at", _Time, nullable=False),
)
sa.Table(
    "checkpoint_status",
    metadata,
    sa.Column("checkpoint", sa.Text(), primary_key=True),
    sa.Column("status", postgresql.JSONB(), nullable=False),
    sa.Column("epoch", sa.BigInteger(), nullable=False),
    sa.Column("published_at", _Time, nullable=False),
)


def upgrade() -> None:
    """Create every table the store had, skipping those that exist."""
    metadata.create_all(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    """Drop every table of the store."""
    metadata.drop_all(op.get_bind())
