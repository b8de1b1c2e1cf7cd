"""Several coordinators on one PostgreSQL store, each owning some of its shards.

A store made with ``--store-shards N`` (N > 1; ``store.shards``) has N shards, and a checkpoint
belongs to shard ``shard_of(name, N)``. Each shard is leased on its own (a ``StoreLock`` of that
shard: an advisory lock and a fencing epoch), so each ``tally serve`` on the store owns some shards
and applies the deltas of their checkpoints, and every write it makes is fenced by the epochs of the
shards it holds. Which coordinator should hold a shard is decided by rendezvous hashing over the
live replicas (:func:`desired_shards`): each computes the same answer from ``store_replicas``, a
joining replica takes about 1/n of the shards, and the shards of one that is gone are spread over
the others.

Every coordinator answers every call. :class:`ShardRouter`, the first gRPC interceptor after the
request and error ones, reads the call's routing key (field 1 of every routed request: a checkpoint
name or a writer handle, see :data:`ROUTE_BY`) straight from the request's bytes; a call of a shard
held here goes on to this coordinator's own servicer, any other is forwarded as it came to the
shard's holder (``replica.Relay``). Writer handles carry their shard (:func:`tag_handle`), so a
writer's calls are routed without a lookup.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import Any
from urllib.parse import parse_qs

import grpc
from google.protobuf.message import DecodeError
from starlette.requests import Request

from tally_server.errors import InvalidArgument, Unavailable
from tally_server.grpc_api.wrapping import WrappingInterceptor
from tally_server.replica import Relay
from tally_server.store.replicas import Owner
from tally_server.store.shards import shard_of

_PREFIX = "/tally.v1.Coordinator/"

# The calls routed by the checkpoint their request names (field 1: ``checkpoint`` or ``name``).
ROUTE_BY_CHECKPOINT = frozenset(
    {
        "OpenWriter",
        "AreCompleted",
        "GetCheckpoint",
        "ListWriters",
        "ListEvents",
        "GetProgress",
        "WatchCheckpoint",
        "ListCompleted",
        "ImportCompleted",
        "ResetCheckpoint",
        "GetCursor",
        "ListFailures",
        "RetryFailed",
        "SetFailureBudget",
        "DeclareSources",
        "ListRemaining",
        "TokenIsCurrent",
    }
)
# The calls routed by the writer handle their request names (field 1, ``handle``).
ROUTE_BY_HANDLE = frozenset(
    {"KeepAlive", "ApplyDeltas", "Flush", "CloseWriter", "SaveCursors", "ReportFailure", "Acquire"}
)
# ListCheckpoints and ListReplicas are the store's as a whole: answered where they arrive.

_HANDLE_SEP = "."


def handle_tag(shard: int) -> str:
    """What a writer handle of a checkpoint in ``shard`` ends with (``.<shard>``)."""
    return f"{_HANDLE_SEP}{shard}"


def tag_handle(handle: str, shard: int) -> str:
    """A writer handle that says which shard its checkpoint is in (``<random>.<shard>``)."""
    return handle + handle_tag(shard)


def handle_shard(handle: str) -> int | None:
    """The shard a handle of :func:`tag_handle` names; None for any other handle (answered here)."""
    _, sep, tail = handle.rpartition(_HANDLE_SEP)
    if not sep or not tail.isdigit() or len(tail) > 4:
        return None
    return int(tail)


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def field_one(raw: bytes) -> str | None:
    """Field 1 of a serialized message, as a string ("" when absent); None if the bytes are malformed.

    Reads the wire format without building the message: an ``ApplyDeltas`` of thousands of deltas
    costs a skip over each top-level field. The last occurrence wins, as in protobuf's own parsing.
    """
    found = ""
    pos, end = 0, len(raw)
    try:
        while pos < end:
            key, pos = _varint(raw, pos)
            field, wire = key >> 3, key & 7
            if wire == 2:
                length, pos = _varint(raw, pos)
                if pos + length > end:
                    return None
                if field == 1:
                    found = raw[pos : pos + length].decode("utf-8")
                pos += length
            elif wire == 0:
                _, pos = _varint(raw, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            else:
                return None
    except (IndexError, UnicodeDecodeError):
        return None
    return found if pos == end else None


def _score(shard: int, name: str) -> bytes:
    return hashlib.blake2b(f"{shard}/{name}".encode(), digest_size=8).digest()


def desired_shards(shards: int, live: Collection[str], me: str) -> frozenset[int]:
    """The shards ``me`` should hold among the ``live`` replicas (``me`` counts too).

    Every replica computes the same assignment from the same list. Each holds ``shards // n`` or one
    more (the replicas first by name get the extra ones), and within that the pairs of shard and
    replica are taken in the order of a hash of both (rendezvous hashing with capacities), so a
    replica joining or leaving moves few shards besides its own share.
    """
    names = sorted(set(live) | {me})
    base, extra = divmod(shards, len(names))
    room = {name: base + (1 if i < extra else 0) for i, name in enumerate(names)}
    pairs = sorted(((_score(s, n), s, n) for s in range(shards) for n in names), reverse=True)
    holder: dict[int, str] = {}
    for _, shard, name in pairs:
        if shard not in holder and room[name] > 0:
            holder[shard] = name
            room[name] -= 1
    return frozenset(s for s, name in holder.items() if name == me)


class ShardMap:
    """Which coordinator holds each shard, as last read from the store (thread-safe replacement)."""

    def __init__(self, shards: int, me: str) -> None:
        self.shards = shards
        self.me = me
        self._owners: Mapping[int, Owner] = {}
        self.held: frozenset[int] = frozenset()  # the shards this coordinator's service owns now
        self._lock = threading.Lock()

    def update(self, owners: Mapping[int, Owner]) -> None:
        """Replace what is known of the holders (the keeper's read of ``store_epoch``)."""
        with self._lock:
            self._owners = dict(owners)

    def owners(self) -> Mapping[int, Owner]:
        """The holder of each shard, as last read."""
        with self._lock:
            return self._owners

    def owner(self, shard: int) -> Owner:
        """The live coordinator holding ``shard``.

        Raises:
            Unavailable: no live coordinator holds it now (it is moving between replicas, or its
                holder died and another takes it within seconds): retry.
        """
        owner = self.owners().get(shard)
        if owner is None or not owner.alive or owner.name == self.me or not owner.grpc_address:
            raise Unavailable(
                f"shard {shard} of the store is moving between coordinators (its holder "
                f"{owner.name if owner is not None else '(none yet)'} is not serving it here); retry in a "
                "few seconds"
            )
        return owner

    def shard_of(self, checkpoint: str) -> int:
        """The shard of a checkpoint on this store."""
        return shard_of(checkpoint, self.shards)


def routing_shard(shard_map: ShardMap, name: str, raw: bytes) -> int | None:
    """The shard a call's request bytes route it to; None: answer it here (malformed, or not routed)."""
    key = field_one(raw)
    if not key:
        return None  # empty or malformed: the servicer here refuses it as it would anyway
    if name in ROUTE_BY_HANDLE:
        return handle_shard(key)
    return shard_map.shard_of(key)


class ShardRouter(WrappingInterceptor):
    """Routes each call of ``ROUTE_BY`` to the coordinator holding its shard (this one or another)."""

    def __init__(self, shard_map: ShardMap, relay: Relay) -> None:
        super().__init__()
        self._map = shard_map
        self._relay = relay

    def _wrap(self, method: str, handler: Any) -> Any:
        name = method[len(_PREFIX) :] if method.startswith(_PREFIX) else ""
        if name not in ROUTE_BY_CHECKPOINT and name not in ROUTE_BY_HANDLE:
            return handler
        decode = handler.request_deserializer
        encode = handler.response_serializer or (lambda message: message)
        shard_map, relay = self._map, self._relay

        def parsed(raw: bytes) -> Any:
            if decode is None:
                return raw  # a handler of raw bytes (a refusal of the token checks)
            try:
                return decode(raw)
            except DecodeError as exc:
                raise InvalidArgument(f"the request could not be decoded as {name}Request: {exc}") from None

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(raw: bytes, context: Any) -> Any:
                shard = routing_shard(shard_map, name, raw)
                if shard is None or shard in shard_map.held:
                    return encode(await inner(parsed(raw), context))
                return await relay.unary(method, lambda: shard_map.owner(shard), raw, context)

            return grpc.unary_unary_rpc_method_handler(unary)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(raw: bytes, context: Any) -> AsyncIterator[Any]:
                shard = routing_shard(shard_map, name, raw)
                if shard is None or shard in shard_map.held:
                    async for item in inner_stream(parsed(raw), context):
                        yield encode(item)
                    return
                async for forwarded in relay.stream(method, lambda: shard_map.owner(shard), raw, context):
                    yield forwarded

            return grpc.unary_stream_rpc_method_handler(stream)
        return handler


# HTTP: where each routed request names its checkpoint (the JSON body's field, or the query's).
_BODY_KEY = {
    "/v1/writers": "checkpoint",
    "/v1/are-completed": "checkpoint",
    "/v1/declare": "checkpoint",
    "/v1/import": "checkpoint",
    "/v1/reset": "name",
    "/v1/failures/retry": "checkpoint",
    "/v1/failures/budget": "checkpoint",
}
_QUERY_ROUTED = frozenset(
    {
        "/v1/remaining",
        "/v1/completed",
        "/v1/writers",
        "/v1/cursors",
        "/v1/events",
        "/v1/progress",
        "/v1/watch",
        "/v1/failures",
        "/v1/claims/current",
    }
)
_WRITERS = "/v1/writers/"
_CHECKPOINT = "/v1/checkpoints/"


class HttpShardRouter:
    """ASGI middleware: :class:`ShardRouter` for the HTTP API (outermost but for request ids and limits).

    Routes by the writer handle in ``/v1/writers/{handle}/...``, the name in
    ``/v1/checkpoints/{name}``, the ``checkpoint`` query parameter of the reads, or the checkpoint
    field of a POST's JSON body (read once, then handed on as it came).
    """

    def __init__(
        self,
        app: Any,
        shard_map: ShardMap,
        forward: Callable[[Any, Callable[[], Owner], bytes | None], Any],
    ) -> None:
        self.app = app
        self._map = shard_map
        self._forward = forward

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Hand the request on here, or answer it with its shard holder's answer."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        body: bytes | None = None
        key: str | None = None
        by_handle = False
        if path.startswith(_WRITERS) and path.count("/") >= 4:
            key, by_handle = path.split("/")[3], True
        elif path.startswith(_CHECKPOINT):
            key = path[len(_CHECKPOINT) :]
        elif scope["method"] == "POST" and path in _BODY_KEY:
            body = await _read_body(receive)
            key = _json_field(body, _BODY_KEY[path])
        elif scope["method"] == "GET" and path in _QUERY_ROUTED:
            values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("checkpoint")
            key = values[-1] if values else None
        shard = None
        if key:
            shard = handle_shard(key) if by_handle else self._map.shard_of(key)
        if shard is None or shard in self._map.held:
            await self.app(scope, _replay(body, receive) if body is not None else receive, send)
            return
        owner_of = self._map.owner
        held_shard = shard
        response = await self._forward(Request(scope, receive), lambda: owner_of(held_shard), body)
        await response(scope, receive, send)


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def again() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def _json_field(body: bytes, field: str) -> str | None:
    try:
        value = json.loads(body).get(field)
    except (ValueError, AttributeError):
        return None  # malformed: refused here as it would be anywhere
    return value if isinstance(value, str) else None
