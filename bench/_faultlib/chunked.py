"""A chunked-transfer POST of many megabytes of small deltas, with no Content-Length to refuse up front.

Measured: the server's RSS growth (peak minus before), how long a concurrent keep-alive stalls,
the HTTP status answered, and whether a healthy writer (lease TTL 10 s, SDK heartbeats) lost its
lease meanwhile. The promise: the body limit (64 MiB) holds while streaming (413 as soon as it is
passed), memory stays near the limit, and nothing else waits behind the upload.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

import tally
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer

from .common import Row, events, mb, peak_rss_bytes, rss_bytes, scratch, serve, wait_for

CHECKPOINT = "fault/chunked"
LEASE_TTL_S = 10.0
CHUNK = 64 * 1024
# A server that grows past this is killed: the figure is made, the machine must survive.
RSS_CAP = 6 * 1024**3
# Expectations once the limit is enforced while streaming (the body limit is 64 MiB).
MAX_RSS_GROWTH = 300 * 1024**2
MAX_KEEPALIVE_STALL_S = LEASE_TTL_S / 2


@dataclass
class ChunkedResult:
    body_bytes: int
    status: str
    rss_before: int
    rss_peak: int
    keepalive_max_s: float
    healthy_expired: list[str]  # the SDK writer and the keep-alive probe, if their lease expired
    upload_s: float
    answer_s: float
    killed_at_cap: bool

    @property
    def rss_growth(self) -> int:
        return max(0, self.rss_peak - self.rss_before)


def body_chunks(total: int) -> Iterator[bytes]:
    """``{"deltas": [...]}`` of ~45-byte deltas, cut into ``CHUNK``-sized pieces, ``total`` bytes overall."""
    yield b'{"deltas": ['
    sent, n, buf = 12, 0, bytearray()
    while sent + len(buf) < total - 64:
        if n:
            buf += b","
        buf += b'{"task_id":"t%x","source_id":"s%x","delta":1}' % (n, n % 4096)
        n += 1
        if len(buf) >= CHUNK:
            sent += len(buf)
            yield bytes(buf)
            buf.clear()
    buf += b"]}"
    yield bytes(buf)


@dataclass
class _Upload:
    sent: int = 0
    status: str = "?"
    upload_s: float = 0.0
    answer_s: float = 0.0


def _send_chunked(server: RunningServer, path: str, total: int, result: _Upload) -> None:
    host, port = server.http_address.rsplit(":", 1)
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=600) as sock:
        sock.sendall(
            (
                f"POST {path} HTTP/1.1\r\nHost: {server.http_address}\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            ).encode()
        )
        sent = 0
        try:
            for piece in body_chunks(total):
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered early and closed: what a limit enforced while streaming does
        result.sent = sent
        result.upload_s = time.monotonic() - started
        try:
            head = sock.recv(4096).split(b"\r\n", 1)[0].decode("latin-1")
            parts = head.split()
            result.status = f"HTTP {parts[1]}" if len(parts) > 1 else f"closed ({head!r})"
        except OSError as exc:
            result.status = f"no answer ({type(exc).__name__})"
    result.answer_s = time.monotonic() - started


def attack(server: RunningServer, total: int) -> ChunkedResult:
    pid = server.process.pid
    with (
        tally.Client(server.grpc_address, timeout=30) as client,
        grpc.insecure_channel(server.grpc_address) as ch,
    ):
        healthy = client.writer(CHECKPOINT, writer_id="healthy")
        healthy.open()
        stub = pb_grpc.CoordinatorStub(ch)
        probe = stub.OpenWriter(pb.OpenWriterRequest(checkpoint=CHECKPOINT, writer_id="probe")).handle
        target = stub.OpenWriter(pb.OpenWriterRequest(checkpoint=CHECKPOINT, writer_id="target")).handle
        rss_before = rss_bytes(pid)
        done = threading.Event()
        outcome = _Upload()
        worst = 0.0
        killed = False

        def probe_keepalive() -> None:
            # Keep-alives back to back: the longest one is how long a heartbeat would have stalled.
            nonlocal worst
            while not done.is_set():
                t0 = time.monotonic()
                try:
                    stub.KeepAlive(pb.KeepAliveRequest(handle=probe), timeout=300)
                except grpc.RpcError:
                    pass  # a server killed at the cap; the stall is still measured
                worst = max(worst, time.monotonic() - t0)
                done.wait(0.1)

        def watch_rss() -> None:
            nonlocal killed
            while not done.is_set():
                if rss_bytes(pid) > RSS_CAP:
                    killed = True
                    server.process.kill()
                    return
                done.wait(0.1)

        helpers = [threading.Thread(target=probe_keepalive), threading.Thread(target=watch_rss)]
        for t in helpers:
            t.start()
        sender = threading.Thread(
            target=_send_chunked, args=(server, f"/v1/writers/{target}/deltas", total, outcome)
        )
        sender.start()
        sender.join()
        # One more full heartbeat period, so a lease the stall doomed has time to be reported.
        wait_for(lambda: healthy.health().lease_lost, LEASE_TTL_S / 2)
        done.set()
        for t in helpers:
            t.join()
        rss_peak = peak_rss_bytes(pid) if not killed else RSS_CAP
        lease_lost = healthy.health().lease_lost
        try:
            healthy.close(timeout=5)
        except tally.TallyError:
            pass  # lease lost, counted below
    expired = (
        {e["writer_id"] for e in events(server.http_url, CHECKPOINT, "writer_expired")}
        if not killed
        else set()
    )
    if lease_lost:
        expired.add("healthy")
    return ChunkedResult(
        body_bytes=total,
        status=outcome.status,
        rss_before=rss_before,
        rss_peak=rss_peak,
        keepalive_max_s=worst,
        healthy_expired=sorted(expired & {"healthy", "probe"}),
        upload_s=outcome.upload_s,
        answer_s=outcome.answer_s,
        killed_at_cap=killed,
    )


def run(sizes: list[int]) -> Row:
    row = Row("chunked", trials=len(sizes))
    for total in sizes:
        with scratch("chunked") as base, serve(base / "data", lease_ttl_s=LEASE_TTL_S) as server:
            result = attack(server, total)
            if server.process.poll() is None:
                server.kill()  # it may still be chewing on the body; its figures are taken
        size = mb(total)
        row.expired += len(result.healthy_expired)
        if result.status.startswith("HTTP 5"):
            row.errors += 1
        row.notes.append(
            f"{size}: {result.status} after {result.answer_s:.0f}s, RSS +{mb(result.rss_growth)}, "
            f"keepalive stall {result.keepalive_max_s:.1f}s"
            + (f", expired: {', '.join(result.healthy_expired)}" if result.healthy_expired else "")
            + (" (server killed at the RSS cap)" if result.killed_at_cap else "")
        )
        row.check(result.status == "HTTP 413", f"{size}: answered {result.status}, want HTTP 413")
        row.check(result.rss_growth <= MAX_RSS_GROWTH, f"{size}: RSS grew {mb(result.rss_growth)}")
        row.check(
            result.keepalive_max_s <= MAX_KEEPALIVE_STALL_S,
            f"{size}: a keep-alive waited {result.keepalive_max_s:.1f}s",
        )
        row.figures[size] = result
    return row
