"""The SDK's status and admin methods against a real coordinator, over gRPC and over HTTP.

Each test runs once per transport on its own checkpoint of one shared server; the congruence test
reads one checkpoint through both transports and expects identical answers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

import tally
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import nemo_read, tree

TRANSPORTS = ["grpc", "http"]


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(tmp_path_factory.mktemp("sdk-status") / "data", settle_ms=0) as srv:
        yield srv


def address_of(server: RunningServer, transport: str) -> str:
    return f"grpc://{server.grpc_address}" if transport == "grpc" else server.http_url


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def client(shared_server: RunningServer, transport: str) -> Iterator[tally.Client]:
    with tally.Client(address_of(shared_server, transport), timeout=20) as c:
        yield c


@pytest.fixture
def name(request: pytest.FixtureRequest, transport: str) -> str:
    """A checkpoint name of this test and transport."""
    return f"sdk/{request.node.originalname}/{transport}"


def complete(client: tally.Client, checkpoint: str, sources: list[str], **writer: object) -> None:
    with client.writer(checkpoint, **writer) as w:  # type: ignore[arg-type]
        for s in sources:
            w.apply_deltas(tree(s))
        w.flush()


def test_writers_live_and_closed(client: tally.Client, name: str) -> None:
    complete(client, name, ["a", "b"], writer_id="done-1", labels={"slurm_job_id": "7"})
    labels = {"slurm_job_id": "8", "slurm_array_task_id": "3"}
    with client.writer(name, writer_id="live-1", labels=labels) as w:
        w.apply_deltas(tree("c") + [("0_d", "d", 1)])
        w.flush()
        (live,) = client.writers(name)
        assert (live.writer_id, live.pending_sources, live.closed_at) == ("live-1", 1, 0.0)
        assert live.labels == labels and live.pid > 0 and live.host
        assert live.counts.completed == 1 and live.counts.applied == 7
        assert live.opened_at <= live.last_seen_at <= time.time() + 1
        every = client.writers(name, include_closed=True)
        assert [w.writer_id for w in every] == ["live-1", "done-1"]
        closed = every[1]
        assert closed.state != live.state and closed.closed_at >= closed.opened_at > 0
        assert closed.counts.completed == 2 and closed.labels["slurm_job_id"] == "7"
        assert len(client.writers(name, include_closed=True, limit=1)) == 1
    assert client.writers(name) == []


def test_events_page_backwards_through_everything(client: tally.Client, name: str) -> None:
    complete(client, name, ["a"], writer_id="w-0")
    with client.writer(name, writer_id="w-1") as w:
        w.apply_deltas([("0_a_late", "a", -1)])  # a delta for a completed source: anomaly
        w.flush()
    for i in range(2, 5):
        complete(client, name, [], writer_id=f"w-{i}")
    newest = client.events(name, limit=100)
    assert newest.next_before_id is None
    ids = [e.id for e in newest.events]
    assert ids == sorted(ids, reverse=True) and len(ids) == len(set(ids)) >= 11
    (anomaly,) = [e for e in newest.events if e.kind == "anomaly"]
    assert anomaly.writer_id == "w-1" and anomaly.checkpoint == name
    assert anomaly.data["source_id"] == "a" and anomaly.data["task_id"] == "0_a_late"
    assert "a" in anomaly.message and anomaly.at > 0

    paged: list[int] = []
    before: int | None = None
    while True:
        page = client.events(name, limit=3, before_id=before)
        assert len(page.events) <= 3
        paged += [e.id for e in page.events]
        if page.next_before_id is None:
            break
        before = page.next_before_id
    assert paged == ids


def test_progress_ends_at_the_live_count(client: tally.Client, name: str) -> None:
    start = time.time()
    complete(client, name, [f"s{i}" for i in range(4)])
    samples = client.progress(name)
    assert samples and samples[-1].completed_count == 4
    assert [s.at for s in samples] == sorted(s.at for s in samples)
    assert all(s.at >= start - 1 for s in client.progress(name, since=start - 1))
    assert client.progress(name, since=time.time() + 3600)[-1].completed_count == 4


def test_completed_pages_in_byte_order(client: tally.Client, name: str) -> None:
    sources = [f"src-{i:03d}" for i in range(23)] + ["é-accent", "Z-upper"]
    complete(client, name, sources)
    assert list(client.completed(name, page_size=7)) == sorted(sources, key=str.encode)
    assert list(client.completed(name)) == sorted(sources, key=str.encode)


def test_import_adopts_ids_in_chunks(client: tally.Client, name: str, shared_server: RunningServer) -> None:
    ids = [f"imp-{i:06d}" for i in range(50_003)]
    result = client.import_completed(name, ids, import_id="imported-1")
    assert result == tally.ImportResult(imported=50_003, completed_count=50_003)
    again = client.import_completed(name, ids[:10] + ["extra"], import_id="imported-2")
    assert again == tally.ImportResult(imported=1, completed_count=50_004)
    assert client.are_completed(name, ["imp-000000", "imp-050002", "extra", "nope"]) == [
        True,
        True,
        True,
        False,
    ]
    folder = shared_server.data_dir / "checkpoints" / name
    assert (folder / ".nemo_curator_metadata" / "imported-1.mdb").exists()
    assert nemo_read(folder) == set(ids) | {"extra"}
    with pytest.raises(tally.InvalidArgument):
        client.import_completed(name, ["x"], import_id="../escape")


def test_reset_refuses_live_writers_unless_forced(
    client: tally.Client, name: str, shared_server: RunningServer
) -> None:
    complete(client, name, ["a", "b"], writer_id="first")
    w = client.writer(name, writer_id="running")
    w.open()
    w.apply_deltas(tree("c"))
    w.flush()
    with pytest.raises(tally.FailedPrecondition, match="live writer"):
        client.reset(name)
    assert client.are_completed(name, ["a", "b", "c"]) == [True, True, True]
    result = client.reset(name, force=True)
    assert result.writers_closed == 1 and result.files_moved == 2
    assert result.moved_to.startswith(".trash/")
    trash = shared_server.data_dir / result.moved_to
    assert sorted(p.name for p in trash.rglob("*.mdb")) == ["first.mdb", "running.mdb"]
    assert client.are_completed(name, ["a", "b", "c"]) == [False, False, False]
    # The forced reset closed the running writer: its client learns so, loudly.
    with pytest.raises(tally.LeaseLost):
        w.close()
    assert client.checkpoint(name).completed_count == 0
    assert any(e.kind == "checkpoint_reset" for e in client.events(name).events)


def test_watch_follows_progress(client: tally.Client, name: str) -> None:
    complete(client, name, ["a"])
    stream = client.watch(name, interval_s=0.05)
    first = next(stream)
    assert first.name == name and first.completed_count == 1
    feeder = threading.Thread(target=complete, args=(client, name, ["b", "c"]))
    feeder.start()
    try:
        counts = [first.completed_count]
        while counts[-1] < 3:
            counts.append(next(stream).completed_count)
    finally:
        feeder.join(30)
        stream.close()  # type: ignore[attr-defined]
    assert counts == sorted(counts) and counts[-1] == 3


def test_unknown_checkpoint_is_not_found(client: tally.Client) -> None:
    for call in (
        lambda: client.writers("sdk/none"),
        lambda: client.events("sdk/none"),
        lambda: client.progress("sdk/none"),
        lambda: list(client.completed("sdk/none")),
        lambda: client.reset("sdk/none"),
        lambda: next(client.watch("sdk/none")),
    ):
        with pytest.raises(tally.NotFound):
            call()


def test_async_client_matches(shared_server: RunningServer, transport: str, name: str) -> None:
    with tally.Client(address_of(shared_server, transport)) as c:
        complete(c, name, ["a", "b", "c"], writer_id="w", labels={"slurm_job_id": "1"})

    async def main() -> dict[str, object]:
        async with tally.AsyncClient(address_of(shared_server, transport)) as client:
            writers = await client.writers(name, include_closed=True)
            events = await client.events(name, limit=2)
            progress = await client.progress(name)
            ids = [s async for s in client.completed(name, page_size=2)]
            imported = await client.import_completed(name, ["c", "d"], import_id="async-import")
            watched = None
            async for status in client.watch(name, interval_s=0.05):
                watched = status.completed_count
                break
            with pytest.raises(tally.FailedPrecondition):
                async with client.writer(name, writer_id="blocker"):
                    await client.reset(name)
            reset = await client.reset(name)
            return {
                "writers": [(w.writer_id, w.labels, w.counts.completed) for w in writers],
                "events": len(events.events),
                "progress": progress[-1].completed_count,
                "ids": ids,
                "imported": imported,
                "watched": watched,
                "reset": reset.files_moved,
            }

    assert asyncio.run(main()) == {
        "writers": [("w", {"slurm_job_id": "1"}, 3)],
        "events": 2,
        "progress": 3,
        "ids": ["a", "b", "c"],
        "imported": tally.ImportResult(1, 4),
        "watched": 4,
        "reset": 2,
    }


def test_grpc_and_http_answer_the_same(tmp_path: Path) -> None:
    checkpoint = "sdk/congruence"
    with running_server(tmp_path / "data", settle_ms=0) as server:
        clients = {t: tally.Client(address_of(server, t)) for t in TRANSPORTS}
        try:
            writer_client = clients["grpc"]
            complete(writer_client, checkpoint, ["a", "b"], writer_id="w0", labels={"slurm_job_id": "5"})
            with writer_client.writer(checkpoint, writer_id="w1") as w:
                w.apply_deltas(tree("c") + [("0_a_x", "a", 1), ("0_d", "d", 1)])
                w.flush()
                answers = {}
                for t, c in clients.items():
                    answers[t] = {
                        "writers": [_no_heartbeat(w) for w in c.writers(checkpoint, include_closed=True)],
                        "events": [c.events(checkpoint, limit=2, before_id=b) for b in (None, 3)],
                        "severities": {e.kind: e.severity for e in c.events(checkpoint, limit=100).events},
                        "progress": c.progress(checkpoint)[-1].completed_count,
                        "completed": list(c.completed(checkpoint, page_size=1)),
                        "watch": _strip_times(next(iter(c.watch(checkpoint)))),
                    }
            assert answers["grpc"] == answers["http"]
            assert answers["grpc"]["completed"] == ["b", "c"]  # "a" was un-completed by the anomaly
            assert answers["grpc"]["severities"] == {
                "checkpoint_created": tally.Severity.INFO,
                "writer_opened": tally.Severity.INFO,
                "writer_closed": tally.Severity.INFO,
                "anomaly": tally.Severity.WARNING,
            }
            imports = {
                t: c.import_completed(checkpoint, ["x", "y"], import_id=f"imp-{t}")
                for t, c in clients.items()
            }
            assert imports == {"grpc": tally.ImportResult(2, 4), "http": tally.ImportResult(0, 4)}
            resets = {t: c.reset(checkpoint) for t, c in clients.items()}
            # w0.mdb, w1.mdb and imp-grpc.mdb; the HTTP import added nothing, so wrote no file.
            assert (resets["grpc"].files_moved, resets["http"].files_moved) == (3, 0)
        finally:
            for c in clients.values():
                c.close()


def _no_heartbeat(writer: tally.WriterStatus) -> tally.WriterStatus:
    # last_seen_at moves with every heartbeat; everything else must match exactly.
    return replace(writer, last_seen_at=0.0)


def _strip_times(status: tally.CheckpointStatus) -> tally.CheckpointStatus:
    return replace(status, writers=tuple(_no_heartbeat(w) for w in status.writers))
