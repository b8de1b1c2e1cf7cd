"""The registry as Tally created it before schema revisions: every table, as ``create_all`` made it.

Revision ID: 0001
Revises:
Create Date: 2026-12-04

The tables are a frozen copy (not an import of ``registry_schema``, which moves on with later
revisions). ``checkfirst``: a registry made by a Tally of before revisions holds some of these
tables already (older ones lack the newest), and gets only those it lacks; ``registry_migrations``
has checked that the ones it has are these.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

metadata = sa.MetaData()

# JSONB on PostgreSQL: binary storage and equality, where plain JSON keeps text verbatim.
_Json = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
# Epoch seconds as float, the unit the domain uses; DOUBLE PRECISION keeps sub-millisecond.
_Time = sa.Double[float]()
# Counters can pass 2**31 over a long run; SQLite's INTEGER is 64-bit already.
_Count = sa.BigInteger()

checkpoints_table = sa.Table(
    "checkpoints",
    metadata,
    sa.Column("name", sa.String(), primary_key=True),
    sa.Column("created_at", _Time, nullable=False),
    sa.Column("last_activity_at", _Time, nullable=False),
    sa.Column("fingerprint", _Json, nullable=False),
)

writers_table = sa.Table(
    "writers",
    metadata,
    sa.Column("handle", sa.String(), primary_key=True),
    sa.Column("checkpoint", sa.String(), nullable=False),
    sa.Column("writer_id", sa.String(), nullable=False),
    sa.Column("host", sa.String(), nullable=False),
    sa.Column("pid", sa.Integer(), nullable=False),
    sa.Column("labels", _Json, nullable=False),
    sa.Column("fingerprint", _Json, nullable=False),
    sa.Column("state", sa.String(), nullable=False),
    sa.Column("opened_at", _Time, nullable=False),
    sa.Column("last_seen_at", _Time, nullable=False),
    sa.Column("closed_at", _Time, nullable=True),
    sa.Column("pending_sources", _Count, nullable=False),
    sa.Column("applied", _Count, nullable=False),
    sa.Column("skipped", _Count, nullable=False),
    sa.Column("rewritten", _Count, nullable=False),
    sa.Column("anomalies", _Count, nullable=False),
    sa.Column("completed", _Count, nullable=False),
    sa.Index("ix_writers_checkpoint", "checkpoint"),
)

events_table = sa.Table(
    "events",
    metadata,
    # SQLite only auto-assigns ids to a column declared exactly INTEGER PRIMARY KEY.
    sa.Column(
        "id",
        sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    sa.Column("checkpoint", sa.String(), nullable=False),
    sa.Column("kind", sa.String(), nullable=False),
    sa.Column("message", sa.Text(), nullable=False),
    sa.Column("at", _Time, nullable=False),
    sa.Column("writer_id", sa.String(), nullable=True),
    sa.Column("data", _Json, nullable=False),
    sa.Index("ix_events_checkpoint_id", "checkpoint", "id"),
)


# Completed count over time, sampled by the service; what the dashboard's progress plot draws.
progress_table = sa.Table(
    "progress_samples",
    metadata,
    sa.Column("checkpoint", sa.String(), primary_key=True),
    sa.Column("at", _Time, primary_key=True),
    sa.Column("completed_count", _Count, nullable=False),
)

# Where a writer got to inside a long source (issue #12's cursors): the last one saved per source,
# by any writer; deleted when the source completes or the checkpoint is reset.
cursors_table = sa.Table(
    "cursors",
    metadata,
    sa.Column("checkpoint", sa.String(), primary_key=True),
    sa.Column("source_id", sa.String(), primary_key=True),
    sa.Column("data", sa.LargeBinary(), nullable=False),
    sa.Column("saved_at", _Time, nullable=False),
    sa.Column("writer_id", sa.String(), nullable=False),
)

# Failed attempts at sources (issue #12's failure budgets): a count and the latest reasons per
# source, deleted when the source completes or is retried.
failures_table = sa.Table(
    "source_failures",
    metadata,
    sa.Column("checkpoint", sa.String(), primary_key=True),
    sa.Column("source_id", sa.String(), primary_key=True),
    sa.Column("attempts", _Count, nullable=False),
    sa.Column("recent", _Json, nullable=False),  # [{"reason", "at", "writer_id"}], oldest first
    sa.Column("last_at", _Time, nullable=False),
)

# A checkpoint's failure budget: failed attempts after which a source is failed (absent: unlimited).
budgets_table = sa.Table(
    "failure_budgets",
    metadata,
    sa.Column("checkpoint", sa.String(), primary_key=True),
    sa.Column("max_attempts", _Count, nullable=False),
)

# Claims on sources (issue #12's claims): per source the highest fencing token ever given (tokens
# only grow, so a row stays when its claim ends) and the writer holding it ("" once released).
claims_table = sa.Table(
    "source_claims",
    metadata,
    sa.Column("checkpoint", sa.String(), primary_key=True),
    sa.Column("source_id", sa.String(), primary_key=True),
    sa.Column("token", _Count, nullable=False),
    sa.Column("holder", sa.String(), nullable=False),  # the writer's handle; "" when released
    sa.Column("writer_id", sa.String(), nullable=False),
    sa.Column("acquired_at", _Time, nullable=False),
)

# Declared sources (issue #12's totals): what a pipeline said it will process, and a count for when
# it could not list the ids.
declared_table = sa.Table(
    "declared_sources",
    metadata,
    sa.Column("checkpoint", sa.String(), primary_key=True),
    sa.Column("source_id", sa.String(), primary_key=True),
)

declared_counts_table = sa.Table(
    "declared_counts",
    metadata,
    sa.Column("checkpoint", sa.String(), primary_key=True),
    sa.Column("count", _Count, nullable=False),
)


def upgrade() -> None:
    """Create every table (and index) the registry had, skipping those that exist."""
    metadata.create_all(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    """Drop every table of the registry."""
    metadata.drop_all(op.get_bind())
