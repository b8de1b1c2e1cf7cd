"""What the PostgreSQL store's parts share: its URL, its engines, its errors and its lock.

The PostgreSQL store (``tally serve --store postgresql+psycopg://...``) keeps completions
(``pg_completions``) and writers' journals (``pg_journal``) in one database. For now one coordinator
owns a store at a time: :class:`StoreLock` holds a session-level advisory lock for the life of
``tally serve``, the way ``datadir_lock`` does for a data directory, and takes the store's fencing
epoch with it. Other coordinators on the store serve as replicas (``tally_server.replica``): they
answer reads from the database and forward writers' calls to the owner until they take the lock.
A store may also be split into shards, each locked and fenced on its own (``StoreLock(shard=k)``,
``store.shards``); shard 0 is the whole store's lock and epoch row of before shards.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from tally_server.domain.ports import CompletionWriteError
from tally_server.errors import Unavailable
from tally_server.store import pg_revisions

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

# Errors of the database or the way to it (down, restarting, out of disk, out of connections):
# transient. Integrity and data errors are bugs and propagate as they are.
TRANSIENT = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.DisconnectionError, sa.exc.TimeoutError)
# The same, raised by psycopg itself where a hot path uses its connection under SQLAlchemy's (a
# commit's pipeline of writes).
TRANSIENT_RAW = (*TRANSIENT, psycopg.OperationalError, psycopg.InterfaceError)
# SQLSTATE class 53: insufficient resources (53100 disk_full, 53200 out_of_memory, ...).
_RESOURCES = "53"
_DISK_FULL = "53100"
# The advisory lock key of a store (one store per database): "tallystr" as a big-endian bigint.
# Shard k of a store (``store.shards``) is locked under ``STORE_LOCK_KEY + k``: shard 0 is the key
# every store had before shards, so a one-shard store is locked exactly as it always was.
STORE_LOCK_KEY = int.from_bytes(b"tallystr", "big")
# Shards a store may have (``store_layout.shards``, 1..MAX_SHARDS; shard numbers 0..MAX_SHARDS-1).
MAX_SHARDS = 256
_CONNECT_TIMEOUT_S = 10
_LOCK_WAIT_S = 2.0
_TRY_LOCK = sa.text("SELECT pg_try_advisory_lock(:k)")
# Taking the lock bumps the fencing epoch; the UPDATE waits for commits in flight that read the old one
# (it changes a key, ``epoch``: FOR UPDATE on the row, see READ_EPOCH).
_DB_NOW = "extract(epoch from clock_timestamp())"
_BUMP_EPOCH = sa.text(
    "INSERT INTO store_epoch (id, epoch, holder, since, renewed_at) "
    f"VALUES (:id, 1, :holder, :since, {_DB_NOW}) "
    "ON CONFLICT (id) DO UPDATE SET epoch = store_epoch.epoch + 1, holder = excluded.holder, "
    "since = excluded.since, renewed_at = excluded.renewed_at RETURNING epoch"
)
# The bump changes a key of the row (epoch is in a unique constraint), so it waits for every commit
# holding the row FOR KEY SHARE (READ_EPOCH) to end. A live commit holds it for milliseconds; one of a
# coordinator paused (SIGSTOP, a hung host) between its read and its COMMIT holds it for ever. The
# lock is ours by then (the advisory lock is taken first), so whatever still holds the row after
# ``BUMP_BLOCKED_S`` is a former holder's transaction: its session is ended, its transaction rolled
# back (never acknowledged: it had not committed), and the bump goes on.
BUMP_BLOCKED_S = 2.0
_END_BLOCKERS = sa.text(
    "SELECT b.pid, coalesce(a.application_name, '') AS application_name, a.state, "
    "pg_terminate_backend(b.pid) AS ended "
    "FROM unnest(pg_blocking_pids(:pid)) AS b(pid) LEFT JOIN pg_stat_activity a ON a.pid = b.pid"
)
# Renewing, keeping the epoch and letting go change ``renewed_at`` alone: FOR NO KEY UPDATE on the
# row, which commits' FOR KEY SHARE reads do not hold up (see READ_EPOCH).
_RENEW = sa.text(f"UPDATE store_epoch SET renewed_at = {_DB_NOW} WHERE id = :id AND epoch = :epoch")
# Taking the lock again after our own session ended: the epoch stays ours if no one took the store.
_KEEP_EPOCH = sa.text(
    f"UPDATE store_epoch SET renewed_at = {_DB_NOW} WHERE id = :id AND epoch = :epoch RETURNING epoch"
)
_EPOCH_NOW = sa.text("SELECT epoch FROM store_epoch WHERE id = :id")
_SILENT_FOR = sa.text(f"SELECT {_DB_NOW} - renewed_at FROM store_epoch WHERE id = :id")
_END_HOLDER = sa.text(
    "SELECT pg_terminate_backend(l.pid) FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND l.classid::bigint = :hi AND l.objid::bigint = :lo AND l.objsubid = 1"
)
# How often the holder shows it is alive, and how long a standby waits for a holder that stopped
# doing so before it ends that holder's session and takes over (a paused or hung coordinator keeps
# its session, and so the lock, however long it is stopped).
RENEW_EVERY_S = 1.0
TAKE_OVER_AFTER_S = 5.0
# On a store of several shards: a coordinator whose row in store_replicas (renewed with its shards'
# leases) is this old counts as gone when the shards are shared out, so that the others take a
# killed one's shards (free: its sessions ended with it) within the 5 s. A live holder's
# shard is still taken only once its lease is TAKE_OVER_AFTER_S silent (its session then ended).
SHARD_HOLDER_GONE_AFTER_S = 3 * RENEW_EVERY_S
# How long a free lock is left to the holder named in store_epoch before a standby takes it: a
# database restart (or an administrator's pg_terminate_backend) ends every session, the holder's
# lock session too, and its keeper takes the lock back within RENEW_EVERY_S. The silence counts
# on the database's clock from the holder's last renewal or the database's start, the later one
# (and from when the database came back for the standby, if it saw it down: a slow recovery), so a
# restart does not hand the store to whichever coordinator reconnects first, while a holder that
# died (kill -9, its host gone) is replaced about this long after its last renewal.
INCUMBENT_GRACE_S = 2 * RENEW_EVERY_S
_HAS_EPOCH = sa.text("SELECT to_regclass('store_epoch') IS NOT NULL")
_INCUMBENT = sa.text(
    "SELECT e.holder, "
    f"{_DB_NOW} - greatest(e.renewed_at, extract(epoch from pg_postmaster_start_time())) AS silent, "
    "EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND l.classid::bigint = :hi AND l.objid::bigint = :lo) AS held "
    "FROM store_epoch e WHERE e.id = :id"
)
# A holder stopping cleanly marks the store as let go: a standby takes it at once, no grace.
_LET_GO = sa.text("UPDATE store_epoch SET renewed_at = 0 WHERE id = :id AND epoch = :epoch")
# What StoreLock.fence reads (shard 0's; ``read_epoch`` for others); a commit sends it first in its
# pipeline of writes (``StoreLock.statement``) and checks it before it commits (``check_rows``).
# FOR KEY SHARE: only an UPDATE that changes a key of the row waits for it, and ``epoch`` is one
# (unique, store revision s0004), so the bump waits for every commit in flight that read the old
# epoch; the holder's renewals, which change ``renewed_at`` alone, do not (FOR SHARE made them wait
# until no commit held the row).
READ_EPOCH = "SELECT epoch FROM store_epoch WHERE id = 1 FOR KEY SHARE"


def read_epoch(shard: int) -> str:
    """``READ_EPOCH`` for shard ``shard`` (its row is ``store_epoch.id = shard + 1``; shard 0's is it).

    The id is written into the text (an ``int``, checked by ``StoreLock``): a statement without
    parameters, as commits have always sent it.
    """
    return READ_EPOCH if shard == 0 else READ_EPOCH.replace("id = 1", f"id = {int(shard) + 1}")


def lock_key(shard: int) -> int:
    """The advisory lock key of shard ``shard`` of a store (shard 0's is ``STORE_LOCK_KEY``)."""
    return STORE_LOCK_KEY + shard


def _key_halves(key: int) -> dict[str, int]:
    """``pg_locks`` shows a bigint advisory key as two 32-bit halves (``classid``, ``objid``)."""
    return {"hi": key >> 32, "lo": key & 0xFFFFFFFF}


# How often a standby tries the lock while another coordinator holds it.
_STANDBY_POLL_S = 0.5
_LOCK_SESSION = (
    "SET tcp_keepalives_idle = 10",
    "SET tcp_keepalives_interval = 5",
    "SET tcp_keepalives_count = 3",
    "SET idle_in_transaction_session_timeout = 0",
)


def store_url(url: str) -> sa.URL:
    """The SQLAlchemy URL of a store, on the psycopg (3) driver.

    ``postgresql://`` and ``postgres://`` (libpq's spellings) mean ``postgresql+psycopg://``.

    Raises:
        ValueError: not a PostgreSQL URL, or another driver than psycopg.
    """
    text = url.strip()
    for plain in ("postgresql://", "postgres://"):
        if text.startswith(plain):
            text = "postgresql+psycopg://" + text[len(plain) :]
    try:
        parsed = sa.make_url(text)
    except (sa.exc.ArgumentError, ValueError):  # ValueError: a port that is not a number
        # Not repeated: what could not be parsed may hold a password.
        raise ValueError(
            "store is not a database URL (it is not repeated here, as it may hold a password); give "
            "postgresql+psycopg://USER@HOST:5432/DB"
        ) from None
    if parsed.drivername != "postgresql+psycopg":
        raise ValueError(
            f"store {parsed.render_as_string()!r} uses {parsed.drivername!r}; the store runs on "
            "PostgreSQL through psycopg 3: give postgresql+psycopg://USER@HOST:5432/DB (or postgresql://...)"
        )
    if not parsed.database:
        raise ValueError(f"store {parsed.render_as_string()!r} names no database; add /DBNAME to it")
    return parsed


def display(url: sa.URL) -> str:
    """The URL as logs and messages show it: never with its password."""
    return url.render_as_string(hide_password=True)


def application_name() -> str:
    """What this process calls itself in ``pg_stat_activity`` (at most 63 bytes, PostgreSQL's limit)."""
    return f"tally serve pid {os.getpid()} on {socket.gethostname()}"[:63]


def create_engine(
    url: sa.URL, *, pooled: bool = True, pre_ping: bool = True, autocommit: bool = False
) -> Engine:
    """An engine on the store's database whose sessions commit synchronously (durable on return).

    ``pre_ping``: check each pooled connection with a round trip before lending it, as a database
    restart may have cut it; without, the first statement on such a connection fails with
    ``connection_invalidated`` set (see :func:`stale_connection`) and the caller tries again.
    ``autocommit``: every statement its own transaction (for reads of one statement: no ``BEGIN``
    and ``ROLLBACK`` round trips around it).
    """
    engine = sa.create_engine(
        url,
        pool_pre_ping=pre_ping,  # a pooled connection may have been cut by a database restart
        poolclass=None if pooled else NullPool,
        connect_args={"connect_timeout": _CONNECT_TIMEOUT_S, "application_name": application_name()},
        **({"isolation_level": "AUTOCOMMIT"} if autocommit else {}),
    )

    @sa.event.listens_for(engine, "connect")
    def _durable(dbapi_connection: Any, _record: Any) -> None:
        # Whatever the server's default: a commit returns once it is flushed to the WAL on disk.
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SET synchronous_commit TO on")
        dbapi_connection.commit()

    return engine


def open_store_engine(url: sa.URL, prepare: Callable[[Engine], None]) -> Engine:
    """``create_engine``, then ``prepare`` it (create tables and the like) before anyone uses it.

    Raises:
        StoreUnreachable: the database cannot be reached (nothing is left open).
    """
    engine = create_engine(url)
    try:
        prepare(engine)
    except TRANSIENT as exc:
        engine.dispose()
        raise StoreUnreachable(url, exc) from None
    except BaseException:
        engine.dispose()
        raise
    return engine


def stale_connection(exc: BaseException) -> bool:
    """Whether ``exc`` says a connection the pool lent was found closed, so a new one may work.

    As a database restart leaves the connections that sat in the pool: SQLAlchemy says so
    (``connection_invalidated``, and discards it), or psycopg itself, for statements sent on its
    own connection (a commit's pipeline), with a connection error or an administrator's shutdown.
    A connection that cannot be made at all is neither (the pool raises that through SQLAlchemy).

    Also an error raised while handling one that says the session ended: the ``ROLLBACK`` of a
    commit whose pipeline read the server's "terminating connection" while results were still due
    fails as "cannot exit pipeline mode while busy", which SQLAlchemy does not take for a
    disconnect, and that failure is what the commit sees.
    """
    if getattr(exc, "connection_invalidated", False):
        return True
    if isinstance(exc, psycopg.OperationalError) and (exc.sqlstate or "")[:2] in ("", "08", "57"):
        return True
    handled = exc.__context__
    for _ in range(8):  # a chain is a few exceptions long; never follow a cycle for ever
        if handled is None:
            return False
        if isinstance(handled, psycopg.OperationalError) and (handled.sqlstate or "")[:2] in ("08", "57"):
            return True
        handled = handled.__context__
    return False


def again_if_cut(call: Callable[[], _T]) -> _T:
    """``call()``, and once more if it found its connection cut (see :func:`stale_connection`).

    For idempotent statements of a pooled engine with the pool's ping: the ping replaces a
    connection a restart left dead, but not one whose session is ended after the ping or while the
    statement runs (a server takes a few milliseconds to end them all). SQLAlchemy has discarded
    the pool's older connections by then, so the second try runs on a new one.
    """
    try:
        return call()
    except TRANSIENT_RAW as exc:
        if not stale_connection(exc):
            raise
        logger.info("a connection to the store was cut (%s); once more on a new one", cause(exc))
    return call()


def cause(exc: BaseException) -> str:
    """The first line of what the database (or the driver) said."""
    text = str(getattr(exc, "orig", None) or exc).strip()
    return (text.splitlines() or [type(exc).__name__])[0][:300]


def _sqlstate(exc: BaseException) -> str:
    return str(getattr(getattr(exc, "orig", None) or exc, "sqlstate", None) or "")


def write_error(url: sa.URL, exc: BaseException, what: str) -> CompletionWriteError:
    """The transient error for a write the database refused or could not be reached for."""
    state = _sqlstate(exc)
    disk_full = state == _DISK_FULL or "no space left" in cause(exc).lower()
    where = display(url)
    if disk_full:
        message = (
            f"the disk of the PostgreSQL store {where} is full; free space or grow its volume — Tally "
            f"retries by itself ({what}: {cause(exc)})"
        )
    elif state.startswith(_RESOURCES):
        message = (
            f"the PostgreSQL store {where} is out of resources ({cause(exc)}); {what} did not happen — "
            "Tally retries by itself"
        )
    else:
        message = (
            f"cannot write {what} to the PostgreSQL store {where} ({cause(exc)}); check that the "
            "database is up and reachable — Tally retries by itself"
        )
    return CompletionWriteError(message, path=where, disk_full=disk_full)


class StoreUnavailable(Unavailable):
    """The store's database cannot be read right now (UNAVAILABLE: the caller retries)."""


def read_error(url: sa.URL, exc: BaseException, what: str) -> StoreUnavailable:
    """The UNAVAILABLE error for a read the database refused or could not be reached for."""
    return StoreUnavailable(
        f"cannot read {what} from the PostgreSQL store {display(url)} ({cause(exc)}); check that the "
        "database is up and reachable, then retry",
        cause=cause(exc),
    )


class StoreUnreachable(OSError):
    """The store's database cannot be used at start (an ``OSError``: ``tally serve`` prints one line)."""

    def __init__(self, url: sa.URL, exc: BaseException) -> None:
        super().__init__(
            f"cannot use the PostgreSQL store {display(url)}: {cause(exc)}; check the URL, that PostgreSQL "
            "is running and reachable from here and that the user may connect and create tables, then "
            "start again"
        )


class Fenced(CompletionWriteError):
    """This coordinator is no longer the store's owner: another took the store's lock and epoch.

    Nothing of the refused commit was written. The coordinator stops (its lock check says so within
    seconds); its writers' calls fail as UNAVAILABLE and go on at the coordinator that took over.
    Of a store of several shards, only the shard's (``shard``) is lost: ``refuses`` (see
    ``CompletionWriteError``) then says which checkpoints are in it, so that the same commit without
    their rows may go through.
    """

    def __init__(
        self,
        url: sa.URL,
        mine: int,
        now: int | None,
        shard: int | None = None,
        refuses: Callable[[str], bool] | None = None,
    ) -> None:
        what = _of_store(url, shard, "the PostgreSQL")
        # Of a shard of a store of several, the coordinator drops that shard and serves the others on.
        after = "drops it" if refuses is not None else "is stopping"
        super().__init__(
            f"this coordinator no longer owns {what}: its epoch is {mine}, "
            f"the store's is {now}; another coordinator took over and this one {after}, so retry "
            "against the one that took over",
            path=display(url),
            disk_full=False,
        )
        self.shard = shard
        self.refuses = refuses


def _of_store(url: sa.URL, shard: int | None, kind: str = "") -> str:
    """How messages name a store, or one of its shards (None: the whole store, or shard 0 of it)."""
    store = f"{kind} store {display(url)}".lstrip()
    return store if shard is None else f"shard {shard} of {store}"


class StoreInUse(OSError):
    """Another coordinator holds the store's lock.

    An ``OSError`` so that ``tally serve`` reports it as one line and exits non-zero, like a data
    directory in use.
    """

    def __init__(self, url: sa.URL, holder: dict[str, Any], shard: int | None = None) -> None:
        if holder:
            since = holder.get("backend_start")
            when = since.isoformat(timespec="seconds") if isinstance(since, datetime.datetime) else "?"
            name = holder.get("application_name") or "a session that did not name itself"
            client = holder.get("client_addr") or "a local socket"
            who = f"{name}, connected from {client} since {when}, PostgreSQL backend pid {holder.get('pid')}"
        else:
            who = "a session this user may not see"
        super().__init__(
            f"{_of_store(url, shard)} is in use by another tally serve ({who}); stop that one first, give "
            "this one another --store, or start it with --standby to take over when that one is gone"
        )
        self.holder = holder
        self.holder_text = f"{_of_store(url, shard)} is served by another tally serve ({who})"


class StoreTakenMeanwhile(StoreInUse):
    """The lock's session ended, and another coordinator took the store (and let it go) meanwhile.

    Its lock is free again, but the store's epoch moved on: that coordinator may have changed
    completions this one still holds in memory, so this one must stop rather than serve on.

    Or (``while_held``) the epoch moved on under the lock's live session: not a takeover (that
    takes the lock first) but an operator's change of ``store_epoch``, or a coordinator bumping it
    without the lock (a bug). Every write of this one is refused from then on, so it stops as well.
    """

    def __init__(
        self,
        url: sa.URL,
        mine: int | None,
        now: int | None,
        shard: int | None = None,
        *,
        while_held: bool = False,
    ) -> None:
        epochs = f"the store's epoch is {now}, this one's was {mine}"
        if while_held:
            text = (
                f"the epoch of {_of_store(url, shard)} moved on while this coordinator held its lock "
                f"({epochs}): an operator changed its row of store_epoch, or a coordinator bumped it "
                "without the lock"
            )
            what = (
                "this one lets the lock go and writes nothing more to it; find out who changed the "
                "epoch, then start this one again to serve it with what the store holds now"
            )
        else:
            text = (
                f"{_of_store(url, shard)} was served by another coordinator while this one had no "
                f"database session ({epochs})"
            )
            what = "start this one again to serve it with what the store holds now"
        OSError.__init__(self, f"{text}; {what}")
        self.holder: dict[str, Any] = {}
        self.holder_text = text


class _Deferring(Exception):
    """The lock is free, but the holder named in the store is silent for less than ``INCUMBENT_GRACE_S``."""

    def __init__(self, holder: str, silent: float) -> None:
        super().__init__(holder, silent)
        self.holder, self.silent = holder, silent


class StoreLock:
    """The session-level advisory lock that makes one coordinator the store's only user.

    Held on a connection of its own from ``acquire`` until ``release`` or the end of the process:
    PostgreSQL releases it when the session ends however it ends (kill -9 included, once the server
    notices the connection is gone).

    Or the lock of one shard of the store (``store.shards``): shard ``k`` is the advisory key
    ``STORE_LOCK_KEY + k`` and the epoch row ``store_epoch.id = k + 1``, each with its own fencing
    epoch; shard 0 is the key and row of the whole store before shards, so a one-shard store is
    locked as it always was. Each lock keeps its own session (a coordinator holding five shards has
    five lock sessions): the code and its tests stay those of the one lock, and a shard is let go,
    lost or taken over alone. A standby ending the session of a silent holder
    (``_end_a_silent_holder``) ends that shard's lock session only.

    Args:
        url: the store's URL.
        holder: the name this coordinator goes by among the store's replicas (``store_epoch.holder``).
        shard: which shard of the store to lock (0, the default: a one-shard store's only one).

    Raises:
        ValueError: ``shard`` is not in 0..MAX_SHARDS-1.
    """

    def __init__(self, url: sa.URL, holder: str | None = None, shard: int = 0) -> None:
        if not 0 <= shard < MAX_SHARDS:
            raise ValueError(
                f"shard {shard} does not exist: a store has at most {MAX_SHARDS} shards, 0..{MAX_SHARDS - 1}"
            )
        self.url = url
        self.holder = holder or application_name()
        self.shard = shard
        self.epoch: int | None = None  # the fencing epoch this coordinator took with the lock
        self._id = {"id": shard + 1}  # its row in store_epoch
        self._key = lock_key(shard)
        self._named = None if shard == 0 else shard  # messages name shards other than the first
        self._read_epoch = read_epoch(shard)
        self._read_epoch_text = sa.text(self._read_epoch)
        self._engine: Engine | None = None
        self._conn: Connection | None = None
        # check() runs on a worker thread while release() may run at shutdown.
        self._mutex = threading.RLock()
        self._released = False
        # Called with the seconds each renewal took (``tally_store_lease_renew_seconds``).
        self.renew_observers: list[Callable[[float], None]] = []

    def acquire(self, wait_s: float = _LOCK_WAIT_S) -> None:
        """Take the lock, waiting up to ``wait_s`` for a holder that is going away.

        A coordinator killed a moment ago may still hold it: PostgreSQL ends its session as soon
        as it sees the connection closed, which takes a few milliseconds. Taking it bumps the
        store's fencing epoch (see :meth:`fence`).

        Raises:
            StoreInUse: another session holds it.
            StoreUnreachable: the database cannot be reached.
        """
        with self._mutex:
            self._acquire(wait_s)

    def wait_for(
        self,
        stop: threading.Event,
        poll: Callable[[], None] | None = None,
        role: str = "standby",
        *,
        reached: bool = False,
    ) -> bool:
        """A standby's (or a replica's) wait: take the lock as soon as the coordinator holding it is gone.

        Logs once who holds it, calls ``poll`` between tries (a replica renews its row and reads the
        owner there). Returns False if ``stop`` was set first (nothing taken). A lock found free is
        left ``INCUMBENT_GRACE_S`` to its holder (see ``_acquire``): a database restart frees it
        with every session, and the holder takes it back without a failover.

        ``reached``: the caller has reached the database already (``tally serve`` has, checking its
        replica name), so an outage is waited out from the first try on: a restart of the database
        just as a replica starts must not stop it.

        Raises:
            StoreUnreachable: the database cannot be reached at the first try (unless ``reached``);
                later outages are waited out.
        """
        told = False
        deferred = False
        reachable = reached
        unreachable_at = -math.inf  # when a try last found the database out of reach
        while not stop.is_set():
            try:
                with self._mutex:
                    self._acquire(0, back_for=time.monotonic() - unreachable_at)
                return True
            except _Deferring as exc:
                reachable = True
                if not deferred:
                    logger.info(
                        "%s: the store's lock is free but its holder %s could not take it back yet "
                        "(silent for %.1f s since it renewed it or the database came back: the database "
                        "restarted or ended its session?); leaving it %.0f s before taking over",
                        role,
                        exc.holder,
                        exc.silent,
                        INCUMBENT_GRACE_S,
                    )
                    deferred = True
                if poll is not None:
                    poll()
            except StoreInUse as exc:
                reachable = True
                if not told:
                    logger.info("%s: %s; taking over as soon as it is gone", role, exc.holder_text)
                    told = True
                self._end_a_silent_holder(exc)
                if poll is not None:
                    poll()
            except StoreUnreachable:
                if not reachable:
                    raise
                unreachable_at = time.monotonic()
                if poll is not None:
                    poll()  # a replica records that the database is out of reach (not ready)
            stop.wait(_STANDBY_POLL_S)
        return False

    def take(self) -> bool:
        """One try at the lock, as a standby's wait makes it: True if it is now held here.

        A free lock is left ``INCUMBENT_GRACE_S`` to the holder named in the store (it may be taking
        it back after a database restart); a holder silent past ``TAKE_OVER_AFTER_S`` has its
        session ended, so a later try takes the lock. On a store of several shards, each
        coordinator tries the shards that are its own this way every ``RENEW_EVERY_S``.

        Raises:
            StoreUnreachable: the database cannot be reached.
        """
        with self._mutex:
            try:
                self._acquire(0, back_for=math.inf)
            except _Deferring:
                return False
            except StoreInUse as exc:
                self._end_a_silent_holder(exc)
                return False
            return True

    def _end_a_silent_holder(self, refused: StoreInUse) -> None:
        """A holder that stopped renewing for ``TAKE_OVER_AFTER_S`` is paused or hung: end its session.

        Its lock goes with the session, so the next try takes the store (bumping the epoch, which
        fences whatever the stopped one still tries when it resumes). Errors are left to the next try.
        """
        try:
            engine = create_engine(self.url, pooled=False)
            try:
                with engine.connect() as conn:
                    silent = conn.execute(_SILENT_FOR, self._id).scalar()
                    if silent is None or silent < TAKE_OVER_AFTER_S:
                        return
                    logger.warning(
                        "%s has not shown it is alive for %.1f s (paused or hung?): ending its database "
                        "session to take the store over",
                        refused.holder_text,
                        silent,
                    )
                    conn.execute(_END_HOLDER, _key_halves(self._key))
                    conn.commit()
            finally:
                engine.dispose()
        except TRANSIENT:
            return

    def fence(self, conn: Connection) -> None:
        """Inside a commit's transaction: go on only while the store's epoch is still ours.

        Reads the epoch ``FOR KEY SHARE`` (``READ_EPOCH``), so a coordinator taking over (whose
        bump changes that key of the row) waits until this transaction ends, and every later commit
        of ours sees its epoch. The holder's renewals do not wait for it.

        Raises:
            Fenced: another coordinator took the store over; nothing may be written.
        """
        self.check_epoch(conn.execute(self._read_epoch_text).scalar())

    @property
    def shards(self) -> frozenset[int]:
        """The shards this lock fences: its own (the ``Fence`` protocol)."""
        return frozenset({self.shard})

    def statement(
        self, carrying: Collection[str] = (), *, all_held: bool = False, skip: Collection[int] = ()
    ) -> tuple[str, tuple[Any, ...]]:
        """What a commit sends first in its pipeline: ``READ_EPOCH`` (of this shard), no parameters.

        Whatever the commit carries (``carrying``, ``all_held``) or skips (``skip``): a lock fences
        its one shard.

        Its rows go to :meth:`check_rows` before the commit (the ``Fence`` protocol).
        """
        return self._read_epoch, ()

    def check_rows(self, rows: Sequence[Sequence[Any]], carrying: Collection[str] = ()) -> dict[int, int]:
        """:meth:`check_epoch` on what :meth:`statement` read (one row, or none if no epoch row).

        Returns the shard and epoch checked (``{shard: epoch}``), the rows a status board may write.
        ``carrying`` is not checked: a lock is the fence of a whole store, or of tests' one shard.

        Raises:
            Fenced: the store's epoch is not the one this coordinator took.
        """
        self.check_epoch(int(rows[0][0]) if rows else None)
        assert self.epoch is not None  # check_epoch refused None
        return {self.shard: self.epoch}

    def check_epoch(self, now: int | None) -> None:
        """What :meth:`fence` checks, for a commit that read ``READ_EPOCH`` itself.

        A commit sends that read first in its transaction, in one pipeline with its writes, and
        checks the epoch before it commits: the read's lock is the same, and a refused commit's
        writes are rolled back, never committed.

        Raises:
            Fenced: ``now`` (the store's epoch) is not the one this coordinator took.
        """
        if self.epoch is None or now != self.epoch:
            raise Fenced(self.url, self.epoch or 0, now, self._named)

    def _acquire(self, wait_s: float, again: bool = False, back_for: float | None = None) -> None:
        """Take the lock on a new session; ``again``: after this coordinator's own session ended.

        ``back_for`` (a standby's tries: seconds since it last found the database out of reach): a
        free lock is left alone while the holder named in the store is another coordinator that was
        silent for less than ``INCUMBENT_GRACE_S``, raising ``_Deferring``. Silent since the later
        of its last renewal and the database's start (the database's clock), or since the database
        came back for this standby (a restart whose recovery took longer than the grace).

        The first take bumps the store's epoch. Taking it again keeps the epoch this coordinator
        holds, as long as the store still has it (no one took the store meanwhile: any other
        coordinator bumps it): commits in flight read that epoch and go through. Bumping it there
        made them fail as fenced, by this coordinator itself, until ``self.epoch`` was updated.

        Raises:
            StoreTakenMeanwhile: ``again``, and the store's epoch moved on meanwhile.
        """
        if self._conn is not None:
            return
        engine = create_engine(self.url, pooled=False)
        try:
            conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            try:
                # If this host vanishes, the server notices within about half a minute (its TCP
                # keepalives), ends the session and frees the lock for a coordinator elsewhere.
                for setting in _LOCK_SESSION:
                    conn.execute(sa.text(setting))
                if back_for is not None:
                    self._defer_to_incumbent(conn, back_for)
                deadline = time.monotonic() + wait_s
                while not conn.execute(_TRY_LOCK, {"k": self._key}).scalar():
                    if time.monotonic() >= deadline:
                        raise StoreInUse(self.url, self._holder(conn), self._named)
                    time.sleep(0.1)
                pg_revisions.upgrade_store(engine, display(self.url))
                if again and self.epoch is not None:
                    if conn.execute(_KEEP_EPOCH, {**self._id, "epoch": self.epoch}).scalar() is None:
                        now = conn.execute(_EPOCH_NOW, self._id).scalar()
                        raise StoreTakenMeanwhile(self.url, self.epoch, now, self._named)
                else:
                    self.epoch = self._bump(conn)
            except BaseException:
                conn.close()
                raise
        except TRANSIENT as exc:
            engine.dispose()
            raise StoreUnreachable(self.url, exc) from None
        except BaseException:
            engine.dispose()
            raise
        self._engine, self._conn = engine, conn

    def _bump(self, conn: Connection) -> int:
        """Bump the epoch on the lock's session ``conn``, ending sessions that hold its row up."""
        pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        done = threading.Event()
        watch = threading.Thread(
            target=self._end_blockers, args=(pid, done), name="tally-epoch-bump", daemon=True
        )
        watch.start()
        try:
            epoch: int = conn.execute(
                _BUMP_EPOCH, {**self._id, "holder": self.holder, "since": time.time()}
            ).scalar_one()
            return epoch
        finally:
            done.set()
            watch.join()

    def _end_blockers(self, pid: int, done: threading.Event) -> None:
        """While session ``pid``'s bump waits, end the sessions it waits for (see ``BUMP_BLOCKED_S``)."""
        engine = create_engine(self.url, pooled=False, autocommit=True)
        told = False
        try:
            while not done.wait(BUMP_BLOCKED_S):
                try:
                    with engine.connect() as other:
                        blockers = other.execute(_END_BLOCKERS, {"pid": pid}).all()
                except TRANSIENT as exc:
                    if not told:
                        logger.warning(
                            "taking %s: could not end the sessions holding its epoch row (%s); "
                            "trying again while the bump waits",
                            _of_store(self.url, self._named),
                            cause(exc),
                        )
                        told = True
                    continue
                for row in blockers:
                    logger.warning(
                        "taking %s: ending a session still holding its epoch row after %.0f s "
                        "(pid %s, %s, %s: a commit of a paused or hung coordinator?); its transaction "
                        "is rolled back",
                        _of_store(self.url, self._named),
                        BUMP_BLOCKED_S,
                        row.pid,
                        row.application_name or "a session that did not name itself",
                        row.state or "state unknown",
                    )
        finally:
            engine.dispose()

    def _defer_to_incumbent(self, conn: Connection, back_for: float) -> None:
        """Raise ``_Deferring`` if the lock is free but its holder may still be taking it back."""
        if not conn.execute(_HAS_EPOCH).scalar():
            return  # a store no coordinator ever served
        row = conn.execute(_INCUMBENT, {**self._id, **_key_halves(self._key)}).first()
        if row is None or row.held or row.holder == self.holder:
            return  # held: the try below says by whom; ours: take it at once
        silent = min(float(row.silent), back_for)
        if silent < INCUMBENT_GRACE_S:
            raise _Deferring(row.holder, silent)

    def _holder(self, conn: Connection) -> dict[str, Any]:
        """Who holds the lock, as far as ``pg_stat_activity`` shows this user (empty if it does not)."""
        row = conn.execute(
            sa.text(
                "SELECT a.pid, a.application_name, host(a.client_addr) AS client_addr, a.backend_start "
                "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
                "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                "AND l.classid::bigint = :hi AND l.objid::bigint = :lo"
            ),
            _key_halves(self._key),
        ).first()
        return dict(row._mapping) if row is not None else {}

    def check(self) -> None:
        """Make sure the lock is still held, taking it again if its session ended; show we are alive.

        Called every ``RENEW_EVERY_S``: a standby ends the session of a holder that stops calling
        it (see ``wait_for``).

        A database restart (or an administrator's ``pg_terminate_backend``) ends the lock's session
        and frees the lock: this takes it again on a new session as soon as the database answers,
        under the same epoch (see ``_acquire``).

        Raises:
            StoreInUse: another coordinator took the lock meanwhile (or took it and let it go:
                ``StoreTakenMeanwhile``), or the epoch moved on under the lock held (a renewal
                that finds another epoch: ``StoreTakenMeanwhile``, the lock let go); this one must
                stop.
            StoreUnreachable: the database cannot be reached (try again later).
        """
        with self._mutex:
            self._check()

    def _check(self) -> None:
        if self._released:
            return
        conn = self._conn
        if conn is not None:
            try:
                started = time.perf_counter()
                # Alive: a standby leaves us be.
                renewed = conn.execute(_RENEW, {**self._id, "epoch": self.epoch}).rowcount
                if not renewed:
                    # Our session (and the lock) is alive, yet the epoch is no longer ours.
                    now = conn.execute(_EPOCH_NOW, self._id).scalar()
                    self._release()
                    raise StoreTakenMeanwhile(self.url, self.epoch, now, self._named, while_held=True)
                took = time.perf_counter() - started
                logger.debug(
                    "renewed the lock of %s in %.2f ms", _of_store(self.url, self._named), took * 1000
                )
                for observe in self.renew_observers:
                    observe(took)
                return
            except TRANSIENT as exc:
                logger.warning(
                    "the session holding the lock of %s ended (%s); taking the lock again",
                    _of_store(self.url, self._named),
                    cause(exc),
                )
                self._release()
        self._acquire(0, again=True)
        logger.info("holding the lock of %s again (epoch %s)", _of_store(self.url, self._named), self.epoch)

    def release(self) -> None:
        """Give the lock up (closing its session releases it). Idempotent."""
        with self._mutex:
            self._released = True
            if self._conn is not None and self.epoch is not None:
                try:  # a standby need not leave this one time to take the lock back
                    self._conn.execute(_LET_GO, {**self._id, "epoch": self.epoch})
                except TRANSIENT as exc:
                    logger.warning("marking %s as let go: %s", _of_store(self.url, self._named), cause(exc))
            self._release()

    def _release(self) -> None:
        conn, engine = self._conn, self._engine
        self._conn = self._engine = None
        if conn is not None:
            try:
                conn.close()
            except TRANSIENT as exc:  # the session is gone already, and the lock with it
                logger.warning("closing the store lock's session: %s", cause(exc))
        if engine is not None:
            engine.dispose()

    def __enter__(self) -> StoreLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
