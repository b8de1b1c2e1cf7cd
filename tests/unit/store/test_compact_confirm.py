"""Hash hits are confirmed in the files: with a hash under which every id collides, nothing that is
not in a completion file is ever reported completed, and the count stays exact."""

from __future__ import annotations

import functools
import zlib
from pathlib import Path

import pytest

from tally_server.domain.checkpoint import CompletedSet
from tally_server.domain.compact import CompactIndex, Hasher, distinct_count
from tally_server.domain.ports import DeleteCompleted, PutCompleted
from tally_server.store.lmdb_files import LmdbCompletionStore

EVERYTHING_COLLIDES = Hasher(lambda key: 0x5EED)

# contains_many's two ways through the index (arrays, one id at a time) each hold to every rule here.
pytestmark = pytest.mark.usefixtures("each_lookup")


def loaded(store: LmdbCompletionStore, name: str, hasher: Hasher) -> CompletedSet:
    """What the service does when it loads a checkpoint (CheckpointTable._read_index)."""
    found = store.load_index(name, hasher)
    index = CompactIndex.build(found.hashes)
    shared = set(index.shared_prefixes().tolist())
    keys = store.keys_matching(name, found.origins, lambda k: index.prefix(hasher.of_key(k)) in shared)
    index.count = distinct_count(index, hasher, keys)
    return CompletedSet(
        index=index, origins=found.origins, confirm=functools.partial(store.contains, name), hasher=hasher
    )


def test_a_colliding_hash_never_completes_a_source_no_file_holds(tmp_path: Path) -> None:
    with LmdbCompletionStore(tmp_path) as store:
        store.commit([PutCompleted("run", "w1", ["a", "b"]), PutCompleted("run", "w2", ["c", "a"])])
        completed = loaded(store, "run", EVERYTHING_COLLIDES)
        asked = ["a", "b", "c", "x", "é", "w1"]
        assert completed.contains_many(asked) == [True, True, True, False, False, False]
        assert [sid in completed for sid in asked] == [True, True, True, False, False, False]
        assert len(completed) == 3  # "a" is in two files and counts once
        before = completed.as_of_now()
        assert [before(sid) for sid in asked] == [True, True, True, False, False, False]

        # A completion committed to w1 (whose entries all share its hash) joins once made durable,
        # invisible to the view taken before it, as with any other hash.
        store.commit([PutCompleted("run", "w1", ["x"])])
        completed.add(["x"], "w1")
        completed.merge()
        assert "x" in completed and not before("x")
        assert len(completed) == 4

        # Un-completed: gone at once, and for good once the delete reached the files.
        assert completed.discard("b")
        store.commit([DeleteCompleted("run", ["b"])])
        completed.merge()
        assert completed.contains_many(asked) == [True, False, True, True, False, False]
        assert len(completed) == 3


def test_a_reload_under_a_colliding_hash_gives_the_same_answers(tmp_path: Path) -> None:
    ids = [f"source-{i}" for i in range(50)]
    with LmdbCompletionStore(tmp_path) as store:
        store.commit([PutCompleted("run", f"w{i % 3}", ids[i::3]) for i in range(3)])
        for hasher in (Hasher(), EVERYTHING_COLLIDES):
            completed = loaded(store, "run", hasher)
            assert len(completed) == len(ids)
            assert completed.contains_many([*ids, "source-50", "nope"]) == [True] * len(ids) + [False, False]


def test_files_read_for_lookups_can_still_be_written_and_loaded(tmp_path: Path) -> None:
    """LMDB opens a file once per process: a handle kept for lookups must give way."""
    with LmdbCompletionStore(tmp_path) as store:
        store.commit([PutCompleted("run", "w1", ["a"])])
    with LmdbCompletionStore(tmp_path) as store:  # a restarted coordinator: no write handle yet
        assert store.contains("run", "w1", [b"a", b"b"]) == [True, False]
        store.commit([PutCompleted("run", "w1", ["b"])])
        assert store.contains("run", "w1", [b"a", b"b"]) == [True, True]
    with LmdbCompletionStore(tmp_path) as store:
        assert store.contains("run", "w1", [b"b"]) == [True]
        assert store.load("run").completed == {"a", "b"}
        assert len(loaded(store, "run", Hasher())) == 2
        store.commit([DeleteCompleted("run", ["a"])])
        assert store.contains("run", "w1", [b"a", b"b"]) == [False, True]


def test_keys_page_through_several_files_in_key_order(tmp_path: Path) -> None:
    ids = {f"id-{i * 7919 % 1000:04d}" for i in range(300)} | {"é", "a"}
    with LmdbCompletionStore(tmp_path) as store:
        store.commit([PutCompleted("run", f"w{i}", sorted(ids)[i::4] + ["a"]) for i in range(4)])
        origins = [f"w{i}" for i in range(4)]
        pages: list[bytes] = []
        after, last = b"", False
        while not last:
            keys, last = store.keys_after("run", origins, after, 7)
            assert len(keys) <= 7 and (last or len(keys) == 7)
            pages += keys
            after = keys[-1] if keys else after
        assert pages == sorted(s.encode() for s in ids)


def test_answers_keep_their_places_when_hits_of_many_files_are_confirmed_together(tmp_path: Path) -> None:
    """Hits are grouped by file to be confirmed: each answer must still land on its own id.

    ``<id>~`` hashes like ``<id>`` (a hit) but is in no file, so only the lookup can refuse it.
    """
    shadowed = Hasher(lambda key: zlib.crc32(key.rstrip(b"~")) << 20)
    ids = [f"source-{i}" for i in range(60)]
    with LmdbCompletionStore(tmp_path) as store:
        store.commit([PutCompleted("run", f"w{i}", ids[i::4]) for i in range(4)])
        completed = loaded(store, "run", shadowed)
        asked = [
            sid + suffix for i, sid in enumerate(reversed(ids)) for suffix in ("", "~")[: 1 + i % 3 // 2]
        ]
        asked += ["nope"]
        assert completed.contains_many(asked) == [not sid.endswith("~") and sid != "nope" for sid in asked]
        # The same with part of the answer coming from the overlay.
        store.commit([PutCompleted("run", "w9", ["late"])])
        completed.add(["late"], "w9")
        asked += ["late", "late~"]
        expected = [not sid.endswith("~") and sid != "nope" for sid in asked]
        assert completed.contains_many(asked) == expected
