"""Every checkpoint the coordinator knows, and when their completed sets are in memory.

Checkpoints are known from the registry at start without reading their files (their counts come
from the newest progress sample). A completed set is loaded on demand (a writer opens, someone
asks ``are_completed``, an export pages through it) and unloaded again while idle once the loaded
ones exceed the memory budget. Status never loads anything.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tally_server.domain import validation
from tally_server.domain.checkpoint import Checkpoint, CompletedSet, choose_unloads
from tally_server.domain.compact import CompactIndex, Hasher, distinct_count
from tally_server.domain.events import EventKind
from tally_server.domain.ports import CheckpointRecord, LoadedIndex, ProgressRecord, QuarantinedFile
from tally_server.errors import NotFound, Unavailable
from tally_server.malloc import release_freed_memory
from tally_server.service.core import Core

log = logging.getLogger(__name__)
T = TypeVar("T")

# An idle checkpoint used within this many seconds is not unloaded (no thrashing under a reader).
UNLOAD_IDLE_S = 2.0
# A merge behind a writer's close that moves at least this many ids gives the freed heap back
# (``malloc_trim`` walks every heap: a few milliseconds, in a load thread); smaller ones leave it.
TRIM_AFTER_MERGING = 10_000
# Loads run beside the event loop; more than one, so that a small checkpoint never waits for a big one.
LOAD_THREADS = 4


class CheckpointTable:
    """Known checkpoints by name, loaded and unloaded under ``budget_bytes``.

    ``also_held`` says how much of the budget other things take (the writers' journal's live state):
    the loaded sets get what is left.
    """

    def __init__(self, core: Core, budget_bytes: int, also_held: Callable[[], int] = lambda: 0) -> None:
        self._core = core
        self.budget_bytes = budget_bytes
        self._also_held = also_held
        self.known: dict[str, Checkpoint] = {}
        self.resetting: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._load_executor = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="tally-load")
        self.hasher = Hasher()
        # Completed count last written as a progress sample, per checkpoint.
        self._sampled: dict[str, int] = {}
        self._merging: set[str] = set()  # checkpoints whose merge is being built
        self._merges: set[asyncio.Task[None]] = set()  # merges behind closes (merge_at_rest)

    def restore(self, records: Iterable[CheckpointRecord], counts: dict[str, int]) -> list[Checkpoint]:
        """Know these registered checkpoints, with their last sampled counts (nothing is read).

        Additive: a checkpoint known already is left as it is (a shard adopted at run time adds
        its checkpoints beside those served). Returns the checkpoints added.
        """
        added = []
        for record in records:
            if record.name in self.known:
                continue
            cp = self.known[record.name] = Checkpoint(
                name=record.name,
                created_at=record.created_at,
                last_activity_at=record.last_activity_at,
                fingerprint=dict(record.fingerprint),
                known_count=counts.get(record.name, 0),
            )
            added.append(cp)
            if record.name in counts:
                self._sampled[record.name] = counts[record.name]
        return added

    def drop(self, names: Iterable[str]) -> None:
        """Forget these checkpoints (given up to another coordinator; nothing is written).

        Their loaded sets go with them; a merge or a census still running on one finishes on the
        forgotten object.
        """
        for name in names:
            self.known.pop(name, None)
            self._sampled.pop(name, None)
            self._locks.pop(name, None)
            self.resetting.discard(name)

    def close(self) -> None:
        """Wait for loads in progress and stop the loading thread."""
        self._load_executor.shutdown(wait=True)

    def __getitem__(self, name: str) -> Checkpoint:
        return self.known[name]

    async def find(self, name: str, *, create: bool, restoring: bool = False) -> Checkpoint | None:
        """The checkpoint named ``name`` (its id set not necessarily loaded), or None.

        A folder on disk that the registry does not know yet (one NeMo Curator wrote, placed in
        the data directory) is adopted and read at once, so its first status is exact; with
        ``create`` a new checkpoint is registered.

        Every call naming a checkpoint comes through here (or :meth:`existing`): one naming a
        checkpoint this coordinator does not own is refused with ``NotOwned`` before anything is
        read or written; but with ``restoring``: the service brings back a journaled writer of a
        checkpoint it is restoring (``CoordinatorService.adopt``: owned once restored).
        """
        if not restoring:
            self._core.check_owned(name)
        cp = self.known.get(name)
        if cp is not None:
            return cp
        core = self._core
        async with self._locks.setdefault(name, asyncio.Lock()):
            cp = self.known.get(name)
            if cp is not None:
                return cp
            on_disk = await self._in_load_thread(core.completions.exists, name)
            if not on_disk and not create:
                return None
            now = core.wall()
            loaded = await self._in_load_thread(self._read_index, name) if on_disk else None
            record = CheckpointRecord(name, created_at=now, last_activity_at=now)
            await core.registry_write(lambda: core.registry.write_batch(checkpoints=[record]))
            cp = Checkpoint(name=name, created_at=now, last_activity_at=now, last_used=core.real_clock())
            self.known[name] = cp
            core.event(name, EventKind.CHECKPOINT_CREATED, f"checkpoint {name} created")
            if loaded is not None:
                self._take_loaded(cp, loaded)
            # A baseline at once: the first periodic sample then makes a second point, so the plot
            # and the rate of a checkpoint whose first run was quick are not one flat dot.
            self._core.bookkeeping.samples([ProgressRecord(name, now, cp.completed_count)])
            self._sampled[name] = cp.completed_count
        self.unload_idle()
        return cp

    async def existing(self, name: str) -> Checkpoint:
        """The checkpoint named ``name``; NOT_FOUND if there is none (creates nothing)."""
        validation.checkpoint_name(name, self._core.limits)
        cp = await self.find(name, create=False)
        if cp is None:
            raise missing_checkpoint(name)
        return cp

    async def completed(self, cp: Checkpoint, *, use: bool = True) -> CompletedSet:
        """The checkpoint's live completed set, loaded from its files if it is not in memory.

        ``use=False`` (a background census) leaves it first in line to be unloaded again.
        """
        if use:
            cp.last_used = self._core.real_clock()
        if cp.completed is not None:
            return cp.completed
        async with self._locks.setdefault(cp.name, asyncio.Lock()):
            if cp.completed is None:
                self._take_loaded(cp, await self._in_load_thread(self._read_index, cp.name))
                self.unload_idle()
            completed = cp.ids()
        if use:
            cp.last_used = self._core.real_clock()
        return completed

    def _read_index(self, name: str) -> tuple[LoadedIndex, CompactIndex | set[str]]:
        """Read the checkpoint's files into a compact index (in a load thread, never the loop's).

        From a remote store, the ids themselves: confirming an index's hits there would put a
        database round trip on the event loop for every lookup.
        """
        store, hasher = self._core.completions, self.hasher
        if store.remote:
            whole = store.load(name)
            # Its origins too: listing completed ids pages through the rows of every one of them.
            loaded = LoadedIndex(origins=whole.origins, hashes=[], files=[], unreadable=whole.unreadable)
            return loaded, whole.completed
        loaded = store.load_index(name, hasher)
        index = CompactIndex.build(loaded.hashes)
        loaded.hashes = []
        release_freed_memory()
        shared = set(index.shared_prefixes().tolist())
        if shared:  # ids in several files (or hash collisions): count the distinct ones exactly
            keys = store.keys_matching(
                name, loaded.origins, lambda k: index.prefix(hasher.of_key(k)) in shared
            )
            index.count = distinct_count(index, hasher, keys)
        return loaded, index

    def empty_set(self, name: str) -> CompletedSet:
        """An empty completed set of checkpoint ``name`` (after a reset)."""
        return self._new_set(name, CompactIndex.build([]) if not self._core.completions.remote else set(), [])

    def _new_set(self, name: str, index: CompactIndex | set[str], origins: list[str]) -> CompletedSet:
        if isinstance(index, set):  # a remote store's ids, held as they are: no lookup leaves memory
            return CompletedSet(index, origins=origins, hasher=self.hasher)
        confirm = functools.partial(self._core.completions.contains, name)
        completed = CompletedSet(index=index, origins=origins, confirm=confirm, hasher=self.hasher)
        completed.background_merges = True  # merge_overlays() builds them in a load thread
        return completed

    async def merge_overlays(self) -> None:
        """Merge the overlays that grew big enough into their compact index.

        Each is built in a load thread (a copy of the whole index: tens of milliseconds at 10 M
        ids, off the event loop). A checkpoint no writer has open merges what it can sooner
        (``CompletedSet.merge_due_at_rest``).
        """
        for cp in list(self.known.values()):
            await self._merge(cp)

    def merge_at_rest(self, cp: Checkpoint) -> None:
        """Merge the overlay of a checkpoint whose last writer just closed, behind the close.

        Then give what the writers freed back to the system: their sessions' state (their task ids,
        the journal's entries) came and went in glibc's heaps and pymalloc's arenas, and the
        overlay's ids, allocated among them, kept that memory resident (bench/README.md, "Memory
        per checkpoint").
        """

        async def merge() -> None:
            try:
                await self._merge(cp, trim=True)
            except Exception:
                log.exception("merging the new completions of checkpoint %s into its index failed", cp.name)

        task = asyncio.get_running_loop().create_task(merge(), name="tally-merge")
        self._merges.add(task)
        task.add_done_callback(self._merges.discard)

    async def settle_merges(self) -> None:
        """Wait for the merges behind closes (on shutdown)."""
        if self._merges:
            await asyncio.gather(*self._merges, return_exceptions=True)

    async def _merge(self, cp: Checkpoint, *, trim: bool = False) -> None:
        completed = cp.completed
        if completed is None or cp.name in self._merging:
            return
        if not (
            completed.merge_due or (completed.merge_due_at_rest and not self._core.sessions.live(cp.name))
        ):
            return
        plan = completed.plan_merge()
        if plan is None:
            return
        cp.pins += 1
        self._merging.add(cp.name)
        try:
            merged = await self.run(plan.build)
        finally:
            cp.pins -= 1
            self._merging.discard(cp.name)
        completed.finish_merge(plan, merged)
        del merged
        if trim and len(plan.sids) >= TRIM_AFTER_MERGING:
            await self.run(release_freed_memory)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking reads of the completion files in a load thread."""
        return await asyncio.get_running_loop().run_in_executor(self._load_executor, fn, *args)

    def _take_loaded(self, cp: Checkpoint, read: tuple[LoadedIndex, CompactIndex | set[str]]) -> None:
        """Install what the store read; unreadable files not reported before become events."""
        loaded, index = read
        reported = set(cp.unreadable_files)
        cp.completed = self._new_set(cp.name, index, loaded.origins)
        cp.known_count = len(cp.completed)
        if cp.declared:  # count the completed among the declared sources from now on
            cp.completed.watch(cp.declared, sum(cp.completed.contains_many(list(cp.declared))))
        cp.unreadable_files = [u.path for u in loaded.unreadable]
        for bad in loaded.unreadable:
            if bad.path not in reported:
                self._core.event(
                    cp.name,
                    EventKind.UNREADABLE_FILE,
                    f"completion file {bad.path} is unreadable and was skipped (its sources count as not "
                    f"completed): {bad.error}",
                    path=bad.path,
                    error=bad.error,
                )

    def quarantined(self, q: QuarantinedFile) -> None:
        """The store moved a writer's damaged own file aside and went on in a fresh one."""
        self._core.stats.files_quarantined += 1
        cp = self.known.get(q.checkpoint)
        if cp is not None and q.path in cp.unreadable_files:
            cp.unreadable_files.remove(q.path)  # the path now holds a fresh, readable file
        self._core.event(
            q.checkpoint,
            EventKind.FILE_QUARANTINED,
            f"completion file {q.path} of writer {q.writer_id} could not be written ({q.error}); it was "
            f"moved to {q.moved_to} and the writer goes on in a fresh file (sources only in the old file "
            "count as not completed and replay)",
            q.writer_id,
            path=q.path,
            moved_to=q.moved_to,
            error=q.error,
        )

    async def _in_load_thread(self, fn: Callable[[str], T], name: str) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._load_executor, fn, name)
        except OSError as exc:
            raise Unavailable(
                f"cannot read the files of checkpoint {name!r} ({exc}); check the data directory's disk "
                "and permissions, then retry",
            ) from exc

    def busy(self, cp: Checkpoint) -> bool:
        """Live writers, a pin (an operation holding the set across an await) or a reset."""
        return bool(cp.pins or self._core.sessions.live(cp.name) or cp.name in self.resetting)

    def unload_idle(self) -> None:
        """Unload the least recently used idle checkpoints while the loaded ones exceed the budget.

        What the writers' journal holds is taken off the budget first.
        """
        for cp in choose_unloads(
            self.known.values(),
            max(0, self.budget_bytes - self._also_held()),
            busy=self.busy,
            used_before=self._core.real_clock() - UNLOAD_IDLE_S,
        ):
            log.debug("unloading idle checkpoint %s (%d completed ids)", cp.name, cp.completed_count)
            cp.unload()

    async def census(self, checkpoints: list[Checkpoint]) -> None:
        """Read each checkpoint once for its count and unreadable files.

        Each is let go again afterwards, unless someone started using it meanwhile.
        """
        for cp in checkpoints:
            used = cp.last_used
            try:
                await self.completed(cp, use=False)
            except Exception:
                log.exception("reading the completion files of checkpoint %s failed", cp.name)
                continue
            if cp.last_used == used and not self.busy(cp):
                cp.unload()

    def sample_progress(self) -> None:
        """Queue a sample of every checkpoint whose completed count changed since its last one."""
        now = self._core.wall()
        samples = []
        for name, cp in self.known.items():
            count = cp.completed_count
            if self._sampled.get(name) != count:
                samples.append(ProgressRecord(name, now, count))
                self._sampled[name] = count
        self._core.bookkeeping.samples(samples)

    def forget_progress(self, name: str) -> None:
        """A reset starts the checkpoint's progress history over."""
        self._sampled.pop(name, None)
        self._core.bookkeeping.forget_samples(name)


def missing_checkpoint(name: str) -> NotFound:
    """The refusal of a read of a checkpoint that does not exist."""
    return NotFound(f"checkpoint {name!r} does not exist; it is created when its first writer opens")
