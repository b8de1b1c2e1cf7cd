"""The PostgreSQL store's tables (SQLAlchemy Core), made and upgraded at start by ``pg_revisions``.

Completions mirror the LMDB layout row for row: a writer's file ``<origin>.mdb`` of a checkpoint is
the rows ``(checkpoint, origin, source_id)``; ids are ``bytea`` (their UTF-8 bytes), so they sort
bytewise, as LMDB keys do, whatever the database's collation. The registry's tables live in their
own metadata (``registry_schema``); the names do not overlap, so both fit in one database.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

metadata = sa.MetaData()

# Where the store's schema revision is kept (``pg_revisions``), apart from the registry's ``alembic_version``.
VERSION_TABLE = "tally_store_version"

# Every completed id, by the writer ("origin") that completed it; an id may be in several origins.
completed_table = sa.Table(
    "completed",
    metadata,
    sa.Column("checkpoint", sa.Text(), primary_key=True),
    sa.Column("source_id", postgresql.BYTEA(), primary_key=True),
    sa.Column("origin", sa.Text(), primary_key=True),
    # No index beyond the primary key: every query names the checkpoint (and most an id), and a
    # second index on (checkpoint, origin) made each commit of completions ~1.5x slower to serve.
)

# The index that tables created before it was dropped still have (``PgCompletionStore`` drops it).
LEGACY_INDEXES = ("ix_completed_origin",)

# Where each checkpoint's ``uncompleted`` number comes from (never the same value twice).
UNCOMPLETED_SEQUENCE = sa.Sequence("completion_uncompleted_seq", metadata=metadata)

# A checkpoint with a completion store of its own (what a checkpoint's folder is on LMDB): made by
# its first completion, gone when a reset moves its rows to the trash.
completion_checkpoints_table = sa.Table(
    "completion_checkpoints",
    metadata,
    sa.Column("checkpoint", sa.Text(), primary_key=True),
    sa.Column("created_at", sa.Double[float](), nullable=False),
    # A number from UNCOMPLETED_SEQUENCE, taken when the row is made and again, by triggers on
    # ``completed`` (revision s0003, not declared here), by every statement that removes one of the
    # checkpoint's rows (DELETE, UPDATE, TRUNCATE), in that statement's transaction. While it is the
    # same, none of the checkpoint's completions has gone: replicas cache completed ids under it.
    sa.Column(
        "uncompleted",
        sa.BigInteger(),
        server_default=sa.text("nextval('completion_uncompleted_seq')"),
        nullable=False,
    ),
)

# Rows of reset checkpoints, never deleted: ``stamp`` tells resets apart (the trash folder's name on LMDB).
completed_trash_table = sa.Table(
    "completed_trash",
    metadata,
    sa.Column("checkpoint", sa.Text(), primary_key=True),
    sa.Column("stamp", sa.Text(), primary_key=True),
    sa.Column("source_id", postgresql.BYTEA(), primary_key=True),
    sa.Column("origin", sa.Text(), primary_key=True),
    sa.Column("trashed_at", sa.Double[float](), nullable=False),
)

# One row written (and committed) by the storage probe.
store_probe_table = sa.Table(
    "store_probe",
    metadata,
    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("at", sa.Double[float](), nullable=False),
)

# The writers' journals: who each writer is (``store.journal.encode_opened``, JSON bytes) and its
# entries (``store.journal.encode_entry``), the same bytes the LMDB journal keeps.
journal_writers_table = sa.Table(
    "journal_writers",
    metadata,
    sa.Column("handle", sa.Text(), primary_key=True),
    sa.Column("opened", postgresql.BYTEA(), nullable=False),
    # The writer's checkpoint (also inside ``opened``): one checkpoint's writers are read alone.
    # Empty only in rows written by a Tally of before revision s0002 that is still running.
    sa.Column("checkpoint", sa.Text(), nullable=True),
    sa.Index("ix_journal_writers_checkpoint", "checkpoint"),
)

journal_entries_table = sa.Table(
    "journal_entries",
    metadata,
    sa.Column("handle", sa.Text(), primary_key=True),
    sa.Column("idx", sa.BigInteger(), primary_key=True, autoincrement=False),
    sa.Column("entry", postgresql.BYTEA(), nullable=False),
)


# The store's fencing epoch: one row, bumped by each coordinator that takes the store's lock. Every
# commit of completions or journal entries reads it (FOR KEY SHARE) in its own transaction and goes
# on only if it is still the epoch its coordinator took: a coordinator deposed by another (after its
# lock's session ended) can change nothing, and the bump waits for its commits in flight. It waits
# because ``epoch`` is a key (the unique constraint, revision s0004): an UPDATE that changes a key
# takes FOR UPDATE, which conflicts with FOR KEY SHARE, while one that changes only ``renewed_at``
# (the holder's renewal every second) takes FOR NO KEY UPDATE, which does not: renewals never wait
# for commits, nor commits for renewals.
store_epoch_table = sa.Table(
    "store_epoch",
    metadata,
    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("epoch", sa.BigInteger(), nullable=False),
    sa.Column("holder", sa.Text(), nullable=False),
    sa.Column("since", sa.Double[float](), nullable=False),
    # The database's clock when the holder last showed it is alive (see ``StoreLock.check``); a
    # standby takes over from a holder that stops renewing (paused, hung) though it keeps its session.
    sa.Column("renewed_at", sa.Double[float](), nullable=True),
    # Makes ``epoch`` a key column: a bump (which changes it) takes FOR UPDATE and waits for commits
    # reading FOR KEY SHARE, while renewals (``renewed_at`` alone) do not (revision s0004). With
    # ``id`` in it, one row per shard (docs/scale-out.md, "What comes next") may share an epoch.
    # Shard k's row is ``id = k + 1`` (``postgres.StoreLock``): a one-shard store's is ``id = 1``.
    sa.UniqueConstraint("id", "epoch", name="uq_store_epoch_id_epoch"),
)

# The replicas serving the store (``store.replicas``): each renews its row every second while it
# runs; the store's owner is the one named by ``store_epoch.holder``, and the others forward writers'
# calls to the addresses it gives here.
store_replicas_table = sa.Table(
    "store_replicas",
    metadata,
    sa.Column("name", sa.Text(), primary_key=True),
    # A random token per process: a second live process under the same name is refused its row.
    sa.Column("instance", sa.Text(), nullable=False),
    sa.Column("grpc_address", sa.Text(), nullable=False),
    sa.Column("http_address", sa.Text(), nullable=False),
    sa.Column("started_at", sa.Double[float](), nullable=False),
    # The database's clock when the replica last showed it is alive.
    sa.Column("renewed_at", sa.Double[float](), nullable=False),
)

# Every checkpoint's status as the store's owner last published it (``store.pg_status``): a
# ``CheckpointView`` as JSON, live writers included, rewritten by the owner when it changes (checked
# every half second). Replicas answer status reads from it; ``epoch`` is the owner's that wrote it.
checkpoint_status_table = sa.Table(
    "checkpoint_status",
    metadata,
    sa.Column("checkpoint", sa.Text(), primary_key=True),
    sa.Column("status", postgresql.JSONB(), nullable=False),
    sa.Column("epoch", sa.BigInteger(), nullable=False),
    # The database's clock when the owner last wrote this row (it writes only rows that changed).
    sa.Column("published_at", sa.Double[float](), nullable=False),
    # The checkpoint's shard (``store.shards.shard_of``): an owner drops rows of its own shards only
    # (revision s0005). Empty in rows published before the store recorded its layout, until then.
    sa.Column("shard", sa.Integer(), nullable=True),
)

# How many shards the store has (``store.shards``): one row, written once by the first coordinator
# that serves the store with shards (``prepare_layout``, revision s0005) and never changed, since a
# checkpoint's shard is a hash of its name modulo that number. Empty in a store no coordinator
# served since the upgrade: it then has one shard.
store_layout_table = sa.Table(
    "store_layout",
    metadata,
    sa.Column("id", sa.SmallInteger(), primary_key=True, autoincrement=False),
    sa.Column("shards", sa.Integer(), nullable=False),
    sa.CheckConstraint("id = 1", name="ck_store_layout_one_row"),
    sa.CheckConstraint("shards BETWEEN 1 AND 256", name="ck_store_layout_shards"),
)
