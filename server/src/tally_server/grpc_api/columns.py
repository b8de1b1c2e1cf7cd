"""ApplyDeltas requests read straight from their bytes by the compiled counting core.

A batch sent as columns (``DeltaColumns``) whose ids are plain ASCII within the limits and whose
deltas are small is read, checked and packed for the journal in one pass over the request's bytes
(``_ledgercore.parse_apply_deltas``), without protobuf building a message and then a str per id
through it. Anything else (the rows form, non-ASCII ids, a refused field, malformed bytes, a request
of more than READ_ON_LOOP_BYTES) is left to protobuf and validation, which decode it or name what is
wrong, exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from tally.v1 import coordinator_pb2 as pb
from tally_server.domain import idmap
from tally_server.domain.validation import CheckedDeltas, Limits
from tally_server.grpc_api.wrapping import WrappingInterceptor

APPLY_DELTAS = "/tally.v1.Coordinator/ApplyDeltas"
# The reading runs where grpc deserializes, on the event loop: up to this many bytes (the SDK's
# largest batch, 10,000 deltas of ids up to ~40 bytes: 2-3 ms), else the request takes protobuf's
# path, whose big batches are turned into lists and checked in a worker thread
# (servicer.OFF_LOOP_ITEMS). Measured (1,000 / 10,000 / 100,000 deltas of 34 bytes): 0.13 / 2.2 /
# 26 ms here; at 128 KiB the SDK's batches of 10,000 went through protobuf, 10 % of the server's
# time in a durable run. The applying of such a batch holds the loop longer than its reading.
READ_ON_LOOP_BYTES = 512 << 10


@dataclass(frozen=True, slots=True)
class ColumnsRequest:
    """An ApplyDeltasRequest whose batch came as plain columns, already validated (``batch``)."""

    handle: str
    batch_seq: int
    ordered: bool
    batch: CheckedDeltas


def reader(limits: Limits) -> Callable[[bytes], pb.ApplyDeltasRequest | ColumnsRequest]:
    """ApplyDeltas' request deserializer: the compiled core's reading when it applies, else protobuf's."""

    def parse(data: bytes) -> pb.ApplyDeltasRequest | ColumnsRequest:
        read = idmap.current().parse_apply_deltas
        if read is not None and len(data) <= READ_ON_LOOP_BYTES:
            got = read(data, limits.max_id_bytes, limits.max_deltas_per_call)
            if got is not None:
                handle, batch_seq, ordered, tasks, sources, values, packed = got
                return ColumnsRequest(
                    handle, batch_seq, ordered, CheckedDeltas(tasks, sources, values, packed)
                )
        return pb.ApplyDeltasRequest.FromString(data)

    return parse


class ColumnsReader(WrappingInterceptor):
    """Gives ApplyDeltas the deserializer of :func:`reader` (innermost: the others pass it on)."""

    def __init__(self, limits: Limits) -> None:
        super().__init__()
        self._parse = reader(limits)

    def _wrap(self, method: str, handler: Any) -> Any:
        if method != APPLY_DELTAS or handler.unary_unary is None or handler.request_deserializer is None:
            return handler  # another method, or a handler of raw bytes (a relay): as it is
        return grpc.unary_unary_rpc_method_handler(
            handler.unary_unary,
            request_deserializer=self._parse,
            response_serializer=handler.response_serializer,
        )
