"""ListCheckpoints and ListWriters page like the other lists (issue 13): ``after`` + ``limit`` in,
``next_after`` out, in one stable order (checkpoints by name in byte order; writers live by writer_id,
then ended ones newest first). Paging with small limits over gRPC and HTTP yields every item exactly
once and ends on an empty ``next_after``; bad ``after`` and ``limit`` values are refused by name.
Real ``tally serve`` processes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest

import tally
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer, running_server

# Names whose byte order differs from a case-insensitive or natural order.
CHECKPOINTS = ["B", "a", "a-b", "a.b", "a/b", "a/b/c", "a_b", "cp-10", "cp-2", "cp-9", "z"]


@contextlib.contextmanager
def stub(server: RunningServer) -> Iterator[pb_grpc.CoordinatorStub]:
    with grpc.insecure_channel(server.grpc_address) as channel:
        yield pb_grpc.CoordinatorStub(channel)


def grpc_pages(call: Callable[[str, int], Any], key: str, limit: int) -> tuple[list[Any], list[str]]:
    """Every item of a paged gRPC list, and the next_after of each page (the last one must be "")."""
    items: list[Any] = []
    cursors: list[str] = []
    after = ""
    while True:
        page = call(after, limit)
        got = list(getattr(page, key))
        assert len(got) <= limit
        items += got
        cursors.append(page.next_after)
        if not page.next_after:
            return items, cursors
        assert len(got) == limit, "only the last page may be short"
        assert len(cursors) < 100, "paging does not end"
        after = page.next_after


def http_pages(
    http: httpx.Client, path: str, params: dict[str, Any], key: str, limit: int
) -> tuple[list[dict[str, Any]], list[str]]:
    items: list[dict[str, Any]] = []
    cursors: list[str] = []
    after = ""
    while True:
        reply = http.get(path, params={**params, "after": after, "limit": limit})
        reply.raise_for_status()
        page = reply.json()
        assert len(page[key]) <= limit
        items += page[key]
        cursors.append(page["next_after"])
        if not page["next_after"]:
            return items, cursors
        assert len(page[key]) == limit, "only the last page may be short"
        assert len(cursors) < 100, "paging does not end"
        after = page["next_after"]


def declare(coordinator: pb_grpc.CoordinatorStub, name: str) -> None:
    coordinator.DeclareSources(pb.DeclareSourcesRequest(checkpoint=name, count=1))


def test_checkpoints_page_by_name_in_byte_order_over_grpc_and_http(server: RunningServer) -> None:
    with stub(server) as coordinator, httpx.Client(base_url=server.http_url, timeout=10) as http:
        for name in reversed(CHECKPOINTS):
            declare(coordinator, name)
        in_byte_order = sorted(CHECKPOINTS, key=str.encode)
        for limit in (1, 2, 3, len(CHECKPOINTS) - 1, len(CHECKPOINTS), 1000):
            listed, cursors = grpc_pages(
                lambda after, n: coordinator.ListCheckpoints(pb.ListCheckpointsRequest(after=after, limit=n)),
                "checkpoints",
                limit,
            )
            assert [c.name for c in listed] == in_byte_order, limit
            assert cursors[-1] == "" and "" not in cursors[:-1]
            assert len(cursors) == -(-len(CHECKPOINTS) // limit), limit  # no empty page at the end
            # Each cursor is the last name of its page.
            assert cursors[:-1] == [in_byte_order[limit * (i + 1) - 1] for i in range(len(cursors) - 1)]
            found, _ = http_pages(http, "/v1/checkpoints", {}, "checkpoints", limit)
            assert [c["name"] for c in found] == in_byte_order, limit
        # No limit: the default page (1,000) holds them all; after any name (listed or not) works.
        whole = coordinator.ListCheckpoints(pb.ListCheckpointsRequest())
        assert [c.name for c in whole.checkpoints] == in_byte_order and whole.next_after == ""
        rest = coordinator.ListCheckpoints(pb.ListCheckpointsRequest(after="a/b/b"))
        assert [c.name for c in rest.checkpoints] == in_byte_order[in_byte_order.index("a/b/c") :]
        assert http.get("/v1/checkpoints", params={"after": "z"}).json() == {
            "checkpoints": [],
            "next_after": "",
        }


def test_the_sdk_lists_every_checkpoint_page_by_page(server: RunningServer) -> None:
    with stub(server) as coordinator:
        for name in CHECKPOINTS:
            declare(coordinator, name)
    for address in (server.grpc_address, server.http_url):
        with tally.Client(address) as client:
            assert [c.name for c in client.checkpoints(page_size=2)] == sorted(CHECKPOINTS, key=str.encode)


def open_writer(coordinator: pb_grpc.CoordinatorStub, checkpoint: str, writer_id: str) -> str:
    reply = coordinator.OpenWriter(
        pb.OpenWriterRequest(checkpoint=checkpoint, writer_id=writer_id, host="node-1", pid=os.getpid())
    )
    return str(reply.handle)


def test_a_list_asked_without_writers_counts_them_and_carries_none(server: RunningServer) -> None:
    """By default each listed checkpoint carries its live writers; asked without (gRPC
    ``without_writers``, HTTP ``writers=false``, the SDK's ``writers=False``), it counts them and
    carries none, on every page; the rest of each status is the same."""
    live = {"lw/a": ["w-2", "w-1", "w-3"], "lw/b": ["only"], "lw/c": []}
    with stub(server) as coordinator, httpx.Client(base_url=server.http_url, timeout=10) as http:
        for name, writer_ids in live.items():
            declare(coordinator, name)
            for writer_id in writer_ids:
                open_writer(coordinator, name, writer_id)
        expected = {name: sorted(ids) for name, ids in live.items()}
        counts = {name: len(ids) for name, ids in live.items()}

        def without(status: Any) -> Any:
            return {k: v for k, v in status.items() if k not in ("writers", "last_activity_at")}

        for limit in (1, 2, 1000):
            full, _ = grpc_pages(
                lambda after, n: coordinator.ListCheckpoints(pb.ListCheckpointsRequest(after=after, limit=n)),
                "checkpoints",
                limit,
            )
            assert {c.name: sorted(w.writer_id for w in c.writers) for c in full} == expected
            bare, _ = grpc_pages(
                lambda after, n: coordinator.ListCheckpoints(
                    pb.ListCheckpointsRequest(after=after, limit=n, without_writers=True)
                ),
                "checkpoints",
                limit,
            )
            assert {c.name: (c.live_writers, len(c.writers)) for c in bare} == {
                n: (k, 0) for n, k in counts.items()
            }
            full_json, _ = http_pages(http, "/v1/checkpoints", {}, "checkpoints", limit)
            assert {c["name"]: sorted(w["writer_id"] for w in c["writers"]) for c in full_json} == expected
            bare_json, _ = http_pages(http, "/v1/checkpoints", {"writers": "false"}, "checkpoints", limit)
            assert {c["name"]: (c["live_writers"], c["writers"]) for c in bare_json} == {
                n: (k, []) for n, k in counts.items()
            }
            assert [without(c) for c in bare_json] == [without(c) for c in full_json]
        refused = http.get("/v1/checkpoints", params={"writers": "some"})
        assert refused.status_code == 400, refused.text
        assert "query parameter 'writers' (sent 'some')" in refused.json()["error"]["message"]
    for address in (server.grpc_address, server.http_url):
        with tally.Client(address) as client:
            with_them = client.checkpoints(page_size=2)
            assert {c.name: sorted(w.writer_id for w in c.writers) for c in with_them} == expected
            counted = client.checkpoints(page_size=2, writers=False)
            assert {c.name: (c.live_writers, c.writers) for c in counted} == {
                n: (k, ()) for n, k in counts.items()
            }


def test_writers_page_live_by_id_then_ended_newest_first(server: RunningServer) -> None:
    """7 live writers and 6 ended sessions (one writer_id ended twice and is live again) page through
    with limits from 1 up: each session once, in the documented order, on both transports."""
    cp = "paging/writers"
    with stub(server) as coordinator, httpx.Client(base_url=server.http_url, timeout=10) as http:
        ended_ids = ["e-3", "again", "e-1", "again", "e-2", "e-0"]  # in the order they open (and close)
        for writer_id in ended_ids:
            coordinator.CloseWriter(pb.CloseWriterRequest(handle=open_writer(coordinator, cp, writer_id)))
        live_ids = ["w-5", "again", "W-4", "w-1", "w-10", "w-2", "_w"]
        for writer_id in live_ids:
            open_writer(coordinator, cp, writer_id)
        live_order = sorted(live_ids, key=str.encode)
        every = len(live_ids) + len(ended_ids)

        def grpc_writers(include_closed: bool) -> Callable[[str, int], Any]:
            return lambda after, n: coordinator.ListWriters(
                pb.ListWritersRequest(checkpoint=cp, include_closed=include_closed, after=after, limit=n)
            )

        for limit in (1, 2, 3, 5, len(live_ids), every - 1, every, 1000):
            listed, cursors = grpc_pages(grpc_writers(True), "writers", limit)
            sessions = [(w.writer_id, w.opened_at) for w in listed]
            assert len(set(sessions)) == len(sessions) == every, limit  # each session once
            assert [w.writer_id for w in listed[: len(live_ids)]] == live_order
            assert {w.state for w in listed[: len(live_ids)]} == {"open"}
            ended = listed[len(live_ids) :]
            assert [w.writer_id for w in ended] == list(reversed(ended_ids))  # newest first
            assert {w.state for w in ended} == {"closed"}
            assert [w.opened_at for w in ended] == sorted((w.opened_at for w in ended), reverse=True)
            assert cursors[-1] == "" and "" not in cursors[:-1]
            assert len(cursors) == -(-every // limit), limit
            found, _ = http_pages(
                http, "/v1/writers", {"checkpoint": cp, "include_closed": "true"}, "writers", limit
            )
            assert [(w["writer_id"], w["opened_at"]) for w in found] == sessions, limit
            # Live writers only: the same live part, paged the same way.
            live, _ = grpc_pages(grpc_writers(False), "writers", limit)
            assert [w.writer_id for w in live] == live_order
            only_live, _ = http_pages(http, "/v1/writers", {"checkpoint": cp}, "writers", limit)
            assert [w["writer_id"] for w in only_live] == live_order
        # The cursors name positions: a live writer's id, an ended one's open time and id.
        first = coordinator.ListWriters(pb.ListWritersRequest(checkpoint=cp, include_closed=True, limit=1))
        assert first.next_after == f"live/{live_order[0]}"
        past = coordinator.ListWriters(
            pb.ListWritersRequest(checkpoint=cp, include_closed=True, limit=len(live_ids) + 1)
        )
        newest = past.writers[-1]
        assert past.next_after == f"ended/{newest.opened_at!r}/{newest.writer_id}"
    # The SDK follows the pages (and its limit caps the total).
    for address in (server.grpc_address, server.http_url):
        with tally.Client(address) as client:
            every_writer = client.writers(cp, include_closed=True, limit=None, page_size=2)
            assert [(w.writer_id, w.opened_at) for w in every_writer] == sessions
            assert [w.writer_id for w in client.writers(cp, page_size=3)] == live_order
            assert len(client.writers(cp, include_closed=True, limit=9, page_size=4)) == 9


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        ({"limit": -1}, "limit", "limit -1 is out of range; ask for 1 to 10,000 checkpoints per page"),
        ({"limit": 10_001}, "limit", "limit 10001 is out of range; ask for 1 to 10,000 checkpoints per page"),
        ({"after": "a//b"}, "after", "after is not a checkpoint name"),
        ({"after": "/abs"}, "after", "pass the previous page's next_after, or '' for the first page"),
    ],
)
def test_bad_checkpoint_pages_are_refused(
    server: RunningServer, params: dict[str, Any], field: str, message: str
) -> None:
    with stub(server) as coordinator:
        declare(coordinator, "refusals/cp")
        with pytest.raises(grpc.RpcError) as refused:
            coordinator.ListCheckpoints(pb.ListCheckpointsRequest(**params))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(refused.value.details())
    reply = httpx.get(f"{server.http_url}/v1/checkpoints", params=params, timeout=10)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "INVALID_ARGUMENT" and message in error["message"]
    assert error["details"]["field"] == field


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        ({"limit": -5}, "limit", "limit -5 is out of range; ask for 1 to 10,000 writers per page"),
        ({"limit": 20_000}, "limit", "limit 20000 is out of range; ask for 1 to 10,000 writers per page"),
        ({"after": "w-1"}, "after", "after 'w-1' is not a position in the list of writers"),
        ({"after": "live/"}, "after", "pass the previous page's next_after unchanged"),
        ({"after": "ended/soon/w-1"}, "after", "is not a position in the list of writers"),
        ({"after": "ended/nan/w-1"}, "after", "is not a position in the list of writers"),
        ({"after": "ended/12.5"}, "after", "'ended/<opened_at>/<writer_id>'"),
    ],
)
def test_bad_writer_pages_are_refused(
    server: RunningServer, params: dict[str, Any], field: str, message: str
) -> None:
    with stub(server) as coordinator:
        open_writer(coordinator, "refusals/writers", "w-1")
        with pytest.raises(grpc.RpcError) as refused:
            coordinator.ListWriters(
                pb.ListWritersRequest(checkpoint="refusals/writers", include_closed=True, **params)
            )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(refused.value.details())
    reply = httpx.get(
        f"{server.http_url}/v1/writers",
        params={"checkpoint": "refusals/writers", "include_closed": "true", **params},
        timeout=10,
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "INVALID_ARGUMENT" and message in error["message"]
    assert error["details"]["field"] == field


def test_a_scoped_token_pages_through_its_own_checkpoints_only(tmp_path: Any) -> None:
    """Pages are made of the checkpoints the token may read: full pages, no gap, no stranger's name."""
    tokens = "root:admin,mine:reader@team-a/"
    with running_server(tmp_path / "data", settle_ms=0, env={"TALLY_TOKENS": tokens}) as server:
        ours = [f"team-a/run-{i}" for i in range(5)]
        with tally.Client(server.grpc_address, token="root") as root:
            for name in [*ours, "team-b/x", "team-a-not/y", "team-b/z", "zzz"]:
                root.declare(name, count=1)
        for address in (server.grpc_address, server.http_url):
            with tally.Client(address, token="mine") as mine:
                assert [c.name for c in mine.checkpoints(page_size=2)] == ours
        first = httpx.get(
            f"{server.http_url}/v1/checkpoints",
            params={"limit": 2},
            headers={"Authorization": "Bearer mine"},
            timeout=10,
        ).json()
        assert [c["name"] for c in first["checkpoints"]] == ours[:2] and first["next_after"] == ours[1]
