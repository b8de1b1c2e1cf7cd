"""Cursors inside long sources (issue #12): saved through a writer, read by anyone, durable when the
call returns, surviving a coordinator's kill -9 and a change of writer, gone once the source
completes or the checkpoint is reset. Real ``tally serve`` processes on both stores (LMDB files with
SQLite, and PostgreSQL), spoken to over raw gRPC and HTTP: the wire contract the SDK builds on.
"""

from __future__ import annotations

import base64
from pathlib import Path

import grpc
import httpx
import pytest

from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer, running_server
from tests.integration.raw import deltas, stub
from tests.integration.workload import tree


def cursors(*items: tuple[str, bytes]) -> list[pb.Cursor]:
    return [pb.Cursor(source_id=s, data=d) for s, d in items]


def cursor_of(coordinator: pb_grpc.CoordinatorStub, checkpoint: str, source: str) -> bytes | None:
    found = coordinator.GetCursor(pb.GetCursorRequest(checkpoint=checkpoint, source_id=source))
    return found.data if found.found else None


def test_a_cursor_survives_a_kill_and_a_new_writer_and_goes_when_its_source_completes(
    tmp_path: Path, store: str | None
) -> None:
    data = tmp_path / "data"
    with running_server(data, settle_ms=0, store=store) as server, stub(server) as coordinator:
        handle = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="cur/run", writer_id="w1")).handle
        coordinator.ApplyDeltas(
            pb.ApplyDeltasRequest(handle=handle, deltas=deltas(tree("long")[:2]), batch_seq=1)
        )
        saved = coordinator.SaveCursors(
            pb.SaveCursorsRequest(
                handle=handle,
                cursors=cursors(("long", b"row=100"), ("other", b"byte=7"), ("long", b"row=2000")),
            )
        )
        assert (saved.saved, saved.completed) == (2, 0)  # the later cursor of "long" replaced the first
        found = coordinator.GetCursor(pb.GetCursorRequest(checkpoint="cur/run", source_id="long"))
        assert (found.found, found.data, found.writer_id) == (True, b"row=2000", "w1")
        assert found.saved_at > 0
        server.kill()  # durable when SaveCursors returned: nothing flushed it since
    with running_server(data, settle_ms=0, store=store) as again, stub(again) as coordinator:
        assert cursor_of(coordinator, "cur/run", "long") == b"row=2000"
        # Another writer picks the source up where the first left it, and finishes it.
        handle = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="cur/run", writer_id="w2")).handle
        coordinator.SaveCursors(pb.SaveCursorsRequest(handle=handle, cursors=cursors(("long", b"row=3000"))))
        assert cursor_of(coordinator, "cur/run", "long") == b"row=3000"
        coordinator.ApplyDeltas(
            pb.ApplyDeltasRequest(handle=handle, deltas=deltas(tree("long")), batch_seq=1)
        )
        coordinator.Flush(pb.FlushRequest(handle=handle))
        assert cursor_of(coordinator, "cur/run", "long") is None  # completed: no cursor any more
        assert cursor_of(coordinator, "cur/run", "other") == b"byte=7"
        # A cursor for a completed source is not saved.
        late = coordinator.SaveCursors(pb.SaveCursorsRequest(handle=handle, cursors=cursors(("long", b"x"))))
        assert (late.saved, late.completed) == (0, 1)
        assert cursor_of(coordinator, "cur/run", "long") is None
    # Nor does a restart bring a completed source's cursor back.
    with running_server(data, settle_ms=0, store=store) as third, stub(third) as coordinator:
        assert cursor_of(coordinator, "cur/run", "long") is None
        assert cursor_of(coordinator, "cur/run", "other") == b"byte=7"


def test_a_cursor_saved_before_a_restart_is_gone_once_its_source_completes(
    tmp_path: Path, store: str | None
) -> None:
    """The cursor was saved by a coordinator that has since restarted: its completion by the new
    one still hides it (and deletes it when read)."""
    data = tmp_path / "data"
    with running_server(data, settle_ms=0, store=store) as server, stub(server) as coordinator:
        handle = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="cur/old", writer_id="w")).handle
        coordinator.SaveCursors(pb.SaveCursorsRequest(handle=handle, cursors=cursors(("s", b"7"))))
    with running_server(data, settle_ms=0, store=store) as again, stub(again) as coordinator:
        handle = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="cur/old", writer_id="w2")).handle
        coordinator.ApplyDeltas(pb.ApplyDeltasRequest(handle=handle, deltas=deltas(tree("s")), batch_seq=1))
        coordinator.Flush(pb.FlushRequest(handle=handle))
        assert cursor_of(coordinator, "cur/old", "s") is None


def test_cursor_refusals_say_what_was_wrong_and_save_nothing(server: RunningServer) -> None:
    with stub(server) as coordinator:
        handle = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="cur/bad", writer_id="w")).handle
        with pytest.raises(grpc.RpcError) as big:
            coordinator.SaveCursors(
                pb.SaveCursorsRequest(handle=handle, cursors=cursors(("a", b"ok"), ("b", b"x" * 4097)))
            )
        assert big.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "4097 bytes, over the limit of 4096" in big.value.details()
        assert cursor_of(coordinator, "cur/bad", "a") is None  # the whole call was refused
        with pytest.raises(grpc.RpcError) as empty:
            coordinator.SaveCursors(pb.SaveCursorsRequest(handle=handle, cursors=cursors(("", b"1"))))
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cursors[0].source_id is empty" in empty.value.details()
        with pytest.raises(grpc.RpcError) as unknown:
            coordinator.SaveCursors(pb.SaveCursorsRequest(handle="nope", cursors=cursors(("a", b"1"))))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        # Exactly 4 KiB is fine; an unknown checkpoint simply has no cursor.
        coordinator.SaveCursors(pb.SaveCursorsRequest(handle=handle, cursors=cursors(("a", b"y" * 4096))))
        assert cursor_of(coordinator, "cur/bad", "a") == b"y" * 4096
        assert cursor_of(coordinator, "cur/never", "a") is None


def test_cursors_over_http_travel_as_base64_and_a_reset_clears_them(tmp_path: Path) -> None:
    tokens = {"TALLY_TOKENS": "w:worker,r:reader@cur/,a:admin"}
    with (
        running_server(tmp_path / "data", settle_ms=0, env=tokens) as server,
        httpx.Client(base_url=server.http_url) as http,
    ):
        worker, reader, admin = ({"authorization": f"Bearer {t}"} for t in ("w", "r", "a"))
        handle = http.post("/v1/writers", json={"checkpoint": "cur/http"}, headers=worker).json()["handle"]
        blob = bytes(range(256))
        body = {"cursors": [{"source_id": "s", "data": base64.b64encode(blob).decode()}]}
        saved = http.post(f"/v1/writers/{handle}/cursors", json=body, headers=worker)
        assert saved.status_code == 200 and saved.json() == {"saved": 1, "completed": 0}
        got = http.get("/v1/cursors", params={"checkpoint": "cur/http", "source_id": "s"}, headers=reader)
        assert got.status_code == 200 and got.json()["found"] is True
        assert base64.b64decode(got.json()["data"]) == blob and got.json()["writer_id"]
        # A reader may not save; a token scoped elsewhere may not read.
        refused = http.post(f"/v1/writers/{handle}/cursors", json=body, headers=reader)
        assert refused.status_code == 403
        bad = http.post(
            f"/v1/writers/{handle}/cursors",
            json={"cursors": [{"source_id": "s", "data": "%%%"}]},
            headers=worker,
        )
        assert bad.status_code == 400 and "data" in bad.json()["error"]["message"]
        http.post(f"/v1/writers/{handle}/close", headers=worker)
        reset = http.post("/v1/reset", json={"name": "cur/http"}, headers=admin)
        assert reset.status_code == 200, reset.text
        gone = http.get("/v1/cursors", params={"checkpoint": "cur/http", "source_id": "s"}, headers=reader)
        assert gone.json() == {"found": False, "data": "", "saved_at": 0.0, "writer_id": ""}


def test_the_sdk_saves_a_cursor_at_flush_and_a_new_writer_resumes_from_it_after_a_kill(
    tmp_path: Path, store: str | None
) -> None:
    """``save_cursor`` buffers; ``flush()`` makes it durable: a kill -9 right after loses nothing, and
    the next writer (another id, another coordinator process) reads it; completing the source ends it."""
    import tally

    data = tmp_path / "data"
    with running_server(data, settle_ms=0, store=store) as server:
        with tally.Client(server.grpc_address) as client:
            w = client.writer("cur/sdk", writer_id="first")
            w.open()
            w.apply_deltas(tree("big")[:1])
            w.save_cursor("big", b"offset=4096")
            assert client.cursor("cur/sdk", "big") is None  # buffered in the writer, not sent yet
            assert w.cursor("big") == b"offset=4096"
            w.flush()
            assert client.cursor("cur/sdk", "big") == b"offset=4096"
            server.kill()
    with running_server(data, settle_ms=0, store=store) as again, tally.Client(again.grpc_address) as client:
        with client.writer("cur/sdk", writer_id="second") as w:
            assert w.cursor("big") == b"offset=4096"
            w.apply_deltas(tree("big"))
            w.flush()
            assert w.cursor("big") is None
        assert client.cursor("cur/sdk", "big") is None
