"""A writer's two tables under the counting rules: its pending counts and its dedup map of task ids.

Both map str ids to ints and only grow with the writer's work: the dedup map keeps every task id a
live writer applied (DESIGN §2.3: a task fired again is skipped), which makes it the coordinator's
largest memory under long-lived writers. Two implementations keep one contract:

- the compiled core (``tally_server._ledgercore``, built from ``_ledgercore.c`` by ``server/setup.py``):
  each id kept as its UTF-8 bytes in one arena (a coordinator grows about 40 bytes less per task id a
  live writer remembers than with a dict of str objects), and the rules' common case, a batch of new
  tasks, applied in one call that fetches the dedup map's slots ahead of its lookups;
- this module's pure Python one, a dict: what runs when the extension was not built (no C compiler),
  or when the server is told so (``TALLY_LEDGER_CORE=python``).

A ledger takes its tables and :func:`py_apply_new`'s compiled twin from :func:`current` (or from the
core it is given); the tests run the rules on both cores and check them against each other.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Protocol, overload


class IdMap(Protocol):
    """What the ledger uses of a table: a dict[str, int]'s reads and writes, and :meth:`take_zeros`."""

    def __len__(self) -> int: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __getitem__(self, key: str, /) -> int: ...
    def __setitem__(self, key: str, value: int, /) -> None: ...
    def __delitem__(self, key: str, /) -> None: ...
    def __iter__(self) -> Iterator[str]: ...
    @overload
    def get(self, key: str, /) -> int | None: ...
    @overload
    def get(self, key: str, default: int, /) -> int: ...
    def items(self) -> Iterable[tuple[str, int]]:
        """The (id, value) pairs, in insertion order."""
        ...

    def values(self) -> Iterable[int]:
        """The values, in insertion order."""
        ...

    def take_zeros(self, sources: list[str], /) -> bool:
        """If each of ``sources`` is here once with the value 0, delete them all and return True.

        Otherwise change nothing and return False.
        """
        ...


class PyIdMap(dict[str, int]):
    """The pure Python table: a dict."""

    __slots__ = ()

    def take_zeros(self, sources: list[str]) -> bool:
        """See :meth:`IdMap.take_zeros`."""
        if not set(map(self.get, sources)) <= {0} or len(dict.fromkeys(sources)) != len(sources):
            return False
        deque(map(self.__delitem__, sources), maxlen=0)
        return True


def _all_added(applied: PyIdMap, tasks: list[str], values: list[int]) -> bool:
    """Add the tasks, none of them in ``applied``, if no task comes twice; returns whether it did.

    One C pass adds them and the size tells whether one came twice; then those added are taken out
    again (none was there before) and nothing changed.
    """
    before = len(applied)
    applied.update(zip(tasks, values, strict=True))
    if len(applied) - before == len(tasks):
        return True
    deque(map(applied.pop, tasks, repeat(None)), maxlen=0)
    return False


def py_apply_new(
    applied: PyIdMap,
    pending: PyIdMap,
    tasks: list[str],
    sources: list[str],
    values: list[int],
    done: set[str] | None = None,
    settling: Mapping[str, float] | None = None,
) -> list[str] | None:
    """The rules' common case: every task new and none twice (else None, nothing changed).

    Adds each task to the dedup map and each delta to its source's count; returns the sources whose
    count is zero at the end of the batch, in the order they first reached zero.

    ``done``: sources that may only be counted if pending already (a writer's own completions,
    which leave ``pending`` as they complete): one of them not pending makes it None too.
    ``settling``: sources whose delta cancels their settle: a delta for one of them while its count
    is zero makes it None too.
    """
    if done and not done.isdisjoint(sid for sid in sources if sid not in pending):
        return None
    if settling:
        counts: dict[str, int | None] = {}
        for sid, d in zip(sources, values, strict=True):
            count = counts[sid] if sid in counts else pending.get(sid)
            if count == 0 and sid in settling:
                return None
            counts[sid] = (count or 0) + d
    if not applied.keys().isdisjoint(tasks) or not _all_added(applied, tasks, values):
        return None
    recheck: dict[str, None] = {}
    count_of = pending.get
    for sid, d in zip(sources, values, strict=True):
        count = count_of(sid, 0) + d
        pending[sid] = count
        if not count:
            recheck[sid] = None
    return [sid for sid in recheck if pending[sid] == 0]


@dataclass(frozen=True)
class LedgerCore:
    """One implementation of the tables: ``name`` is ``"compiled"`` or ``"python"``."""

    name: str
    new_map: Callable[[], IdMap]
    copy_map: Callable[[Iterable[tuple[str, int]]], IdMap]
    apply_new: Callable[
        [IdMap, IdMap, list[str], list[str], list[int], set[str] | None, Mapping[str, float] | None],
        list[str] | None,
    ]
    # validation's check of a plain batch, packing its ids for the journal (None: validation's own)
    plain_batch: Callable[[list[str], list[str], list[int], int], bytes | None] | None = None
    # an ApplyDeltasRequest's bytes read when they hold a plain batch of columns (grpc_api/columns.py)
    parse_apply_deltas: (
        Callable[[bytes, int, int], tuple[str, int, bool, list[str], list[str], list[int], bytes] | None]
        | None
    ) = None
    # Python's hash of file keys packed as rows of words, without the GIL (domain/compact.py)
    hash_rows: Callable[[Any, Any, Any], bool] | None = None
    # lmdb_pages.pack_words of file keys, one copy per key, without the GIL (store/lmdb_reads.py)
    pack_rows: Callable[[Any, Any, Any, Any], bool] | None = None
    # a compact index's entries made and sorted in one radix pass and bucket sorts, without the GIL
    # (domain/compact.py: 10 M entries in a fifth of numpy's sort)
    sort_entries: Callable[[Sequence[Any], int, Any], bool] | None = None
    # dict.setdefault of many keys in one pass: the ids a live set's overlay gains (domain/completed.py)
    set_absent: Callable[[dict[str, int], list[str], int], list[str] | None] | None = None


PYTHON = LedgerCore("python", PyIdMap, PyIdMap, py_apply_new)  # type: ignore[arg-type]


def _compiled() -> LedgerCore | None:
    try:
        from tally_server import _ledgercore
    except ImportError:
        return None

    class CompiledIdMap(_ledgercore.IdMap, MutableMapping[str, int]):  # type: ignore[misc]
        """The compiled table, with the rest of a mapping's methods (``keys``, ``pop``, ``==``)."""

        __slots__ = ()

        def __repr__(self) -> str:
            return f"IdMap({dict(self.items())!r})"

    return LedgerCore(
        "compiled",
        CompiledIdMap,
        CompiledIdMap,
        _ledgercore.apply_new,  # type: ignore[arg-type]
        _ledgercore.plain_batch,
        _ledgercore.parse_apply_deltas,
        _ledgercore.hash_rows,
        _ledgercore.pack_rows,
        _ledgercore.sort_entries,
        _ledgercore.set_absent,
    )


COMPILED = _compiled()
"""The compiled core, or None when the extension was not built."""

MISSING = (
    "this installation lacks the compiled counting core (tally_server._ledgercore); reinstall "
    "tally-server where a C compiler and Python's headers are available, or use auto (the same rules "
    "in Python)"
)
"""Why ``compiled`` cannot be used here (settings refuse it with this, before :func:`use` would)."""


_current = COMPILED or PYTHON


def current() -> LedgerCore:
    """The core new ledgers use: the compiled one if it was built, unless :func:`use` said otherwise."""
    return _current


def use(name: str) -> LedgerCore:
    """Choose the core new ledgers use (``tally serve --ledger-core``): auto, compiled or python.

    Raises:
        ValueError: ``compiled`` was asked for and the extension was not built, or an unknown name.
    """
    global _current
    if name == "python":
        _current = PYTHON
    elif name == "compiled":
        if COMPILED is None:
            raise ValueError(MISSING)
        _current = COMPILED
    elif name == "auto":
        _current = COMPILED or PYTHON
    else:
        raise ValueError(f"unknown ledger core {name!r}: use auto, compiled or python")
    return _current
