"""A compact index of completed ids: sorted 64-bit hashes, each tagged with the file holding its id.

About 10 bytes per id instead of a Python ``str`` in a ``dict`` (about 100). A hash says "maybe";
only a lookup of the id itself in the file the entry names says "yes" (the caller's job, see
:class:`tally_server.domain.checkpoint.CompletedSet`), so a collision never completes anything.

Layout: one sorted ``uint64`` array; each entry is the top ``64 - origin_bits`` bits of the id's
hash with the index of its file (its *origin*) in the low ``origin_bits``. Sorting that one array
sorts hashes and keeps their origins beside them for free. Two small helpers make lookups cheap:

- a directory of where each run of the top ``k`` hash bits starts (about 0.5 byte per id), so a
  batch lookup is a few vectorised bisection steps inside a bucket of a dozen entries, all in cache;
- a bitmap of the hash bits (at most 1 byte per id) answering most single misses in a few
  hundred nanoseconds without touching the big array (a writer's ledger asks one id at a time).

The hash is Python's own ``hash()`` of the id's UTF-8 bytes: the fastest one at hand (C, and cached
on ``str`` objects), salted per process, which is fine because the index never leaves memory.
For an ASCII ``str``, CPython hashes the same bytes as for the equal ``bytes``, so asking about an
ASCII id needs no encoding (checked once at import; otherwise every id is encoded first).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from tally_server.domain import bytes_hash, idmap

U64 = npt.NDArray[np.uint64]
M64 = (1 << 64) - 1
# Origins the entry layout has room for before it grows (the bits come out of the hash).
MIN_ORIGIN_BITS = 8
# Entries scanned per step for shared prefixes (a slice that stays in the CPU's cache).
_SCAN_CHUNK = 1 << 16
_STR_HASH_IS_BYTES_HASH = hash("tally-ascii-id") == hash(b"tally-ascii-id")


class Hasher:
    """Hashes ids (``str``) and file keys (their UTF-8 ``bytes``) alike, to 64 bits.

    ``key_hash`` replaces Python's ``hash`` (tests inject one that collides on purpose).
    """

    def __init__(self, key_hash: Callable[[bytes], int] | None = None) -> None:
        self._custom = key_hash
        self._fast_str = key_hash is None and _STR_HASH_IS_BYTES_HASH

    @property
    def spans_supported(self) -> bool:
        """Whether ``of_words`` can hash keys over arrays (Python's own hash, called or reproduced)."""
        return self._custom is None and (bytes_hash.AVAILABLE or idmap.current().hash_rows is not None)

    def of_key(self, key: bytes) -> int:
        """The 64-bit hash of one id's UTF-8 bytes."""
        return (hash(key) if self._custom is None else self._custom(key)) & M64

    def of_id(self, source_id: str) -> int:
        """The hash of one id, equal to ``of_key`` of its UTF-8 bytes (without encoding ASCII)."""
        if self._fast_str and source_id.isascii():
            return hash(source_id) & M64
        return self.of_key(source_id.encode())

    def of_keys(self, keys: Iterable[bytes], count: int = -1) -> U64:
        """The hashes of many UTF-8 ids, as an array (``count``: how many, if known)."""
        if self._custom is None:
            return np.fromiter(map(hash, keys), dtype=np.int64, count=count).view(np.uint64)
        return np.fromiter(map(self.of_key, keys), dtype=np.uint64, count=count)

    def of_words(self, words: U64, lengths: npt.NDArray[np.int64]) -> U64 | None:
        """``of_keys`` of keys packed as rows of words (``lmdb_pages.pack_words``), over arrays.

        The compiled core calls Python's own hash on each row (a sixth of numpy's time, beside the
        event loop: it lets go of the GIL); else numpy reproduces it. None with a custom hash, or
        where neither can (see :mod:`tally_server.domain.bytes_hash`). Every length is at least 1.
        """
        if self._custom is not None:
            return None
        rows = idmap.current().hash_rows
        if rows is not None:
            out = np.empty(len(lengths), dtype=np.uint64)
            if rows(np.ascontiguousarray(words), np.ascontiguousarray(lengths, dtype=np.int64), out):
                return out
        python_hash = bytes_hash.PYTHON_HASH
        return None if python_hash is None else python_hash.of_words(words, lengths)

    def of_ids(self, ids: Sequence[str]) -> U64:
        """The hashes of many ids, as an array (the same values as ``of_keys``)."""
        if self._fast_str and "".join(ids).isascii():
            return np.fromiter(map(hash, ids), dtype=np.int64, count=len(ids)).view(np.uint64)
        return np.fromiter(map(self.of_id, ids), dtype=np.uint64, count=len(ids))


def origin_bits_for(origins: int) -> int:
    """How many low bits of an entry name its file, for ``origins`` files."""
    return max(MIN_ORIGIN_BITS, (max(origins, 1) - 1).bit_length())


def prefix_mask(origin_bits: int, origins: int) -> int:
    """The hash bits an entry keeps once ``origins`` origins need room (never fewer than now)."""
    return M64 ^ ((1 << max(origin_bits, origin_bits_for(origins))) - 1)


class CompactIndex:
    """Immutable sorted entries (hash prefix | origin), with an optional sequence per entry.

    Args:
        entries: sorted ``uint64`` entries.
        origin_bits: how many low bits of an entry name its origin.
        seqs: the completion sequence of each entry (None: all 0, which is what a load gives).
        count: how many distinct ids the entries stand for (an id in two files has two entries).
    """

    def __init__(
        self, entries: U64, origin_bits: int, seqs: npt.NDArray[np.uint32] | None, count: int
    ) -> None:
        self.entries = entries
        self.origin_bits = origin_bits
        self.seqs = seqs
        self.count = count
        self._mask = (1 << origin_bits) - 1
        self._prefix_mask = M64 ^ self._mask
        n = len(entries)
        k = max(1, (n // 16).bit_length())  # buckets of 8 to 16 entries on average
        self._shift = 64 - k
        self._dir = np.zeros((1 << k) + 1, dtype=np.uint32)
        # 4 to 8 bits per id, indexed by the top hash bits: the entries set them in order.
        log_bits = max(6, (8 * n).bit_length() - 1)
        self._bit_shift = 64 - log_bits
        bitmap = np.zeros(1 << (log_bits - 3), dtype=np.uint8)
        self._steps = _fill(entries, self._shift, self._dir, self._bit_shift, bitmap)
        self._bitmap = bitmap.data  # indexed one byte at a time, as a Python int
        self._shared: U64 = np.empty(0, dtype=np.uint64)
        self._entries_mv = entries.data
        self._dir_mv = self._dir.data

    @classmethod
    def build(cls, per_origin: Sequence[U64], origin_bits: int | None = None) -> CompactIndex:
        """The index of ``per_origin[i]``, the full hashes of the ids origin ``i`` holds (any order).

        ``count`` assumes that entries sharing a hash prefix are one id held by several origins;
        :meth:`shared_prefixes` lists them for a caller that can tell (see the store's loader).
        """
        bits = origin_bits_for(len(per_origin)) if origin_bits is None else origin_bits
        prefix = np.uint64(M64 ^ ((1 << bits) - 1))
        entries = np.empty(sum(len(h) for h in per_origin), dtype=np.uint64)
        sort = idmap.current().sort_entries
        tagged = sort is not None and sort(
            [np.ascontiguousarray(h, np.uint64) for h in per_origin], int(prefix), entries
        )
        if not tagged:
            at = 0
            for i, h in enumerate(per_origin):
                part = entries[at : at + len(h)]
                np.bitwise_and(h, prefix, out=part)
                part |= np.uint64(i)
                at += len(h)
            entries.sort()  # equal entries are alike, so no need for a stable sort (3x slower at 10 M)
        index = cls(entries, bits, None, len(entries))
        # Neighbours with one prefix (their XOR fits in the origin bits), a slice at a time: no
        # array as large as the entries is allocated (each would cost its page faults again).
        shared: list[U64] = []
        low = np.uint64(1 << bits)
        for at in range(0, len(entries) - 1, _SCAN_CHUNK):
            head = entries[at : at + _SCAN_CHUNK + 1]
            same = np.bitwise_xor(head[1:], head[:-1]) < low
            found = int(np.count_nonzero(same))
            if found:
                index.count -= found
                shared.append(head[1:][same] & prefix)
        if shared:
            index._shared = np.unique(np.concatenate(shared))
        return index

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        """The memory the index's arrays take."""
        seqs = self.seqs.nbytes if self.seqs is not None else 0
        return self.entries.nbytes + self._dir.nbytes + len(self._bitmap) + seqs

    def shared_prefixes(self) -> U64:
        """Hash prefixes held by more than one entry of a built index.

        An id in several files, or a collision.
        """
        return self._shared

    def prefix(self, h: int) -> int:
        """The part of hash ``h`` the index keeps (the rest of an entry names its file)."""
        return h & self._prefix_mask

    def origin(self, i: int) -> int:
        """The file (origin number) of entry ``i``."""
        return int(self._entries_mv[i]) & self._mask

    def seq(self, i: int) -> int:
        """The completion sequence of entry ``i`` (0: loaded from the files)."""
        return 0 if self.seqs is None else int(self.seqs[i])

    def candidates(self, h: int) -> Iterator[int]:
        """Indices of the entries whose hash prefix is that of ``h`` (usually none or one)."""
        bit = h >> self._bit_shift
        if not (self._bitmap[bit >> 3] >> (bit & 7)) & 1:
            return
        p = h & self._prefix_mask
        top = p >> self._shift
        entries = self._entries_mv
        i = bisect.bisect_left(entries, p, self._dir_mv[top], self._dir_mv[top + 1])
        n = len(entries)
        while i < n and entries[i] & self._prefix_mask == p:
            yield i
            i += 1

    def first_many(self, hashes: U64) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.bool_]]:
        """For each hash: the index of the first entry with its prefix, and whether there is one."""
        n = len(self.entries)
        if n == 0 or len(hashes) == 0:
            return np.zeros(len(hashes), dtype=np.intp), np.zeros(len(hashes), dtype=bool)
        p = hashes & np.uint64(self._prefix_mask)
        top = (p >> np.uint64(self._shift)).astype(np.intp)
        lo = self._dir[top].astype(np.intp)
        hi = self._dir[top + 1].astype(np.intp)
        entries = self.entries
        for _ in range(self._steps):
            active = lo < hi
            mid = (lo + hi) >> 1
            right = entries[np.minimum(mid, n - 1)] < p
            lo = np.where(active & right, mid + 1, lo)
            hi = np.where(active & ~right, mid, hi)
        at = np.minimum(lo, n - 1)
        found = (lo < n) & ((entries[at] & np.uint64(self._prefix_mask)) == p)
        return at, found

    def merged(
        self,
        hashes: U64,
        origins: npt.NDArray[np.uint32],
        seqs: npt.NDArray[np.uint64],
        *,
        origin_count: int,
        added: int,
        settled: int,
    ) -> CompactIndex:
        """A new index with these entries added (``added`` new distinct ids).

        Sequences at or below ``settled`` (no view can tell them apart any more) are stored as 0;
        when all are, no sequence array is kept at all.
        """
        bits = max(self.origin_bits, origin_bits_for(origin_count))
        entries, old_seqs = self.entries, self.seqs
        if bits != self.origin_bits:  # more origins than the layout had room for: repack
            low = entries & np.uint64(self._mask)
            entries = (entries >> np.uint64(bits) << np.uint64(bits)) | low
            order = np.argsort(entries, kind="stable")
            entries = entries[order]
            old_seqs = old_seqs[order] if old_seqs is not None else None
        prefix = np.uint64(M64 ^ ((1 << bits) - 1))
        new = (hashes & prefix) | origins.astype(np.uint64)
        order = np.argsort(new, kind="stable")
        new, seqs = new[order], seqs[order]
        at = np.searchsorted(entries, new)
        out = np.insert(entries, at, new)
        seqs = np.where(seqs <= settled, 0, seqs)
        out_seqs: npt.NDArray[np.uint32] | None = None
        if old_seqs is not None:
            old_seqs = np.where(old_seqs <= settled, 0, old_seqs)
        if (old_seqs is not None and old_seqs.any()) or seqs.any():
            width = (
                np.uint32
                if max(int(seqs.max(initial=0)), int(old_seqs.max(initial=0)) if old_seqs is not None else 0)
                < 1 << 32
                else np.uint64
            )
            base = old_seqs if old_seqs is not None else np.zeros(len(entries), dtype=width)
            out_seqs = np.insert(base.astype(width), at, seqs.astype(width))
        return CompactIndex(out, bits, out_seqs, self.count + added)


def _fill(
    entries: U64, shift: int, directory: npt.NDArray[np.uint32], bit_shift: int, bitmap: npt.NDArray[np.uint8]
) -> int:
    """Fill the directory and the bitmap of sorted ``entries``; returns the bisection steps a bucket needs.

    A slice at a time, so that no temporary is as large as the entries: below 32 MB, glibc may
    place one in the load thread's malloc arena (its mmap threshold grows with what was freed),
    and once freed its memory stays resident (``malloc_trim`` never returns the top of a
    thread's arena): 7 MB at 1 M ids, measured (issue #10).
    ``directory[t]`` ends as the number of entries whose top ``64 - shift`` bits are below ``t``.
    """
    top_shift, low_shift = np.uint64(shift), np.uint64(bit_shift)
    for at in range(0, len(entries), _SCAN_CHUNK):
        part = entries[at : at + _SCAN_CHUNK]
        # Shifted right by at least one bit, so the view as int64 (no copy) is the same numbers.
        tops = (part >> top_shift).view(np.int64)
        first = int(tops[0])
        tops -= first
        counts = np.bincount(tops)
        window = directory[first + 1 : first + 1 + len(counts)]
        np.add(window, counts, out=window, casting="unsafe")
        bits = (part >> low_shift).view(np.int64)
        low = int(bits[0]) & ~7  # a whole byte of the bitmap
        bits -= low
        flags = np.zeros(int(bits[-1]) + 1, dtype=bool)
        flags[bits] = True
        packed = np.packbits(flags, bitorder="little")
        window8 = bitmap[low >> 3 : (low >> 3) + len(packed)]
        window8 |= packed
    np.cumsum(directory, out=directory)
    most = 0
    for at in range(0, len(directory) - 1, _SCAN_CHUNK):
        most = max(most, int(np.diff(directory[at : at + _SCAN_CHUNK + 1]).max()))
    return most.bit_length()


def distinct_count(index: CompactIndex, hasher: Hasher, keys: Iterable[bytes]) -> int:
    """``index.count`` corrected with ``keys``: every key whose hash prefix several entries share.

    ``build`` counts one id per prefix; two different ids under one prefix (a collision) are two.
    """
    seen: dict[int, set[bytes]] = {}
    for key in keys:
        seen.setdefault(index.prefix(hasher.of_key(key)), set()).add(key)
    return index.count + sum(len(ids) - 1 for ids in seen.values())
