"""The replicas of a PostgreSQL store: who serves it, who owns it, and where to reach each.

Every ``tally serve`` on a store writes a row to ``store_replicas`` at start and renews it every
second (:meth:`ReplicaBoard.announce`); a clean stop deletes it. The owner is the replica named by
``store_epoch.holder`` (it took the store's lock, see ``postgres.StoreLock``); the others read its
addresses here to forward writers' calls to it, and status views list them all. On a store of
several shards (``store.shards``) each shard has its owner, the holder of its row (``store_epoch.id =
shard + 1``): :meth:`ReplicaBoard.owners`; shard 0's is :meth:`ReplicaBoard.owner`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from tally_server.store import pg_revisions
from tally_server.store.postgres import (
    RENEW_EVERY_S,
    TAKE_OVER_AFTER_S,
    TRANSIENT,
    StoreUnreachable,
    again_if_cut,
    create_engine,
    display,
)

logger = logging.getLogger(__name__)

# This process among the store's coordinators (every board of it: a replica's, then the owner's).
_INSTANCE = secrets.token_hex(8)

_DB_NOW = "extract(epoch from clock_timestamp())"
# The row of this name is taken over only from this very process or from one silent long enough to
# be taken for gone: two live coordinators under one name would forward to each other.
_ANNOUNCE = sa.text(
    "INSERT INTO store_replicas (name, instance, grpc_address, http_address, started_at, renewed_at) "
    f"VALUES (:name, :instance, :grpc, :http, :started, {_DB_NOW}) ON CONFLICT (name) DO UPDATE SET "
    "instance = excluded.instance, grpc_address = excluded.grpc_address, "
    "http_address = excluded.http_address, started_at = excluded.started_at, "
    "renewed_at = excluded.renewed_at "
    f"WHERE store_replicas.instance = excluded.instance OR store_replicas.renewed_at < {_DB_NOW} - :gone"
)
_LEAVE = sa.text("DELETE FROM store_replicas WHERE name = :name AND instance = :instance")
# Rows of replicas gone an hour without a clean stop (kill -9, a lost host) are swept by the others.
_SWEEP = sa.text(f"DELETE FROM store_replicas WHERE renewed_at < {_DB_NOW} - 3600")
_OWNER = sa.text(
    f"SELECT e.holder, e.epoch, e.since, {_DB_NOW} - e.renewed_at AS silent_s, "
    "r.grpc_address, r.http_address "
    "FROM store_epoch e LEFT JOIN store_replicas r ON r.name = e.holder WHERE e.id = 1"
)
_OWNERS = sa.text(
    f"SELECT e.id - 1 AS shard, e.holder, e.epoch, e.since, {_DB_NOW} - e.renewed_at AS silent_s, "
    "r.grpc_address, r.http_address "
    "FROM store_epoch e LEFT JOIN store_replicas r ON r.name = e.holder ORDER BY e.id"
)
_REPLICAS = sa.text(
    f"SELECT name, grpc_address, http_address, started_at, {_DB_NOW} - renewed_at AS silent_s "
    "FROM store_replicas ORDER BY name"
)


class ReplicaNameInUse(OSError):
    """Another live coordinator of the store goes by this replica's name (an ``OSError``: one line)."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"another tally serve on this store, alive within the last {TAKE_OVER_AFTER_S:.0f} s, goes by "
            f"the replica name {name!r}: give each coordinator of a store its own TALLY_REPLICA_NAME (the "
            "default, HOSTNAME-PID, is unique), or wait until that one has stopped"
        )
        self.name = name


@dataclass(frozen=True, slots=True)
class Owner:
    """The replica that owns the store (holds its lock and fencing epoch)."""

    name: str
    epoch: int
    since: float  # unix time it took the store
    silent_s: float  # seconds since it last showed it is alive (the database's clock)
    grpc_address: str  # "" if it has not announced itself (yet)
    http_address: str

    @property
    def alive(self) -> bool:
        """Whether it showed it is alive recently enough that no replica takes the store from it."""
        return self.silent_s < TAKE_OVER_AFTER_S


@dataclass(frozen=True, slots=True)
class Replica:
    """One ``tally serve`` on the store, as it announced itself."""

    name: str
    grpc_address: str
    http_address: str
    started_at: float
    silent_s: float
    owner: bool  # it holds a shard of the store (the whole store, with one shard)
    shards: tuple[int, ...] = ()  # the shards it holds, in order

    @property
    def alive(self) -> bool:
        """Whether it renewed its row within the time after which the store's owner is replaced."""
        return self.silent_s < TAKE_OVER_AFTER_S


class ReplicaBoard:
    """This replica's row in ``store_replicas`` and the look-ups of the others.

    Thread-safe (the engine's pool hands each call its own connection); calls block, so the event
    loop runs them on worker threads.

    Args:
        url: the store's URL.
        name: this replica's name (the store lock's holder name when it owns the store).
        grpc_address: where other replicas reach its gRPC port (``host:port``).
        http_address: where other replicas reach its HTTP port (``host:port``).

    Raises:
        StoreUnreachable: the database cannot be reached to create the tables.
    """

    def __init__(self, url: sa.URL, name: str, grpc_address: str, http_address: str) -> None:
        self.url = url
        self.name = name
        self.grpc_address = grpc_address
        self.http_address = http_address
        self._started = time.time()
        self._instance = _INSTANCE
        self._engine: Engine = create_engine(url)
        try:
            pg_revisions.upgrade_store(self._engine, display(url))
        except TRANSIENT as exc:
            self._engine.dispose()
            raise StoreUnreachable(url, exc) from None

    def announce(self) -> None:
        """Write (or renew) this replica's row; sweeps rows of replicas gone for an hour.

        Runs once more on a connection a database restart cut (it writes the same again).

        Raises:
            ReplicaNameInUse: another live coordinator of the store goes by this name.
            sqlalchemy.exc.OperationalError: and the like when the database cannot be reached.
        """

        def write() -> int:
            with self._engine.begin() as conn:
                written = conn.execute(
                    _ANNOUNCE,
                    {
                        "name": self.name,
                        "instance": self._instance,
                        "grpc": self.grpc_address,
                        "http": self.http_address,
                        "started": self._started,
                        "gone": TAKE_OVER_AFTER_S,
                    },
                ).rowcount
                conn.execute(_SWEEP)
            return written

        if not again_if_cut(write):
            raise ReplicaNameInUse(self.name)

    def leave(self) -> None:
        """Delete this replica's row (a clean stop); errors are logged, the row then ages out."""
        try:
            with self._engine.begin() as conn:
                conn.execute(_LEAVE, {"name": self.name, "instance": self._instance})
        except TRANSIENT as exc:
            logger.warning("could not remove replica %s from the store's list: %s", self.name, exc)

    def owner(self) -> Owner | None:
        """The store's owner, or None if no coordinator ever took the store (read twice if cut)."""

        def read() -> Owner | None:
            with self._engine.connect() as conn:
                return _owner(conn)

        return again_if_cut(read)

    def owners(self) -> dict[int, Owner]:
        """Each shard's owner (the holder of its row), by shard; shards never taken are missing.

        Read twice if the connection was cut.
        """

        def read() -> dict[int, Owner]:
            with self._engine.connect() as conn:
                return _owners(conn)

        return again_if_cut(read)

    def snapshot(self) -> tuple[Owner | None, list[Replica]]:
        """Shard 0's owner and every replica announced in the last hour (by name), read at one instant.

        A replica is marked ``owner`` if it holds any shard (with one shard: the store); its
        ``shards`` are listed on a store of several shards only.
        """
        owners, replicas = self.holders()
        return owners.get(0), replicas

    def holders(self) -> tuple[dict[int, Owner], list[Replica]]:
        """Each shard's owner (as :meth:`owners`) and every replica (as :meth:`snapshot`), in one read."""
        with self._engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
            owners = _owners(conn)
            rows = conn.execute(_REPLICAS).all()
        held: dict[str, list[int]] = {}
        for shard, holder in owners.items():
            held.setdefault(holder.name, []).append(shard)
        # On a store of one shard (only row 1 ever taken) the owner owns the store, not "shard 0".
        sharded = max(owners, default=0) > 0
        replicas = [
            Replica(
                name=r.name,
                grpc_address=r.grpc_address,
                http_address=r.http_address,
                started_at=float(r.started_at),
                silent_s=float(r.silent_s),
                owner=r.name in held,
                shards=tuple(held.get(r.name, ())) if sharded else (),
            )
            for r in rows
        ]
        return owners, replicas

    def close(self) -> None:
        """Close the board's connections."""
        self._engine.dispose()


def _owner(conn: Connection) -> Owner | None:
    row = conn.execute(_OWNER).first()
    return None if row is None else _as_owner(row)


def _owners(conn: Connection) -> dict[int, Owner]:
    return {int(row.shard): _as_owner(row) for row in conn.execute(_OWNERS)}


def _as_owner(row: sa.Row[Any]) -> Owner:
    return Owner(
        name=row.holder,
        epoch=int(row.epoch),
        since=float(row.since),
        silent_s=float(row.silent_s) if row.silent_s is not None else 0.0,
        grpc_address=row.grpc_address or "",
        http_address=row.http_address or "",
    )


def check_name_free(url: sa.URL, name: str, *, sleep: Callable[[float], object] = time.sleep) -> None:
    """At start: refuse a replica name that a live coordinator of the store goes by.

    A name renewed less than ``TAKE_OVER_AFTER_S`` ago may be that of a coordinator that just died
    (kill -9, then restarted at once by systemd or Kubernetes under the same name): the start waits
    until the name has been silent that long and goes on if nobody renewed it meanwhile (the same
    silence after which the row is taken over), so a restart after a crash is late by at most that,
    never refused. A coordinator alive under the name renews it every ``RENEW_EVERY_S``.

    Raises:
        ReplicaNameInUse: a coordinator renewed its row under ``name`` while this one waited.
        StoreUnreachable: the database cannot be reached.
    """
    engine = create_engine(url, pooled=False)
    try:
        pg_revisions.upgrade_store(engine, display(url))
        seen = _renewed(engine, name)
        if seen is None or seen[1] >= TAKE_OVER_AFTER_S:
            return
        wait = TAKE_OVER_AFTER_S - seen[1] + RENEW_EVERY_S / 4
        logger.info(
            "the replica name %r was renewed %.1f s ago: waiting %.1f s for it to be free (a coordinator "
            "that died under it stops renewing it; a live one keeps renewing it and this one is refused)",
            name,
            seen[1],
            wait,
        )
        sleep(wait)
        again = _renewed(engine, name)
    except TRANSIENT as exc:
        raise StoreUnreachable(url, exc) from None
    finally:
        engine.dispose()
    if again is not None and again[0] != seen[0]:
        raise ReplicaNameInUse(name)


def _renewed(engine: Engine, name: str) -> tuple[float, float] | None:
    """When ``name``'s row was last renewed (the database's clock) and how long ago, if it has one."""
    with engine.begin() as conn:
        row = conn.execute(
            sa.text(f"SELECT renewed_at, {_DB_NOW} - renewed_at FROM store_replicas WHERE name = :name"),
            {"name": name},
        ).one_or_none()
    return None if row is None else (float(row[0]), float(row[1]))
