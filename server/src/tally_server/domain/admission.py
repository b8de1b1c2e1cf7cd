"""Who may join a checkpoint, and when it may start over (DESIGN §2.5, §4)."""

from __future__ import annotations

from collections.abc import Mapping

from tally_server.domain.checkpoint import WriterSession
from tally_server.domain.validation import Limits
from tally_server.domain.words import count
from tally_server.errors import AlreadyExists, FailedPrecondition, ResourceExhausted


def admit_writer(
    checkpoint: str, writer_id: str, live: Mapping[str, WriterSession], limits: Limits, lease_ttl_s: float
) -> None:
    """A new writer joins unless its id is live or the checkpoint has as many writers as allowed.

    Raises:
        AlreadyExists: a live writer has this id.
        ResourceExhausted: the checkpoint has ``max_writers_per_checkpoint`` live writers.
    """
    other = live.get(writer_id)
    if other is not None:
        raise AlreadyExists(
            f"writer {writer_id!r} is already live on checkpoint {checkpoint!r} (host {other.host!r}, "
            f"pid {other.pid}); close it, wait for its lease to expire ({lease_ttl_s:g} s), or choose "
            "another writer_id",
            writer_id=writer_id,
        )
    if len(live) >= limits.max_writers_per_checkpoint:
        raise ResourceExhausted(
            f"checkpoint {checkpoint!r} already has {count(len(live), 'live writer')}, the limit (setting "
            f"max_writers_per_checkpoint={limits.max_writers_per_checkpoint}); close a writer or "
            "raise the limit",
        )


def check_reset(checkpoint: str, live: Mapping[str, WriterSession], *, force: bool) -> None:
    """A checkpoint starts over only with no live writers, unless forced (they are then closed).

    Raises:
        FailedPrecondition: writers are live and the reset is not forced.
    """
    if live and not force:
        ids = ", ".join(sorted(live)[:10])
        raise FailedPrecondition(
            f"checkpoint {checkpoint!r} has {count(len(live), 'live writer')} ({ids}); "
            + (
                "stop it first, or force the reset (its pending state is dropped and its client gets "
                "NOT_FOUND)"
                if len(live) == 1
                else "stop them first, or force the reset (their pending state is dropped and their "
                "clients get NOT_FOUND)"
            ),
            live_writers=len(live),
        )
