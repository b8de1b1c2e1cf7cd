"""``store_epoch.epoch`` made a key column (unique with ``id``), so commits can read it FOR KEY SHARE.

Revision ID: s0004
Revises: s0003
Create Date: 2026-12-05

Every commit reads the store's epoch first in its transaction, and a coordinator taking over bumps
it (``postgres.StoreLock``): the bump must wait for every commit in flight that read the old epoch.
Until now commits read it ``FOR SHARE``, which also made the holder's renewal (an ``UPDATE`` of
``renewed_at`` every second), its taking back of its own epoch and its letting go wait until no
commit held the row (commits overlap): under durable load a renewal waited ~30 ms at the median and
up to a quarter of a second, out of the few seconds a standby leaves a silent holder.

PostgreSQL's row locks tell keys apart: an ``UPDATE`` takes ``FOR UPDATE`` on the row only when it
changes a column of a unique index a foreign key could use (plain, not partial nor on an
expression, not deferrable), otherwise ``FOR NO KEY UPDATE``; ``FOR KEY SHARE`` conflicts with the
first and not the second. The constraint is on ``(id, epoch)``: every column of such an index is a
key column, so ``epoch`` is one, while rows of their own (the per-shard leases planned in
docs/scale-out.md) may hold equal epochs. With this constraint the bump, which changes ``epoch``, takes ``FOR
UPDATE`` and still waits for commits reading ``FOR KEY SHARE``; updates of ``renewed_at`` alone
(renewal, keeping the epoch, letting go) no longer do, and commits no longer wait for them.

While a Tally of before this revision still runs beside an upgraded store (a rolling upgrade): its
commits read ``FOR SHARE``, stronger than needed, and the bump of whichever Tally takes over waits
for them as before; only its own renewals still wait behind its commits. The constraint is what
makes ``FOR KEY SHARE`` fence: a Tally of this revision on a store downgraded below it would read
``FOR KEY SHARE`` against a bump that no longer waits for it, so downgrade only with every
coordinator of this revision stopped.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "s0004"
down_revision: str | None = "s0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CONSTRAINT = "uq_store_epoch_id_epoch"


def upgrade() -> None:
    """Add the unique constraint (one row: instant)."""
    op.create_unique_constraint(CONSTRAINT, "store_epoch", ["id", "epoch"])


def downgrade() -> None:
    """Drop it (stop every coordinator of this revision first: see above)."""
    op.drop_constraint(CONSTRAINT, "store_epoch", type_="unique")
