"""The journal's log keeps what a plain model keeps: random opens, entries, snapshots and forgets,
with the journal closed and reopened at random points and its log rewritten in the background
beside the commits, load back exactly what a dict of writers says, and what the LMDB journal it
replaced loads for the same commits."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tally_server.domain.journal import Applied, Completing, Entry, JournaledWriter, Persisted, Snapshot
from tally_server.domain.ledger import ApplyCounts, LedgerState
from tally_server.domain.ports import ForgetWriter, JournalEntry, JournalOp, OpenJournal
from tally_server.store import journal_log
from tally_server.store.journal import LmdbJournal
from tally_server.store.journal_log import LogJournal
from tests.unit.store.test_journal import who

settings.register_profile(
    "tally-journal-log", max_examples=150, derandomize=True, deadline=None, database=None
)
PROFILE = settings.get_profile("tally-journal-log")

HANDLES = ("a", "b", "é", "a2")


def snapshot(seq: int) -> Snapshot:
    state = LedgerState({"s": seq}, {f"t{seq}": 1}, {"done"}, set(), [], ApplyCounts(seq, 0, 0, 0, 0))
    return Snapshot(state, seq, ApplyCounts(1, 0, 0, 0, 0), [])


entries = st.one_of(
    st.builds(lambda seq: Applied(seq, [(f"t{seq}", "s", 1)], []), st.integers(0, 99)),
    st.builds(lambda n: Completing([f"s{i}" for i in range(n)]), st.integers(0, 3)),
    st.builds(lambda n: Persisted(["x" * n]), st.integers(0, 300)),  # some big enough to grow the log
    st.builds(snapshot, st.integers(0, 99)),
)
ops = st.one_of(
    st.builds(lambda h: OpenJournal(who(h)), st.sampled_from(HANDLES)),
    st.builds(JournalEntry, st.sampled_from(HANDLES), st.integers(1, 12), entries),
    st.builds(ForgetWriter, st.sampled_from(HANDLES)),
)
steps = st.lists(
    st.one_of(st.lists(ops, min_size=1, max_size=4), st.sampled_from(["reopen", "settle"])),
    max_size=30,
)


class Model:
    """The journal's meaning: who each writer is, and its entries by index."""

    def __init__(self) -> None:
        self.opened: dict[str, OpenJournal] = {}
        self.entries: dict[str, dict[int, Entry]] = {}

    def commit(self, commit: list[JournalOp]) -> None:
        for op in commit:
            if isinstance(op, OpenJournal):
                self.opened[op.opened.handle] = op
            elif isinstance(op, JournalEntry):
                indexed = self.entries.setdefault(op.handle, {})
                if isinstance(op.entry, Snapshot):
                    for before in [i for i in indexed if i < op.index]:
                        del indexed[before]
                indexed[op.index] = op.entry
            else:
                self.opened.pop(op.handle, None)
                self.entries.pop(op.handle, None)

    def load(self) -> list[JournaledWriter]:
        found = []
        for handle in sorted(self.opened, key=str.encode):
            indexed = sorted(self.entries.get(handle, {}).items())
            last = indexed[-1][0] if indexed else 0
            found.append(JournaledWriter(self.opened[handle].opened, [e for _, e in indexed], last))
        return found

    def count(self) -> int:
        return sum(len(indexed) for indexed in self.entries.values())


@contextmanager
def folders() -> Iterator[tuple[Path, Path]]:
    with tempfile.TemporaryDirectory() as log_dir, tempfile.TemporaryDirectory() as lmdb_dir:
        yield Path(log_dir), Path(lmdb_dir)


@pytest.mark.parametrize("compact_min_bytes", [journal_log.COMPACT_MIN_BYTES, 1 << 10])
@settings(PROFILE)
@given(history=steps)
def test_the_log_loads_what_the_model_and_the_lmdb_journal_hold(
    history: list[list[JournalOp] | str], compact_min_bytes: int
) -> None:
    saved = journal_log.COMPACT_MIN_BYTES
    journal_log.COMPACT_MIN_BYTES = compact_min_bytes  # the lower one rewrites the log often
    try:
        model = Model()
        with folders() as (log_dir, lmdb_dir):
            journal, lmdb = LogJournal(log_dir), LmdbJournal(lmdb_dir)
            try:
                for step in history:
                    if step == "reopen":  # stops a rewrite under way, if any (the log stays as it was)
                        journal.close()
                        journal = LogJournal(log_dir)
                    elif step == "settle":
                        journal.wait_rewritten()
                        assert journal.size_bytes() == (log_dir / journal_log.LOG_FILENAME).stat().st_size
                    else:
                        assert isinstance(step, list)
                        journal.commit(step)
                        lmdb.commit(step)
                        model.commit(step)
                    assert journal.load() == model.load() == lmdb.load()
                    assert journal.entries() == model.count() == lmdb.entries()
                journal.close()
                journal = LogJournal(log_dir)
                assert journal.load() == model.load()
            finally:
                journal.close()
                lmdb.close()
    finally:
        journal_log.COMPACT_MIN_BYTES = saved
