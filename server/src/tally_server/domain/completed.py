"""The live completed set of a checkpoint: a compact index of what its files hold, plus what changed since."""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, islice

import numpy as np
import numpy.typing as npt

from tally_server.domain import compact, idmap
from tally_server.domain.compact import CompactIndex, Hasher

# Measured with tracemalloc on CPython 3.11: a str object is 49 bytes plus its characters, its dict
# slot about 31, the int beside it about 32; a set slot about 40.
_BYTES_PER_OVERLAY_ID = 49 + 31 + 32
_BYTES_PER_TOMBSTONE = 49 + 40
_SEQ_SHIFT = 32  # an overlay value is (seq << 32) | origin index (_NO_ORIGIN: none)
_NO_ORIGIN = (1 << 32) - 1
# Up to this many ids, contains_many asks one at a time (see there).
_ONE_BY_ONE = 8
# A set no writer adds to merges once its overlay holds this fraction of the index's ids (1/256:
# then the overlay's ~112 bytes an id cost about 4 % of the index's ~10).
_REST_MERGE_DIVISOR = 256
# Confirms ids: (origin, their UTF-8 keys) -> whether that origin's file holds each (blocking).
Confirm = Callable[[str, Sequence[bytes]], list[bool]]


class CompletedSet:
    """The live completed set of one checkpoint (§2.4), with a sequence number per completion.

    The sequence lets each writer see "the completed set as it stood when it opened" without
    copying it: a source counts for that writer if it was completed at or before its open sequence.

    Three parts, so that 10 M ids take about 100 MB rather than 1 GB:

    - ``index``, a :class:`CompactIndex` of what was loaded from the files (and merged since):
      hashes only, so every hit is confirmed by ``confirm`` looking the id up in the file its entry
      names; a hash collision therefore never makes a source completed;
    - an overlay ``dict`` of ids completed since (with their sequence and file), merged into the
      index once it holds ``merge_at`` ids;
    - tombstones: ids of the index discarded since (un-completed by an anomaly).

    ``add`` takes the origin (the writer file) the ids were committed to; ids added without one
    (a set built in memory) stay in the overlay.

    Two corners the hashes leave, both needing a 56-bit hash collision with an id of the same
    file: an id committed but not yet added may read as completed a moment early (it is durable
    already); and ``add`` cannot tell an id that file held before from a new one, so it relies on
    writers never completing again into their own file what it holds (the ledger makes that an
    anomaly), or it would count the id twice.
    """

    def __init__(
        self,
        initial: Iterable[str] = (),
        *,
        index: CompactIndex | None = None,
        origins: Sequence[str] = (),
        confirm: Confirm | None = None,
        hasher: Hasher | None = None,
        merge_at: int = 0,
    ) -> None:
        if index is not None and confirm is None:
            raise ValueError("an index needs a confirm port")
        self._seq = 0
        self._viewed = False  # a view was taken at the current sequence
        self._views: weakref.WeakSet[_View] = weakref.WeakSet()
        self._index = index
        self._origins = list(origins)
        self._origin_ids = {name: i for i, name in enumerate(self._origins)}
        self._confirm = confirm
        self._hasher = hasher or Hasher()
        self._merge_at = merge_at or max(50_000, (index.count if index is not None else 0) // 32)
        self._overlay: dict[str, int] = dict.fromkeys(initial, _NO_ORIGIN)
        # Ids taken out of the overlay by a discard so far: the one change to an id already in it
        # (add only adds ids it lacks), so a merge planned at the same count finds its ids unchanged.
        self._overlay_discards = 0
        self._mergeable = 0  # overlay ids with an origin
        # Set by the service: it runs merges in a load thread (see ``plan_merge``), not in ``add``.
        self.background_merges = False
        self._tombstones: set[str] = set()
        self._hidden = 0  # tombstones that hide an id of the index (the others hide a mere hash hit)
        # Declared sources (issue #12's totals) and how many of them are completed, kept exact by
        # add and discard; empty until ``watch``.
        self.declared: set[str] | frozenset[str] = frozenset()
        self.declared_done = 0
        self._id_chars = sum(map(len, self._overlay))
        self._tomb_chars = 0

    def __contains__(self, source_id: object) -> bool:
        if not isinstance(source_id, str):
            return False
        if source_id in self._overlay:
            return True
        if source_id in self._tombstones:
            return False
        return self._indexed_seq(source_id) is not None

    def __len__(self) -> int:
        indexed = self._index.count if self._index is not None else 0
        return indexed - self._hidden + len(self._overlay)

    @property
    def origins(self) -> list[str]:
        """The files (writer ids) whose ids this set holds."""
        return list(self._origins)

    def _indexed_seq(self, source_id: str, skip_origin: int = -1) -> int | None:
        """The sequence of ``source_id`` in the index, confirmed in its file; None if absent.

        ``skip_origin``: an origin whose file just received the id (its entries prove nothing).
        """
        index = self._index
        if index is None:
            return None
        h = self._hasher.of_id(source_id)
        key = b""
        for i in index.candidates(h):
            origin = index.origin(i)
            if origin == skip_origin:
                continue
            key = key or source_id.encode()
            assert self._confirm is not None
            if self._confirm(self._origins[origin], [key])[0]:
                return index.seq(i)
        return None

    def contains_many(self, source_ids: Sequence[str]) -> list[bool]:
        """``[sid in self for sid in source_ids]``, vectorised over the index.

        Every hash hit is confirmed in the file its entry names, the hits of one file in one call
        (one read transaction). A few ids are looked up one by one: numpy's steps cost more than
        they do (one id: ~0.1 ms through the arrays, a few µs alone).
        """
        if len(source_ids) <= _ONE_BY_ONE:
            return [sid in self for sid in source_ids]
        overlay, tombstones = self._overlay, self._tombstones
        if (overlay and not overlay.keys().isdisjoint(source_ids)) or (
            tombstones and not tombstones.isdisjoint(source_ids)
        ):
            return [seq is not None for seq in self._seqs_many(source_ids)]
        # The usual case: the index alone answers, without a Python step per hit.
        found = self._index_hits(source_ids)
        if found is None:
            return [False] * len(source_ids)
        hits, _, confirmed = found
        answer = np.zeros(len(source_ids), dtype=bool)
        answer[hits] = confirmed
        if not all(confirmed):  # another entry with the same hash prefix may hold it (rare)
            for k, ok in zip(hits.tolist(), confirmed, strict=True):
                if not ok and self._indexed_seq(source_ids[k]) is not None:
                    answer[k] = True
        return answer.tolist()

    def _seqs_many(self, source_ids: Sequence[str]) -> list[int | None]:
        """Each id's completion sequence (None: not in the set), vectorised over the index.

        What ``contains_many`` answers, with the sequence a view compares to its cutoff, so that a
        view asks the files once per batch instead of once more per member.
        """
        overlay, tombstones = self._overlay, self._tombstones
        rest: list[int] | None = None  # positions of ``asked`` in ``source_ids`` (None: the same)
        out: list[int | None] = [None] * len(source_ids)
        if (overlay and not overlay.keys().isdisjoint(source_ids)) or (
            tombstones and not tombstones.isdisjoint(source_ids)
        ):
            rest = []
            for i, sid in enumerate(source_ids):
                value = overlay.get(sid)
                if value is not None:
                    out[i] = value >> _SEQ_SHIFT
                elif sid not in tombstones:
                    rest.append(i)
            asked: Sequence[str] = [source_ids[i] for i in rest]
        else:
            asked = source_ids
        found = self._index_hits(asked)
        if found is None:
            return out
        index = self._index
        assert index is not None
        hits, firsts, confirmed = found
        for k, first, ok in zip(hits.tolist(), firsts.tolist(), confirmed, strict=True):
            # Not in the first entry's file: another entry with the same hash prefix may hold it (rare).
            seq = index.seq(first) if ok else self._indexed_seq(asked[k])
            out[k if rest is None else rest[k]] = seq
        return out

    def _index_hits(
        self, asked: Sequence[str]
    ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp], list[bool]] | None:
        """Which of ``asked`` the index may hold, and whether the files confirm each (None: none).

        The positions in ``asked`` whose hash prefix the index holds, each one's first entry with
        that prefix, and whether that entry's file holds the id (the hits of one file in one call).
        """
        index = self._index
        if index is None or not asked or not len(index):
            return None
        assert self._confirm is not None
        at, found = index.first_many(self._hasher.of_ids(asked))
        hits = np.flatnonzero(found)
        if not len(hits):
            return None
        origins = index.entries[at[hits]] & np.uint64((1 << index.origin_bits) - 1)
        order = np.argsort(origins, kind="stable")  # the hits of each file together
        hits, origins = hits[order], origins[order]
        cuts = (np.flatnonzero(origins[1:] != origins[:-1]) + 1).tolist()
        keys = [asked[k].encode() for k in hits.tolist()]
        confirmed: list[bool] = []
        for lo, hi in zip([0, *cuts], [*cuts, len(keys)], strict=True):
            confirmed += self._confirm(self._origins[int(origins[lo])], keys[lo:hi])
        return hits, at[hits], confirmed

    def discard_many(self, source_ids: Iterable[str]) -> int:
        """Drop these completions (un-completes); returns how many were completed.

        ``discard`` of each, with the index asked once for all of them.
        """
        distinct = list(dict.fromkeys(source_ids))
        in_index = [
            sid
            for sid, seq in zip(distinct, self._seqs_many(distinct), strict=True)
            if seq is not None and sid not in self._overlay
        ]
        dropped = sum(self.discard(sid) for sid in distinct if sid in self._overlay)
        for sid in in_index:  # in the index, confirmed above and not hidden yet: hide it
            self._tombstones.add(sid)
            self._tomb_chars += len(sid)
            self._hidden += 1
            if sid in self.declared:
                self.declared_done -= 1
        return dropped + len(in_index)

    def add(self, sources: Iterable[str], origin: str | None = None, *, distinct: bool = False) -> None:
        """``sources`` were committed to ``origin``'s file: they are completed from now on.

        ``distinct``: ``sources`` is a list in which no id comes twice (a ledger's completions), so
        it is taken as it is instead of deduplicated first.
        """
        if self._viewed:
            self._seq += 1
            self._viewed = False
        if origin is None:
            tag = _NO_ORIGIN
        else:
            tag = self._origin_ids.get(origin, -1)
            if tag < 0:
                tag = self._origin_ids[origin] = len(self._origins)
                self._origins.append(origin)
        value = (self._seq << _SEQ_SHIFT) | tag
        overlay, tombstones = self._overlay, self._tombstones
        new = sources if distinct and isinstance(sources, list) else list(dict.fromkeys(sources))
        # Ids the overlay holds already keep their sequence: the compiled core leaves them out as
        # it adds the others (one pass, below); else they are left out first (usually none: C passes).
        set_absent = idmap.current().set_absent
        if set_absent is None and not overlay.keys().isdisjoint(new):
            new = [sid for sid in new if sid not in overlay]
        index = self._index
        if new and index is not None and len(index):
            # The id is in ``origin``'s file already (committed before it is added), so an entry
            # of that file whose hash matches may be another id: only other files can tell. Ids
            # with no entry of their hash prefix at all (nearly every one) are settled at once.
            doubtful = [sid for sid in new if sid not in tombstones] if tombstones else new
            _, found = index.first_many(self._hasher.of_ids(doubtful))
            if found.any():
                indexed = {
                    sid
                    for sid, hit in zip(doubtful, found.tolist(), strict=True)
                    if hit and self._indexed_seq(sid, skip_origin=tag) is not None
                }
                if indexed:
                    new = [sid for sid in new if sid not in indexed]
        if set_absent is None:
            overlay.update(dict.fromkeys(new, value))
        else:
            added = set_absent(overlay, new, value)
            new = new if added is None else added
        self._id_chars += sum(map(len, new))
        if self.declared:
            self.declared_done += len(self.declared.intersection(new))
        if tag != _NO_ORIGIN:
            self._mergeable += len(new) - (len(tombstones.intersection(new)) if tombstones else 0)
        if self.merge_due and not self.background_merges:
            self.merge()

    def discard(self, source_id: str) -> bool:
        """Drop one completion (an un-complete); returns whether the source was completed."""
        dropped = self._discard(source_id)
        if dropped and source_id in self.declared:
            self.declared_done -= 1
        return dropped

    def watch(self, declared: set[str], done: int) -> None:
        """Keep count of the completed among ``declared`` (``done`` of them are completed now)."""
        self.declared = declared
        self.declared_done = done

    def _discard(self, source_id: str) -> bool:
        value = self._overlay.pop(source_id, None)
        if value is not None:
            self._overlay_discards += 1
            self._id_chars -= len(source_id)
            if source_id not in self._tombstones and self._confirm is not None:
                if value & _NO_ORIGIN != _NO_ORIGIN:
                    self._mergeable -= 1
                # Its file may hold it until the delete is committed (or for good, if that
                # fails), and an entry sharing its hash prefix would then confirm it: hide it.
                self._tombstones.add(source_id)
                self._tomb_chars += len(source_id)
            return True
        if source_id in self._tombstones or self._indexed_seq(source_id) is None:
            return False
        self._tombstones.add(source_id)
        self._tomb_chars += len(source_id)
        self._hidden += 1
        return True

    @property
    def merge_due(self) -> bool:
        """The overlay holds enough ids with a file to merge them into the index."""
        return self._confirm is not None and self._mergeable >= self._merge_at

    @property
    def merge_due_at_rest(self) -> bool:
        """Worth merging once no writer is open: the overlay's ids with a file take ~1/256 of the index.

        An id costs ~112 bytes in the overlay and ~10 in the index. While writers write, merges wait
        for ``merge_due`` (a merge copies the whole index); once they are gone, the overlay would
        otherwise keep its ids as they are until the next writer, and their small objects pin the
        memory of everything the writers freed around them.
        """
        if self._confirm is None or not self._mergeable:
            return False
        return self._mergeable >= (self._index.count if self._index is not None else 0) // _REST_MERGE_DIVISOR

    def merge(self) -> None:
        """Move the overlay's ids that have a file into the compact index (at once)."""
        plan = self.plan_merge()
        if plan is not None:
            self.finish_merge(plan, plan.build())

    def plan_merge(self) -> MergePlan | None:
        """What a merge moves, as it stands now.

        Only the overlay's snapshot is taken here (C passes: ~12 ms at 400,000 ids). ``MergePlan.build``
        (hashing the ids, leaving out those whose hash prefix is taken, and the costly part: a copy
        of the whole index) may run in another thread while this set goes on changing; then
        ``finish_merge`` installs the result.
        """
        overlay, tombstones = self._overlay, self._tombstones
        if self._confirm is None:
            return None  # without files to confirm in, the ids stay as they are
        # The ids with a file and no tombstone, found with C passes (the overlay holds ~50,000).
        sids = list(overlay)
        values = np.fromiter(overlay.values(), dtype=np.uint64, count=len(sids))
        keep = (values & np.uint64(_NO_ORIGIN)) != np.uint64(_NO_ORIGIN)
        if tombstones:
            keep &= ~np.fromiter(map(tombstones.__contains__, sids), dtype=bool, count=len(sids))
        whole = bool(keep.all())
        if not whole:
            sids, values = list(compress(sids, keep.tolist())), values[keep]
        if not sids:
            return None
        if self._index is None:
            self._index = CompactIndex.build([])
        settled = min((v.cutoff for v in self._views), default=self._seq)
        return MergePlan(
            self._index,
            sids,
            values,
            self._hasher,
            len(self._origins),
            settled,
            self._overlay_discards,
            whole,
        )

    def finish_merge(self, plan: MergePlan, merged: CompactIndex) -> None:
        """Install ``merged`` (``plan.build()``); the moved ids leave the overlay."""
        if self._index is not plan.index:
            return  # another merge came first: this one is moot, its ids are still in the overlay
        self._index = merged
        overlay, tombstones = self._overlay, self._tombstones
        if plan.whole and not tombstones and self._overlay_discards == plan.discards:
            # The plan took the whole overlay and nothing left it since (add only appends ids it
            # lacks): the moved ids are its first entries, in order. What came after them is the
            # new overlay, copied without a lookup per moved id.
            moved_count = len(plan.sids)
            # Read from the end: the ids added since the plan are few, the moved ones many.
            since = list(islice(reversed(overlay.items()), len(overlay) - moved_count))
            since.reverse()
            self._overlay = dict(since)
            self._id_chars -= plan.chars
            self._mergeable -= moved_count  # each had a file and no tombstone
            self._merge_at = max(self._merge_at, self._index.count // 32)
            return
        values: list[int] = plan.values.tolist()
        if not tombstones and (
            self._overlay_discards == plan.discards or list(map(overlay.get, plan.sids)) == values
        ):
            # Each moved id is in the overlay as planned (nothing was discarded meanwhile): C passes.
            # Each had a file and no tombstone, so each was counted mergeable.
            deque(map(overlay.__delitem__, plan.sids), maxlen=0)
            self._id_chars -= plan.chars
            self._mergeable -= len(plan.sids)
            moved: Iterable[tuple[str, int]] = ()
        else:
            moved = zip(plan.sids, values, strict=True)
        for sid, value in moved:
            if sid in tombstones:
                # Discarded while the merge was built (and maybe completed again since, which
                # keeps it in the overlay): its tombstone now hides an entry of the index. Its
                # discard took it out of the mergeable count; an add since did not count it.
                self._hidden += 1
            elif overlay.get(sid) == value:
                del overlay[sid]
                self._id_chars -= len(sid)
                self._mergeable -= 1  # planned with a file, and no tombstone: it was counted
        if len(overlay) <= len(plan.sids):
            # A dict never shrinks as keys leave it: its table stays sized for every id it held
            # (3.7 MB for 100,000) until it is copied.
            self._overlay = overlay = dict(overlay)
        self._merge_at = max(self._merge_at, self._index.count // 32)

    def mergeable_recounted(self) -> int:
        """The overlay's ids with a file and no tombstone, counted one by one.

        ``merge_due`` reads the count kept as ids come and go; this is what it must equal.
        """
        tombstones = self._tombstones
        return sum(
            1 for sid, v in self._overlay.items() if v & _NO_ORIGIN != _NO_ORIGIN and sid not in tombstones
        )

    def estimated_bytes(self) -> int:
        """Roughly how many bytes the set holds in memory.

        The compact index, and each id of the overlay and the tombstones as a str in its dict or set.
        """
        size = self._index.nbytes if self._index is not None else 0
        size += len(self._overlay) * _BYTES_PER_OVERLAY_ID + self._id_chars
        size += len(self._tombstones) * _BYTES_PER_TOMBSTONE + self._tomb_chars
        return size

    def as_of_now(self) -> Callable[[str], bool]:
        """A view of the set frozen at this moment (later additions are invisible to it)."""
        self._viewed = True
        view = _View(self, self._seq, empty=not len(self))
        self._views.add(view)
        return view

    def overlay_in_byte_order(self) -> list[bytes]:
        """The overlay's ids as UTF-8, sorted (what a page of ids merges with the files' keys)."""
        return sorted(sid.encode() for sid in self._overlay)

    def sources(self) -> list[str]:
        """Every id; only for a set without an index (built in memory)."""
        if self._index is not None and len(self._index):
            raise RuntimeError("the ids of an indexed set are in its files; page through them there")
        return [sid for sid in self._overlay if sid not in self._tombstones]

    def in_byte_order(self) -> list[bytes]:
        """Every id as UTF-8 in LMDB's key order; only for a set without an index."""
        return sorted(sid.encode() for sid in self.sources())


@dataclass
class MergePlan:
    """Ids of the overlay on their way into the compact index (see ``CompletedSet.plan_merge``).

    ``build`` narrows ``sids`` and ``values`` to the ids that move (and may clear ``whole``):
    ``finish_merge`` reads them once it has returned.
    """

    index: CompactIndex
    sids: list[str]  # the ids that move
    values: npt.NDArray[np.uint64]  # each one's overlay value as planned
    hasher: Hasher
    origin_count: int
    settled: int
    discards: int = 0  # the set's count of overlay discards when planned
    # ``sids`` are every id of the overlay when planned, in its order (none was left out).
    whole: bool = False
    chars: int = 0  # the characters of ``sids`` (``build`` counts them)

    def build(self) -> CompactIndex:
        """The index with the ids added: a copy of it, the costly part (any thread).

        Reads only what was snapshotted and the index (which no one changes): safe beside the set.
        """
        index, sids, values = self.index, self.sids, self.values
        hashes = self.hasher.of_ids(sids)
        # An id whose hash prefix another entry has already (or another id merged with it) stays
        # in the overlay: entries must never leave open which one carries which sequence.
        _, taken = index.first_many(hashes)
        prefixes = hashes & np.uint64(compact.prefix_mask(index.origin_bits, self.origin_count))
        _, first, counts = np.unique(prefixes, return_index=True, return_counts=True)
        alone = np.zeros(len(sids), dtype=bool)
        alone[first[counts == 1]] = True
        keep = alone & ~taken
        if not keep.all():
            self.whole = False
            sids, values, hashes = list(compress(sids, keep.tolist())), values[keep], hashes[keep]
            self.sids, self.values = sids, values
            if not sids:
                return index
        self.chars = sum(map(len, sids))
        return index.merged(
            hashes,
            (values & np.uint64(_NO_ORIGIN)).astype(np.uint32),
            values >> np.uint64(_SEQ_SHIFT),
            origin_count=self.origin_count,
            added=len(sids),
            settled=self.settled,
        )


class _View:
    """``CompletedSet.as_of_now()``: what counted as completed at ``cutoff``."""

    __slots__ = ("__weakref__", "_set", "cutoff", "empty")

    def __init__(self, completed: CompletedSet, cutoff: int, *, empty: bool = False) -> None:
        self._set = completed
        self.cutoff = cutoff
        # The set was empty at ``cutoff`` (a writer opened on a fresh checkpoint): whatever is added
        # later comes after it, so nothing ever counted; no lookup needed.
        self.empty = empty

    def __call__(self, source_id: str) -> bool:
        if self.empty:
            return False
        s = self._set
        value = s._overlay.get(source_id)
        if value is not None:
            return value >> _SEQ_SHIFT <= self.cutoff
        if source_id in s._tombstones:
            return False
        seq = s._indexed_seq(source_id)
        return seq is not None and seq <= self.cutoff

    def many(self, source_ids: Sequence[str]) -> list[bool]:
        """``[self(sid) for sid in source_ids]``, vectorised over the index.

        Only ids in the set now can have counted at ``cutoff`` (a discard hides an id from every
        view), so the set's vectorised lookup, which gives each member's sequence, decides.
        """
        if self.empty:
            return [False] * len(source_ids)
        cutoff = self.cutoff
        return [seq is not None and seq <= cutoff for seq in self._set._seqs_many(source_ids)]
