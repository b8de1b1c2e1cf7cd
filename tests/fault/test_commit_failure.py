"""A completion commit that fails is never reported durable, and is retried until it is."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from tally_server.domain.ports import CommitReport, CompletionOp
from tally_server.domain.validation import Limits
from tally_server.errors import Unavailable
from tally_server.service import CoordinatorService
from tally_server.store.journal_log import LogJournal
from tally_server.store.lmdb_files import LmdbCompletionStore
from tally_server.store.registry import SqlRegistry, default_sqlite_url
from tests.integration.workload import nemo_read, tree


class FailingStore(LmdbCompletionStore):
    """The real LMDB store, whose next ``failures`` commits fail as a full disk would."""

    failures = 0

    def commit(self, ops: Sequence[CompletionOp]) -> CommitReport:
        if self.failures:
            self.failures -= 1
            raise OSError(28, "No space left on device")
        return super().commit(ops)


@pytest.mark.parametrize("settle_ms", [0, 20])
def test_failed_commit_is_never_acknowledged_and_is_retried(tmp_path: Path, settle_ms: int) -> None:
    async def scenario() -> None:
        store = FailingStore(tmp_path)
        service = CoordinatorService(
            completions=store,
            journal=LogJournal(tmp_path),
            registry=SqlRegistry(default_sqlite_url(tmp_path)),
            limits=Limits(),
            settle_ms=settle_ms,
            lease_ttl_s=30,
        )
        await service.start()
        try:
            opened = await service.open_writer("fault/disk", writer_id="w")
            # The disk stays full until the failure was seen (a retry of the settle loop could
            # otherwise succeed between the failed flush and the check below).
            store.failures = 10**9
            if settle_ms == 0:
                # The call that would complete the source reports the failure instead.
                with pytest.raises(Unavailable, match="could not persist"):
                    await service.apply_deltas(opened.handle, tree("a"))
            else:
                await service.apply_deltas(opened.handle, tree("a"))
                with pytest.raises(Unavailable, match="flush again"):
                    await service.flush(opened.handle)
            assert await service.are_completed("fault/disk", ["a"]) == [False]
            store.failures = 0
            # The settle loop retries; a flush now returns only once "a" is durable.
            await service.flush(opened.handle)
            assert await service.are_completed("fault/disk", ["a"]) == [True]
        finally:
            await service.shutdown()

    asyncio.run(scenario())
    # Read after the store closed its files: one process must not open an LMDB file twice.
    assert nemo_read(tmp_path / "checkpoints" / "fault" / "disk") == {"a"}
