"""SqlRegistry on real databases: SQLite in tmp_path and PostgreSQL (marker ``postgres``)."""

from __future__ import annotations

import sqlite3
import threading
from contextlib import closing
from pathlib import Path

import pytest
import sqlalchemy as sa

from tally_server.domain.ports import CheckpointRecord, EventRecord, ProgressRecord, WriterRecord
from tally_server.store import registry as registry_module
from tally_server.store.registry import SqlRegistry, default_sqlite_url


def writer(handle: str, checkpoint: str = "run", **overrides: object) -> WriterRecord:
    record = WriterRecord(
        handle=handle,
        checkpoint=checkpoint,
        writer_id=f"host-{handle}",
        host="node-7",
        pid=4242,
        labels={"slurm_job_id": "981", "note": "ünïcode ✓"},
        fingerprint={"pipeline": "abc123", "input": "def456"},
        state="open",
        opened_at=1_700_000_000.125,
        last_seen_at=1_700_000_010.5,
    )
    for name, value in overrides.items():
        setattr(record, name, value)
    return record


def checkpoint(registry: SqlRegistry, name: str) -> CheckpointRecord | None:
    return next((c for c in registry.list_checkpoints() if c.name == name), None)


def test_checkpoints_upsert_get_list(registry: SqlRegistry) -> None:
    assert checkpoint(registry, "curation/run-42") is None
    assert registry.list_checkpoints() == []

    first = CheckpointRecord("curation/run-42", 1_700_000_000.0, 1_700_000_000.0, {"pipeline": "p1"})
    registry.write_batch(checkpoints=[first])
    registry.write_batch(checkpoints=[CheckpointRecord("alpha", 1.5, 2.25)])

    assert checkpoint(registry, "curation/run-42") == first
    assert checkpoint(registry, "alpha") == CheckpointRecord("alpha", 1.5, 2.25, {})

    updated = CheckpointRecord("curation/run-42", 1_700_000_000.0, 1_700_000_123.456789, {"pipeline": "p2"})
    registry.write_batch(checkpoints=[updated])

    assert checkpoint(registry, "curation/run-42") == updated
    assert [c.name for c in registry.list_checkpoints()] == ["alpha", "curation/run-42"]
    assert registry.list_checkpoints()[1] == updated


def test_writers_upsert_list_round_trip(registry: SqlRegistry) -> None:
    a = writer("h-a")
    b = writer("h-b", opened_at=1_700_000_001.0, labels={}, fingerprint={})
    other = writer("h-c", checkpoint="other")
    for record in (b, a, other):
        registry.write_batch(writers=[record])

    assert registry.list_writers("run") == [a, b]  # oldest first
    assert registry.list_writers("other") == [other]
    assert registry.list_writers("missing") == []

    a_later = writer(
        "h-a",
        state="closed",
        last_seen_at=1_700_000_099.0,
        closed_at=1_700_000_100.0,
        pending_sources=3,
        applied=2**40,  # counters outgrow 32 bits on long runs
        skipped=5,
        rewritten=6,
        anomalies=7,
        completed=8,
        labels={"k": "v2"},
    )
    registry.write_batch(writers=[a_later])

    assert registry.list_writers("run") == [a_later, b]
    # By handle (a close sent again after a restart is answered from there).
    assert registry.find_writer("h-a") == a_later
    assert registry.find_writer("h-c") == other
    assert registry.find_writer("h-missing") is None


def test_one_batch_of_many_rows_inserts_the_new_and_updates_the_known(registry: SqlRegistry) -> None:
    """A flush carries a row per writer that beat since the last one (one statement a table)."""
    known = [writer(f"h-{i}", opened_at=1_700_000_000.0 + i) for i in range(5)]
    registry.write_batch(writers=known, checkpoints=[CheckpointRecord("run", 1.0, 2.0)])
    beaten = [writer(f"h-{i}", opened_at=1_700_000_000.0 + i, last_seen_at=2e9 + i) for i in range(0, 5, 2)]
    new = [writer(f"h-{i}", opened_at=1_700_000_000.0 + i, labels={"n": str(i)}) for i in range(5, 8)]
    registry.write_batch(
        writers=[*beaten, *new],
        checkpoints=[CheckpointRecord("run", 1.0, 3.0, {"p": "1"}), CheckpointRecord("other", 4.0, 5.0)],
    )
    expected = {r.handle: r for r in [*known, *beaten, *new]}
    assert registry.list_writers("run") == sorted(expected.values(), key=lambda r: r.opened_at)
    assert registry.list_checkpoints() == [
        CheckpointRecord("other", 4.0, 5.0),
        CheckpointRecord("run", 1.0, 3.0, {"p": "1"}),
    ]


def test_mark_open_writers(registry: SqlRegistry) -> None:
    registry.write_batch(writers=[writer("h-1")])
    registry.write_batch(writers=[writer("h-2", checkpoint="other", opened_at=1_700_000_005.0)])
    closed = writer("h-3", state="closed", closed_at=1_700_000_050.0)
    registry.write_batch(writers=[closed])

    marked = registry.mark_open_writers("lost", 1_700_000_200.0)

    assert [(w.handle, w.state, w.closed_at) for w in marked] == [
        ("h-1", "lost", 1_700_000_200.0),
        ("h-2", "lost", 1_700_000_200.0),
    ]
    assert marked[0].labels == writer("h-1").labels
    assert {w.handle: w.state for w in registry.list_writers("run")} == {"h-1": "lost", "h-3": "closed"}
    assert registry.list_writers("run")[1] == closed
    assert registry.mark_open_writers("lost", 1_700_000_300.0) == []


def test_mark_open_writers_of_owned_checkpoints_leaves_the_others_open(
    registry: SqlRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry_module, "_HANDLES_PER_STATEMENT", 2)  # several statements
    mine = [writer(f"h-{i}", checkpoint=f"a/{i % 2}", opened_at=1_700_000_000.0 + i) for i in range(5)]
    theirs = [writer("h-b", checkpoint="b/0"), writer("h-c", checkpoint="c")]
    registry.write_batch(writers=[*mine, *theirs, writer("h-x", checkpoint="a/0", state="closed")])

    marked = registry.mark_open_writers("lost", 1_700_000_200.0, ["h-3"], lambda name: name.startswith("a/"))

    assert [(w.handle, w.state, w.closed_at) for w in marked] == [
        (h, "lost", 1_700_000_200.0) for h in ("h-0", "h-1", "h-2", "h-4")
    ]
    assert marked[0].labels == writer("h-0").labels
    states = {w.handle: w.state for cp in ("a/0", "a/1", "b/0", "c") for w in registry.list_writers(cp)}
    assert states == {
        "h-0": "lost", "h-1": "lost", "h-2": "lost", "h-3": "open", "h-4": "lost",
        "h-x": "closed", "h-b": "open", "h-c": "open",
    }  # fmt: skip
    assert registry.mark_open_writers("lost", 1_700_000_300.0, (), lambda name: False) == []
    assert [w.handle for w in registry.mark_open_writers("lost", 1_700_000_300.0)] == ["h-b", "h-c", "h-3"]


@pytest.mark.postgres
def test_a_writer_opened_while_owned_writers_are_marked_is_left_open(registry_postgres_url: str) -> None:
    """Between the read of the open writers and their update, another coordinator opens one."""
    with SqlRegistry(registry_postgres_url) as registry, SqlRegistry(registry_postgres_url) as other:
        registry.write_batch(writers=[writer("h-old", checkpoint="a/1")])
        opened: list[str] = []

        def open_meanwhile(conn: object, cursor: object, statement: str, *args: object) -> None:
            if statement.lstrip().upper().startswith("UPDATE WRITERS") and not opened:
                opened.append("h-new")
                other.write_batch(writers=[writer("h-new", checkpoint="a/1", opened_at=1_700_000_001.0)])

        sa.event.listen(registry._engine, "before_cursor_execute", open_meanwhile)
        marked = registry.mark_open_writers("lost", 1_700_000_200.0, (), lambda name: True)

        assert opened == ["h-new"]
        assert [w.handle for w in marked] == ["h-old"]
        assert {w.handle: w.state for w in registry.list_writers("a/1")} == {"h-old": "lost", "h-new": "open"}


def test_events_newest_first_with_paging(registry: SqlRegistry) -> None:
    added: list[EventRecord] = []
    for i in range(7):
        event = EventRecord(
            checkpoint="run",
            kind="anomaly" if i % 2 else "writer_opened",
            message=f"event {i}",
            at=1_700_000_000.0 + i,
            writer_id=None if i == 0 else f"host-{i}",
            data={"task_id": f"t{i}", "old": -1, "new": i, "nested": {"ok": True, "list": [1, "x"]}},
        )
        registry.write_batch(events=[event])
        added.append(event)
        registry.write_batch(events=[EventRecord("other", "writer_opened", f"noise {i}", 0.0)])

    ids = [e.id for e in added if isinstance(e.id, int)]  # write_batch stores the new id
    assert len(ids) == len(added)
    assert ids == sorted(ids)

    newest = registry.list_events("run")
    assert newest == list(reversed(added))
    assert newest[-1].writer_id is None
    assert newest[0].data == {"task_id": "t6", "old": -1, "new": 6, "nested": {"ok": True, "list": [1, "x"]}}

    page1 = registry.list_events("run", limit=3)
    page2 = registry.list_events("run", limit=3, before_id=page1[-1].id)
    page3 = registry.list_events("run", limit=3, before_id=page2[-1].id)
    assert [e.message for e in page1 + page2 + page3] == [f"event {i}" for i in range(6, -1, -1)]
    assert len(page3) == 1
    assert registry.list_events("run", limit=3, before_id=ids[0]) == []
    assert registry.list_events("run", limit=0) == []
    assert registry.list_events("missing") == []


def test_a_batch_of_events_is_one_insert_and_keeps_their_order(registry: SqlRegistry) -> None:
    """A batch's events (e.g. a batch's first 20 anomalies and its summary) are one INSERT, not one
    each, and their ids still increase in the order they happened, across checkpoints."""
    first = EventRecord("run", "writer_opened", "before", 0.0)
    registry.write_batch(events=[first])
    inserts: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO EVENTS"):
            inserts.append(statement)

    sa.event.listen(registry._engine, "before_cursor_execute", count)
    batch = [
        EventRecord("other" if i % 3 == 0 else "run", "anomaly", f"event {i}", 1.0 + i, f"w{i}", {"i": i})
        for i in range(21)
    ]
    registry.write_batch(events=batch)
    assert len(inserts) == 1

    ids = [e.id for e in batch]
    assert all(isinstance(i, int) and first.id is not None and i > first.id for i in ids)
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    ran = [e for e in batch if e.checkpoint == "run"]
    assert registry.list_events("run") == [*reversed(ran), first]
    assert registry.list_events("other") == list(reversed([e for e in batch if e.checkpoint == "other"]))
    older = registry.list_events("run", limit=5, before_id=ran[7].id)
    assert [e.message for e in older] == [e.message for e in reversed(ran[2:7])]

    # More rows than one statement takes (1,000): still in order from one statement to the next.
    many = [EventRecord("many", "anomaly", f"m{i}", 2.0, None, {"i": i}) for i in range(2500)]
    registry.write_batch(events=many)
    assert [e.id for e in many] == sorted(e.id for e in many if e.id is not None)
    assert [e.data["i"] for e in registry.list_events("many", limit=3000)] == list(range(2499, -1, -1))


def test_state_survives_reopening(registry_url: str) -> None:
    with SqlRegistry(registry_url) as first:
        first.write_batch(checkpoints=[CheckpointRecord("run", 1.0, 2.0, {"input": "x"})])
        first.write_batch(writers=[writer("h-1")])
        first.write_batch(events=[EventRecord("run", "writer_opened", "opened", 3.0, "host-h-1")])

    with SqlRegistry(registry_url) as second:  # already at the newest revision: nothing to upgrade
        assert checkpoint(second, "run") == CheckpointRecord("run", 1.0, 2.0, {"input": "x"})
        assert second.list_writers("run") == [writer("h-1")]
        assert [e.message for e in second.list_events("run")] == ["opened"]


def test_default_sqlite_url_creates_a_wal_database_in_the_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "not" / "yet" / "there"
    url = default_sqlite_url(data_dir)
    assert url == f"sqlite:///{data_dir / 'registry.sqlite3'}"

    with SqlRegistry(url) as reg:
        reg.write_batch(checkpoints=[CheckpointRecord("run", 1.0, 1.0)])

    with closing(sqlite3.connect(data_dir / "registry.sqlite3")) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        indexes = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"checkpoints", "writers", "events"} <= tables
    assert {"ix_writers_checkpoint", "ix_events_checkpoint_id"} <= indexes


def test_registry_can_be_used_from_another_thread(tmp_path: Path) -> None:
    with SqlRegistry(default_sqlite_url(tmp_path)) as reg:
        reg.write_batch(checkpoints=[CheckpointRecord("run", 1.0, 1.0)])
        results: list[object] = []
        thread = threading.Thread(target=lambda: results.append(checkpoint(reg, "run")))
        thread.start()
        thread.join()

    assert results == [CheckpointRecord("run", 1.0, 1.0)]


def test_unsupported_database_is_refused() -> None:
    with pytest.raises(ValueError, match="sqlite"):
        SqlRegistry("mysql+pymysql://user@localhost/db")


def test_progress_samples_round_trip_and_reset(registry: SqlRegistry) -> None:
    registry.write_batch(
        samples=[
            ProgressRecord("run", 10.0, 1),
            ProgressRecord("run", 20.5, 7),
            ProgressRecord("other", 15.0, 3),
        ]
    )
    registry.write_batch(samples=[])
    assert registry.list_samples("run") == [ProgressRecord("run", 10.0, 1), ProgressRecord("run", 20.5, 7)]
    assert registry.list_samples("run", since=11.0) == [ProgressRecord("run", 20.5, 7)]
    registry.delete_samples("run")
    assert registry.list_samples("run") == []
    assert registry.list_samples("other") == [ProgressRecord("other", 15.0, 3)]
