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


def _rows(keys: list[bytes]) -> U64:
    """Keys as rows of little-endian words, zero past each key's end (as a load packs them)."""
    width = max(len(k) for k in keys) // 8 + 1
    packed = b"".join(k.ljust(8 * width, b"\0") for k in keys)
    return np.frombuffer(packed, dtype="<u8").reshape(len(keys), width).astype(np.uint64)


def _check(hasher: SipHash13) -> bool:
    """Whether ``hasher`` gives ``hash()``'s values, for keys of every length from 1 to 64."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
    mixed = [rng.integers(0, 256, size=length, dtype=np.uint8).tobytes() for length in range(1, 65)]
    mixed += [bytes([0xFF]) * length for length in range(1, 17)]
    # And one length for all, as most checkpoints' ids have (a path of its own in ``of_words``).
    groups = [mixed] + [[rng.bytes(length) for _ in range(8)] for length in (5, 12, 16)]
    for keys in groups:
        lengths = np.array([len(k) for k in keys], dtype=np.int64)
        want = np.array([hash(k) for k in keys], dtype=np.int64).view(np.uint64)
        if not np.array_equal(hasher.of_words(_rows(keys), lengths), want):
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
