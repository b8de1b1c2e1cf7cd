"""Big request bodies (issue #7, point 5): a chunked body cannot bypass the size limit, and a big valid
batch is parsed off the event loop, so heartbeats keep answering meanwhile."""

from __future__ import annotations

import json
import select
import socket
import statistics
import threading
import time
from pathlib import Path

import grpc
import httpx

from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer, running_server

LIMIT = 1 << 20
DELTA = b'{"task_id":"t-0000000001","source_id":"s-0000000001","delta":1},'


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def chunked_post(address: str, path: str, total: int) -> tuple[int, dict[str, object], int]:
    """POST a JSON body of ``total`` bytes with Transfer-Encoding: chunked, stopping as soon as the
    server answers. Returns (status, JSON body, bytes of body sent)."""
    host, port = address.rsplit(":", 1)
    chunk = DELTA * 1000
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )

        def send(piece: bytes) -> None:
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")

        send(b'{"deltas":[')
        sent = 0
        while sent < total:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break  # answered before the body is complete
            send(chunk)
            sent += len(chunk)
        else:
            send(DELTA[:-1] + b"]}")
            sock.sendall(b"0\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(65536)
        head, _, body = reply.partition(b"\r\n\r\n")
        status = int(head.split()[1])
        headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        length = int(headers[b"content-length"])
        while len(body) < length:
            body += sock.recv(65536)
    return status, json.loads(body), sent


def test_a_chunked_body_over_the_limit_is_refused_while_it_streams(tmp_path: Path) -> None:
    env = {"TALLY_MAX_MESSAGE_BYTES": str(LIMIT)}
    with (
        running_server(tmp_path / "data", settle_ms=0, env=env) as server,
        httpx.Client(base_url=server.http_url, timeout=60) as http,
    ):
        handle = http.post("/v1/writers", json={"checkpoint": "cp", "writer_id": "w"}).json()["handle"]
        path = f"/v1/writers/{handle}/deltas"
        # Warm up the request path once, so what follows measures the body only.
        assert chunked_post(server.http_address, path, 0)[0] == 200
        before = rss_bytes(server.process.pid)

        total = 16 * LIMIT
        status, body, sent = chunked_post(server.http_address, path, total)

        assert status == 413
        error = body["error"]
        assert isinstance(error, dict) and error["code"] == "RESOURCE_EXHAUSTED"
        assert "max_message_bytes" in error["message"] and str(LIMIT) in error["message"]
        assert sent < total, "the server waited for the whole body before refusing it"
        growth = rss_bytes(server.process.pid) - before
        assert growth < 4 * LIMIT, f"the server grew by {growth} bytes for a refused body"
        # Nothing of it was applied (the one delta is the warm-up's), and the server goes on serving.
        writers = http.get("/v1/writers", params={"checkpoint": "cp"}).json()["writers"]
        assert [w["counts"]["applied"] for w in writers] == [1]
        assert http.post(f"/v1/writers/{handle}/keepalive").status_code == 200


def test_keepalives_answer_while_a_big_batch_is_parsed(server: RunningServer) -> None:
    # 100k deltas (the default limit per call) with long ids: ~55 MB of JSON. Parsing it on the event
    # loop held every other request for well over a second.
    width = 250
    deltas = [
        {"task_id": f"{i:0{width}d}", "source_id": f"s{i % 5000:0{width - 1}d}", "delta": 1}
        for i in range(100_000)
    ]
    body = json.dumps({"deltas": deltas}).encode()
    del deltas
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        handle = stub.OpenWriter(pb.OpenWriterRequest(checkpoint="cp", writer_id="big")).handle
        watcher = stub.OpenWriter(pb.OpenWriterRequest(checkpoint="cp", writer_id="watcher")).handle
        stub.KeepAlive(pb.KeepAliveRequest(handle=watcher))  # the channel is connected

        done = threading.Event()
        outcome: dict[str, object] = {}

        def post() -> None:
            try:
                with httpx.Client(base_url=server.http_url, timeout=120) as poster:
                    reply = poster.post(
                        f"/v1/writers/{handle}/deltas",
                        content=body,
                        headers={"content-type": "application/json"},
                    )
                outcome["reply"] = reply.status_code, reply.json()
            finally:
                done.set()

        sender = threading.Thread(target=post)
        sender.start()
        took: list[float] = []
        while not done.is_set():
            started = time.perf_counter()
            stub.KeepAlive(pb.KeepAliveRequest(handle=watcher), timeout=30)
            took.append(time.perf_counter() - started)
        sender.join()

    status, reply = outcome["reply"]  # type: ignore[misc]
    assert status == 200, reply
    assert reply["counts"]["applied"] == 100_000
    assert took, "no keepalive was issued while the batch was in flight"
    # Blocked behind the parse, one keepalive waits for all of it (seconds) while the others take
    # milliseconds; a loaded machine slows every keepalive alike, so the bound grows with the median.
    bound = 1.0 + 20 * statistics.median(took)
    assert max(took) < bound, (
        f"a keepalive waited {max(took):.2f}s behind the batch ({len(took)} sent, "
        f"median {statistics.median(took) * 1000:.1f} ms)"
    )
