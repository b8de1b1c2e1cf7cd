"""Checkpoints' status, published by the store's owner for its replicas to answer status reads.

A checkpoint's status (counts, live writers, pending sources) lives in the owner's memory. The owner
writes each checkpoint's ``CheckpointView`` (as JSON) to ``checkpoint_status`` when it changed, at
most every half second (``CoordinatorService``'s ``status`` loop), fenced by the store's epoch: a
deposed owner writes nothing. Replicas read it back (:meth:`StatusBoard.status`), so what they
answer is at most that half second, plus a commit, behind the owner's memory.

On a store of several shards (``store.shards``) each owner publishes the checkpoints of the shards
it holds, each fenced by its own shard's epoch (the shards a publish carries), and drops only rows
of the shards its fence read checked: each row records its checkpoint's shard. A shard another
coordinator took refuses its own rows alone; the others are published before this owner notices.
"""

from __future__ import annotations

import functools
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
# The statuses go as one JSON array, element i the status of name i (paired by their ordinality; the
# array is read once, as a function in FROM): as an array of text, psycopg escapes every quote of every
# status in Python (a regex callback per quote), which took more time than the rest of a publish with a
# few hundred live writers.
_UPSERT = sa.text(
    "INSERT INTO checkpoint_status (checkpoint, status, epoch, published_at, shard) "
    f"SELECT c, s, e, {_DB_NOW}, k "
    "FROM unnest(:names, :epochs, :shards) WITH ORDINALITY AS t(c, e, k, i) "
    "JOIN jsonb_array_elements(CAST(:statuses AS jsonb)) WITH ORDINALITY AS j(s, i) USING (i) "
    "ON CONFLICT (checkpoint) DO UPDATE SET status = excluded.status, epoch = excluded.epoch, "
    "published_at = excluded.published_at, shard = excluded.shard"
).bindparams(
    sa.bindparam("names", type_=postgresql.ARRAY(sa.Text())),
    sa.bindparam("statuses", type_=sa.Text()),
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

        Only checkpoints of the shards the fence holds are written (others are skipped), fenced by
        those checkpoints' shards alone (what the publish carries), so a shard another coordinator
        took (this one paused past its lease, its loss not noticed yet) refuses its own statuses
        only: the others are published without them. ``keep`` reads every shard held and drops
        only rows of the shards that read checked, so never a row of a shard another coordinator
        holds; a shard refused is left out of the read (its rows left be) and the others go on.

        Returns False (writing nothing) when the fence refuses the publish as a whole (the store's
        epoch, or that of every shard it carries, is no longer this owner's). Runs once more on a
        connection a database restart cut (it writes the same again).

        Raises:
            RuntimeError: this board has no fence (a replica's: it only reads).
        """
        fence = self._fence
        if fence is None:
            raise RuntimeError("this status board has no fence: only the board of an owner publishes")
        held = fence.shards
        pending: dict[str, tuple[int, str]] = {}
        for name, status in changed.items():
            shard = shard_of(name, self._shards)
            if shard not in held:
                logger.debug("not publishing checkpoint %r: its shard %d is not held", name, shard)
                continue
            pending[name] = (shard, json.dumps(status))
        skip: set[int] = set()  # shards refused: the read leaves them out, their rows are left be
        while True:
            try:
                again_if_cut(functools.partial(self._write, fence, pending, keep, frozenset(skip)))
                return True
            except Fenced as exc:
                if exc.refuses is None:
                    return False  # the whole store's epoch, or every shard's: nothing may be written
                refused = {name for name in pending if exc.refuses(name)}
                skipped = exc.shard is not None and exc.shard not in skip
                if exc.shard is not None:
                    skip.add(exc.shard)
                if not refused and not skipped:
                    return False  # refused for nothing it can leave out: it would be refused again
                logger.info("publishing the statuses of the other shards than those refused: %s", exc)
                pending = {name: value for name, value in pending.items() if name not in refused}
                if not pending and keep is None:
                    return False  # nothing of it was published

    def _write(
        self,
        fence: Fence,
        pending: Mapping[str, tuple[int, str]],
        keep: Sequence[str] | None,
        skip: frozenset[int],
    ) -> None:
        """One fenced transaction of :meth:`publish`: ``pending`` (shard, JSON) by name, ``keep``'s drop.

        Raises:
            Fenced: as ``run_fence`` (nothing was written).
        """
        with self._engine.begin() as conn:
            checked = run_fence(conn, fence, list(pending), all_held=keep is not None, skip=skip)
            # A fence not told the store's shard count does not refuse a shard let go since
            # ``publish`` looked: its checkpoints are skipped here.
            written = {name: value for name, value in pending.items() if value[0] in checked}
            if written:
                shards = [shard for shard, _ in written.values()]
                params = {
                    "names": list(written),
                    "statuses": "[" + ",".join(status for _, status in written.values()) + "]",
                    "epochs": [checked[shard] for shard in shards],
                    "shards": shards,
                }
                conn.execute(_UPSERT, params)
            if keep is not None and self._shards == 1:
                conn.execute(_DROP_OTHERS, {"names": list(keep)})
            elif keep is not None:
                conn.execute(_DROP_OTHERS_IN, {"names": list(keep), "shards": sorted(checked)})

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
