"""Checkpoints' status, published by the store's owner for its replicas to answer status reads.

A checkpoint's status (counts, live writers, pending sources) lives in the owner's memory. The owner
writes each checkpoint's ``CheckpointView`` (as JSON) to ``checkpoint_status`` when it changed, at
most every half second (``CoordinatorService``'s ``status`` loop), fenced by the store's epoch: a
deposed owner writes nothing. Replicas read it back (:meth:`StatusBoard.status`), so what they
answer is at most that half second, plus a commit, behind the owner's memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from tally_server.store import pg_revisions
from tally_server.store.postgres import (
    READ_EPOCH,
    TRANSIENT,
    again_if_cut,
    create_engine,
    display,
    read_error,
)

_DB_NOW = "extract(epoch from clock_timestamp())"
_EPOCH = sa.text(READ_EPOCH)  # what commits read: a takeover's bump waits for this write too
_UPSERT = sa.text(
    "INSERT INTO checkpoint_status (checkpoint, status, epoch, published_at) "
    f"SELECT c, s::jsonb, :epoch, {_DB_NOW} FROM unnest(:names, :statuses) AS t(c, s) "
    "ON CONFLICT (checkpoint) DO UPDATE SET status = excluded.status, epoch = excluded.epoch, "
    "published_at = excluded.published_at"
).bindparams(
    sa.bindparam("names", type_=postgresql.ARRAY(sa.Text())),
    sa.bindparam("statuses", type_=postgresql.ARRAY(sa.Text())),
)
_DROP_OTHERS = sa.text("DELETE FROM checkpoint_status WHERE checkpoint <> ALL(:names)").bindparams(
    sa.bindparam("names", type_=postgresql.ARRAY(sa.Text()))
)
_NAMES = sa.text("SELECT checkpoint FROM checkpoint_status")
_STATUSES = sa.text(
    "SELECT checkpoint, status FROM checkpoint_status WHERE checkpoint = ANY(:names)"
).bindparams(sa.bindparam("names", type_=postgresql.ARRAY(sa.Text())))


class StatusBoard:
    """The ``checkpoint_status`` table: written by the owner, read by replicas (blocking calls).

    Args:
        url: the store's database.
        epoch: the owner's fencing epoch now (None on a replica, which only reads).
    """

    def __init__(self, url: sa.URL, epoch: Callable[[], int | None] = lambda: None) -> None:
        self.url = url
        self._epoch = epoch
        self._engine = create_engine(url)
        try:
            # A replica may start beside an owner made before this table existed.
            pg_revisions.upgrade_store(self._engine, display(url))
        except BaseException:
            self._engine.dispose()
            raise

    def publish(self, changed: Mapping[str, Any], keep: Sequence[str] | None = None) -> bool:
        """Write the statuses that changed; with ``keep``, drop every other checkpoint's row.

        Returns False (writing nothing) when the store's epoch is no longer this owner's. Runs once
        more on a connection a database restart cut (it writes the same again).
        """
        epoch = self._epoch()

        def write() -> bool:
            with self._engine.begin() as conn:
                if conn.execute(_EPOCH).scalar() != epoch:
                    return False
                if changed:
                    statuses = [json.dumps(status) for status in changed.values()]
                    conn.execute(_UPSERT, {"epoch": epoch, "names": list(changed), "statuses": statuses})
                if keep is not None:
                    conn.execute(_DROP_OTHERS, {"names": list(keep)})
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
