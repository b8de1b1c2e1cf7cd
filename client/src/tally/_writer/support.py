"""What the writer's core and drivers share besides state: input checks, errors and their words."""

from __future__ import annotations

import logging
import operator
import os
import socket
from collections.abc import Iterable

from tally._types import Delta, OpenedWriter
from tally._words import count
from tally.errors import Internal, InvalidArgument, LeaseLost, NotFound, TallyError, Unavailable

logger = logging.getLogger("tally._writer")

# Heartbeat period when the server reported no lease TTL.
FALLBACK_HEARTBEAT_S = 10.0
# After close() gave up delivering the buffer, this long more (at most the client's timeout) is
# spent telling the coordinator the writer is gone, so that its id is free now and not only when
# the lease runs out.
CLOSE_GRACE_S = 5.0


def default_writer_id() -> str:
    """NeMo Curator's writer id: ``<hostname>-<pid>``."""
    return f"{socket.gethostname()}-{os.getpid()}"


def validated(deltas: Iterable[Delta]) -> list[Delta]:
    """``deltas`` as a list of ``(str, str, int)``; numpy integers are accepted, bools are not.

    Raises:
        InvalidArgument: Not an iterable of such tuples (names the first bad item).
    """
    try:
        items = list(deltas)
    except TypeError:
        raise InvalidArgument(f"apply_deltas expects a list of tuples, got {type(deltas).__name__}") from None
    if _plain(items):
        return items
    out: list[Delta] = []
    for i, item in enumerate(items):
        try:
            task_id, source_id, raw = item
            # operator.index accepts numpy integers but not floats; bool is an int we refuse.
            delta = operator.index(raw)
            ok = isinstance(task_id, str) and isinstance(source_id, str) and not isinstance(raw, bool)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise InvalidArgument(
                f"deltas[{i}] = {item!r} is not a (task_id: str, source_id: str, delta: int) tuple"
            )
        out.append((task_id, source_id, delta))
    return out


def _plain(items: list[Delta]) -> bool:
    """Whether every item is a ``(str, str, int)`` tuple, checked a column at a time at C speed.

    False says nothing is wrong yet, only that :func:`validated` must look at each item.
    """
    if not set(map(type, items)) <= {tuple}:
        return False
    try:
        task_ids, source_ids, values = zip(*items, strict=True) if items else ((), (), ())
        "".join(task_ids)  # a TypeError if one is not a str
        "".join(source_ids)
    except (TypeError, ValueError):  # not all of length 3, or not all str
        return False
    return set(map(type, values)) <= {int}  # exactly int: not bool, not numpy (converted one by one)


def as_tally_error(exc: Exception) -> TallyError:
    """``exc`` if it is a TallyError; anything else from a transport is a bug, reported as Internal."""
    if isinstance(exc, TallyError):
        return exc
    # A transport must raise TallyError only; anything else is a bug, but it must still stop the
    # writer visibly instead of killing the sender and leaving flush() waiting forever.
    logger.error("unexpected error from the Tally transport", exc_info=exc)
    return Internal(f"unexpected error in the Tally client transport: {exc!r}")


def fresh(err: TallyError) -> TallyError:
    """A copy of ``err`` to raise: one stored instance raised from several calls piles up tracebacks."""
    return type(err)(err.message, err.code, err.details)


def describe(err: TallyError) -> str:
    """``CODE: message``, as ``WriterHealth.last_error`` shows errors."""
    return f"{err.code.value}: {err.message}"


def lease_lost_error(
    writer_id: str, checkpoint: str, err: TallyError, during: str, buffered: int
) -> LeaseLost:
    """Log a lost lease once, and the error that flush()/close() raise from then on."""
    logger.error(
        "tally writer %s lost its lease on checkpoint %r (the coordinator answered %s while %s: "
        "%s); discarding %s. Its pending counts are gone, so its unfinished "
        "sources replay on the next run",
        writer_id,
        checkpoint,
        err.code.value,
        during,
        err.message,
        count(buffered, "buffered delta"),
    )
    return LeaseLost(
        f"tally writer {writer_id!r} lost its lease on checkpoint {checkpoint!r}: the "
        f"coordinator no longer knows it ({err.message}). {count(buffered, 'buffered delta')} "
        f"{'was' if buffered == 1 else 'were'} discarded; unfinished sources replay on the next run. "
        "Open a new writer to continue.",
        details=err.details,
    )


def log_retry(writer_id: str, seq: int, size: int, failures: int, delay: float, err: TallyError) -> None:
    log = logger.warning if failures == 1 else logger.debug
    log(
        "tally writer %s: batch %d (%s) not delivered, retry %d in %.2fs: %s",
        writer_id,
        seq,
        count(size, "delta"),
        failures,
        delay,
        err.message,
    )


def log_batch_refused(writer_id: str, seq: int, err: TallyError, buffered: int) -> None:
    logger.error(
        "tally writer %s: the coordinator refused batch %d (%s: %s); the writer stops sending "
        "and discards %s (%s on the next run); "
        "flush()/close() will raise this error",
        writer_id,
        seq,
        err.code.value,
        err.message,
        count(buffered, "buffered delta"),
        "its source replays" if buffered == 1 else "their sources replay",
    )


def log_close_anyway_failed(writer_id: str, err: TallyError) -> None:
    if isinstance(err, NotFound):
        return  # the coordinator had already let it go
    logger.warning(
        "tally writer %s: could not close it on the coordinator either (%s); it stays live there "
        "until its lease expires",
        writer_id,
        err,
    )


def warn_overflow(writer_id: str, max_buffered: int, *, before_open: bool) -> None:
    if before_open:
        reason = "the writer is not open yet, so nothing drains it; open it before applying deltas"
    else:
        reason = "apply_deltas on the event loop cannot wait for room; await flush() for back-pressure"
    logger.warning(
        "tally writer %s buffers more than max_buffered=%d deltas: %s", writer_id, max_buffered, reason
    )


def warn_dropped(writer_id: str, dropped: int, why: str) -> None:
    logger.warning(
        "tally writer %s discards %s given to apply_deltas after it stopped (%s); "
        "further discards are counted in health().dropped",
        writer_id,
        count(dropped, "delta"),
        why or "the writer is closed",
    )


def log_heartbeat_failed(writer_id: str, err: TallyError, delay: float, lease_ttl_s: float | None) -> None:
    if not isinstance(err, Unavailable):
        logger.error("tally writer %s: heartbeat refused: %s", writer_id, describe(err))
        return
    logger.warning(
        "tally writer %s: heartbeat failed (%s), retrying in %.2fs; the lease expires %.0fs "
        "after the last successful one",
        writer_id,
        err.message,
        delay,
        lease_ttl_s or 0.0,
    )


def log_opened(opened: OpenedWriter, checkpoint: str, flush_interval_s: float) -> None:
    settle_s = opened.settle_ms / 1000.0
    if settle_s > 0 and flush_interval_s > settle_s / 2:
        logger.warning(
            "tally writer %s: flush_interval_s=%.3f is not well below the coordinator's settle "
            "window of %d ms; deltas of one source may arrive after its count touched zero",
            opened.writer_id,
            flush_interval_s,
            opened.settle_ms,
        )
    logger.debug(
        "tally writer %s opened on checkpoint %r (lease %.1fs, %s already completed)",
        opened.writer_id,
        checkpoint,
        opened.lease_ttl_s,
        count(opened.completed_count, "source"),
    )
