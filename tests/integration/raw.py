"""Speaking to a real ``tally serve`` below the SDK: raw gRPC stubs and ``Delta`` messages."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc

from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer


@contextlib.contextmanager
def stub(server: RunningServer) -> Iterator[pb_grpc.CoordinatorStub]:
    """A stub on a plaintext channel to ``server``, closed on exit."""
    with grpc.insecure_channel(server.grpc_address) as channel:
        yield pb_grpc.CoordinatorStub(channel)


def deltas(batch: list[tuple[str, str, int]]) -> list[pb.Delta]:
    """``(task_id, source_id, delta)`` tuples as the wire's ``Delta`` messages."""
    return [pb.Delta(task_id=t, source_id=s, delta=d) for t, s, d in batch]
