"""Operations shared by clients and writers: the chunked, retrying ``are_completed`` query."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from tally._retry import Deadline, RetryPolicy, async_call_with_retry, call_with_retry
from tally._transport import AsyncTransport, Transport
from tally.errors import InvalidArgument

# Queries are split so that one huge list stays well under the server's ids-per-query limit
# (100 000 by default) and under gRPC's message size limit.
ARE_COMPLETED_CHUNK = 10_000


def source_id_chunks(ids: Iterable[str]) -> list[list[str]]:
    """Validate ``ids`` locally (strings only) and split them into query-sized chunks.

    Raises:
        InvalidArgument: ``ids`` is a single string or holds something that is not a string.
    """
    if isinstance(ids, str | bytes):
        # A lone string would be iterated character by character: almost surely a mistake.
        raise InvalidArgument(f"source ids must be a list of strings, not a single {type(ids).__name__}")
    items = list(ids)
    for i, sid in enumerate(items):
        if not isinstance(sid, str):
            raise InvalidArgument(f"source_ids[{i}] is {type(sid).__name__} {sid!r}; source ids are strings")
    return [items[i : i + ARE_COMPLETED_CHUNK] for i in range(0, len(items), ARE_COMPLETED_CHUNK)]


def are_completed(
    transport: Transport, policy: RetryPolicy, timeout: float, checkpoint: str, ids: Iterable[str]
) -> list[bool]:
    """Blocking chunked query; each chunk gets ``timeout`` seconds, retries included."""
    answer: list[bool] = []
    for chunk in source_id_chunks(ids):
        answer += call_with_retry(
            functools.partial(transport.are_completed, checkpoint, chunk),
            policy,
            Deadline(timeout),
            f"are_completed({checkpoint!r}, {len(chunk)} ids)",
        )
    return answer


async def async_are_completed(
    transport: AsyncTransport, policy: RetryPolicy, timeout: float, checkpoint: str, ids: Iterable[str]
) -> list[bool]:
    """asyncio twin of :func:`are_completed`."""
    answer: list[bool] = []
    for chunk in source_id_chunks(ids):
        answer += await async_call_with_retry(
            functools.partial(transport.are_completed, checkpoint, chunk),
            policy,
            Deadline(timeout),
            f"are_completed({checkpoint!r}, {len(chunk)} ids)",
        )
    return answer
