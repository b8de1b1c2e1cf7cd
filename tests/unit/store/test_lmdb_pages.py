"""A load reads keys from the pages of a completion file (``lmdb_pages``) and hashes them in numpy
(``bytes_hash``): the same hashes as a cursor walk and ``hash()``, and a file it cannot vouch for
is walked with a cursor as before (so a damaged one fails as LMDB reports it)."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import lmdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tally.integrations import lmdb_pages, nemo_format
from tally_server.domain import bytes_hash
from tally_server.domain.compact import Hasher
from tally_server.store.file_handles import HandleCache
from tally_server.store.lmdb_reads import FileReads
from tests import lmdb_damage
from tests.nemo_format import NemoWriter, nemo_write

pytestmark = pytest.mark.skipif(
    not (bytes_hash.AVAILABLE and lmdb_pages.SUPPORTED),
    reason="hash() cannot be reproduced on this interpreter",
)


@pytest.fixture(params=["read", "mapped"])
def how_read(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Files read into memory, or mapped as files over ``MAX_FILE_BYTES`` are (the same checks)."""
    if request.param == "mapped":
        monkeypatch.setattr(lmdb_pages, "MAX_FILE_BYTES", 0)
    return str(request.param)


def cursor_hashes(path: Path) -> list[int]:
    """What a load computed before: ``hash()`` of every key a cursor walk gives, sorted."""
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, max_dbs=1)
    try:
        db = env.open_db(nemo_format.COMPLETED_DB, create=False)
        with env.begin(db=db) as txn, txn.cursor(db=db) as cursor:
            return sorted(hash(k) & (2**64 - 1) for k in cursor.iternext(keys=True, values=False))
    finally:
        env.close()


def tree_stat(path: Path) -> lmdb_pages.TreeStat:
    """What the file's LMDB read transaction says of ``completed_sources``, as the store asks it."""
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, max_dbs=1)
    try:
        db = env.open_db(nemo_format.COMPLETED_DB, create=False)
        with env.begin(db=db) as txn:
            return lmdb_pages.TreeStat.of(txn, db, env)
    finally:
        env.close()


def verdict(path: Path, stat: lmdb_pages.TreeStat | None = None) -> lmdb_pages.Verdict:
    """``lmdb_pages.keys``' verdict on the file, checked against its LMDB transaction."""
    data, spare = lmdb_pages.file_pages(path)
    return lmdb_pages.keys(data, nemo_format.COMPLETED_DB, stat or tree_stat(path), lambda _: None, spare)


def page_keys(path: Path) -> list[int] | None:
    """The lengths of the keys ``lmdb_pages.keys`` gives (None: it cannot vouch for the file)."""
    batches: list[lmdb_pages.Keys] = []
    data, spare = lmdb_pages.file_pages(path)
    if (
        lmdb_pages.keys(data, nemo_format.COMPLETED_DB, tree_stat(path), batches.append, spare).kind
        != "whole"
    ):
        return None
    return [n for batch in batches for n in batch.lengths.tolist()]


def store_hashes(path: Path) -> list[int]:
    """What a load computes now (``FileReads.hash_keys``), sorted."""
    reads = FileReads(HandleCache(4), 4)
    try:
        return sorted(int(h) for h in reads.hash_keys(path, Hasher()))
    finally:
        reads.close()


@pytest.mark.usefixtures("how_read")
def test_the_pages_give_every_key_of_a_tree_several_levels_deep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lmdb_pages, "LEAF_BATCH", 7)  # many batches of leaf pages
    rng = random.Random(7)
    ids = [f"{rng.getrandbits(48):012x}" for _ in range(30_000)]  # 12 bytes, NeMo's content ids
    ids += ["x" * n for n in range(1, 300)] + [f"path/to/file-{i}.jsonl" for i in range(2_000)]
    path = tmp_path / "w.mdb"
    writer = NemoWriter(tmp_path, "w")  # NeMo's own writes: a put per id, in batches
    for i in range(0, len(ids), 1000):
        writer.persist_completed(ids[i : i + 1000])
    for sid in ids[::7]:  # deletions leave pages partly filled and nodes out of order
        writer.remove_from_completed(sid)
    writer.close()
    path = tmp_path / nemo_format.METADATA_DIRNAME / "w.mdb"

    lengths = page_keys(path)
    assert lengths is not None  # read from the pages, not walked
    kept = sorted(set(ids) - set(ids[::7]))
    assert sorted(lengths) == sorted(len(s) for s in kept)
    assert store_hashes(path) == cursor_hashes(path) == sorted(hash(s.encode()) & (2**64 - 1) for s in kept)


@pytest.mark.usefixtures("how_read")
def test_an_empty_database_has_no_keys(tmp_path: Path) -> None:
    path = tmp_path / "w.mdb"
    nemo_write(path, ["a", "b"])
    env = lmdb.open(str(path), subdir=False, max_dbs=1, lock=False)
    db = env.open_db(nemo_format.COMPLETED_DB)
    with env.begin(write=True, db=db) as txn:
        txn.delete(b"a")
        txn.delete(b"b")
    env.close()
    assert page_keys(path) == []
    assert store_hashes(path) == []


@pytest.mark.usefixtures("how_read")
def test_keys_that_are_not_ascii_are_walked_with_a_cursor(tmp_path: Path) -> None:
    path = tmp_path / "w.mdb"
    nemo_write(path, ["plain", "café", "数据/文件"])
    assert page_keys(path) is None
    assert store_hashes(path) == cursor_hashes(path)
    assert len(store_hashes(path)) == 3


def test_a_key_that_is_not_utf8_is_still_damage(tmp_path: Path) -> None:
    path = tmp_path / "w.mdb"
    nemo_write(path, ["a"])
    env = lmdb.open(str(path), subdir=False, max_dbs=1, lock=False)
    db = env.open_db(nemo_format.COMPLETED_DB)
    with env.begin(write=True, db=db) as txn:
        txn.put(b"\xff\xfe", b"1")
    env.close()
    with pytest.raises(UnicodeDecodeError):
        store_hashes(path)


def _leaf_pages(path: Path) -> list[int]:
    data = path.read_bytes()
    psize = lmdb_damage._page_size(data)
    main_root, _ = lmdb_damage._meta(data, psize)
    flags_at = lmdb_damage.FLAGS_OFFSET
    return [
        p
        for p in range(2, len(data) // psize)
        if p != main_root and struct.unpack_from("<H", data, p * psize + flags_at)[0] == lmdb_damage.P_LEAF
    ]


@pytest.mark.usefixtures("how_read")
def test_a_tree_root_of_the_wrong_type_is_damage(tmp_path: Path) -> None:
    path = tmp_path / "w.mdb"
    nemo_write(path, [f"{i:012x}" for i in range(5_000)])
    lmdb_damage.damage(path, "tree_root")
    assert verdict(path).kind == "damaged"
    with pytest.raises(nemo_format.DamagedFileError, match="branch .* type flags 0x0000, not 0x0001"):
        store_hashes(path)


@pytest.mark.usefixtures("how_read")
def test_a_leaf_of_the_wrong_type_is_damage_and_no_read_walks_it(tmp_path: Path) -> None:
    """LMDB's cursor steps onto a sibling page without checking its type and aborts the process."""
    path = tmp_path / "w.mdb"
    ids = [f"{i:012x}" for i in range(5_000)]
    nemo_write(path, ids)
    page = lmdb_damage.damage(path, "leaf")
    assert verdict(path) == lmdb_pages.Verdict(
        "damaged", f"leaf page {page} has type flags 0x0000, not 0x0002"
    )
    reads = FileReads(HandleCache(4), 4)
    try:
        with pytest.raises(nemo_format.DamagedFileError, match=f"{path}: damaged LMDB tree"):
            reads.hash_keys(path, Hasher())
        with pytest.raises(nemo_format.DamagedFileError):
            reads.hash_keys(path, Hasher(lambda k: len(k)))  # a hash the pages cannot compute: checked too
        # Every other read of the file reads nothing, rather than walking it (and aborting).
        assert reads.keys_matching(path, lambda _: True) == []
        assert reads.keys_after(path, b"", 10) == ([], False)
        assert reads.merged_keys_after([path], ids[-2].encode(), 10) == ([], True)
        reads.forget(path)  # LMDB opens a file once per process
        env = nemo_format.open_env(path, write=True)  # as a writer opens its own file
        try:
            with pytest.raises(nemo_format.DamagedFileError):
                reads.check_tree(path, env, nemo_format.open_completed_db(path, env))
        finally:
            env.close()
    finally:
        reads.close()


@pytest.mark.usefixtures("how_read")
def test_a_main_database_root_marked_as_a_branch_is_damage_before_lmdb_opens_the_database(
    tmp_path: Path,
) -> None:
    """LMDB's search for the database record asserts (``NUMKEYS(mp) > 1``) on a one-node branch."""
    path = tmp_path / "w.mdb"
    nemo_write(path, [f"{i:012x}" for i in range(5_000)])
    data = bytearray(path.read_bytes())
    psize = lmdb_damage._page_size(data)
    main_root, _ = lmdb_damage._meta(data, psize)
    struct.pack_into("<H", data, main_root * psize + lmdb_damage.FLAGS_OFFSET, 0x01)  # P_BRANCH
    path.write_bytes(data)
    reads = FileReads(HandleCache(4), 4)
    try:
        with pytest.raises(nemo_format.DamagedFileError, match="main database page .* type flags 0x0001"):
            reads.hash_keys(path, Hasher())
        assert reads.contains(path, [b"000000000000"]) == [False]
        assert reads.keys_after(path, b"", 10) == ([], False)
    finally:
        reads.close()


@pytest.mark.usefixtures("how_read")
def test_flags_besides_a_pages_type_are_left_to_lmdb(tmp_path: Path) -> None:
    """P_DIRTY never reaches the disk on a tree page; this reader leaves such a page to LMDB's
    walk (which reports it as damage, MDB_CORRUPTED, rather than asserting)."""
    path = tmp_path / "w.mdb"
    nemo_write(path, [f"{i:012x}" for i in range(5_000)])
    data = bytearray(path.read_bytes())
    psize = lmdb_damage._page_size(data)
    page = _leaf_pages(path)[3]
    struct.pack_into("<H", data, page * psize + lmdb_damage.FLAGS_OFFSET, lmdb_damage.P_LEAF | 0x10)
    path.write_bytes(data)
    assert verdict(path) == lmdb_pages.Verdict("unsupported", "a leaf page has flags besides its type")
    with pytest.raises(lmdb.CorruptedError):
        store_hashes(path)


@pytest.mark.usefixtures("how_read")
def test_a_meta_page_no_longer_the_transactions_is_not_damage(tmp_path: Path) -> None:
    """A file written after the read transaction began: its meta pages alternate, so a page
    reader can no longer tell the snapshot's tree; it must say "walk", never "damaged"."""
    path = tmp_path / "w.mdb"
    nemo_write(path, [f"{i:012x}" for i in range(5_000)])
    before = tree_stat(path)
    for n in range(2):  # two commits: both meta pages now belong to later transactions
        env = lmdb.open(str(path), subdir=False, max_dbs=1, lock=False)
        db = env.open_db(nemo_format.COMPLETED_DB)
        with env.begin(write=True, db=db) as txn:
            for i in range(3_000):
                txn.delete(f"{i:012x}".encode())
            txn.put(f"new-{n}".encode(), b"1")
        env.close()
    assert verdict(path, before) == lmdb_pages.Verdict(
        "unsupported", "no meta page of the reading transaction"
    )
    assert verdict(path).kind == "whole"


@pytest.mark.usefixtures("how_read")
def test_a_page_that_is_not_where_it_says_is_walked_with_a_cursor(tmp_path: Path) -> None:
    path = tmp_path / "w.mdb"
    nemo_write(path, [f"{i:012x}" for i in range(5_000)])
    data = bytearray(path.read_bytes())
    psize = lmdb_damage._page_size(data)
    page = _leaf_pages(path)[3]  # a leaf in the middle of the tree
    struct.pack_into("<Q", data, page * psize, page + 1)  # its own page number, wrong
    path.write_bytes(data)
    assert verdict(path) == lmdb_pages.Verdict("unsupported", "a leaf page does not carry its own number")
    assert store_hashes(path) == cursor_hashes(path)  # LMDB does not look at it; neither does the load


@pytest.mark.usefixtures("how_read")
def test_a_tree_unlike_what_lmdb_says_is_damage(tmp_path: Path) -> None:
    path = tmp_path / "w.mdb"
    nemo_write(path, [f"{i:012x}" for i in range(5_000)])
    data = bytearray(path.read_bytes())
    psize = lmdb_damage._page_size(data)
    page = _leaf_pages(path)[2]
    lower_at = page * psize + lmdb_damage.FLAGS_OFFSET + 2
    (lower,) = struct.unpack_from("<H", data, lower_at)
    struct.pack_into("<H", data, lower_at, lower - 2)  # one node fewer on that page
    path.write_bytes(data)
    # The entries no longer add up to LMDB's count: a walk would lose an id without a word.
    assert verdict(path) == lmdb_pages.Verdict("damaged", "4999 entries in the leaf pages, LMDB counts 5000")
    with pytest.raises(nemo_format.DamagedFileError):
        store_hashes(path)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=80), min_size=1, max_size=60))
def test_the_array_hash_is_pythons_hash(keys: list[bytes]) -> None:
    python_hash = bytes_hash.PYTHON_HASH
    assert python_hash is not None
    data = np.frombuffer(b"".join(keys) + bytes(96), dtype=np.uint8)  # room for a whole key past the last
    lengths = np.array([len(k) for k in keys], dtype=np.int64)
    offsets = (np.cumsum(lengths) - lengths).astype(np.int64)
    got = python_hash.of_words(lmdb_pages.pack_words(data, offsets, lengths), lengths)
    assert got.tolist() == [hash(k) & (2**64 - 1) for k in keys]
    same = np.full(len(keys), len(keys[0]), dtype=np.int64)  # one length for all
    got = python_hash.of_words(lmdb_pages.pack_words(data, offsets, same), same)
    want = [hash(data[o : o + len(keys[0])].tobytes()) & (2**64 - 1) for o in offsets.tolist()]
    assert got.tolist() == want


def test_the_hash_is_used_only_once_it_gives_what_hash_gives() -> None:
    """The import-time self-check would catch a hasher keyed differently from this process."""
    assert bytes_hash.PYTHON_HASH is not None
    assert bytes_hash._check(bytes_hash.PYTHON_HASH)
    assert not bytes_hash._check(bytes_hash.SipHash13(1, 2))
