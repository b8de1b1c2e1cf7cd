"""The journal's append-only log: a tail torn by a crash is dropped and cut off, the log is rewritten
once mostly dead (beside the commits, none lost, a crash at any point of it harmless, a failed one
tried again later), a former LMDB journal is migrated, and a full disk leaves no partial record
(one that cannot be cut off refuses commits until it is)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tally_server.domain.journal import Completing, JournaledWriter, Persisted, Snapshot
from tally_server.domain.ledger import ApplyCounts, LedgerState
from tally_server.domain.ports import CompletionWriteError, ForgetWriter, JournalEntry, JournalOp, OpenJournal
from tally_server.store import journal_format, journal_log
from tally_server.store.journal import LMDB_JOURNAL_FILENAME, LmdbJournal
from tally_server.store.journal_log import LOG_FILENAME, LogJournal
from tests.property.test_journal_log_model import Model
from tests.small_disk import Filler, small_tmpfs
from tests.unit.store.test_journal import batch, who


def history() -> list[list[JournalOp]]:
    """Commits of two writers: entries, a snapshot, a writer forgotten, a third opened."""
    state = LedgerState({"s": 1}, {"t1": 1}, {"done"}, set(), [], ApplyCounts(3, 0, 0, 0, 1))
    return [
        [OpenJournal(who("a")), OpenJournal(who("b"))],
        [JournalEntry("a", i, batch(i)) for i in range(1, 4)],
        [JournalEntry("b", 1, Completing(["s"])), JournalEntry("a", 4, Persisted(["s"]))],
        [JournalEntry("a", 5, Snapshot(state, 3, ApplyCounts(1, 0, 0, 0, 0), ["done"]))],
        [JournalEntry("a", 6, batch(4)), ForgetWriter("b"), OpenJournal(who("c"))],
        [JournalEntry("c", 1, batch(5))],
    ]


def run(
    data_dir: Path, commits: list[list[JournalOp]], journal_class: type[LogJournal | LmdbJournal] = LogJournal
) -> list[JournaledWriter]:
    journal = journal_class(data_dir)
    for ops in commits:
        journal.commit(ops)
    loaded = journal.load()
    journal.close()
    return loaded


def load(data_dir: Path) -> list[JournaledWriter]:
    journal = LogJournal(data_dir)
    try:
        return journal.load()
    finally:
        journal.close()


def last_record_at(path: Path) -> int:
    """The offset of the log's last record (walking the records from the header on)."""
    data, at, last = path.read_bytes(), journal_format.HEADER.size, -1
    while at < len(data):
        length, _ = journal_format.RECORD.unpack_from(data, at)
        last, at = at, at + journal_format.RECORD.size + length
    assert at == len(data) and last > 0
    return last


def torn(kind: str, data: bytes, last: int) -> bytes:
    if kind == "garbage after it":
        return data + b"\x07garbage that is no record"
    if kind == "zeros after it":  # a file extended by a crash before its data reached the disk
        return data + b"\0" * 64
    if kind == "cut short":
        return data[:-3]
    if kind == "only its length":
        return data[: last + 4]
    assert kind == "a byte flipped"
    middle = last + journal_format.RECORD.size + 5
    return data[:middle] + bytes([data[middle] ^ 0x40]) + data[middle + 1 :]


@pytest.mark.parametrize(
    "kind", ["garbage after it", "zeros after it", "cut short", "only its length", "a byte flipped"]
)
def test_a_torn_tail_is_dropped_and_cut_off_so_later_records_follow_good_ones(
    tmp_path: Path, kind: str
) -> None:
    commits = history()
    before = run(tmp_path, commits[:-1])
    after = run(tmp_path, commits[-1:])
    assert after != before
    path = tmp_path / LOG_FILENAME
    good_end = last_record_at(path)
    data = path.read_bytes()
    broken = torn(kind, data, good_end)
    path.write_bytes(broken)

    expected = after if kind in ("garbage after it", "zeros after it") else before
    assert load(tmp_path) == expected
    kept = len(data) if expected is after else good_end
    assert path.stat().st_size == kept  # truncated at the last good record
    assert path.read_bytes() == data[:kept]

    # A later commit lands right after the good records, and comes back (not the garbage).
    run(tmp_path, [[JournalEntry("c", 2, Persisted(["x"]))]])
    reloaded = {w.opened.handle: w for w in load(tmp_path)}
    assert reloaded["c"].entries[-1] == Persisted(["x"]) and reloaded["c"].last_index == 2
    assert set(reloaded) == {"a", "c"}


def test_a_log_that_is_not_ours_or_is_newer_is_refused(tmp_path: Path) -> None:
    path = tmp_path / LOG_FILENAME
    path.write_bytes(b"SQLite format 3\0" + b"\0" * 100)
    with pytest.raises(OSError, match="is not a Tally journal"):  # tally serve says so and exits
        LogJournal(tmp_path)
    path.write_bytes(journal_format.HEADER.pack(journal_format.MAGIC, journal_format.FORMAT_VERSION + 1))
    with pytest.raises(OSError, match="journal format 2"):
        LogJournal(tmp_path)
    assert path.stat().st_size == journal_format.HEADER.size  # left alone


def test_a_mostly_dead_log_is_rewritten_and_keeps_the_live_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(journal_log, "COMPACT_MIN_BYTES", 8 << 10)
    journal = LogJournal(tmp_path)
    path = tmp_path / LOG_FILENAME
    state = LedgerState({"s": 2}, {}, set(), {"u"}, ["s"], ApplyCounts(9, 0, 0, 0, 0))
    biggest = 0
    with caplog.at_level(logging.INFO, logger=journal_log.__name__):
        for round_ in range(60):
            handle = f"w{round_ % 7}"
            if round_ % 7 == round_ // 7 % 7:
                journal.commit([ForgetWriter(handle)])
            journal.commit([OpenJournal(who(handle))])
            base = 10 * round_
            journal.commit([JournalEntry(handle, base + i, batch(i)) for i in range(1, 6)])
            journal.commit([JournalEntry(handle, base + 6, Snapshot(state, 5, ApplyCounts(), []))])
            journal.commit([JournalEntry(handle, base + 7, Completing(["s"]))])
            journal.wait_rewritten()  # the rewrite runs beside the commits: let it finish
            biggest = max(biggest, path.stat().st_size)
            assert journal.size_bytes() == path.stat().st_size
    rewrites = [r for r in caplog.records if "rewrote the writers' journal" in r.getMessage()]
    assert len(rewrites) >= 3  # 60 rounds write ~80 KiB: the log stays near the 8 KiB threshold
    assert biggest < 16 << 10
    live, count = journal.load(), journal.entries()
    journal.close()

    reopened = LogJournal(tmp_path)
    assert reopened.load() == live and reopened.entries() == count
    assert {w.opened.handle for w in live} == {f"w{i}" for i in range(7)}
    assert all([type(e) for e in w.entries] == [Snapshot, Completing] for w in live)
    assert not (tmp_path / ".journal.log.tmp").exists()
    reopened.close()


def test_a_rewrite_interrupted_by_a_crash_leaves_the_old_log(tmp_path: Path) -> None:
    expected = run(tmp_path, history())
    (tmp_path / ".journal.log.tmp").write_bytes(b"half a rewrite")
    assert load(tmp_path) == expected
    assert not (tmp_path / ".journal.log.tmp").exists()


def test_the_start_rewrites_a_mostly_dead_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = LogJournal(tmp_path)
    for i in range(1, 200):
        journal.commit([OpenJournal(who(f"w{i}")), JournalEntry(f"w{i}", 1, batch(i))])
        journal.commit([ForgetWriter(f"w{i - 1}")])
    size = journal.size_bytes()
    journal.close()
    monkeypatch.setattr(journal_log, "COMPACT_MIN_BYTES", 1 << 10)
    reopened = LogJournal(tmp_path)
    assert reopened.size_bytes() < size // 10
    assert [(w.opened.handle, w.entries, w.last_index) for w in reopened.load()] == [
        ("w199", [batch(199)], 1)
    ]


def lmdb_journal(data_dir: Path, commits: list[list[JournalOp]]) -> list[JournaledWriter]:
    return run(data_dir, commits, LmdbJournal)


def test_a_former_lmdb_journal_is_migrated_and_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    expected = lmdb_journal(tmp_path, history())
    assert len(expected) == 2 and expected[0].entries
    with caplog.at_level(logging.INFO, logger=journal_log.__name__):
        journal = LogJournal(tmp_path)
    assert journal.load() == expected
    assert journal.entries() == sum(len(w.entries) for w in expected)
    assert not (tmp_path / LMDB_JOURNAL_FILENAME).exists()
    assert [r.getMessage() for r in caplog.records if "migrated" in r.getMessage()] == [
        f"migrated the writers' journal from {tmp_path / LMDB_JOURNAL_FILENAME} to {tmp_path / LOG_FILENAME} "
        "(2 writers, 3 entries)"
    ]
    # The writers carry on where they were, in the log.
    journal.commit([JournalEntry("a", 7, Persisted(["t"]))])
    journal.close()
    reloaded = load(tmp_path)
    assert reloaded[0].entries[-1] == Persisted(["t"]) and reloaded[0].last_index == 7


def test_with_both_journals_the_log_wins(tmp_path: Path) -> None:
    """A crash after the migrated log was renamed in place, before the LMDB file was removed."""
    commits = history()
    expected = run(tmp_path, commits)
    lmdb_journal(tmp_path, commits[:2])
    (tmp_path / (LMDB_JOURNAL_FILENAME + "-lock")).write_bytes(b"")
    assert load(tmp_path) == expected
    assert not (tmp_path / LMDB_JOURNAL_FILENAME).exists()
    assert not (tmp_path / (LMDB_JOURNAL_FILENAME + "-lock")).exists()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        yield disk


def test_a_full_disk_leaves_no_partial_record_behind(small_disk: Path) -> None:
    journal = LogJournal(small_disk)
    journal.commit(history()[0])
    size = journal.size_bytes()
    filler = Filler(small_disk)
    filler.fill(leave=32 * 4096)  # room for part of the next record
    big = JournalEntry("a", 1, Completing([f"source-{i:06d}" for i in range(20_000)]))
    with pytest.raises(CompletionWriteError, match="is full") as failed:
        journal.commit([big])
    assert failed.value.disk_full
    assert (small_disk / LOG_FILENAME).stat().st_size == size  # the partial record cut off
    assert journal.size_bytes() == size and journal.entries() == 0

    filler.free()
    journal.commit([JournalEntry("a", 1, Persisted(["s"]))])
    journal.close()
    assert [(w.opened.handle, w.entries) for w in load(small_disk)] == [("a", [Persisted(["s"])]), ("b", [])]


def test_an_entry_put_before_a_snapshot_after_it_survives_a_rewrite_and_a_migration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot dropped what came before it when it was written, not what was put after it
    (as LMDB had it): a rewritten or migrated log puts the live entries back as they are."""
    state = LedgerState({}, {}, set(), set(), [], ApplyCounts())
    commits: list[list[JournalOp]] = [
        [OpenJournal(who("a")), JournalEntry("a", 1, batch(1))],
        [JournalEntry("a", 3, Snapshot(state, 1, ApplyCounts(), []))],
        [JournalEntry("a", 2, batch(2))],
    ]
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    expected = lmdb_journal(tmp_path / "old", commits)
    assert [e for w in expected for e in w.entries] == [batch(2), Snapshot(state, 1, ApplyCounts(), [])]
    assert load(tmp_path / "old") == expected  # migrated
    assert run(tmp_path / "new", commits) == expected
    monkeypatch.setattr(journal_log, "COMPACT_MIN_BYTES", 0)
    monkeypatch.setattr(journal_log, "COMPACT_RATIO", 0)  # every open and commit rewrites the log
    assert load(tmp_path / "new") == expected
    assert run(tmp_path / "new", [[JournalEntry("b", 1, batch(1))]]) == expected
    assert load(tmp_path / "new") == expected


# --- the rewrite in the background -----------------------------------------------------------------


def churn(rounds: int) -> list[list[JournalOp]]:
    """Commits that leave mostly dead records: writers opened, their entries given way to snapshots,
    writers forgotten and opened again."""
    state = LedgerState({"s": 2}, {}, set(), {"u"}, ["s"], ApplyCounts(9, 0, 0, 0, 0))
    commits: list[list[JournalOp]] = []
    for round_ in range(rounds):
        handle = f"w{round_ % 7}"
        if round_ % 7 == round_ // 7 % 7:
            commits.append([ForgetWriter(handle)])
        commits.append([OpenJournal(who(handle))])
        base = 10 * round_
        commits.append([JournalEntry(handle, base + i, batch(i)) for i in range(1, 6)])
        commits.append([JournalEntry(handle, base + 6, Snapshot(state, 5, ApplyCounts(), []))])
        commits.append([JournalEntry(handle, base + 7, Completing([f"s{round_}"]))])
    return commits


def model_of(commits: list[list[JournalOp]]) -> list[JournaledWriter]:
    model = Model()
    for ops in commits:
        model.commit(ops)
    return model.load()


class Pauses:
    """A rewrite hook: the rewrite stops at each of ``points`` until the test lets it go on."""

    def __init__(self, *points: str) -> None:
        self.reached = {p: threading.Event() for p in points}
        self.go = {p: threading.Event() for p in points}
        self.seen: list[str] = []

    def __call__(self, point: str) -> None:
        if not self.seen or self.seen[-1] != point:
            self.seen.append(point)
        if point in self.reached:
            self.reached[point].set()
            assert self.go[point].wait(60), f"the test never let the rewrite go on from {point!r}"


def test_commits_go_on_while_the_log_is_rewritten_and_none_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The commit that starts a rewrite returns before it is written; the commits made while it
    writes the live state, and while it copies them, are in the new log (forgets, snapshots and
    opens of writers the rewritten state holds among them)."""
    monkeypatch.setattr(journal_log, "COMPACT_MIN_BYTES", 8 << 10)
    journal = LogJournal(tmp_path)
    pauses = Pauses("written", "caught up")
    journal.rewrite_hook = pauses
    commits = churn(60)
    done = 0
    with caplog.at_level(logging.INFO, logger=journal_log.__name__):
        while journal._compactor is None:  # commit until one starts a rewrite: it is paused, not waited for
            journal.commit(commits[done])
            done += 1
        assert pauses.reached["written"].wait(60)
        assert (tmp_path / ".journal.log.tmp").stat().st_size > 0
        for ops in commits[done : done + 12]:  # copied to the new log unlocked
            journal.commit(ops)
        pauses.go["written"].set()
        assert pauses.reached["caught up"].wait(60)
        for ops in commits[done + 12 : done + 20]:  # copied under the lock, just before the swap
            journal.commit(ops)
        done += 20
        old_size = journal.size_bytes()
        pauses.go["caught up"].set()
        journal.wait_rewritten()
    assert pauses.seen[-5:] == ["written", "caught up", "swapping", "renamed", "rewrote"]
    assert [r.getMessage() for r in caplog.records if "rewrote" in r.getMessage()]
    assert journal.size_bytes() == (tmp_path / LOG_FILENAME).stat().st_size < old_size
    assert not (tmp_path / ".journal.log.tmp").exists()
    assert journal.load() == model_of(commits[:done])
    journal.rewrite_hook = lambda point: None
    for ops in commits[done : done + 10]:  # the commits after the swap go to the new log
        journal.commit(ops)
    journal.close()
    assert load(tmp_path) == model_of(commits[: done + 10])


CRASHING_CHILD = """
import os, signal, sys, threading
from pathlib import Path

from tally_server.store import journal_format, journal_log
from tally_server.store.journal_log import LogJournal
from tests.unit.store.test_journal_log import churn

journal_log.COMPACT_MIN_BYTES = 8 << 10
journal_format.REWRITE_RECORD_BYTES = 1 << 10  # the live state in many writes: a crash can cut it
data_dir, point, wait = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "wait"
reached, more = threading.Event(), threading.Event()


def hook(name):
    if name == point:
        reached.set()
        if wait:  # let the commits go on meanwhile
            more.wait(60)
        os.kill(os.getpid(), signal.SIGKILL)


journal = LogJournal(data_dir)
journal.rewrite_hook = hook
after = 0
for done, ops in enumerate(churn(int(sys.argv[4])), 1):
    journal.commit(ops)
    print(done, flush=True)
    if reached.is_set():
        after += 1
        if after == 10:
            more.set()
threading.Event().wait(60)
sys.exit(f"the rewrite never reached {point!r}")
"""


@pytest.mark.parametrize(
    ("point", "wait", "temp_left"),
    [
        ("writing", True, True),  # the live state half written to the temporary file
        ("written", True, True),
        ("caught up", True, True),
        ("swapping", False, True),  # all copied and synced, not renamed
        ("renamed", False, False),  # renamed, the directory not synced
        ("rewrote", False, False),
    ],
)
def test_a_crash_at_any_point_of_a_rewrite_reopens_to_what_was_committed(
    tmp_path: Path, point: str, wait: bool, temp_left: bool
) -> None:
    rounds = 100
    root = Path(__file__).resolve().parents[3]
    child = subprocess.run(
        [sys.executable, "-c", CRASHING_CHILD, str(tmp_path), point, "wait" if wait else "", str(rounds)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    acked = int(child.stdout.split()[-1])
    commits = churn(rounds)
    assert acked < len(commits)
    assert (tmp_path / ".journal.log.tmp").exists() == temp_left
    # Every acknowledged commit is there; the one in flight when killed may be too, whole.
    assert load(tmp_path) in (model_of(commits[:acked]), model_of(commits[: acked + 1]))
    assert not (tmp_path / ".journal.log.tmp").exists()


def test_a_rewrite_the_disk_has_no_room_for_keeps_the_log_and_is_tried_again(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(journal_log, "COMPACT_MIN_BYTES", 1 << 30)  # none while the log is built
    journal = LogJournal(small_disk)
    model = Model()

    def commit(ops: list[JournalOp]) -> None:
        journal.commit(ops)
        model.commit(ops)

    commit([OpenJournal(who("a"))])
    for index in range(1, 101):  # ~100 KiB live
        commit([JournalEntry("a", index, Persisted([f"{index:04d}" * 250]))])
    for index in range(1, 201):  # ~200 KiB dead: entry 1 over and over
        commit([JournalEntry("a", 1, Persisted([f"{index:04d}" * 250]))])
    filler = Filler(small_disk)
    filler.fill(leave=8 * 4096)  # room for commits, not for the live state

    monkeypatch.setattr(journal_log, "COMPACT_MIN_BYTES", 16 << 10)
    monkeypatch.setattr(journal_log, "COMPACT_RATIO", 2)
    size = journal.size_bytes()
    with caplog.at_level(logging.INFO, logger=journal_log.__name__):
        commit([JournalEntry("b", 1, Persisted(["s"]))])  # past the threshold: starts a rewrite
        journal.wait_rewritten()
        failed = [r for r in caplog.records if "could not rewrite" in r.getMessage()]
        assert len(failed) == 1 and "No space left on device" in failed[0].getMessage()
        assert not (small_disk / ".journal.log.tmp").exists()
        assert (small_disk / LOG_FILENAME).stat().st_size == journal.size_bytes() > size  # the old log
        for i in range(2, 6):  # still taking commits, and not trying again at each one
            commit([JournalEntry("b", i, Persisted(["s"]))])
        assert journal._compactor is None
        assert len([r for r in caplog.records if "rewrite" in r.getMessage()]) == 1
        assert journal.load() == model.load()

        filler.free()  # room again: once the log has grown a little more, the rewrite is retried
        big = journal.size_bytes()
        index = 6
        while not [r for r in caplog.records if "rewrote" in r.getMessage()]:
            commit([JournalEntry("b", index, Persisted(["t" * 1000]))])
            journal.wait_rewritten()
            index += 1
            assert journal.size_bytes() < big + (40 << 10)
    assert journal.size_bytes() < big // 2
    assert journal.load() == model.load()
    journal.close()
    assert load(small_disk) == model.load()


# --- a partial record that cannot be cut off -------------------------------------------------------


@pytest.mark.parametrize("then", ["the disk is fixed", "restart"])
def test_a_partial_record_that_cannot_be_cut_off_refuses_commits_until_it_is(
    small_disk: Path, then: str
) -> None:
    """A full disk cuts a record short, and the file refuses to be truncated (append-only: the
    kernel's own EPERM). Nothing may follow the partial record: commits are refused, saying so,
    until it is cut off, by a later commit or by the next start (where its checksum fails)."""
    journal = LogJournal(small_disk)
    journal.commit(history()[0])
    path = small_disk / LOG_FILENAME
    size = journal.size_bytes()
    filler = Filler(small_disk)
    filler.fill(leave=32 * 4096)  # room for part of the next record
    if subprocess.run(["chattr", "+a", str(path)], capture_output=True).returncode != 0:
        pytest.skip("this kernel's tmpfs has no append-only attribute (chattr +a)")
    try:
        big = JournalEntry("a", 1, Completing([f"source-{i:06d}" for i in range(20_000)]))
        with pytest.raises(CompletionWriteError, match="cannot cut it off") as failed:
            journal.commit([big])
        assert "Operation not permitted" in str(failed.value) and "restart tally serve" in str(failed.value)
        partial = path.stat().st_size
        assert partial > size  # the partial record is there
        filler.free()  # room again, but the partial record still cannot be cut off
        with pytest.raises(CompletionWriteError, match="accepts no commit until it can"):
            journal.commit([JournalEntry("a", 1, Persisted(["s"]))])
        assert path.stat().st_size == partial  # nothing appended after it
        assert journal.entries() == 0
    finally:
        subprocess.run(["chattr", "-a", str(path)], check=True)
    if then == "restart":
        journal.close()
        journal = LogJournal(small_disk)
        assert path.stat().st_size == size
    journal.commit([JournalEntry("a", 1, Persisted(["s"]))])
    journal.close()
    assert [(w.opened.handle, w.entries) for w in load(small_disk)] == [("a", [Persisted(["s"])]), ("b", [])]
    assert path.stat().st_size > size


def test_the_memory_the_live_state_takes_follows_it(tmp_path: Path) -> None:
    journal = LogJournal(tmp_path)
    assert journal.memory_bytes() == 0
    journal.commit(
        [OpenJournal(who("a"))] + [JournalEntry("a", i, Persisted(["x" * 1000])) for i in range(1, 101)]
    )
    held = journal.memory_bytes()
    assert 100 * 1000 < held < 100 * 1300  # the entries' bytes, and a little for Python's objects
    journal.commit(
        [
            JournalEntry(
                "a", 101, Snapshot(LedgerState({}, {}, set(), set(), [], ApplyCounts()), 1, ApplyCounts(), [])
            )
        ]
    )
    assert journal.memory_bytes() < 1000  # the snapshot let the entries go
    journal.commit([JournalEntry("a", 102, Persisted(["x" * 1000]))])
    after = journal.memory_bytes()
    journal.close()
    reopened = LogJournal(tmp_path)
    assert reopened.memory_bytes() == after
    reopened.commit([ForgetWriter("a")])
    assert reopened.memory_bytes() == 0
    reopened.close()


def test_closing_during_a_rewrite_stops_it_and_keeps_the_old_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_log, "COMPACT_MIN_BYTES", 8 << 10)
    journal = LogJournal(tmp_path)
    pauses = Pauses("written")
    journal.rewrite_hook = pauses
    commits = churn(60)
    done = 0
    while journal._compactor is None:
        journal.commit(commits[done])
        done += 1
    assert pauses.reached["written"].wait(60)
    size = journal.size_bytes()
    waiting = threading.Event()  # close() said the rewrite must stop, and waits for it
    wait_rewritten = journal.wait_rewritten
    monkeypatch.setattr(journal, "wait_rewritten", lambda: (waiting.set(), wait_rewritten()))
    closing = threading.Thread(target=journal.close)
    closing.start()
    assert waiting.wait(60)
    pauses.go["written"].set()
    closing.join(60)
    assert not closing.is_alive()
    assert "swapping" not in pauses.seen  # stopped before the swap
    assert not (tmp_path / ".journal.log.tmp").exists()
    assert (tmp_path / LOG_FILENAME).stat().st_size == size  # the old log, as it was
    assert load(tmp_path) == model_of(commits[:done])
