"""The registry behind a real server, on SQLite (default) and on PostgreSQL; leases that expire."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa

from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import running_server


def run_and_read_registry(
    data: Path, registry_url: str | None
) -> tuple[list[tuple[str, str, int]], list[str]]:
    with running_server(data, settle_ms=0, registry_url=registry_url) as server:
        with grpc.insecure_channel(server.grpc_address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            handle = stub.OpenWriter(
                pb.OpenWriterRequest(
                    checkpoint="reg/a", writer_id="array-3", labels={"slurm_array_task_id": "3"}
                )
            ).handle
            deltas = [
                pb.Delta(task_id="0_s", source_id="s", delta=1),
                pb.Delta(task_id="0_s_0", source_id="s", delta=-1),
            ]
            stub.ApplyDeltas(pb.ApplyDeltasRequest(handle=handle, deltas=deltas))
            stub.ApplyDeltas(
                pb.ApplyDeltasRequest(handle=handle, deltas=[pb.Delta(task_id="0_t", source_id="t", delta=1)])
            )
            stub.CloseWriter(pb.CloseWriterRequest(handle=handle))
    url = registry_url or f"sqlite:///{data / 'registry.sqlite3'}"
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            writers = [
                (r.writer_id, r.state, r.completed)
                for r in conn.execute(sa.text("SELECT writer_id, state, completed FROM writers"))
            ]
            events = [r.kind for r in conn.execute(sa.text("SELECT kind FROM events ORDER BY id"))]
    finally:
        engine.dispose()
    return writers, events


def test_default_registry_is_sqlite_in_the_data_dir(tmp_path: Path) -> None:
    writers, events = run_and_read_registry(tmp_path / "data", None)
    assert writers == [("array-3", "closed", 1)]
    assert events == ["checkpoint_created", "writer_opened", "writer_closed"]


@pytest.mark.postgres
def test_registry_on_postgresql(tmp_path: Path, postgres_url: str) -> None:
    writers, events = run_and_read_registry(tmp_path / "data", postgres_url)
    assert writers == [("array-3", "closed", 1)]
    assert events == ["checkpoint_created", "writer_opened", "writer_closed"]
    assert not (tmp_path / "data" / "registry.sqlite3").exists()


def test_expired_lease_closes_the_writer_and_drops_pending(tmp_path: Path) -> None:
    with running_server(tmp_path / "data", settle_ms=0, lease_ttl_s=0.5) as server:
        with grpc.insecure_channel(server.grpc_address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            handle = stub.OpenWriter(pb.OpenWriterRequest(checkpoint="lease/a", writer_id="silent")).handle
            stub.ApplyDeltas(
                pb.ApplyDeltasRequest(handle=handle, deltas=[pb.Delta(task_id="0_s", source_id="s", delta=1)])
            )
            # Wait for the reaper by blocking on a condition the server reports, bounded by the test timeout.
            status = stub.GetCheckpoint(pb.GetCheckpointRequest(name="lease/a"))
            while status.live_writers:
                status = stub.GetCheckpoint(
                    pb.GetCheckpointRequest(name="lease/a"), wait_for_ready=True, timeout=5
                )
            assert status.pending_sources == 0
            with pytest.raises(grpc.RpcError) as lost:
                stub.KeepAlive(pb.KeepAliveRequest(handle=handle))
            assert lost.value.code() == grpc.StatusCode.NOT_FOUND
            # The writer id is free again.
            stub.OpenWriter(pb.OpenWriterRequest(checkpoint="lease/a", writer_id="silent"))
        assert "writer_expired" in (tmp_path / "data" / "tally-serve.log").read_text()


def made_before_revisions(url: str) -> None:
    """A registry as a Tally before schema revisions left it: create_all, no alembic_version."""
    from tally_server.store import registry_schema

    engine = sa.create_engine(url)
    oldest = [registry_schema.metadata.tables[n] for n in ("checkpoints", "writers", "events")]
    registry_schema.metadata.create_all(engine, tables=oldest)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO events (checkpoint, kind, message, at, data) VALUES ('old', 'x', 'm', 1, '{}')"
            )
        )
    engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_serve_adopts_and_upgrades_a_registry_made_before_revisions(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    from tally_server.store.registry_migrations import head_revision

    url = request.getfixturevalue("postgres_url") if backend == "postgresql" else None
    if url is not None:
        made_before_revisions(url)
    else:
        (tmp_path / "data").mkdir()
        made_before_revisions(f"sqlite:///{tmp_path / 'data' / 'registry.sqlite3'}")
    writers, events = run_and_read_registry(tmp_path / "data", url)
    assert writers == [("array-3", "closed", 1)]
    assert events == ["x", "checkpoint_created", "writer_opened", "writer_closed"]
    engine = sa.create_engine(url or f"sqlite:///{tmp_path / 'data' / 'registry.sqlite3'}")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all() == [
            head_revision()
        ]
    engine.dispose()


def test_serve_refuses_a_registry_a_newer_tally_upgraded_in_one_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from tally_server.store.registry import SqlRegistry

    url = f"sqlite:///{tmp_path / 'registry.sqlite3'}"
    SqlRegistry(url).close()
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999_later'"))
    engine.dispose()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    tally = str(Path(sys.executable).parent / "tally")
    result = subprocess.run(
        [
            tally,
            "serve",
            "--data-dir",
            str(tmp_path / "data"),
            "--registry-url",
            url,
            "--grpc-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"tally serve: the registry database {url} is at schema revision 9999_later, which this Tally "
        "does not know (its newest is 0001): a newer Tally has upgraded it; run that Tally or a newer one, "
        "or restore the backup taken before the upgrade"
    ]
