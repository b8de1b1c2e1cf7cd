"""A PostgreSQL store's shards: which shard a checkpoint is in, how many a store has, and their fence.

A store has a fixed number of shards (``store_layout.shards``, 1 to ``MAX_SHARDS``), chosen when it is
first served (:func:`prepare_layout`) and never changed: a checkpoint's shard is a hash of its name
modulo that number (:func:`shard_of`). Each shard is leased on its own (``postgres.StoreLock`` with
``shard=k``), with its own fencing epoch, so that several coordinators can each own some checkpoints
(docs/scale-out.md, "What comes next"). With one shard, the default, shard 0 is the whole store,
locked and fenced exactly as before shards.

Every transaction that writes is fenced (:class:`Fence`): it reads the epochs of the shards of the
checkpoints it writes (of every shard its coordinator holds, when it does not say which
checkpoints) ``FOR KEY SHARE`` first, and commits only if each is still the epoch that coordinator
took. A :class:`ShardFence` is the fence of a coordinator holding several shards; a ``StoreLock``
is the fence of the one shard it locks.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from tally_server.domain.ports import CompletionWriteError
from tally_server.domain.words import count
from tally_server.store import pg_revisions
from tally_server.store.postgres import (
    MAX_SHARDS,
    TRANSIENT,
    Fenced,
    StoreLock,
    StoreUnreachable,
    create_engine,
    display,
)

logger = logging.getLogger(__name__)

_RECORD = sa.text(
    "INSERT INTO store_layout (id, shards) VALUES (1, :shards) ON CONFLICT (id) DO NOTHING RETURNING shards"
)
_LAYOUT = sa.text("SELECT shards FROM store_layout WHERE id = 1")
_UNSHARDED_STATUS = sa.text("SELECT checkpoint FROM checkpoint_status WHERE shard IS NULL")
_SET_STATUS_SHARDS = sa.text(
    "UPDATE checkpoint_status AS s SET shard = t.k FROM unnest(:names, :shards) AS t(c, k) "
    "WHERE s.checkpoint = t.c"
).bindparams(
    sa.bindparam("names", type_=postgresql.ARRAY(sa.Text())),
    sa.bindparam("shards", type_=postgresql.ARRAY(sa.Integer())),
)
# What a ShardFence reads first in a transaction that writes: for each shard it checks (those held
# of the checkpoints the transaction writes, or every shard held), the epoch it took (sent with the
# statement, so the check needs nothing else) and the store's, read FOR KEY SHARE (a row per shard,
# ``store_epoch.id = shard + 1``; see ``postgres.READ_EPOCH``). A shard without a row reads NULL:
# not ours.
_READ_EPOCHS = (
    "SELECT k.shard, k.mine, "
    "(SELECT e.epoch FROM store_epoch e WHERE e.id = k.shard + 1 FOR KEY SHARE) AS now "
    "FROM unnest(%s::int4[], %s::int8[]) AS k(shard, mine)"
)


def shard_of(checkpoint: str, shards: int) -> int:
    """The shard of ``checkpoint`` in a store of ``shards`` shards: CRC-32 of its UTF-8 name, modulo.

    Part of the store's format: every coordinator of a store must agree on it, and a store's
    checkpoints stay in their shards for its whole life, so this never changes.
    """
    return zlib.crc32(checkpoint.encode("utf-8")) % shards


def check_shard_count(shards: int) -> int:
    """``shards`` if a store may have that many shards.

    Raises:
        ValueError: not in 1..MAX_SHARDS.
    """
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        raise ValueError(
            f"a store has 1 to {MAX_SHARDS} shards, not {shards!r}; give --store-shards a number in "
            "that range"
        )
    return shards


class StoreLayoutMismatch(OSError):
    """The store's shard count is not the one asked for (an ``OSError``: ``tally serve`` prints one line)."""

    def __init__(self, url: sa.URL, shards: int, wanted: int) -> None:
        super().__init__(
            f"the PostgreSQL store {display(url)} has {count(shards, 'shard')} (fixed when it was made by "
            f"the first coordinator to serve it), not the {wanted} asked for; start with --store-shards "
            f"{shards} or without the option (a store's count cannot change: to use another, make a new "
            "store and move the completions with tally export and tally import)"
        )
        self.shards, self.wanted = shards, wanted


def prepare_layout(url: sa.URL, wanted: int | None) -> int:
    """Upgrade the store's tables, record its shard count if it has none yet, and return its count.

    A store gets its count once, from the first coordinator that serves it with shards
    (``wanted``, or 1 if None); recording it also fills the shard of status rows published before
    (``checkpoint_status.shard``). Two coordinators starting at once agree on whichever was first.

    Raises:
        ValueError: ``wanted`` is not in 1..MAX_SHARDS.
        StoreLayoutMismatch: ``wanted`` is given and the store has another count.
        StoreUnreachable: the database cannot be reached.
    """
    if wanted is not None:
        check_shard_count(wanted)
    engine = create_engine(url, pooled=False)
    try:
        pg_revisions.upgrade_store(engine, display(url))
        with engine.begin() as conn:
            made = conn.execute(_RECORD, {"shards": wanted or 1}).scalar()
            if made is not None:
                _fill_status_shards(conn, int(made))
                logger.info("store %s is made of %s from now on", display(url), count(made, "shard"))
            shards = int(conn.execute(_LAYOUT).scalar_one())
    except TRANSIENT as exc:
        raise StoreUnreachable(url, exc) from None
    finally:
        engine.dispose()
    if wanted is not None and wanted != shards:
        raise StoreLayoutMismatch(url, shards, wanted)
    return shards


def _fill_status_shards(conn: Connection, shards: int) -> None:
    """Give every status row published before the store had a layout its checkpoint's shard."""
    names = list(conn.execute(_UNSHARDED_STATUS).scalars())
    if names:
        conn.execute(_SET_STATUS_SHARDS, {"names": names, "shards": [shard_of(n, shards) for n in names]})


@runtime_checkable
class Fence(Protocol):
    """What a coordinator's writes to the store are fenced by: the epochs of the shards it holds.

    A ``StoreLock`` (one shard, the whole store by default) and a :class:`ShardFence` (several).
    """

    @property
    def shards(self) -> frozenset[int]:
        """The shards this fence checks."""
        ...

    def fence(self, conn: Connection) -> None:
        """Inside a transaction that writes: go on only while every shard's epoch is still ours.

        Raises:
            Fenced: one is not (another coordinator took the shard); nothing may be written.
        """
        ...

    def statement(
        self, carrying: Collection[str] = (), *, all_held: bool = False, skip: Collection[int] = ()
    ) -> tuple[str, tuple[Any, ...]]:
        """The read a commit sends first in its pipeline (psycopg's ``%s`` style, and its parameters).

        ``carrying``: the checkpoints whose rows the commit writes; a fence that knows their shards
        reads only those it holds of them. ``all_held`` (or no ``carrying``): every shard held, for a
        commit that also writes rows of checkpoints it cannot name. ``skip``: shards not to read (a
        writer that found them refused already and writes nothing of them); a fence of one shard
        reads it whatever ``skip`` says.
        """
        ...

    def check_rows(self, rows: Sequence[Sequence[Any]], carrying: Collection[str] = ()) -> dict[int, int]:
        """Check what :meth:`statement` read, before the commit; returns each checked shard's epoch.

        ``carrying``: the checkpoints whose rows the commit writes (a fence that knows their
        shards refuses a commit carrying one of a shard it did not read).

        Raises:
            Fenced: a shard's epoch is not the one this coordinator took, or the commit carries a
                checkpoint of a shard not read (``refuses`` says which checkpoints, when the fence
                knows their shards).
        """
        ...


class NoShardHeld(Fenced):
    """A coordinator holding no shard of the store tried to write to it."""

    def __init__(self, url: sa.URL) -> None:
        CompletionWriteError.__init__(
            self,
            f"this coordinator holds no shard of the PostgreSQL store {display(url)}, so it may write "
            "nothing to it; retry against the coordinators that own the store's shards",
            path=display(url),
            disk_full=False,
        )
        self.shard = None


class ShardNotHeld(Fenced):
    """A commit carried rows of a checkpoint whose shard its fence did not read (handed over, or lost).

    ``refuses`` (``CompletionWriteError.refuses``): the checkpoints of every shard the commit
    carried but its fence did not read; the commit without their ops may go through (the group
    committer commits the rest of its group again).
    """

    def __init__(
        self, url: sa.URL, shard: int, checkpoint: str, refuses: Callable[[str], bool] | None = None
    ) -> None:
        CompletionWriteError.__init__(
            self,
            f"this coordinator no longer holds shard {shard} of the PostgreSQL store {display(url)} "
            f"(checkpoint {checkpoint!r} is in it): the shard was handed over or lost, so nothing of "
            "this commit was written; retry against the coordinator that holds it now",
            path=display(url),
            disk_full=False,
        )
        self.shard = shard
        self.refuses = refuses


class ShardFence:
    """The fence of a coordinator holding several shards of a store: one ``StoreLock`` per shard.

    Thread-safe: commits check it on their threads while shards are added and removed. A commit
    checks the shards held when its read was sent (:meth:`statement` carries their epochs), so a
    shard added meanwhile is checked from the next commit on, and one removed meanwhile still
    passes if the store's epoch was ours when the commit read it (the read holds the row, so
    whoever takes the shard next waits for that commit).

    Given the store's number of shards (``store_shards``), a commit is fenced by the shards of the
    checkpoints it carries (``carrying``), not by every shard held: its read covers only those
    (held) shards, so a shard another coordinator took (this one paused past its lease) refuses the
    commits of its own checkpoints alone, and those of the shards kept go on before this
    coordinator even notices. A commit carrying a checkpoint of a shard its read did not check (a
    shard removed before the read was sent: handed over or lost) is refused, whatever the epochs of
    the others, so a late write of a shard given up never passes on the strength of the shards
    kept. Either refusal says which checkpoints it refuses (``refuses``): the same commit without
    them may pass. A commit carrying nothing, or rows of checkpoints it cannot name (``all_held``),
    reads every shard held, as without ``store_shards``.

    Args:
        locks: the locks held, by shard (each acquired already).
        url: the store's URL (for messages), if ``locks`` is empty.
        store_shards: how many shards the store has (None: commits are checked by their read alone).

    Raises:
        ValueError: as :meth:`add`, or no lock and no ``url``.
    """

    def __init__(
        self,
        locks: Mapping[int, StoreLock] | None = None,
        *,
        url: sa.URL | None = None,
        store_shards: int | None = None,
    ) -> None:
        locks = dict(locks or {})
        if url is None:
            if not locks:
                raise ValueError("a ShardFence without locks needs the store's url")
            url = next(iter(locks.values())).url
        self.url = url
        self.store_shards = store_shards
        self._mutex = threading.Lock()
        self._locks: dict[int, StoreLock] = {}
        for shard, lock in locks.items():
            if lock.shard != shard:
                raise ValueError(f"the lock given for shard {shard} is the lock of shard {lock.shard}")
            self.add(lock)

    def add(self, lock: StoreLock) -> None:
        """Fence writes with ``lock``'s shard too, from the next commit on.

        Raises:
            ValueError: ``lock`` holds no epoch (acquire it first), is of another store, or its
                shard is in the fence already under another lock (remove that one first).
        """
        if lock.epoch is None:
            raise ValueError(
                f"the lock of shard {lock.shard} holds no epoch: acquire it before fencing with it"
            )
        if lock.url != self.url:
            raise ValueError(
                f"the lock of shard {lock.shard} is of store {display(lock.url)}, not {display(self.url)}"
            )
        with self._mutex:
            held = self._locks.get(lock.shard)
            if held is not None and held is not lock:
                raise ValueError(f"shard {lock.shard} is fenced by another lock already; remove it first")
            self._locks[lock.shard] = lock

    def remove(self, shard: int) -> StoreLock | None:
        """Stop fencing with ``shard`` (from the next commit on); returns its lock (None if not held).

        Releasing the lock is the caller's: let the shard's writers drain first.
        """
        with self._mutex:
            return self._locks.pop(shard, None)

    @property
    def shards(self) -> frozenset[int]:
        """The shards held now."""
        with self._mutex:
            return frozenset(self._locks)

    def lock(self, shard: int) -> StoreLock | None:
        """The lock of ``shard``, if it is held."""
        with self._mutex:
            return self._locks.get(shard)

    def statement(
        self, carrying: Collection[str] = (), *, all_held: bool = False, skip: Collection[int] = ()
    ) -> tuple[str, tuple[Any, ...]]:
        """The read of shards' epochs (``FOR KEY SHARE``), with the epochs they were taken with.

        The shards held of the checkpoints in ``carrying``, given ``store_shards``; every shard held
        with ``all_held``, no ``carrying`` or no ``store_shards``. Never those in ``skip`` (a
        checkpoint carried of one of them is then refused by :meth:`check_rows`, as not read).
        """
        wanted = None
        if self.store_shards is not None and carrying and not all_held:
            wanted = {shard_of(name, self.store_shards) for name in carrying}
        with self._mutex:
            held = sorted(
                (shard, lock.epoch)
                for shard, lock in self._locks.items()
                if (wanted is None or shard in wanted) and shard not in skip
            )
        return _READ_EPOCHS, ([shard for shard, _ in held], [epoch for _, epoch in held])

    def check_rows(self, rows: Sequence[Sequence[Any]], carrying: Collection[str] = ()) -> dict[int, int]:
        """Check what :meth:`statement` read: every shard's epoch must be the one its lock took.

        And, given ``store_shards``, every checkpoint in ``carrying`` must be of a shard the read
        checked. Returns the shards checked and their epochs.

        Raises:
            NoShardHeld: no shard was held when the read was sent (and nothing is carried).
            Fenced: a shard's epoch moved on, or it has no row (another coordinator took it); given
                ``store_shards``, it ``refuses`` the checkpoints of that shard.
            ShardNotHeld: a checkpoint carried is of a shard the read did not check; it ``refuses``
                the checkpoints of every such shard.
        """
        if not rows and (self.store_shards is None or not carrying):
            raise NoShardHeld(self.url)
        checked: dict[int, int] = {}
        for shard, mine, now in rows:
            if mine is None or now is None or int(now) != int(mine):
                refuses = (
                    None if self.store_shards is None else _within(frozenset({int(shard)}), self.store_shards)
                )
                raise Fenced(self.url, int(mine or 0), None if now is None else int(now), int(shard), refuses)
            checked[int(shard)] = int(mine)
        if self.store_shards is not None:
            missing = {shard_of(name, self.store_shards): name for name in carrying}
            for shard in checked:
                missing.pop(shard, None)
            if missing:
                shard, name = min(missing.items())
                raise ShardNotHeld(self.url, shard, name, _within(frozenset(missing), self.store_shards))
        return checked

    def refusal(self, checkpoint: str) -> ShardNotHeld | None:
        """What a commit carrying ``checkpoint`` would be refused with now, given the shards held.

        None if its shard is held (or the fence does not know the store's number of shards). Lets
        the group committer fail such ops before their commit rather than have it refused (the
        fence still refuses one whose shard leaves meanwhile).
        """
        if self.store_shards is None:
            return None
        shard = shard_of(checkpoint, self.store_shards)
        held = self.shards
        if shard in held:
            return None
        return ShardNotHeld(self.url, shard, checkpoint, _outside(held, self.store_shards))

    def fence(self, conn: Connection, carrying: Collection[str] = ()) -> None:
        """Read the held shards' epochs ``FOR KEY SHARE`` in ``conn``'s transaction and check them.

        Raises:
            NoShardHeld: no shard is held.
            Fenced: another coordinator took one of the shards read, or (``ShardNotHeld``) a
                checkpoint in ``carrying`` is of a shard not held; nothing may be written.
        """
        run_fence(conn, self, carrying)


def _outside(shards: frozenset[int], store_shards: int) -> Callable[[str], bool]:
    """Whether a checkpoint is of none of ``shards`` (of a store of ``store_shards``)."""
    return lambda name: shard_of(name, store_shards) not in shards


def _within(shards: frozenset[int], store_shards: int) -> Callable[[str], bool]:
    """Whether a checkpoint is of one of ``shards`` (of a store of ``store_shards``)."""
    return lambda name: shard_of(name, store_shards) in shards


def run_fence(
    conn: Connection,
    fence: Fence,
    carrying: Collection[str] = (),
    *,
    all_held: bool = False,
    skip: Collection[int] = (),
) -> dict[int, int]:
    """``fence``'s read in ``conn``'s transaction, checked; returns each checked shard's epoch.

    ``carrying``: the checkpoints whose rows the transaction writes (see ``ShardFence``: the read
    covers their shards); ``all_held``: it also writes rows of checkpoints it cannot name, so the
    read covers every shard held; ``skip``: shards the read leaves out even so (``Fence.statement``).

    Raises:
        Fenced: as ``fence.check_rows``.
    """
    sql, params = fence.statement(carrying, all_held=all_held, skip=skip)
    result = conn.exec_driver_sql(sql, params) if params else conn.exec_driver_sql(sql)
    return fence.check_rows([tuple(row) for row in result], carrying)
