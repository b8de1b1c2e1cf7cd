"""A compact index's entries, made and sorted by the compiled core, against numpy.

Opening a checkpoint builds its compact index from the hashes of each file's keys: every hash cut
to its prefix and tagged with its file's number, all of them sorted. The compiled core does it in
one pass that scatters the entries by their top bits, then sorts each bucket by radix and insertion
(``_ledgercore.sort_entries``); numpy masks, tags and sorts. Both must give the same array, or a
lookup would miss an id that is there. Hashes are uniform, so the inputs below are not: all in one
bucket, one value repeated, few distinct values, buckets of every size.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tally_server.domain import compact, idmap
from tests.conftest import compiled_core_required

M64 = (1 << 64) - 1

values = st.one_of(
    st.integers(0, M64),
    st.sampled_from([0, 1, M64, M64 - 1, 1 << 63, (1 << 63) - 1]),
    st.integers(0, 255).map(lambda b: b << 56),  # the top byte only: 256 buckets at most
    st.integers(0, 1000),  # every value in the first bucket
)
parts = st.lists(st.lists(values, max_size=300), max_size=9)


def numpy_entries(hashes: list[np.ndarray], bits: int) -> np.ndarray:
    prefix = np.uint64(M64 ^ ((1 << bits) - 1))
    tagged = [(h & prefix) | np.uint64(i) for i, h in enumerate(hashes)]
    entries = np.concatenate(tagged) if tagged else np.empty(0, dtype=np.uint64)
    entries.sort()
    return entries


def sort_entries() -> object:
    compiled_core_required()
    assert idmap.COMPILED is not None and idmap.COMPILED.sort_entries is not None
    return idmap.COMPILED.sort_entries


@given(parts, st.integers(1, 8))
def test_the_compiled_entries_are_numpys(found: list[list[int]], bits: int) -> None:
    sort = sort_entries()
    hashes = [np.array(p, dtype=np.uint64) for p in found]
    out = np.zeros(sum(map(len, found)), dtype=np.uint64)
    assert sort(hashes, M64 ^ ((1 << bits) - 1), out) is True  # type: ignore[operator]
    assert np.array_equal(out, numpy_entries(hashes, bits))


@pytest.mark.parametrize("count", [2_047, 2_048, 200_003])
def test_many_uniform_hashes_sort_as_numpy_sorts_them(count: int) -> None:
    # Enough entries for the top-bit buckets (2,048 entries make the first bucket split).
    sort = sort_entries()
    rng = np.random.default_rng(count)
    sizes = (count // 3, 0, count - count // 3)
    hashes = [rng.integers(0, M64, size=n, dtype=np.uint64, endpoint=True) for n in sizes]
    out = np.empty(count, dtype=np.uint64)
    assert sort(hashes, M64 ^ 3, out) is True  # type: ignore[operator]
    assert np.array_equal(out, numpy_entries(hashes, 2))


def test_the_compiled_sort_refuses_what_does_not_fit() -> None:
    sort = sort_entries()
    hashes = [np.arange(3, dtype=np.uint64), np.arange(2, dtype=np.uint64)]
    out = np.zeros(4, dtype=np.uint64)
    with pytest.raises(ValueError, match="out holds 32 bytes for 5 entries"):
        sort(hashes, M64, out)  # type: ignore[operator]
    with pytest.raises(ValueError, match="part 1 holds 3 bytes"):
        sort([hashes[0], b"abc"], M64, np.zeros(3, dtype=np.uint64))  # type: ignore[operator]
    with pytest.raises(BufferError, match="not writable"):
        sort(hashes, M64, bytes(40))  # type: ignore[operator]
    assert not out.any()  # nothing written


@pytest.mark.usefixtures("each_ledger_core")
def test_an_index_built_on_each_core_is_the_same() -> None:
    rng = np.random.default_rng(7)
    per_origin = [rng.integers(0, M64, size=n, dtype=np.uint64, endpoint=True) for n in (5_000, 1, 0, 3_000)]
    per_origin[3][:10] = per_origin[0][:10]  # one id in two files: entries that share a prefix
    index = compact.CompactIndex.build(per_origin)
    assert np.array_equal(index.entries, numpy_entries(per_origin, index.origin_bits))
    assert index.count == 8_001 - 10
