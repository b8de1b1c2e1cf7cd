"""The registry's writes fenced by the store's epochs, when the registry is in the store's database.

On a PostgreSQL store the registry (``registry.SqlRegistry``) lives in the store's database unless
``--registry-url`` says otherwise. Its writes about a checkpoint (writer rows, events, progress
samples, claims, cursors, failed attempts, budgets, declared sources) are then conditional on the
epoch of that checkpoint's shard, as the store's completions and journal are: each write
transaction runs the coordinator's fence (``shards.run_fence``, the same read ``FOR KEY SHARE`` of
``store_epoch``) with the checkpoints it writes, reading the epochs of their shards only, and is
refused as a whole, nothing of it written, when one of those shards' epoch moved on (another
coordinator took it) or a checkpoint written is of a shard no longer held. So a coordinator that
lost a shard (paused past its lease) writes nothing of it to the registry either, while its writes
of the shards it kept go on; a refusal names the checkpoints refused (``RegistryFenced.refused``),
so the write-behind writes the others again without them. A registry in another database cannot
be fenced in the same transaction; its writes are not (``app.build_service`` says so at start).
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy.engine import Connection

from tally_server.errors import RegistryFenced
from tally_server.store.postgres import Fenced
from tally_server.store.shards import Fence, run_fence


def fence_write(conn: Connection, fence: Fence, carrying: Collection[str]) -> None:
    """Run ``fence`` in ``conn``'s transaction for a registry write of the checkpoints ``carrying``.

    Raises:
        RegistryFenced: a shard's epoch moved on, or a checkpoint carried is of a shard not held;
            the caller's transaction must write nothing (raising out of it rolls it back).
    """
    try:
        run_fence(conn, fence, carrying)
    except Fenced as exc:
        message = f"nothing of this registry write was written: {exc}"
        raise RegistryFenced(message, exc.shard, _refused(exc, carrying)) from exc


def _refused(refusal: Fenced, carrying: Collection[str]) -> frozenset[str]:
    """The checkpoints of ``carrying`` that ``refusal`` says can never pass this fence again.

    Those of the shards lost or moved on, when the fence knows the store's shards (``refuses``,
    set by ``ShardFence.check_rows``); else all of them: the whole store's epoch is gone.
    """
    if refusal.refuses is not None:
        return frozenset(filter(refusal.refuses, carrying))
    return frozenset(carrying)
