"""Damage real LMDB files the way a bad disk or a torn copy does, in ways LMDB still opens.

Parses the on-disk layout of LMDB 0.9 on a 64-bit little-endian host (page header 16 bytes, meta
page after it) just far enough to find a database's root page, then overwrites that page's flags:
LMDB opens the file, and the damage shows up only when the page is used, as
``MDB_CORRUPTED: Located page was wrong type``.

- ``"main_root"``: the main database's root, which holds the ``completed_sources`` record, so
  ``open_db(b"completed_sources")`` fails (NeMo Curator's loader then counts the file as empty).
- ``"tree_root"``: the root of ``completed_sources`` itself, so ``open_db`` works and reading
  the ids with a cursor fails.
- ``"leaf"``: the last leaf page of ``completed_sources`` (a tree of two levels or more), reached
  by a cursor walk from its left sibling; LMDB 0.9 does not check its type there and aborts the
  whole process on an assertion (``mdb_cursor_next: Assertion 'IS_LEAF(mp)' failed``).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Literal

PAGE_HEADER = 16  # mp_pgno u64, mp_pad u16, mp_flags u16, mp_lower u16, mp_upper u16
FLAGS_OFFSET = 10
DB_RECORD = struct.Struct("<IHHQQQQQ")  # md_pad, md_flags, md_depth, branch, leaf, overflow, entries, root
P_LEAF = 0x02
F_SUBDATA = 0x02

Damage = Literal["main_root", "tree_root", "leaf"]


def _page_size(data: bytes) -> int:
    # mm_dbs[FREE_DBI].md_pad of a meta page holds the page size.
    return struct.unpack_from("<I", data, PAGE_HEADER + 24)[0]


def _meta(data: bytes, psize: int) -> tuple[int, int]:
    """(main database root page, txnid) of the newer of the two meta pages."""
    best = (0, -1)
    for page in (0, 1):
        base = page * psize + PAGE_HEADER
        main = DB_RECORD.unpack_from(data, base + 24 + DB_RECORD.size)
        (txnid,) = struct.unpack_from("<Q", data, base + 24 + 2 * DB_RECORD.size + 8)
        if txnid > best[1]:
            best = (main[7], txnid)
    return best


def _subdb_root(data: bytes, psize: int, main_root: int, name: bytes) -> int:
    base = main_root * psize
    flags, lower = struct.unpack_from("<HH", data, base + FLAGS_OFFSET)
    assert flags & P_LEAF, "the main database is larger than one page; use a smaller file"
    for i in range((lower - PAGE_HEADER) // 2):
        (ptr,) = struct.unpack_from("<H", data, base + PAGE_HEADER + 2 * i)
        lo, hi, nflags, ksize = struct.unpack_from("<HHHH", data, base + ptr)
        key = data[base + ptr + 8 : base + ptr + 8 + ksize]
        if key == name and nflags & F_SUBDATA:
            return DB_RECORD.unpack_from(data, base + ptr + 8 + ksize)[7]
    raise AssertionError(f"no database {name!r} in the main database")


def _last_leaf(data: bytes, psize: int, root: int) -> int:
    page = root
    while True:
        base = page * psize
        flags, lower = struct.unpack_from("<HH", data, base + FLAGS_OFFSET)
        if flags & P_LEAF:
            assert page != root, "the tree is one page; use a bigger file"
            return page
        (ptr,) = struct.unpack_from("<H", data, base + lower - 2)  # the last node
        lo, hi, nflags = struct.unpack_from("<HHH", data, base + ptr)
        page = lo | hi << 16 | nflags << 32


def damage(path: Path, where: Damage) -> int:
    """Overwrite the flags of one page of ``path`` with 0; returns the page number damaged."""
    data = bytearray(path.read_bytes())
    psize = _page_size(data)
    main_root, _ = _meta(data, psize)
    page = main_root if where == "main_root" else _subdb_root(data, psize, main_root, b"completed_sources")
    if where == "leaf":
        page = _last_leaf(data, psize, page)
    struct.pack_into("<H", data, page * psize + FLAGS_OFFSET, 0)
    path.write_bytes(data)
    return page
