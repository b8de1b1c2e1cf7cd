"""Completed sets load beside the event loop: a checkpoint being read never holds up calls on
another one (issue #10). A store whose load of one checkpoint waits for the test's signal makes
the ordering explicit; nothing depends on timing."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from tally_server.domain.compact import Hasher
from tally_server.domain.ports import LoadedIndex, PutCompleted
from tally_server.domain.validation import Limits
from tally_server.service import CoordinatorService
from tally_server.store.journal_log import LogJournal
from tally_server.store.lmdb_files import LmdbCompletionStore
from tally_server.store.registry import SqlRegistry, default_sqlite_url


class HeldStore(LmdbCompletionStore):
    """The real store; reading checkpoint ``big`` waits until the test lets it go on."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.loading = threading.Event()
        self.go_on = threading.Event()

    def load_index(self, checkpoint: str, hasher: Hasher) -> LoadedIndex:
        if checkpoint == "big":
            self.loading.set()
            assert self.go_on.wait(60), "the test never let the load of 'big' go on"
        return super().load_index(checkpoint, hasher)


async def never(seconds: float) -> None:
    await asyncio.Event().wait()


def _service(tmp_path: Path, store: LmdbCompletionStore) -> CoordinatorService:
    """A coordinator on ``store`` whose background loops never run (the test drives it)."""
    return CoordinatorService(
        completions=store,
        journal=LogJournal(tmp_path),
        registry=SqlRegistry(default_sqlite_url(tmp_path)),
        limits=Limits(),
        settle_ms=0,
        lease_ttl_s=10.0,
        sleep=never,
    )


def test_a_call_on_another_checkpoint_answers_while_a_big_one_loads(tmp_path: Path) -> None:
    with LmdbCompletionStore(tmp_path) as files:  # what a previous run left on disk
        files.commit(
            [
                PutCompleted("big", "w1", [f"b{i}" for i in range(1000)]),
                PutCompleted("small", "w1", ["s1", "s2"]),
            ]
        )

    async def main() -> None:
        store = HeldStore(tmp_path)
        service = _service(tmp_path, store)
        await service.start()
        try:
            big = asyncio.ensure_future(service.are_completed("big", ["b7", "nope"]))
            assert await asyncio.to_thread(store.loading.wait, 60)
            # "big" is being read right now, and stays so until we say: "small" answers meanwhile.
            small = await asyncio.wait_for(service.are_completed("small", ["s1", "nope"]), 60)
            assert small == [True, False]
            assert not big.done()
            store.go_on.set()
            assert await asyncio.wait_for(big, 60) == [True, False]
        finally:
            store.go_on.set()
            await service.shutdown()

    asyncio.run(main())


def test_completions_move_into_the_compact_index_in_a_load_thread(tmp_path: Path) -> None:
    async def main() -> None:
        service = _service(tmp_path, LmdbCompletionStore(tmp_path))
        await service.start()
        try:
            await service.import_completed("run", ["a", "b"], import_id="first")
            table = service._checkpoints
            completed = table["run"].ids()
            completed._merge_at = 2  # as if the overlay had grown to 1/32 of a big index
            view = completed.as_of_now()
            await service.import_completed("run", ["c", "d"], import_id="second")
            assert completed.merge_due  # add() leaves the merge to the service
            await table.merge_overlays()
            assert not completed.merge_due
            assert completed.estimated_bytes() < 200  # no id left as a str in the overlay
            assert await service.are_completed("run", ["a", "b", "c", "d", "e"]) == [True] * 4 + [False]
            assert [view(s) for s in "abcd"] == [True, True, False, False]  # sequences survived
            assert (await service.get_checkpoint("run")).completed_count == 4
        finally:
            await service.shutdown()

    asyncio.run(main())
