"""Where the keys of a completion file's ``completed_sources`` tree lie, read from its pages in numpy.

A load needs every key of a file only to hash it. A cursor makes one Python ``bytes`` per key
(about 150 ns each, the GIL taken and released around every step); walking the B-tree's pages
level by level with array operations finds all of them in a few milliseconds per 100,000 keys.

Only what the caller's open LMDB read transaction says is trusted: the pages are those of the
meta page whose transaction id is the transaction's, and the database record must be the one LMDB
reports (depth, branch, leaf and overflow page and entry counts). A file that fails that, or that
this reader does not handle (duplicate-sorted or integer-keyed databases, values on overflow
pages, keys that are not ASCII), is "unsupported": the caller walks it with a cursor as before.

Past that point the pages are the transaction's snapshot, so what they hold is what LMDB would
walk. Every page reached must lie inside the file and below the last page LMDB knows, have the
type its level needs (branch above, leaf at the bottom), hold at least one node, every node
inside the page, and the pages and entries found must add up to LMDB's counts; anything else is
"damaged", and the file must not be walked: LMDB 0.9's cursor trusts a sibling page's type and
aborts the whole process on a leaf that is not one (``mdb.c``: ``Assertion 'IS_LEAF(mp)'``). A page
not carrying its own number, or with flags besides its type, is checked through but its keys are
left to a cursor walk (LMDB ignores the number, and reports a P_DIRTY page as MDB_CORRUPTED).

The layout is LMDB 0.9's on a 64-bit little-endian host (``mdb.c``; ``tests/lmdb_damage.py``
parses the same fields to damage files on purpose).
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
_U64 = np.uint64

PAGE_HEADER = 16  # mp_pgno u64, mp_pad u16, mp_flags u16, mp_lower u16, mp_upper u16
NODE_HEADER = 8  # mn_lo u16, mn_hi u16, mn_flags u16, mn_ksize u16, then the key
P_BRANCH = 0x01
P_LEAF = 0x02
# The bits of mp_flags that say what a page is (branch, leaf, overflow, meta, LEAF2). The others
# (P_DIRTY, P_LOOSE, P_KEEP, P_SUBP) never reach the disk on a tree page; LMDB ignores them.
TYPE_BITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20
F_BIGDATA = 0x01
META_MAGIC = 0xBEEFC0DE
META_VERSION = 1
# MDB_meta after the page header: magic u32, version u32, address u64, mapsize u64, two MDB_db
# records (free, main), last_pg u64, txnid u64.
DB_RECORD = struct.Struct("<IHHQQQQQ")  # md_pad, md_flags, md_depth, branch, leaf, overflow, entries, root
META_HEAD = struct.Struct("<IIQQ")
P_INVALID = (1 << 64) - 1
F_SUBDATA = 0x02
SUPPORTED = sys.byteorder == "little" and struct.calcsize("P") == 8
# Leaf pages unpacked at once (about 700,000 keys of 12 bytes at 4 KiB pages).
LEAF_BATCH = 4096
# Zero bytes after a file's content in memory: whole words are read past the last key.
SPARE = 16
# Larger files are mapped rather than read (:func:`file_pages`): their pages stay file-backed (the
# kernel can take them back) instead of one copy in the heap. About 10 M keys of 12 bytes.
MAX_FILE_BYTES = 1 << 28


@dataclass(frozen=True)
class TreeStat:
    """What LMDB itself says of the database in the reading transaction (``txn.stat(db)``)."""

    txnid: int
    last_pgno: int
    depth: int
    branch_pages: int
    leaf_pages: int
    overflow_pages: int
    entries: int

    @classmethod
    def of(cls, txn: Any, db: Any, env: Any) -> TreeStat:
        """What LMDB says of ``db`` in the read transaction ``txn`` of ``env`` (py-lmdb objects)."""
        stat = txn.stat(db)
        return cls(
            txnid=txn.id(),
            last_pgno=env.info()["last_pgno"],
            depth=stat["depth"],
            branch_pages=stat["branch_pages"],
            leaf_pages=stat["leaf_pages"],
            overflow_pages=stat["overflow_pages"],
            entries=stat["entries"],
        )


@dataclass(frozen=True)
class Verdict:
    """What :func:`keys` made of a file.

    ``whole``: every key was given. ``unsupported``: this reader cannot vouch for the keys (not
    ASCII, another layout, a meta page no longer the transaction's); walk the file with a cursor.
    ``damaged``: the tree of the transaction's own meta page is broken (a page of the wrong type,
    a node outside its page, counts that disagree with LMDB's): never walk it, the file is
    unreadable. ``why`` says what was found.
    """

    kind: Literal["whole", "unsupported", "damaged"]
    why: str = ""


WHOLE = Verdict("whole")


@dataclass
class Keys:
    """The keys of a database, each a row of little-endian words (:func:`pack_words`)."""

    words: npt.NDArray[np.uint64]
    lengths: I64


def read_file(path: Path) -> npt.NDArray[np.uint8]:
    """The whole file in memory, followed by 16 zero bytes (whole-word reads of the last key)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        size = os.fstat(fd).st_size
        data = np.zeros(size + SPARE, dtype=np.uint8)
        view = data.data[:size]
        got = 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
    finally:
        os.close(fd)
    return data[: got + SPARE] if got < size else data


def file_pages(path: Path) -> tuple[npt.NDArray[np.uint8], int]:
    """The file's bytes for :func:`keys`, and how many spare zero bytes follow them.

    A file up to :data:`MAX_FILE_BYTES` is read into memory (:func:`read_file`, :data:`SPARE`
    bytes after it); a larger one is mapped read-only (no spare bytes: :func:`keys` then copies
    each batch of leaf pages, with spare bytes, before it reads their keys).
    """
    if os.stat(path).st_size <= MAX_FILE_BYTES:
        return read_file(path), SPARE
    return np.memmap(path, dtype=np.uint8, mode="r"), 0


def words_at(data: npt.NDArray[np.uint8], offsets: npt.NDArray[np.int64], width: int) -> U64:
    """The ``width`` little-endian words from each offset on, as rows (``data`` ends in 16 spare bytes).

    Two aligned reads and two shifts per word: numpy reads unaligned words about twice as slowly.
    """
    aligned = data[: len(data) // 8 * 8].view("<u8")
    q = offsets >> 3
    right = ((offsets & 7) << 3).astype(np.uint64)
    left = _U64(64) - right  # a shift by 64 gives 0 here, which is what an aligned offset needs
    out = np.empty((len(offsets), width), dtype=np.uint64)
    low = aligned.take(q)
    for j in range(width):
        high = aligned.take(q + (j + 1))
        column = out[:, j]
        np.right_shift(low, right, out=column)
        high_part = np.left_shift(high, left)
        column |= high_part
        low = high
    return out


def pack_words(
    data: npt.NDArray[np.uint8], offsets: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
) -> U64:
    """The keys ``data[o : o + n]`` as rows of little-endian words, zero past each key's end.

    ``data`` must end in at least 16 spare bytes (whole words are read, then masked). A row has
    ``max(lengths) // 8 + 1`` words: every key's last, partial (possibly empty) word is inside it.
    """
    n = len(offsets)
    width = int(lengths.max(initial=0)) // 8 + 1
    if n and int(lengths.min()) == int(lengths.max()):  # one length: scalar masks
        out = words_at(data, offsets, width)
        out[:, width - 1] &= _U64((1 << 8 * (int(lengths[0]) % 8)) - 1)
        return out
    out = np.empty((n, width), dtype=np.uint64)
    words = np.ndarray(shape=(len(data) - 7,), dtype="<u8", buffer=data, strides=(1,))
    limit = len(data) - 16
    for j in range(width):
        keep = np.clip(lengths - 8 * j, 0, 8).astype(np.uint64)  # bytes of each key in word j
        mask = np.left_shift(_U64(1), keep << _U64(3)) - _U64(1)  # 1 << 64 is 0 here: all ones
        out[:, j] = words[np.minimum(offsets + 8 * j, limit)] & mask
    return out


Packer = Callable[[npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.int64]], U64]
"""The contract of :func:`pack_words` (another implementation of it may be given to :func:`keys`)."""


class _Pages:
    def __init__(self, data: npt.NDArray[np.uint8], psize: int, last_pgno: int, spare: int) -> None:
        self.data = data
        self.spare = spare
        self.size = len(data) - spare
        # A word at every byte offset: one word each is read faster so than by two aligned reads.
        self.words = np.ndarray(shape=(len(data) - 7,), dtype="<u8", buffer=data, strides=(1,))
        self.psize = psize
        self.last_pgno = last_pgno
        self.by_page = data[: self.size - self.size % psize].view("<u2").reshape(-1, psize // 2)


def _meta(data: npt.NDArray[np.uint8], psize: int, txnid: int, size: int) -> tuple[int, int, int] | None:
    """(main database root, main depth, last page) of the meta page of transaction ``txnid``."""
    raw = data.data
    for page in (0, 1):
        base = page * psize + PAGE_HEADER
        if base + META_HEAD.size + 2 * DB_RECORD.size + 16 > size:
            return None
        magic, version, _, _ = META_HEAD.unpack_from(raw, base)
        main = DB_RECORD.unpack_from(raw, base + META_HEAD.size + DB_RECORD.size)
        last_pg, meta_txnid = struct.unpack_from("<QQ", raw, base + META_HEAD.size + 2 * DB_RECORD.size)
        if magic == META_MAGIC and version == META_VERSION and meta_txnid == txnid:
            return main[7], main[2], last_pg
    return None


class _Check:
    """What the walk found so far: damage (final) or something only a cursor walk reads."""

    def __init__(self) -> None:
        self.damage = ""
        self.unsupported = ""

    def damaged(self, why: str) -> None:
        self.damage = self.damage or why

    def cannot_read(self, why: str) -> None:
        self.unsupported = self.unsupported or why

    def verdict(self) -> Verdict:
        if self.damage:
            return Verdict("damaged", self.damage)
        if self.unsupported:
            return Verdict("unsupported", self.unsupported)
        return WHOLE


def _level(
    pages: _Pages, pgnos: I64, flag: int, what: str, check: _Check
) -> tuple[I64, I64, npt.NDArray[np.uint64]] | None:
    """The nodes of these pages, in order: (offsets in the file, offsets in their page, headers).

    None (with ``check.damage`` set) if a page cannot be followed: outside the tree, not of the
    type its place needs, or with a node outside it. A page that does not carry its own number,
    or carries flags besides its type, is followed, but its keys are left to a cursor walk (see
    the module's docstring). A node header is one little-endian word: ``mn_lo | mn_hi << 16 | mn_flags << 32 |
    mn_ksize << 48``.
    """
    psize = pages.psize
    if len(pgnos) == 0:
        check.damaged(f"no {what} pages")
        return None
    low, high = int(pgnos.min()), int(pgnos.max())
    if low < 2 or high > pages.last_pgno:
        bad = low if low < 2 else high
        check.damaged(f"{what} page {bad} outside the file's pages 2..{pages.last_pgno}")
        return None
    if (high + 1) * psize > pages.size:
        # LMDB's header said the file was long enough when it was opened: it changed since.
        check.cannot_read(f"file shorter than its page {high}")
        return None
    rows = pages.by_page[pgnos]  # a copy of the pages, one row of 16-bit words each
    if not np.array_equal(rows.view(np.uint64)[:, 0], pgnos.astype(np.uint64)):
        check.cannot_read(f"a {what} page does not carry its own number")
    flags, lower, upper = rows[:, 5], rows[:, 6].astype(np.int64), rows[:, 7].astype(np.int64)
    wrong = (flags & TYPE_BITS) != flag
    if wrong.any():
        at = int(np.argmax(wrong))
        check.damaged(f"{what} page {int(pgnos[at])} has type flags 0x{int(flags[at]):04x}, not 0x{flag:04x}")
        return None
    if (flags != flag).any():
        check.cannot_read(f"a {what} page has flags besides its type")
    misshaped = (lower < PAGE_HEADER + 2) | ((lower & 1) != 0) | (lower > upper) | (upper > psize)
    if misshaped.any():
        at = int(np.argmax(misshaped))
        check.damaged(
            f"{what} page {int(pgnos[at])} has no nodes or a bad layout "
            f"(lower {int(lower[at])}, upper {int(upper[at])})"
        )
        return None
    counts = (lower - PAGE_HEADER) >> 1
    slots = np.arange(int(counts.max()), dtype=np.int64)
    ptrs = rows[:, PAGE_HEADER // 2 : PAGE_HEADER // 2 + len(slots)]
    used = slots < counts[:, None]
    bad = (ptrs < upper[:, None]) | (ptrs > psize - NODE_HEADER) | ((ptrs & 1) != 0)
    if (bad & used).any():
        at = int(np.argmax((bad & used).any(axis=1)))
        check.damaged(f"{what} page {int(pgnos[at])} has a node outside its page")
        return None
    ptr = ptrs[used].astype(np.int64)
    node = (pgnos * psize)[:, None] + ptrs
    node = node[used]
    return node, ptr, pages.words[node]


def main_root(path: Path, txnid: int, last_pgno: int, depth: int) -> Verdict:
    """Whether the root page of the main database (which holds the database records) is sound.

    Checked before LMDB opens a named database: its search trusts the root's type too (a root of
    one node marked as a branch fails an assertion, ``NUMKEYS(mp) > 1``, and aborts the process).
    ``txnid``, ``last_pgno`` and ``depth`` are what LMDB says of the environment and its main
    database; only a main database of one page is checked (a NeMo completion file's).
    """
    if not SUPPORTED:
        return Verdict("unsupported", "not an LMDB layout this reader knows")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        first = os.pread(fd, PAGE_HEADER + META_HEAD.size + 4, 0)
        if len(first) < PAGE_HEADER + META_HEAD.size + 4:
            return Verdict("unsupported", "shorter than a meta page")
        psize = struct.unpack_from("<I", first, PAGE_HEADER + META_HEAD.size)[0]
        if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
            return Verdict("unsupported", f"page size {psize}")
        metas = np.frombuffer(os.pread(fd, 2 * psize, 0) + bytes(SPARE), dtype=np.uint8)
        meta = _meta(metas, psize, txnid, len(metas) - SPARE)
        if meta is None or meta[2] != last_pgno or meta[1] != depth:
            return Verdict("unsupported", "no meta page of the environment's transaction")
        root, _, _ = meta
        if root == P_INVALID or depth != 1:
            return Verdict("unsupported", "no main database of one page")
        if root < 2 or root > last_pgno:
            return Verdict(
                "damaged", f"main database root page {root} outside the file's pages 2..{last_pgno}"
            )
        page = os.pread(fd, psize, root * psize)
    finally:
        os.close(fd)
    if len(page) < psize:
        return Verdict("unsupported", f"file shorter than its page {root}")
    flags, lower, upper = struct.unpack_from("<HHH", page, 10)
    if flags & P_BRANCH:  # LMDB would search it as a branch
        why = f"main database page {root} has type flags 0x{flags:04x}, not 0x{P_LEAF:04x}"
        return Verdict("damaged", why)
    if not flags & P_LEAF:  # neither: LMDB's search stops there and reports MDB_CORRUPTED itself
        return Verdict("unsupported", f"main database page {root} is not a leaf")
    if lower < PAGE_HEADER + 2 or lower & 1 or lower > upper or upper > psize:
        return Verdict("damaged", f"main database page {root} has no nodes or a bad layout")
    for at in range(PAGE_HEADER, lower, 2):
        (ptr,) = struct.unpack_from("<H", page, at)
        if ptr < upper or ptr > psize - NODE_HEADER or ptr & 1:
            return Verdict("damaged", f"main database page {root} has a node outside its page")
        ksize = struct.unpack_from("<H", page, ptr + 6)[0]
        if ptr + NODE_HEADER + ksize > psize:
            return Verdict("damaged", f"main database page {root} has a key past its page")
    return WHOLE


def keys(
    data: npt.NDArray[np.uint8],
    name: bytes,
    stat: TreeStat,
    each: Callable[[Keys], None],
    spare: int = SPARE,
    pack: Packer | None = None,
) -> Verdict:
    """Give ``each`` the keys of database ``name`` in ``data`` (from :func:`file_pages`), a batch at a time.

    ``spare``: how many zero bytes follow the file's bytes in ``data`` (:func:`file_pages` says).
    ``pack``: what packs the keys as rows of words (:func:`pack_words` unless another is given).

    The verdict: ``whole`` (every key given), ``unsupported`` (the batches given so far must be
    dropped and the file walked with a cursor) or ``damaged`` (the tree of LMDB's own read
    transaction is broken: never walk it). Leaf pages are read :data:`LEAF_BATCH` at a time, so
    a big file never has all its keys unpacked at once. Once the meta page is the transaction's,
    every page of the tree is checked even when a cursor walk will read the keys, because a
    cursor walk trusts a page's type and LMDB aborts the process on one it did not expect.
    """
    if not SUPPORTED or len(data) < spare + 2 * 512:
        return Verdict("unsupported", "not an LMDB layout this reader knows")
    raw = data.data
    psize = struct.unpack_from("<I", raw, PAGE_HEADER + META_HEAD.size)[0]  # the free DB's md_pad
    if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
        return Verdict("unsupported", f"page size {psize}")
    meta = _meta(data, psize, stat.txnid, len(data) - spare)
    if meta is None or meta[2] != stat.last_pgno:
        # Meta pages alternate with every write: this file is no longer the transaction's snapshot.
        return Verdict("unsupported", "no meta page of the reading transaction")
    main_root, main_depth, last_pgno = meta
    pages = _Pages(data, psize, last_pgno, spare)
    if main_depth != 1:  # a main database of more than one page: not a NeMo completion file
        return Verdict("unsupported", "a main database of more than one page")
    check = _Check()
    found = _level(pages, np.array([main_root], dtype=np.int64), P_LEAF, "main database", check)
    if found is None:
        return check.verdict()
    node, in_page, header = found
    record: tuple[int, ...] | None = None
    for i in range(len(node)):
        start = int(node[i]) + NODE_HEADER
        head = int(header[i])
        if head >> 48 == len(name) and bytes(data[start : start + len(name)]) == name:
            if (head >> 32) & 0xFFFF != F_SUBDATA or head & 0xFFFFFFFF != DB_RECORD.size:
                return Verdict("unsupported", "the database record is not one LMDB opens")
            if int(in_page[i]) + NODE_HEADER + len(name) + DB_RECORD.size > psize:
                return Verdict("unsupported", "the database record is not one LMDB opens")
            record = DB_RECORD.unpack_from(raw, start + len(name))
    if record is None:
        return Verdict("unsupported", "no database record")
    _, md_flags, depth, branch, leaf, overflow, entries, root = record
    if md_flags != 0 or overflow != 0 or stat.overflow_pages != 0:
        return Verdict("unsupported", "a database with flags or overflow pages")
    if (depth, branch, leaf, entries) != (stat.depth, stat.branch_pages, stat.leaf_pages, stat.entries):
        return Verdict("unsupported", "the database record is not the transaction's")
    if root == P_INVALID:
        if entries == depth == leaf == branch == 0:
            return WHOLE
        return Verdict("damaged", f"no root page, but LMDB counts {entries} entries")
    if depth == 0:
        return Verdict("damaged", f"root page {root} in a tree of depth 0")
    level = np.array([root], dtype=np.int64)
    for height in range(depth - 1):
        found = _level(pages, level, P_BRANCH, f"branch (level {height + 1} of {depth})", check)
        if found is None:
            return check.verdict()
        node, in_page, header = found
        if (in_page + NODE_HEADER + (header >> np.uint64(48)).astype(np.int64) > psize).any():
            return Verdict("damaged", "a branch node's key runs past its page")
        branch -= len(level)
        # A branch node's child: mn_lo | mn_hi << 16 | mn_flags << 32.
        level = (header & np.uint64(0xFFFFFFFFFFFF)).astype(np.int64)
    if len(level) != leaf or branch != 0:
        return Verdict(
            "damaged",
            f"{len(level)} leaf pages and {stat.branch_pages - branch} branch pages in the tree, "
            f"LMDB counts {leaf} and {stat.branch_pages}",
        )
    for at in range(0, len(level), LEAF_BATCH):
        batch = _leaves(pages, data, level[at : at + LEAF_BATCH], check, pack or pack_words)
        if batch is None:
            if check.damage:
                return check.verdict()
            continue
        entries -= len(batch.lengths)
        if not check.unsupported:
            each(batch)
    if entries != 0 and not check.damage:
        return Verdict(
            "damaged", f"{stat.entries - entries} entries in the leaf pages, LMDB counts {stat.entries}"
        )
    return check.verdict()


def _leaves(
    pages: _Pages, data: npt.NDArray[np.uint8], pgnos: I64, check: _Check, pack: Packer
) -> Keys | None:
    """The keys on these leaf pages; None if one of them is damaged (``check`` says how).

    Keys a cursor walk must read (not ASCII, empty, nodes with flags) are given all the same, with
    ``check.unsupported`` set: their count still has to add up.
    """
    found = _level(pages, pgnos, P_LEAF, "leaf", check)
    if found is None:
        return None
    node, in_page, header = found
    klen = (header >> np.uint64(48)).astype(np.int64)
    dsize = (header & np.uint64(0xFFFFFFFF)).astype(np.int64)
    # Leaf nodes: flags 0 (the value in the page), a key of 1 byte or more.
    node_flags = (header >> np.uint64(32)) & np.uint64(0xFFFF)
    if node_flags.any():
        check.cannot_read("a leaf node with flags")
        # A value on overflow pages keeps only its page number in the leaf.
        dsize = np.where((node_flags & np.uint64(F_BIGDATA)) != 0, 8, dsize)
    if not klen.all():
        check.cannot_read("an empty key")
    if (in_page + NODE_HEADER + klen + dsize > pages.psize).any():
        check.damaged("a leaf node's key or value runs past its page")
        return None
    if pages.spare >= SPARE:
        words = pack(data, node + NODE_HEADER, klen)
    else:  # a mapped file: its last key may end at its last byte; copy the pages, with spare bytes
        psize = pages.psize
        order = np.argsort(pgnos, kind="stable")
        at = order[np.searchsorted(pgnos[order], node // psize)]
        copy = np.zeros(len(pgnos) * psize + SPARE, dtype=np.uint8)
        copy[: len(pgnos) * psize] = pages.by_page[pgnos].view(np.uint8).reshape(-1)
        words = pack(copy, at * psize + in_page + NODE_HEADER, klen)
    if np.bitwise_or.reduce(words, axis=None) & np.uint64(0x8080808080808080):
        check.cannot_read("keys that are not ASCII")  # a cursor walk checks that they are UTF-8
    return Keys(words, klen)
