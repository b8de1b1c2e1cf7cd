"""Shards: the store's shard count (``store_layout``) and each published status's shard.

Revision ID: s0005
Revises: s0004
Create Date: 2026-12-06

A store gets a fixed number of shards, each leased and fenced on its own (``store.shards``, the
first stage of per-checkpoint ownership in docs/scale-out.md). ``store_layout`` keeps that number
in its one row; it is left empty here, and the first coordinator that serves the store with shards
writes it (``shards.prepare_layout``, which also fills the shard of status rows published before).
``checkpoint_status.shard`` lets each owner drop only rows of its own shards; nullable, as a Tally
of before this revision still running beside an upgraded store writes rows without it (with one
shard, every row is its owner's anyway). ``store_epoch`` needs no change: shard k's row is
``id = k + 1``, and shard 0's is the one row a store had before.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "s0005"
down_revision: str | None = "s0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create ``store_layout`` (empty) and add ``checkpoint_status.shard`` (instant: no rewrite)."""
    op.create_table(
        "store_layout",
        sa.Column("id", sa.SmallInteger(), primary_key=True, autoincrement=False),
        sa.Column("shards", sa.Integer(), nullable=False),
        sa.CheckConstraint("id = 1", name="ck_store_layout_one_row"),
        sa.CheckConstraint("shards BETWEEN 1 AND 256", name="ck_store_layout_shards"),
    )
    op.add_column("checkpoint_status", sa.Column("shard", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drop both; stop every coordinator of this revision first.

    A Tally of before this revision knows no shards: on a store of several, it would take shard 0's
    lock for the whole store's.
    """
    op.drop_column("checkpoint_status", "shard")
    op.drop_table("store_layout")
