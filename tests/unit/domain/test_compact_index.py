"""The compact index's directory and bitmap, built a slice at a time, against a whole-array build.

The sizes that matter are the edges: no entry, one, a bucket count that just grows (``n // 16``
crossing a power of two), the bitmap's (``8 n`` crossing one) and the slices of the build
(``compact._SCAN_CHUNK``), including a bucket whose run of entries straddles two slices.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tally_server.domain import compact
from tally_server.domain.compact import CompactIndex

CHUNK = compact._SCAN_CHUNK
EDGES = [0, 1, 2, 15, 16, 17, 31, 32, 33, 1023, 1024, 1025, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1]


def entries_of(n: int, seed: int, cluster: int = 0, at: int = 0) -> npt.NDArray[np.uint64]:
    """``n`` sorted random entries; ``cluster`` of them share one directory bucket, placed from ``at``."""
    rng = np.random.default_rng(seed)
    out = np.sort(rng.integers(0, 1 << 64, size=n, dtype=np.uint64))
    if cluster and n:
        k = max(1, (n // 16).bit_length())
        at = min(at, n - cluster)
        # Between the neighbours of the run, all in the bucket of the run's first entry.
        bucket = int(out[at]) >> (64 - k) << (64 - k)
        start = max(bucket, int(out[at - 1]) if at else 0)
        out[at : at + cluster] = np.sort(
            rng.integers(start, bucket + (1 << (64 - k)) - 1, size=cluster, dtype=np.uint64, endpoint=True)
        )
        out.sort()
    return out


def reference(entries: npt.NDArray[np.uint64]) -> tuple[npt.NDArray[np.uint32], bytes, int]:
    """The directory, bitmap and bisection steps as a whole-array build makes them (the former code)."""
    n = len(entries)
    k = max(1, (n // 16).bit_length())
    tops = (entries >> np.uint64(64 - k)).view(np.int64)
    directory = np.zeros((1 << k) + 1, dtype=np.uint32)
    np.cumsum(np.bincount(tops, minlength=1 << k), out=directory[1:])
    steps = int(np.diff(directory).max()).bit_length() if n else 0
    log_bits = max(6, (8 * n).bit_length() - 1)
    flags = np.zeros(1 << log_bits, dtype=bool)
    flags[(entries >> np.uint64(64 - log_bits)).view(np.int64)] = True
    return directory, np.packbits(flags, bitorder="little").tobytes(), steps


def check(entries: npt.NDArray[np.uint64]) -> None:
    index = CompactIndex(entries, compact.MIN_ORIGIN_BITS, None, len(entries))
    directory, bitmap, steps = reference(entries)
    assert np.array_equal(index._dir, directory)
    assert bytes(index._bitmap) == bitmap
    assert index._steps >= steps  # enough bisection steps for the fullest bucket
    assert index.nbytes == entries.nbytes + directory.nbytes + len(bitmap)
    # Every entry is found where it is (the first of equal prefixes), by both lookups.
    at, found = index.first_many(entries)
    assert found.all()
    prefixes = entries & np.uint64(index._prefix_mask)
    assert np.array_equal(at, np.searchsorted(prefixes, prefixes))
    for i in np.linspace(0, len(entries) - 1, num=min(len(entries), 50), dtype=np.intp):
        assert i in list(index.candidates(int(entries[i])))
    # Misses: hashes whose prefix no entry has.
    others = np.random.default_rng(len(entries)).integers(0, 1 << 64, size=200, dtype=np.uint64)
    absent = ~np.isin(others & np.uint64(index._prefix_mask), prefixes)
    _, found = index.first_many(others)
    assert not found[absent].any()
    assert not any(list(index.candidates(int(h))) for h in others[absent])


@pytest.mark.parametrize("n", EDGES)
def test_the_directory_and_bitmap_are_those_of_a_whole_array_build(n: int) -> None:
    check(entries_of(n, seed=n))


def test_a_bucket_straddling_two_slices_counts_whole() -> None:
    # 300 entries in one bucket across the first slice boundary: bisection needs 9 steps, and
    # either slice alone holds fewer than 256 of them.
    entries = entries_of(3 * CHUNK, seed=7, cluster=300, at=CHUNK - 150)
    index = CompactIndex(entries, compact.MIN_ORIGIN_BITS, None, len(entries))
    assert index._steps == 9
    check(entries)


@settings(max_examples=40, deadline=None)
@given(
    n=st.one_of(st.sampled_from(EDGES), st.integers(0, 3 * CHUNK)),
    seed=st.integers(0, 2**32 - 1),
    cluster=st.integers(0, 400),
    at=st.integers(0, 3 * CHUNK),
)
def test_lookups_are_exact_at_any_size(n: int, seed: int, cluster: int, at: int) -> None:
    check(entries_of(n, seed, min(cluster, n), at))


def test_a_build_keeps_no_temporary_as_large_as_its_entries() -> None:
    # A whole-array temporary (its memory kept by a thread's malloc arena once freed) was what
    # made 1 M ids cost 17.5 bytes each; the build now allocates a slice's worth at a time.
    import tracemalloc

    entries = entries_of(1 << 20, seed=1)
    tracemalloc.start()
    try:
        index = CompactIndex(entries, compact.MIN_ORIGIN_BITS, None, len(entries))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    kept = index.nbytes - entries.nbytes  # the directory and the bitmap
    assert peak < kept + entries.nbytes // 2
