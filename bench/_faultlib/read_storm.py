"""Read traffic against idle writers: status reads must never starve heartbeats.

Idle writers (lease TTL 10 s) heartbeat through the SDK in their own process, so a busy client
cannot be what made them miss a beat. Meanwhile readers hammer the status API: GET
/v1/checkpoints over HTTP, GetCheckpoint and ListWriters over gRPC. Counted: healthy writers
expired (server ``writer_expired`` events or the SDK's ``health().lease_lost``) and 5xx/INTERNAL
answers to the readers.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

import grpc
import grpc.aio
import httpx

import tally
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc

from .common import Row, cpu_seconds, events, scratch, serve, wait_for

LEASE_TTL_S = 10.0
CHECKPOINTS = 4
SEEDED_PER_CHECKPOINT = 5_000  # completed ids per checkpoint, so status reads have something to say


@dataclass(frozen=True)
class Storm:
    """``raw``: the HTTP readers are bare keep-alive sockets, not httpx.

    500 concurrent reads through one httpx client (or 500 clients) in one process make about 50 reads
    a second, the client's CPU at 100 % and the server's at 6 %: no storm. Bare sockets make the
    server answer as fast as it can (about 1,200 reads a second on 2 cores), its CPU at 100 %.
    """

    name: str
    writers: int
    http_readers: int
    grpc_readers: int
    raw: bool = False


LIGHT = Storm("100 writers + 50 readers", writers=100, http_readers=25, grpc_readers=25)
HEAVY = Storm(
    "240 writers + 500 GET /v1/checkpoints", writers=240, http_readers=500, grpc_readers=0, raw=True
)


@dataclass
class StormResult:
    storm: Storm
    expired: set[str]
    reads: int = 0
    server_errors: int = 0  # 5xx / INTERNAL / UNKNOWN
    other_failures: dict[str, int] = field(default_factory=dict)  # timeouts, refused connections
    abandoned: int = 0  # reads still unanswered when the storm ended
    failure_details: list[str] = field(default_factory=list)  # the failed HTTP reads: what, when
    server_cpu: float = 0.0  # the server's CPU during the storm, in cores
    seconds: float = 0.0


def checkpoint_of(i: int) -> str:
    return f"storm/{i % CHECKPOINTS}"


def _writers_main(address: str, count: int, ready: MpEvent, stop: MpEvent, out: Any) -> None:
    """Child process: ``count`` idle SDK writers that only heartbeat; reports which lost their lease."""
    import logging

    logging.getLogger("tally").setLevel(logging.CRITICAL)  # the parent reports; no log storm here
    with tally.Client(address, timeout=30) as client:
        writers = [client.writer(checkpoint_of(i), writer_id=f"idle-{i}") for i in range(count)]
        for w in writers:
            w.open()
        ready.set()
        stop.wait()
        out.put(sorted(w.writer_id for w in writers if w.health().lease_lost))
        for w in writers:
            try:
                w.close(timeout=5)
            except tally.TallyError:
                pass  # a lost lease: already reported


async def _read(storm: Storm, http_url: str, grpc_address: str, seconds: float, result: StormResult) -> None:
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(
        max_connections=storm.http_readers + 10, max_keepalive_connections=storm.http_readers + 10
    )

    def failed(kind: str) -> None:
        result.other_failures[kind] = result.other_failures.get(kind, 0) + 1

    async with httpx.AsyncClient(base_url=http_url, timeout=30, limits=limits) as http:

        def failed_read(exc: Exception) -> None:
            failed(type(exc).__name__)
            into = seconds - (deadline - time.monotonic())
            result.failure_details.append(f"{exc!r} {into:.1f}s into the storm")

        def answered(status: int) -> None:
            result.reads += 1
            if status >= 500:
                result.server_errors += 1

        async def http_reader() -> None:
            while time.monotonic() < deadline:
                try:
                    reply = await http.get("/v1/checkpoints")
                except httpx.HTTPError as exc:
                    failed_read(exc)
                    continue
                answered(reply.status_code)

        async def raw_reader() -> None:
            host, port = http_url.removeprefix("http://").rsplit(":", 1)
            while time.monotonic() < deadline:
                try:
                    await _raw_reads(host, int(port), deadline, answered)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    failed_read(exc)

        async with grpc.aio.insecure_channel(grpc_address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)

            async def grpc_reader(n: int) -> None:
                i = n
                while time.monotonic() < deadline:
                    i += 1
                    try:
                        if i % 2:
                            await stub.GetCheckpoint(
                                pb.GetCheckpointRequest(name=checkpoint_of(i)), timeout=30
                            )
                        else:
                            await stub.ListWriters(
                                pb.ListWritersRequest(checkpoint=checkpoint_of(i)), timeout=30
                            )
                    except grpc.aio.AioRpcError as err:
                        if err.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                            result.reads += 1
                            result.server_errors += 1
                        else:
                            failed(err.code().name)
                        continue
                    result.reads += 1

            readers = [
                *(
                    asyncio.ensure_future(raw_reader() if storm.raw else http_reader())
                    for _ in range(storm.http_readers)
                ),
                *(asyncio.ensure_future(grpc_reader(n)) for n in range(storm.grpc_readers)),
            ]
            # Reads still waiting a moment after the storm's end are abandoned, not counted.
            _, late = await asyncio.wait(readers, timeout=seconds + 2)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            result.abandoned = len(late)


_READ = b"GET /v1/checkpoints HTTP/1.1\r\nHost: tally\r\n\r\n"


async def _raw_reads(host: str, port: int, deadline: float, answered: Callable[[int], None]) -> None:
    """GET /v1/checkpoints again and again on one kept-alive connection until ``deadline``.

    Raises:
        OSError, asyncio.IncompleteReadError: the connection failed or the server closed it.
        ValueError: an answer that is not HTTP/1.1 with a Content-Length.
    """
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.monotonic() < deadline:
            writer.write(_READ)
            head = await reader.readuntil(b"\r\n\r\n")
            status_line, *headers = head.decode("latin-1").split("\r\n")
            length = next(int(h.split(":", 1)[1]) for h in headers if h.lower().startswith("content-length:"))
            await reader.readexactly(length)
            answered(int(status_line.split(" ", 2)[1]))
    except StopIteration:
        raise ValueError(f"an answer without Content-Length: {head[:200]!r}") from None
    finally:
        writer.close()


def storm_once(storm: Storm, seconds: float) -> StormResult:
    with scratch("storm") as base, serve(base / "data", lease_ttl_s=LEASE_TTL_S) as server:
        with tally.Client(server.grpc_address, timeout=120) as client:
            for c in range(CHECKPOINTS):
                name = checkpoint_of(c)
                client.import_completed(
                    name, [f"{name}-s{i}" for i in range(SEEDED_PER_CHECKPOINT)], import_id="seed"
                )
        ctx = mp.get_context("spawn")
        ready, stop = ctx.Event(), ctx.Event()
        out: Any = ctx.Queue()
        child = ctx.Process(target=_writers_main, args=(server.grpc_address, storm.writers, ready, stop, out))
        child.start()
        try:
            if not wait_for(lambda: ready.is_set() or not child.is_alive(), 180) or not ready.is_set():
                raise RuntimeError(f"{storm.writers} writers did not open (exit code {child.exitcode})")
            result = StormResult(storm, set())
            started, cpu_before = time.monotonic(), cpu_seconds(server.process.pid)
            asyncio.run(_read(storm, server.http_url, server.grpc_address, seconds, result))
            result.seconds = time.monotonic() - started
            result.server_cpu = (cpu_seconds(server.process.pid) - cpu_before) / result.seconds
            # One heartbeat period after the storm: a lease the storm doomed is reported by then.
            time.sleep(LEASE_TTL_S / 3)
            stop.set()
            lease_lost = set(out.get(timeout=120))
        finally:
            stop.set()
            child.join(120)
            if child.is_alive():
                child.kill()
                child.join()
        expired = {
            e["writer_id"]
            for c in range(CHECKPOINTS)
            for e in events(server.http_url, checkpoint_of(c), "writer_expired")
        }
        result.expired = expired | lease_lost
    return result


def run(seconds: float) -> Row:
    row = Row("read_storm", trials=2)
    for storm in (LIGHT, HEAVY):
        result = storm_once(storm, seconds)
        row.expired += len(result.expired)
        row.errors += result.server_errors
        failures = ", ".join(f"{v} {k}" for k, v in sorted(result.other_failures.items()))
        row.notes.append(
            f"{storm.name}: {len(result.expired)} expired, {result.reads:,} reads in {result.seconds:.0f}s, "
            f"server CPU {result.server_cpu:.0%} of a core"
            + (f" ({result.abandoned} unanswered at the end)" if result.abandoned else "")
            + (f", failed reads: {failures}" if failures else "")
        )
        row.notes += [f"  {detail}" for detail in result.failure_details[:5]]
        row.figures[storm.name] = result
    return row
