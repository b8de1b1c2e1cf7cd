"""Checkpoints' status, published by the store's owner for its replicas to answer status reads.

A checkpoint's status (counts, live writers, pending sources) lives in the owner's memory. The owner
writes each checkpoint's ``CheckpointView`` (as JSON) to ``checkpoint_status`` when it changed, at
most every half second (``CoordinatorService``'s ``status`` loop), fenced by the store's epoch: a
deposed owner writes nothing. Replicas read it back (:meth:`StatusBoard.status`), so what they
answer is at most that half second, plus a commit, behind the owner's memory.

On a store of several shards (``store.shards``) each owner publishes the checkpoints of the shards
it holds, fenced by those shards' epochs, and drops only rows of its own shards: each row records
its checkpoint's shard.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from tally_server.store import pg_revisions
from tally_server.store.postgres import (
    TRANSIENT,
    Fenced,
    again_if_cut,
    create_engine,
    display,
    read_error,
)
from tally_server.store.shards import Fence, check_shard_count, run_fence, shard_of

logger = logging.getLogger(__name__)

_DB_NOW = "extract(epoch from clock_timestamp())"
# Each row with its shard and that shard's epoch (the owner's fence reads them first: a takeover's
# bump waits for this write too).
_UPSERT = sa.text(
    "INSERT INTO checkpoint_status (checkpoint, status, epoch, published_at, shard) "
    f"SELECT c, s::jsonb, e, {_DB_NOW}, k FROM unnest(:names, :statuses, :epochs, :shards) AS t(c, s, e, k) "
    "ON CONFLICT (checkpoint) DO UPDATE SET status = excluded.status, epoch = excluded.epoch, "
    "published_at = excluded.published_at, shard = excluded.shard"
).bindparams(
    sa.bindparam("names", type_=postgresql.ARRAY(sa.Text())),
    sa.bindparam("statuses", type_=postgresql.ARRAY(sa.Text())),
    sa.bindparam("epochs", type_=postgresql.ARRAY(sa.BigInteger())),
    sa.bindparam("shards", type_=postgresql.ARRAY(sa.Integer())),
)
# One shard: every row is the owner's.
_DROP_OTHERS = sa.text("DELETE FROM checkpoint_status WHERE checkpoint <> ALL(:names)").bindparams(
    sa.bindparam("names", type_=postgresql.ARRAY(sa.Text()))
)
# Several: only rows of the publisher's shards (the others' owners keep theirs).
_DROP_OTHERS_IN = sa.text(
    "DELETE FROM checkpoint_status WHERE checkpoint <> ALL(:names) AND shard = ANY(:shards)"
).bindparams(
    sa.bindparam("names", type_=postgresql.ARRAY(sa.Text())),
    sa.bindparam("shards", type_=postgresql.ARRAY(sa.Integer())),
)
_NAMES = sa.text("SELECT checkpoint FROM checkpoint_status")
_STATUSES = sa.text(
    "SELECT checkpoint, status FROM checkpoint_status WHERE checkpoint = ANY(:names)"
).bindparams(sa.bindparam("names", type_=postgresql.ARRAY(sa.Text())))


class StatusBoard:
    """The ``checkpoint_status`` table: written by the owner, read by replicas (blocking calls).

    Args:
        url: the store's database.
        fence: the owner's fence (its ``StoreLock``, or its shards' ``ShardFence``); None on a
            replica, which only reads.
        shards: how many shards the store has (``store.shards.prepare_layout``).

    Raises:
        ValueError: ``shards`` is not in 1..MAX_SHARDS.
    """

    def __init__(self, url: sa.URL, fence: Fence | None = None, shards: int = 1) -> None:
        self.url = url
        self._fence = fence
        self._shards = check_shard_count(shards)
        self._engine = create_engine(url)
        try:
            # A replica may start beside an owner made before this table existed.
            pg_revisions.upgrade_store(self._engine, display(url))
        except BaseException:
            self._engine.dispose()
            raise

    def publish(self, changed: Mapping[str, Any], keep: Sequence[str] | None = None) -> bool:
        """Write the statuses that changed; with ``keep``, drop every other checkpoint's row.

        Only checkpoints of the shards the fence holds are written (others are skipped), and
        ``keep`` drops only rows of those shards. Returns False (writing nothing) when a shard's
        epoch is no longer this owner's. Runs once more on a connection a database restart cut (it
        writes the same again).

        Raises:
            RuntimeError: this board has no fence (a replica's: it only reads).
        """
        fence = self._fence
        if fence is None:
            raise RuntimeError("this status board has no fence: only the board of an owner publishes")

        def write() -> bool:
            with self._engine.begin() as conn:
                try:
                    held = run_fence(conn, fence)
                except Fenced:
                    return False
                names, statuses, epochs, shards = [], [], [], []
                for name, status in changed.items():
                    shard = shard_of(name, self._shards)
                    if shard not in held:
                        logger.debug("not publishing checkpoint %r: its shard %d is not held", name, shard)
                        continue
                    names.append(name)
                    statuses.append(json.dumps(status))
                    epochs.append(held[shard])
                    shards.append(shard)
                if names:
                    params = {"names": names, "statuses": statuses, "epochs": epochs, "shards": shards}
                    conn.execute(_UPSERT, params)
                if keep is not None and self._shards == 1:
                    conn.execute(_DROP_OTHERS, {"names": list(keep)})
                elif keep is not None:
                    conn.execute(_DROP_OTHERS_IN, {"names": list(keep), "shards": sorted(held)})
            return True

        return again_if_cut(write)

    def names(self) -> list[str]:
        """Every checkpoint with a published status.

        Raises:
            StoreUnavailable: the database cannot be read now (UNAVAILABLE: retry).
        """
        try:
            with self._engine.connect() as conn:
                return list(conn.execute(_NAMES).scalars())
        except TRANSIENT as exc:
            raise read_error(self.url, exc, "the checkpoints' status") from None

    def statuses(self, names: Sequence[str]) -> dict[str, Any]:
        """The published status (JSON) of each of ``names`` that has one.

        Raises:
            StoreUnavailable: the database cannot be read now (UNAVAILABLE: retry).
        """
        try:
            with self._engine.connect() as conn:
                rows = conn.execute(_STATUSES, {"names": list(names)}).all()
        except TRANSIENT as exc:
            raise read_error(self.url, exc, "the checkpoints' status") from None
        return {row[0]: row[1] for row in rows}

    def close(self) -> None:
        """Close the board's connections."""
        self._engine.dispose()
