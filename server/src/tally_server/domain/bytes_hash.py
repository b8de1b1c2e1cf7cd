"""Python's own ``hash()`` of many byte strings at once, in numpy, without a ``bytes`` per key.

CPython 3.11+ hashes ``bytes`` (and ASCII ``str``) with SipHash-1-3 keyed by the process's hash
secret (``Python/pyhash.c``). Loading a checkpoint hashes millions of keys read straight from the
pages of their files; computing the same function over arrays costs a fraction of making each
key a Python object and calling ``hash`` on it.

This leans on CPython internals (the algorithm and the ``_Py_HashSecret`` symbol), so it checks
itself once, against ``hash()`` on keys of every length up to 64 bytes, and :data:`AVAILABLE` is
False on any other interpreter, algorithm or result: callers then hash one key at a time as before.
"""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]
_U64 = np.uint64


def _secret() -> tuple[int, int] | None:
    """The two 64-bit SipHash keys of this process, or None where they cannot be read."""
    if sys.implementation.name != "cpython" or sys.hash_info.algorithm != "siphash13":
        return None
    if sys.byteorder != "little" or sys.hash_info.cutoff != 0:
        return None
    try:
        secret = (ctypes.c_uint64 * 3).in_dll(ctypes.pythonapi, "_Py_HashSecret")
    except (AttributeError, ValueError, OSError):
        return None
    return int(secret[0]), int(secret[1])


def _rotl(x: U64, bits: int, tmp: U64) -> None:
    """``x = x <<< bits`` in place (``tmp``: scratch of the same shape)."""
    np.right_shift(x, _U64(64 - bits), out=tmp)
    np.left_shift(x, _U64(bits), out=x)
    np.bitwise_or(x, tmp, out=x)


def _round(v0: U64, v1: U64, v2: U64, v3: U64, tmp: U64) -> None:
    """One SipRound, in place."""
    v0 += v1
    _rotl(v1, 13, tmp)
    v1 ^= v0
    _rotl(v0, 32, tmp)
    v2 += v3
    _rotl(v3, 16, tmp)
    v3 ^= v2
    v0 += v3
    _rotl(v3, 21, tmp)
    v3 ^= v0
    v2 += v1
    _rotl(v1, 17, tmp)
    v1 ^= v2
    _rotl(v2, 32, tmp)


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


class SipHash13:
    """Python's ``hash`` of byte strings (Python/pyhash.c, ``siphash13``), for given keys."""

    def __init__(self, k0: int, k1: int) -> None:
        self._init = (
            _U64(k0 ^ 0x736F6D6570736575),
            _U64(k1 ^ 0x646F72616E646F6D),
            _U64(k0 ^ 0x6C7967656E657261),
            _U64(k1 ^ 0x7465646279746573),
        )

    def of_words(self, words: U64, lengths: npt.NDArray[np.int64]) -> U64:
        """``hash()`` of each key given as a row of :func:`pack_words`, as ``uint64``.

        Every length must be at least 1 (``hash(b"")`` is 0, a special case not handled here).
        """
        n = len(lengths)
        if n == 0:
            return np.empty(0, dtype=np.uint64)
        full = lengths >> 3
        if int(full.min()) == int(full.max()):  # one length class: no reordering needed
            return self._hash(words, lengths, full, None)
        order = np.argsort(-full, kind="stable")  # longest first: the rows still compressing are a prefix
        out = np.empty(n, dtype=np.uint64)
        out[order] = self._hash(words[order], lengths[order], full[order], -full[order])
        return out

    def _hash(
        self,
        words: U64,
        lengths: npt.NDArray[np.int64],
        full: npt.NDArray[np.int64],
        descending: npt.NDArray[np.int64] | None,
    ) -> U64:
        n = len(lengths)
        v0, v1, v2, v3, tmp = np.empty((5, n), dtype=np.uint64)
        for v, k in zip((v0, v1, v2, v3), self._init, strict=True):
            v.fill(k)
        most = int(full.max())
        for j in range(most):
            # The keys with more than j whole words: all, or a prefix when sorted longest first.
            m = n if descending is None else int(np.searchsorted(descending, -j, side="left"))
            mi = words[:m, j]
            a, b, c, d, t = v0[:m], v1[:m], v2[:m], v3[:m], tmp[:m]
            d ^= mi
            _round(a, b, c, d, t)
            a ^= mi
        if descending is None:
            last = words[:, most].copy()
        else:
            last = np.take_along_axis(words, full[:, None], axis=1)[:, 0]
        last |= lengths.astype(np.uint64) << _U64(56)
        v3 ^= last
        _round(v0, v1, v2, v3, tmp)
        v0 ^= last
        v2 ^= _U64(0xFF)
        for _ in range(3):
            _round(v0, v1, v2, v3, tmp)
        v0 ^= v1
        v2 ^= v3
        v0 ^= v2
        np.minimum(v0, _U64(0xFFFFFFFFFFFFFFFE), out=v0)  # hash() is never -1: it gives -2 instead
        return v0


def _check(hasher: SipHash13) -> bool:
    """Whether ``hasher`` gives ``hash()``'s values, for keys of every length from 1 to 64."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
    keys = [rng.integers(0, 256, size=length, dtype=np.uint8).tobytes() for length in range(1, 65)]
    keys += [bytes([0xFF]) * length for length in range(1, 17)]
    data = np.frombuffer(b"".join(keys) + bytes(16), dtype=np.uint8)
    lengths = np.array([len(k) for k in keys], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    want = np.array([hash(k) for k in keys], dtype=np.int64).view(np.uint64)
    if not np.array_equal(hasher.of_words(pack_words(data, offsets, lengths), lengths), want):
        return False
    for length in (5, 12, 16):  # one length for all, as most checkpoints' ids have
        same = np.full(8, length, dtype=np.int64)
        got = hasher.of_words(pack_words(data, np.arange(8, dtype=np.int64) * 3, same), same)
        want = np.array([hash(data[3 * i : 3 * i + length].tobytes()) for i in range(8)], dtype=np.int64)
        if not np.array_equal(got, want.view(np.uint64)):
            return False
    return True


def _load() -> SipHash13 | None:
    keys = _secret()
    if keys is None:
        return None
    hasher = SipHash13(*keys)
    return hasher if _check(hasher) else None


PYTHON_HASH: SipHash13 | None = _load()
AVAILABLE = PYTHON_HASH is not None
