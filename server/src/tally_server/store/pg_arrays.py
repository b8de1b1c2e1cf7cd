"""Arrays sent to PostgreSQL in its binary format, built at C speed: a commit's ids and entries.

psycopg dumps a list parameter one element at a time in Python (a dumper call per id, about 1 µs
each); a group commit of the PostgreSQL store sends thousands of ids and tens of journal entries.
:func:`bytea_array` and :func:`int4_runs` build the whole value in a few C-level passes instead;
pass them with a binary placeholder (``%b``). They stand for exactly the arrays psycopg would send.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence

import psycopg
from psycopg.adapt import Dumper
from psycopg.pq import Format

_BYTEA_OID = 17
_INT4_OID = 23
# One dimension, no NULLs, the element type, the length, the lower bound (1).
_HEADER = struct.Struct(">iiIii")
_EMPTY = struct.Struct(">iiI")  # zero dimensions: an empty array
_LENGTH = struct.Struct(">i")
_INT4 = _LENGTH.pack(4)


class ByteaArray(bytes):
    """A ``bytea[]`` value in PostgreSQL's binary format (see :func:`bytea_array`)."""

    __slots__ = ()


class Int4Array(bytes):
    """An ``int4[]`` value in PostgreSQL's binary format (see :func:`int4_runs`)."""

    __slots__ = ()


class _ByteaArrayDumper(Dumper):
    format = Format.BINARY
    oid = psycopg.postgres.types["bytea"].array_oid

    def dump(self, obj: ByteaArray) -> bytes:
        return obj


class _Int4ArrayDumper(Dumper):
    format = Format.BINARY
    oid = psycopg.postgres.types["int4"].array_oid

    def dump(self, obj: Int4Array) -> bytes:
        return obj


# Only these two classes are concerned: every other type keeps psycopg's own dumpers.
psycopg.adapters.register_dumper(ByteaArray, _ByteaArrayDumper)
psycopg.adapters.register_dumper(Int4Array, _Int4ArrayDumper)


def bytea_array(values: Sequence[bytes]) -> ByteaArray:
    """``values`` as one ``bytea[]`` parameter (each element its 4-byte length, then its bytes)."""
    if not values:
        return ByteaArray(_EMPTY.pack(0, 0, _BYTEA_OID))
    lengths = map(_LENGTH.pack, map(len, values))
    body = b"".join(itertools.chain.from_iterable(zip(lengths, values, strict=True)))
    return ByteaArray(_HEADER.pack(1, 0, _BYTEA_OID, len(values), 1) + body)


def int4_runs(runs: Sequence[tuple[int, int]]) -> Int4Array:
    """One ``int4[]`` parameter: each ``(value, times)`` of ``runs`` gives ``value`` ``times`` times.

    Raises:
        struct.error: a value outside int4's range.
    """
    length = sum(times for _, times in runs)
    if not length:
        return Int4Array(_EMPTY.pack(0, 0, _INT4_OID))
    body = b"".join((_INT4 + _LENGTH.pack(value)) * times for value, times in runs)
    return Int4Array(_HEADER.pack(1, 0, _INT4_OID, length, 1) + body)
