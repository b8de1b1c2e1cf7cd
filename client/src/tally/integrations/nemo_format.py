"""NeMo Curator 1.4.0's completion-file format: the one implementation in Tally (DESIGN §3).

A completion file is an LMDB environment in one file (``subdir=False``) with one named database
``b"completed_sources"``: key = source id (UTF-8), value ``b"1"``. The coordinator's store
(``tally_server.store.lmdb_files``) and the operator commands (``tally inspect``, ``import``,
``export``) all go through these functions, so open flags, the database name, the damage checks
and map growth exist once. It lives in the SDK because those commands ship with it
(``tally-client[cli]``, which brings ``lmdb``) and the SDK never imports the server; the server
depends on the SDK anyway. ``import tally`` does not import this module.

Two rules go beyond what NeMo Curator itself does, because Tally serves many runs from one
process and must neither lose nor invent completions:

- Only a *missing* ``completed_sources`` database means "nothing completed". Any other error
  (``MDB_CORRUPTED``, ``MDB_INVALID``, ``MDB_PAGE_NOTFOUND``, a truncated file, ...) makes the
  file unreadable; NeMo's loader counts such a file as empty.
- A completion file is a regular file, never a symbolic link: links are neither followed nor
  written through, so nothing outside the folder is read or created.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping
from itertools import repeat
from pathlib import Path
from typing import Any

import lmdb

from tally.integrations import lmdb_pages

METADATA_DIRNAME = ".nemo_curator_metadata"
COMPLETED_DB = b"completed_sources"
COMPLETED_VALUE = b"1"
FILE_SUFFIX = ".mdb"
# NeMo Curator's map size; readers size their map from the file, so a grown map stays readable.
NEMO_MAP_SIZE = 1 << 30
# LMDB's compiled-in key limit (mdb_env_get_maxkeysize); a longer source id cannot be stored.
MAX_KEY_BYTES = 511
# A full map is grown by doubling; this bounds a runaway (1 GiB doubled 8 times is 256 GiB).
MAX_MAP_GROWTHS = 8
# Marks a file being built by create_file. It does not end in FILE_SUFFIX, so no loader (Tally's
# or NeMo Curator's ``*.mdb`` glob) ever reads a half-built file.
TEMP_MARKER = ".tmp-"
_WRITE_BATCH = 10_000


class DamagedFileError(Exception):
    """The file cannot be a completion file: a link or other non-regular file, empty or truncated."""


# The file's content is damaged or is not a NeMo completion file. Errors of the disk or of the
# process (ENOSPC, EIO, EACCES, ENOMEM, MDB_PANIC) are not here: they say nothing about the file.
DAMAGE_ERRORS: tuple[type[BaseException], ...] = (
    DamagedFileError,
    lmdb.CorruptedError,
    lmdb.InvalidError,
    lmdb.PageNotFoundError,
    lmdb.VersionMismatchError,
    lmdb.IncompatibleError,
    lmdb.BadTxnError,  # what a cursor reports after walking into a garbled page
    UnicodeDecodeError,  # a key that is not UTF-8: not a source id NeMo Curator wrote
)
# Anything that means "this file cannot be read now": damage, or the disk/OS refusing.
READ_ERRORS: tuple[type[BaseException], ...] = (*DAMAGE_ERRORS, lmdb.Error, OSError)

_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_DISK_FULL_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))
# Below this much free space, an I/O error of an LMDB commit is taken for a full disk (see below).
_NEARLY_FULL_BYTES = 1 << 20


def is_disk_full(exc: BaseException, folder: Path | None = None) -> bool:
    """Whether ``exc``, or any exception it was raised from, says the disk or quota is full.

    LMDB reports a short write, which is what a full disk gives it in the middle of a commit, as
    EIO ("Input/output error"); with ``folder`` given, such an error counts as a full disk when
    the filesystem holding ``folder`` has (almost) no space left.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_FULL_ERRNOS:
            return True
        if isinstance(current, lmdb.Error):
            code = getattr(current, "code", None)
            if code in _DISK_FULL_ERRNOS or any(text in str(current) for text in _DISK_FULL_TEXTS):
                return True
            if folder is not None and code == errno.EIO and _free_bytes(folder) < _NEARLY_FULL_BYTES:
                return True
        current = current.__cause__ or current.__context__
    return False


def _free_bytes(folder: Path) -> int:
    for candidate in (folder, *folder.parents):
        try:
            st = os.statvfs(candidate)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return _NEARLY_FULL_BYTES  # unknown: do not guess "full"


def encode_key(source_id: str) -> bytes:
    """The LMDB key of a source id.

    Raises:
        ValueError: the id is empty or over LMDB's key limit.
    """
    key = source_id.encode()
    if not key or len(key) > MAX_KEY_BYTES:
        raise ValueError(
            f"source id {source_id[:80]!r} is {len(key)} bytes; LMDB keys must be 1 to {MAX_KEY_BYTES} bytes"
        )
    return key


def check_regular(path: Path) -> os.stat_result:
    """``lstat`` of ``path``, refusing anything but a regular file (a link is never followed).

    Raises:
        DamagedFileError: a symbolic link, directory, FIFO, device or socket.
        FileNotFoundError: nothing at ``path``.
    """
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        if stat.S_ISLNK(st.st_mode):
            kind = f"a symbolic link (to {os.readlink(path)})"
        elif stat.S_ISDIR(st.st_mode):
            kind = "a directory"
        else:
            kind = "not a regular file"
        raise DamagedFileError(f"{path}: is {kind}; completion files must be regular files, never followed")
    return st


def _open_for_writing(path: Path, map_size: int) -> Any:
    """Open ``path`` for writing with NeMo Curator's flags (no lock table, synced commits)."""
    return lmdb.open(
        str(path),
        subdir=False,
        lock=False,
        max_dbs=1,
        map_size=map_size,
        metasync=False,
        sync=True,
        readahead=False,
    )


def open_env(path: Path, *, write: bool, map_size: int = NEMO_MAP_SIZE, readahead: bool = True) -> Any:
    """Open an existing completion file with NeMo Curator's flags, after checking it is whole.

    LMDB's inter-process lock table is off, as in NeMo Curator: one process owns each file.
    Returns an ``lmdb.Environment`` (lmdb ships no usable type for it).

    Raises:
        DamagedFileError: not a regular file, empty, truncated, or swapped while being opened.
        lmdb.Error, OSError: LMDB or the disk refused.
    """
    before = check_regular(path)
    if before.st_size == 0:
        # LMDB would silently turn an empty file into a new environment when opened for writing.
        raise DamagedFileError(f"{path}: empty file (0 bytes), not an LMDB file")
    if write:
        env = _open_for_writing(path, map_size)
    else:
        # readahead=False for handles kept open for lookups: each reads a few pages, no more.
        env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, max_dbs=1, readahead=readahead)
    try:
        after = os.lstat(path)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise DamagedFileError(f"{path}: replaced while being opened")
        check_whole(env, path)
    except BaseException:
        env.close()
        raise
    return env


def check_whole(env: Any, path: Path) -> None:
    """Refuse a file shorter than the pages its meta page claims.

    LMDB maps the file and trusts its header; reading a page past the end of a truncated file
    raises SIGBUS, which would kill the whole process (NeMo Curator's own loader dies so).
    """
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = os.stat(path).st_size
    if size < needed:
        raise DamagedFileError(f"{path}: truncated: {size} bytes, but its LMDB header needs {needed}")


def open_completed_db(path: Path, env: Any, *, create: bool = False) -> Any | None:
    """The ``completed_sources`` database handle; None only when the database does not exist.

    The main database's root page is checked first: LMDB's search for the database record trusts
    that page's type and can abort the whole process on a damaged one (``lmdb_pages.main_root``).
    Every other error propagates: a damaged main database must never read as "no completions".

    Raises:
        DamagedFileError: the main database's root page is damaged.
        lmdb.Error: LMDB refused (a damaged page it detects itself, ...).
    """
    info, main = env.info(), env.stat()
    verdict = lmdb_pages.main_root(path, info["last_txnid"], info["last_pgno"], main["depth"])
    if verdict.kind == "damaged":
        raise DamagedFileError(f"{path}: damaged LMDB main database: {verdict.why}")
    try:
        return env.open_db(COMPLETED_DB, create=create)
    except lmdb.NotFoundError:
        return None


def _ignore(keys: lmdb_pages.Keys) -> None:
    """A batch of keys read only to check the pages."""


def check_pages(
    path: Path,
    txn: Any,
    db: Any,
    env: Any,
    each: Callable[[lmdb_pages.Keys], None] = _ignore,
    pack: lmdb_pages.Packer | None = None,
) -> bool:
    """Check the tree of ``db`` in ``txn`` from the file's pages, giving ``each`` its keys.

    ``pack``: what packs the keys as rows of words (``lmdb_pages.pack_words`` unless another is given).

    Returns True when every key was read from the pages (given to ``each``), False when this reader
    cannot vouch for them (another layout, keys that are not ASCII): a cursor walk must read them,
    and may. A file of any size is checked (one over ``lmdb_pages.MAX_FILE_BYTES`` is mapped, not read).

    Raises:
        DamagedFileError: the tree of the transaction's snapshot is broken (a page of the wrong
            type, ...): a cursor walk could abort the process (LMDB asserts), so nothing may walk it.
    """
    if not lmdb_pages.SUPPORTED:
        return False
    tree = lmdb_pages.TreeStat.of(txn, db, env)
    data, spare = lmdb_pages.file_pages(path)
    verdict = lmdb_pages.keys(data, COMPLETED_DB, tree, each, spare, pack)
    if verdict.kind == "damaged":
        raise DamagedFileError(f"{path}: damaged LMDB tree in {COMPLETED_DB.decode()}: {verdict.why}")
    return verdict.kind == "whole"


def read_ids(env: Any, db: Any) -> set[str]:
    """Every source id in the database (a full cursor walk: check its pages first, ``check_pages``)."""
    with env.begin(db=db) as txn, txn.cursor(db=db) as cursor:
        return {key.decode() for key in cursor.iternext(keys=True, values=False)}


def read_file(path: Path) -> set[str]:
    """Completed ids of one file, read as NeMo Curator 1.4.0 reads it, but strictly.

    Its pages are checked before LMDB walks them (``open_completed_db``, ``check_pages``): a
    damaged file raises here instead of aborting the process.

    Raises:
        DamagedFileError, lmdb.Error, OSError, UnicodeDecodeError (see ``READ_ERRORS``): the file
            cannot be read; its contents must not be counted.
    """
    env = open_env(path, write=False)
    try:
        db = open_completed_db(path, env)
        if db is None:
            return set()
        with env.begin(db=db) as txn:
            check_pages(path, txn, db, env)
            with txn.cursor(db=db) as cursor:
                return {key.decode() for key in cursor.iternext(keys=True, values=False)}
    finally:
        env.close()


def apply_changes(env: Any, db: Any, changes: Mapping[bytes, bool]) -> bool:
    """One write transaction: put (True) or delete (False) each key; durable when this returns.

    Returns whether anything changed. A full map is doubled and the transaction retried.
    """
    for _ in range(MAX_MAP_GROWTHS + 1):
        changed = False
        try:
            with env.begin(write=True) as txn:
                puts: list[bytes] = []  # a run of puts, written in one C loop (the same puts in order)
                for key, present in changes.items():
                    if present:
                        puts.append(key)
                        continue
                    if puts:
                        changed = _put_all(txn, db, puts) or changed
                        puts = []
                    changed = txn.delete(key, db=db) or changed
                if puts:
                    changed = _put_all(txn, db, puts) or changed
        except lmdb.MapFullError:
            # The aborted transaction left the file untouched; a bigger map keeps it readable
            # by NeMo Curator, whose readers size their map from the file.
            env.set_mapsize(env.info()["map_size"] * 2)
            continue
        if changed:
            # NeMo Curator's flags (metasync=False) fsync the data pages at commit but not the
            # meta page, so a power loss could undo the last transaction. Tally promises
            # durability (a lost un-complete would resurrect a completion), hence the meta sync.
            env.sync(True)
        return changed
    raise lmdb.MapFullError(f"map still full after {MAX_MAP_GROWTHS} doublings")


def _put_all(txn: Any, db: Any, keys: list[bytes]) -> bool:
    """``txn.put(key, COMPLETED_VALUE, db=db)`` for each key in order, in one call (the same tree)."""
    with txn.cursor(db=db) as cursor:
        cursor.putmulti(zip(keys, repeat(COMPLETED_VALUE)), overwrite=True)
    return bool(keys)


def temp_name(path: Path, tag: str | None = None) -> Path:
    """Where ``create_file`` builds ``path``: ``.<name>.tmp-<tag>`` (a random tag by default).

    A name that would not fit in a file name (255 bytes: a writer id near its limit) is replaced
    by a digest of it, the same for the same name.
    """
    tail = f"{TEMP_MARKER}{tag or secrets.token_hex(4)}"
    name = f".{path.name}{tail}"
    if len(name.encode()) > 255:
        name = f".{hashlib.sha256(path.name.encode()).hexdigest()[:32]}{tail}"
    return path.with_name(name)


def create_file(
    path: Path,
    ids: Iterable[str] = (),
    *,
    map_size: int = NEMO_MAP_SIZE,
    replace: bool = False,
    temp: Path | None = None,
) -> int:
    """Create the completion file ``path`` holding ``ids``, atomically.

    The file is built under a temporary name in the same folder (``temp``, by default
    ``temp_name(path)``), synced, then renamed into place and the folder synced: ``path`` either
    does not exist or is a whole file, whatever fails (a full disk, a crash). The temporary file is
    removed on failure. The rename replaces a link at ``path`` itself, never its target.

    Returns how many ids were written.

    Raises:
        FileExistsError: something is at ``path`` and ``replace`` is false, or at ``temp``.
        ValueError: an id LMDB cannot store.
        lmdb.Error, OSError: the disk refused (nothing is left behind).
    """
    if not replace and os.path.lexists(path):
        raise FileExistsError(errno.EEXIST, "refusing to replace an existing file", str(path))
    temp = temp_name(path) if temp is None else temp
    # O_EXCL|O_NOFOLLOW: never open something another process (or a link) put at this name.
    os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
    count = 0
    try:
        env = _open_for_writing(temp, map_size)
        try:
            db = env.open_db(COMPLETED_DB)  # as NeMo Curator's actor does on open: its first transaction
            batch: dict[bytes, bool] = {}
            for sid in ids:
                batch[encode_key(sid)] = True
                if len(batch) >= _WRITE_BATCH:
                    apply_changes(env, db, batch)
                    count += len(batch)
                    batch = {}
            if batch:
                apply_changes(env, db, batch)
                count += len(batch)
            env.sync(True)
        finally:
            env.close()
        if not replace and os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "refusing to replace an existing file", str(path))
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        raise
    fsync_dir(path.parent)
    return count


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (a create, rename or removal) survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe_error(exc: BaseException, path: Path | None = None) -> str:
    """``Type: message``, without the path prefix LMDB puts on its messages when ``path`` is given."""
    text = f"{type(exc).__name__}: {exc}"
    return text.replace(f"{path}: ", "") if path is not None else text
