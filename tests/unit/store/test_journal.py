"""The writers' journal on disk: what is committed comes back in order, snapshots and forgets shrink
it, and a write torn by a crash leaves the journal as it was before that write.

The journal is an append-only log (``LogJournal``); the LMDB journal it replaced (``LmdbJournal``)
is still read to migrate a data directory, so the semantics tests run on both. The log's own tests
(torn tails, rewrites, migration, a full disk) are in ``test_journal_log.py``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import lmdb
import pytest

from tally_server.domain import validation
from tally_server.domain.journal import Applied, Completing, Opened, Persisted, Reverted, Snapshot
from tally_server.domain.ledger import ApplyCounts, DeltaBatch, LedgerState
from tally_server.domain.ports import ForgetWriter, JournalEntry, OpenJournal
from tally_server.store.journal import (
    LMDB_JOURNAL_FILENAME,
    LmdbJournal,
    NoJournal,
    decode_entry,
    encode_entry,
)
from tally_server.store.journal_log import LogJournal

JOURNALS = pytest.mark.parametrize("journal_class", [LogJournal, LmdbJournal])


def who(handle: str) -> Opened:
    return Opened(handle, "cp/x", f"writer-{handle}", "host", 7, {"slurm": "3"}, {"input": "h"}, 1.5, "tok")


def batch(seq: int) -> Applied:
    return Applied(seq, [(f"t{seq}", "s", 1), (f"u{seq}", "é-src", -1)], ["hit"] if seq == 2 else [])


@JOURNALS
def test_entries_come_back_in_order_per_writer(tmp_path: Path, journal_class: type[LogJournal]) -> None:
    journal = journal_class(tmp_path)
    journal.commit([OpenJournal(who("a")), OpenJournal(who("b"))])
    journal.commit([JournalEntry("a", i, batch(i)) for i in range(1, 12)])  # 10 and 11 sort after 9
    journal.commit([JournalEntry("b", 1, Completing(["s"])), JournalEntry("a", 12, Persisted(["s"]))])
    journal.close()

    loaded = {w.opened.handle: w for w in journal_class(tmp_path).load()}
    assert loaded["a"].opened == who("a")
    assert loaded["a"].entries == [*(batch(i) for i in range(1, 12)), Persisted(["s"])]
    assert loaded["a"].last_index == 12
    assert loaded["b"].entries == [Completing(["s"])]


@JOURNALS
def test_load_with_owns_brings_back_only_the_owned_checkpoints_writers(
    tmp_path: Path, journal_class: type[LogJournal]
) -> None:
    journal = journal_class(tmp_path)
    where = {"a": "a/1", "b": "b/1", "c": "a/2"}
    journal.commit([OpenJournal(replace(who(h), checkpoint=cp)) for h, cp in where.items()])
    journal.commit([JournalEntry(h, 1, batch(i)) for i, h in enumerate(where, 1)])
    mine = journal.load(lambda name: name.startswith("a/"))
    assert [(w.opened.handle, w.entries, w.last_index) for w in mine] == [
        ("a", [batch(1)], 1),
        ("c", [batch(3)], 1),
    ]
    assert journal.load(lambda name: False) == []
    assert [w.opened.handle for w in journal.load()] == ["a", "b", "c"]  # the others stay journaled
    journal.close()


def test_no_journal_loads_nothing_whatever_it_owns() -> None:
    assert NoJournal().load(lambda name: True) == NoJournal().load() == []


@JOURNALS
def test_a_snapshot_replaces_what_came_before_and_forget_drops_a_writer(
    tmp_path: Path, journal_class: type[LogJournal]
) -> None:
    journal = journal_class(tmp_path)
    journal.commit([OpenJournal(who("a")), OpenJournal(who("b"))])
    journal.commit([JournalEntry("a", i, batch(i)) for i in range(1, 6)] + [JournalEntry("b", 1, batch(1))])
    state = LedgerState({"s": 1}, {"t1": 1}, {"done"}, {"undone"}, ["settling"], ApplyCounts(5, 1, 0, 1, 1))
    snapshot = Snapshot(state, 5, ApplyCounts(1, 0, 0, 0, 0), ["done"])
    journal.commit([JournalEntry("a", 6, snapshot), JournalEntry("a", 7, batch(6))])
    assert journal.entries() == 3  # a: the snapshot and one batch; b: one batch
    journal.commit([ForgetWriter("b")])
    assert journal.entries() == 2
    loaded = journal.load()
    assert [w.opened.handle for w in loaded] == ["a"]
    assert loaded[0].entries == [snapshot, batch(6)]
    assert loaded[0].last_index == 7
    journal.close()
    reopened = journal_class(tmp_path)
    assert reopened.load() == loaded and reopened.entries() == 2


def test_every_entry_survives_its_encoding() -> None:
    state = LedgerState(
        {"s": -3, "ü": 0}, {"t": 2, "long" * 100: -1}, {"a", "b"}, set(), ["ü"], ApplyCounts(1, 2, 3, 4, 5)
    )
    entries = [
        Applied(2**64 - 1, [("t", "s", -(2**61)), ("t2", "s\x00x", 2**61)], ["h"]),
        Applied(0, [], []),
        Completing(["a", "b"]),
        Persisted([]),
        Reverted(["x"]),
        Snapshot(state, 9, ApplyCounts(0, 1, 0, 0, 0), ["b"]),
    ]
    for entry in entries:
        assert decode_entry(encode_entry(entry)) == entry


@pytest.mark.usefixtures("each_ledger_core")  # validation packs the ids in C or in Python
def test_a_checked_batch_is_written_byte_for_byte_as_its_rows() -> None:
    """Validation hands the journal its ASCII columns joined: the entry is the one the rows make."""
    rows = [("0_a", "a", 1), ("0_b_0", "b", -1), ("x" * 511, "a", 2**62 - 1), ("t", "s\x00x", -(2**62) + 1)]
    columns = [list(c) for c in zip(*rows, strict=True)]
    checked = validation.delta_columns(*columns, validation.Limits(), int64=True)
    assert checked.packed is not None  # the quick path, the columns packed by validation
    other = validation.delta_columns(["é", *columns[0][1:]], *columns[1:], validation.Limits())
    assert other.packed is None  # not ASCII: each id encoded on its own
    for batch in (checked, other):
        entry = Applied(7, batch, ["a"])
        expected = encode_entry(Applied(7, list(batch), ["a"]))
        assert encode_entry(entry) == expected
        assert decode_entry(expected) == entry
    assert isinstance(checked, DeltaBatch) and list(checked) == rows and checked == rows


def test_a_write_torn_by_a_crash_leaves_the_lmdb_journal_as_before_it(tmp_path: Path) -> None:
    """A crash in the middle of a commit: the new pages reached the disk, the meta page that would
    publish them did not. LMDB's copy-on-write B-tree then shows the previous commit, whole; the
    torn one was never acknowledged (a commit is acknowledged only once its meta page is synced)."""
    journal = LmdbJournal(tmp_path)
    journal.commit([OpenJournal(who("a")), JournalEntry("a", 1, batch(1))])
    journal.close()
    path = tmp_path / LMDB_JOURNAL_FILENAME
    page = lmdb.open(str(path), subdir=False, readonly=True, lock=False).stat()["psize"]
    metas_before = path.read_bytes()[: 2 * page]

    journal = LmdbJournal(tmp_path)
    journal.commit([JournalEntry("a", 2, batch(2)), JournalEntry("a", 3, Completing(["s"]))])
    journal.close()
    with open(path, "r+b") as raw:
        raw.write(metas_before)  # the meta pages as they were: the last commit torn

    loaded = LmdbJournal(tmp_path).load()
    assert [w.opened.handle for w in loaded] == ["a"]
    assert loaded[0].entries == [batch(1)]
    assert loaded[0].last_index == 1


def test_an_unknown_entry_kind_is_refused_loudly() -> None:
    with pytest.raises(ValueError, match="unknown journal entry kind"):
        decode_entry(b"Zjunk")
