"""Where the keys of a completion file's ``completed_sources`` tree lie, read from its pages in numpy.

A load needs every key of a file only to hash it. A cursor makes one Python ``bytes`` per key
(about 150 ns each, the GIL taken and released around every step); walking the B-tree's pages
level by level with array operations finds all of them in a few milliseconds per 100,000 keys.

Only what the caller's open LMDB read transaction says is trusted: the pages are those of the
meta page whose transaction id is the transaction's, and the tree must have exactly the depth and
the branch, leaf and overflow page and entry counts that LMDB reports for the database. Every page
reached must lie inside the file and below the last page LMDB knows, carry its own number and the
flags its level needs (branch above, leaf at the bottom), and every node must lie inside its page.
Anything else, or anything this reader does not handle (duplicate-sorted or integer-keyed
databases, values on overflow pages, keys that are not ASCII), gives None: the caller then walks
the file with a cursor as before, so a damaged file fails exactly as LMDB reports it.

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

import numpy as np
import numpy.typing as npt

from tally_server.domain import bytes_hash

I64 = npt.NDArray[np.int64]

PAGE_HEADER = 16  # mp_pgno u64, mp_pad u16, mp_flags u16, mp_lower u16, mp_upper u16
NODE_HEADER = 8  # mn_lo u16, mn_hi u16, mn_flags u16, mn_ksize u16, then the key
P_BRANCH = 0x01
P_LEAF = 0x02
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
# Larger files are walked with a cursor: their pages stay file-backed (the kernel can take them
# back) instead of one copy in the heap. About 10 M keys of 12 bytes.
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


@dataclass
class Keys:
    """The keys of a database, each a row of little-endian words (``bytes_hash.pack_words``)."""

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


class _Pages:
    def __init__(self, data: npt.NDArray[np.uint8], psize: int, last_pgno: int) -> None:
        self.data = data
        self.size = len(data) - SPARE
        # A word at every byte offset: one word each is read faster so than by two aligned reads.
        self.words = np.ndarray(shape=(len(data) - 7,), dtype="<u8", buffer=data, strides=(1,))
        self.psize = psize
        self.last_pgno = last_pgno
        self.by_page = data[: self.size - self.size % psize].view("<u2").reshape(-1, psize // 2)


def _meta(data: npt.NDArray[np.uint8], psize: int, txnid: int) -> tuple[int, int, int] | None:
    """(main database root, main depth, last page) of the meta page of transaction ``txnid``."""
    raw = data.data
    for page in (0, 1):
        base = page * psize + PAGE_HEADER
        if base + META_HEAD.size + 2 * DB_RECORD.size + 16 > len(data) - SPARE:
            return None
        magic, version, _, _ = META_HEAD.unpack_from(raw, base)
        main = DB_RECORD.unpack_from(raw, base + META_HEAD.size + DB_RECORD.size)
        last_pg, meta_txnid = struct.unpack_from("<QQ", raw, base + META_HEAD.size + 2 * DB_RECORD.size)
        if magic == META_MAGIC and version == META_VERSION and meta_txnid == txnid:
            return main[7], main[2], last_pg
    return None


def _level(pages: _Pages, pgnos: I64, flag: int) -> tuple[I64, I64, npt.NDArray[np.uint64]] | None:
    """The nodes of these pages, in order: (offsets in the file, offsets in their page, headers).

    None if a page is out of bounds or not what its place needs. A node header is one
    little-endian word: ``mn_lo | mn_hi << 16 | mn_flags << 32 | mn_ksize << 48``.
    """
    psize = pages.psize
    if len(pgnos) == 0 or int(pgnos.min()) < 2 or int(pgnos.max()) > pages.last_pgno:
        return None
    if (int(pgnos.max()) + 1) * psize > pages.size:
        return None
    rows = pages.by_page[pgnos]  # a copy of the pages, one row of 16-bit words each
    if not np.array_equal(rows.view(np.uint64)[:, 0], pgnos.astype(np.uint64)):
        return None
    flags, lower, upper = rows[:, 5], rows[:, 6].astype(np.int64), rows[:, 7].astype(np.int64)
    if not (flags == flag).all() or (lower < PAGE_HEADER + 2).any() or ((lower & 1) != 0).any():
        return None
    if (lower > upper).any() or (upper > psize).any():
        return None
    counts = (lower - PAGE_HEADER) >> 1
    slots = np.arange(int(counts.max()), dtype=np.int64)
    ptrs = rows[:, PAGE_HEADER // 2 : PAGE_HEADER // 2 + len(slots)]
    used = slots < counts[:, None]
    bad = (ptrs < upper[:, None]) | (ptrs > psize - NODE_HEADER) | ((ptrs & 1) != 0)
    if (bad & used).any():
        return None
    ptr = ptrs[used].astype(np.int64)
    node = (pgnos * psize)[:, None] + ptrs
    node = node[used]
    return node, ptr, pages.words[node]


def keys(data: npt.NDArray[np.uint8], name: bytes, stat: TreeStat, each: Callable[[Keys], None]) -> bool:
    """Give ``each`` the keys of database ``name`` in ``data`` (from :func:`read_file`), a batch at a time.

    False when the tree cannot be vouched for (the batches given so far must then be dropped and
    the file walked with a cursor). Leaf pages are read :data:`LEAF_BATCH` at a time, so a big file
    never has all its keys unpacked at once.
    """
    if not SUPPORTED or len(data) < SPARE + 2 * 512:
        return False
    raw = data.data
    psize = struct.unpack_from("<I", raw, PAGE_HEADER + META_HEAD.size)[0]  # the free DB's md_pad
    if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
        return False
    meta = _meta(data, psize, stat.txnid)
    if meta is None or meta[2] != stat.last_pgno:
        return False
    main_root, main_depth, last_pgno = meta
    pages = _Pages(data, psize, last_pgno)
    if main_depth != 1:  # a main database of more than one page: not a NeMo completion file
        return False
    found = _level(pages, np.array([main_root], dtype=np.int64), P_LEAF)
    if found is None:
        return False
    node, in_page, header = found
    record: tuple[int, ...] | None = None
    for i in range(len(node)):
        start = int(node[i]) + NODE_HEADER
        head = int(header[i])
        if head >> 48 == len(name) and bytes(data[start : start + len(name)]) == name:
            if (head >> 32) & 0xFFFF != F_SUBDATA or head & 0xFFFFFFFF != DB_RECORD.size:
                return False
            if int(in_page[i]) + NODE_HEADER + len(name) + DB_RECORD.size > psize:
                return False
            record = DB_RECORD.unpack_from(raw, start + len(name))
    if record is None:
        return False
    _, md_flags, depth, branch, leaf, overflow, entries, root = record
    if md_flags != 0 or overflow != 0 or stat.overflow_pages != 0:
        return False
    if (depth, branch, leaf, entries) != (stat.depth, stat.branch_pages, stat.leaf_pages, stat.entries):
        return False
    if root == P_INVALID or depth == 0:
        return entries == 0 and depth == 0 and leaf == 0
    level = np.array([root], dtype=np.int64)
    for _ in range(depth - 1):
        found = _level(pages, level, P_BRANCH)
        if found is None:
            return False
        node, in_page, header = found
        if (in_page + NODE_HEADER + (header >> np.uint64(48)).astype(np.int64) > psize).any():
            return False
        branch -= len(level)
        # A branch node's child: mn_lo | mn_hi << 16 | mn_flags << 32.
        level = (header & np.uint64(0xFFFFFFFFFFFF)).astype(np.int64)
    if len(level) != leaf or branch != 0:
        return False
    for at in range(0, len(level), LEAF_BATCH):
        batch = _leaves(pages, data, level[at : at + LEAF_BATCH])
        if batch is None:
            return False
        entries -= len(batch.lengths)
        each(batch)
    return entries == 0


def _leaves(pages: _Pages, data: npt.NDArray[np.uint8], pgnos: I64) -> Keys | None:
    """The keys on these leaf pages; None if one of them cannot be vouched for."""
    found = _level(pages, pgnos, P_LEAF)
    if found is None:
        return None
    node, in_page, header = found
    klen = (header >> np.uint64(48)).astype(np.int64)
    # Leaf nodes: flags 0 (the value in the page), a key of 1 byte or more, key and value inside.
    dsize = (header & np.uint64(0xFFFFFFFF)).astype(np.int64)
    if ((header >> np.uint64(32)) & np.uint64(0xFFFF)).any() or not klen.all():
        return None
    if (in_page + NODE_HEADER + klen + dsize > pages.psize).any():
        return None
    words = bytes_hash.pack_words(data, node + NODE_HEADER, klen)
    if np.bitwise_or.reduce(words, axis=None) & np.uint64(0x8080808080808080):
        return None  # not all ASCII: a cursor walk checks that they are UTF-8
    return Keys(words, klen)
