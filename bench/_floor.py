"""The floor under one small call on this machine: what no gRPC service in Python can go below.

``floor(samples, warmup, folder)`` starts a bare grpcio echo server in a process of its own (an
``grpc.aio`` server, as ``tally serve`` is, with one generic method that returns its request
bytes: no protobuf, no interceptor, no service) and calls it one call at a time from a blocking
channel, as the SDK does. Each sample is one echo of a 40-byte request, then one ``fdatasync`` of a
64-byte append to a file in ``folder`` (as the journal syncs a batch it acknowledges). It returns
the milliseconds of the echo alone (the floor of ``are_completed([id])``) and of the echo plus the
sync (the floor of ``apply_deltas([d]) + flush()``, which waits for one synced write).

    python bench/_floor.py serve    # the echo server: prints its port, serves until killed
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc import aio

METHOD = "/bench.Floor/Echo"
REQUEST = b"x" * 40
RECORD = b"r" * 64


def _same(data: bytes) -> bytes:
    return data


class _Echo(grpc.GenericRpcHandler):
    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        async def echo(request: bytes, context: aio.ServicerContext) -> bytes:
            return request

        return grpc.unary_unary_rpc_method_handler(
            echo, request_deserializer=_same, response_serializer=_same
        )


async def _serve() -> None:
    server = aio.server()
    server.add_generic_rpc_handlers((_Echo(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


def floor(samples: int, warmup: int, folder: Path) -> tuple[list[float], list[float]]:
    """Milliseconds of a bare echo, and of the echo plus one ``fdatasync``, one sample at a time."""
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "serve"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.unary_unary(METHOD, request_serializer=_same, response_deserializer=_same)
            fd = os.open(folder / "floor.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                echoed, synced = [], []
                for i in range(warmup + samples):
                    t0 = time.perf_counter()
                    echo(REQUEST, timeout=30)
                    t1 = time.perf_counter()
                    os.write(fd, RECORD)
                    os.fdatasync(fd)
                    t2 = time.perf_counter()
                    if i >= warmup:
                        echoed.append((t1 - t0) * 1000)
                        synced.append((t2 - t0) * 1000)
            finally:
                os.close(fd)
        return echoed, synced
    finally:
        server.kill()
        server.wait(30)


if __name__ == "__main__":
    if sys.argv[1:] != ["serve"]:
        sys.exit(__doc__)
    asyncio.run(_serve())
