"""File keys packed and hashed over arrays, on each counting core, against numpy and ``hash``.

Opening a checkpoint hashes every key of its completion files from their pages, packed as rows of
words: the compiled core copies each key into its row (``_ledgercore.pack_rows``) and calls Python's
bytes hash on each row (``_ledgercore.hash_rows``); the Python one packs (``lmdb_pages.pack_words``)
and reproduces the hash in numpy (``bytes_hash``). Both must give the same rows and ``hash(key)``
exactly, or an id would be looked up under another hash than the one it was indexed by.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tally.integrations import lmdb_pages
from tally_server.domain import compact, idmap
from tally_server.store import lmdb_reads
from tests.conftest import compiled_core_required

pytestmark = pytest.mark.usefixtures("each_ledger_core")

keys = st.lists(st.binary(min_size=1, max_size=80), min_size=1, max_size=50) | st.integers(1, 40).flatmap(
    lambda n: st.lists(st.binary(min_size=n, max_size=n), min_size=1, max_size=50)  # one length for all
)


def packed(found: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The keys as a load packs them: rows of words read from one buffer (with its spare bytes)."""
    lengths = np.array([len(k) for k in found], dtype=np.int64)
    data = np.zeros(int(lengths.sum()) + lmdb_pages.SPARE, dtype=np.uint8)
    data[: int(lengths.sum())] = np.frombuffer(b"".join(found), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return lmdb_pages.pack_words(data, offsets, lengths), lengths


@given(keys)
def test_keys_packed_as_words_hash_as_python_hashes_them(found: list[bytes]) -> None:
    words, lengths = packed(found)
    want = np.array([hash(k) for k in found], dtype=np.int64).view(np.uint64)
    hashes = compact.Hasher().of_words(words, lengths)
    assert hashes is not None and np.array_equal(hashes, want)
    assert [compact.Hasher().of_key(k) for k in found] == want.tolist()


def test_the_compiled_hash_refuses_a_key_longer_than_its_row() -> None:
    compiled_core_required()
    hash_rows = idmap.COMPILED.hash_rows if idmap.COMPILED else None
    assert hash_rows is not None
    words, lengths = packed([b"abc", b"defgh"])  # rows of one word
    out = np.zeros(2, dtype=np.uint64)
    with pytest.raises(ValueError, match="key 1 of 9 bytes in a row of 8"):
        hash_rows(words, np.array([3, 9], dtype=np.int64), out)
    with pytest.raises(ValueError, match="do not make n rows"):
        hash_rows(words, lengths, np.zeros(3, dtype=np.uint64))
    assert not out.any()  # nothing written
    assert hash_rows(words, lengths, out) and out.tolist() == [hash(b"abc") % 2**64, hash(b"defgh") % 2**64]


@given(keys, st.data())
def test_keys_anywhere_in_a_buffer_pack_as_numpy_packs_them(found: list[bytes], data: st.DataObject) -> None:
    lengths = np.array([len(k) for k in found], dtype=np.int64)
    gaps = [data.draw(st.integers(0, 9)) for _ in found]  # keys at any alignment, in any order
    buffer, offsets = bytearray(), []
    for key, gap in zip(found, gaps, strict=True):
        buffer += bytes(range(gap)) + key
        offsets.append(len(buffer) - len(key))
    raw = np.frombuffer(bytes(buffer) + bytes(lmdb_pages.SPARE), dtype=np.uint8)
    order = np.array(data.draw(st.permutations(range(len(found)))), dtype=np.int64)
    at, sized = np.array(offsets, dtype=np.int64)[order], lengths[order]
    assert np.array_equal(lmdb_reads._pack(raw, at, sized), lmdb_pages.pack_words(raw, at, sized))


def test_the_compiled_packing_refuses_a_key_outside_its_buffer_or_row() -> None:
    compiled_core_required()
    pack_rows = idmap.COMPILED.pack_rows if idmap.COMPILED else None
    assert pack_rows is not None
    data = np.frombuffer(b"abcdefghij", dtype=np.uint8)
    out = np.ones((2, 1), dtype=np.uint64)
    lengths = np.array([3, 4], dtype=np.int64)
    for offsets, why in (([0, 7], "key 1 of 4 bytes at 7, in 10 bytes"), ([-1, 0], "key 0 of 3 bytes at -1")):
        with pytest.raises(ValueError, match=why):
            pack_rows(data, np.array(offsets, dtype=np.int64), lengths, out)
    with pytest.raises(ValueError, match="key 1 of 9 bytes at 0, in 10 bytes of data and a row of 8"):
        pack_rows(data, np.array([0, 0], dtype=np.int64), np.array([3, 9], dtype=np.int64), out)
    assert out.tolist() == [[1], [1]]  # nothing written
    assert pack_rows(data, np.array([0, 6], dtype=np.int64), lengths, out)
    assert out.view(np.uint8).reshape(2, 8).tobytes() == b"abc" + bytes(5) + b"ghij" + bytes(4)
