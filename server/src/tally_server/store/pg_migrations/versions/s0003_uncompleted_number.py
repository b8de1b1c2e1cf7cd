"""A number per checkpoint that changes whenever one of its completions goes: replicas cache by it.

Revision ID: s0003
Revises: s0002
Create Date: 2026-12-05

``completion_checkpoints.uncompleted`` is taken from the sequence ``completion_uncompleted_seq``
when the row is made (a checkpoint's first completion, again after a reset) and again by a trigger
on ``completed`` whenever a statement removes rows from it: ``DELETE`` and ``UPDATE`` (statement
triggers reading the old rows, ``REFERENCING OLD TABLE``: one ``UPDATE`` of the checkpoints named,
whatever the number of rows) and ``TRUNCATE`` (every checkpoint's). The trigger runs in the
statement's transaction, so the new number commits with the removal, or neither does. No code path
that un-completes (an anomaly, a reset's move to the trash, an operator's SQL) can leave the number
as it was, and a sequence never gives a value twice, so a number once replaced never comes back. A
replica keeps the completed ids it has read under the number it read with them, and trusts them only
while the number is the same (``replica.CompletedCache``).

Inserts (the owner's hot path: every commit of completions) fire nothing. The rows already there get
numbers of their own when the column is added.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "s0003"
down_revision: str | None = "s0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SEQUENCE = "completion_uncompleted_seq"

_FUNCTION = f"""
CREATE FUNCTION completed_uncompleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        UPDATE completion_checkpoints SET uncompleted = nextval('{SEQUENCE}');
    ELSE
        UPDATE completion_checkpoints SET uncompleted = nextval('{SEQUENCE}')
        WHERE checkpoint IN (SELECT DISTINCT checkpoint FROM gone);
    END IF;
    RETURN NULL;
END
$$
"""
_TRIGGERS = (
    "CREATE TRIGGER completed_deleted AFTER DELETE ON completed REFERENCING OLD TABLE AS gone "
    "FOR EACH STATEMENT EXECUTE PROCEDURE completed_uncompleted()",
    "CREATE TRIGGER completed_updated AFTER UPDATE ON completed REFERENCING OLD TABLE AS gone "
    "FOR EACH STATEMENT EXECUTE PROCEDURE completed_uncompleted()",
    "CREATE TRIGGER completed_truncated AFTER TRUNCATE ON completed "
    "FOR EACH STATEMENT EXECUTE PROCEDURE completed_uncompleted()",
)


def upgrade() -> None:
    """The sequence, the column (a number for each row already there), the function and its triggers."""
    op.execute(f"CREATE SEQUENCE {SEQUENCE}")
    op.add_column(
        "completion_checkpoints",
        sa.Column(
            "uncompleted",
            sa.BigInteger(),
            server_default=sa.text(f"nextval('{SEQUENCE}')"),
            nullable=False,
        ),
    )
    op.execute(f"ALTER SEQUENCE {SEQUENCE} OWNED BY completion_checkpoints.uncompleted")
    op.execute(_FUNCTION)
    for trigger in _TRIGGERS:
        op.execute(trigger)


def downgrade() -> None:
    """Drop the triggers, the function and the column (and with it the sequence it owns)."""
    for name in ("completed_deleted", "completed_updated", "completed_truncated"):
        op.execute(f"DROP TRIGGER {name} ON completed")
    op.execute("DROP FUNCTION completed_uncompleted()")
    op.drop_column("completion_checkpoints", "uncompleted")
