"""The ids and deltas both sides of ``bench/compare.py`` send: plain Python, imported from either venv.

Tally's side runs in ``.venv`` and NeMo Curator's in ``.venv-nemo``; both import this module so that
the two sides get exactly the same deltas.
"""

from __future__ import annotations

BATCH = 1000  # deltas per ApplyDeltas call / per ``apply_deltas.remote()``
QUERY_CHUNK = 10_000  # ids per AreCompleted call: the SDK's own chunk (tally._ops.ARE_COMPLETED_CHUNK)

_MASK = (1 << 48) - 1
# Odd, so i -> i * _MULT mod 2**48 is a bijection: distinct i give distinct ids.
_MULT = 0x9E3779B97F4B
# Ids of the pre-built checkpoints start here, far from the writers' ids.
LOAD_BASE = 1 << 40

Delta = tuple[str, str, int]


def source_id(i: int) -> str:
    """12 hex digits, like NeMo Curator's content ids (a sha256 prefix), scattered over the key space."""
    return f"{(i * _MULT) & _MASK:012x}"


def writer_sources(writer: int, sources: int) -> list[str]:
    """The source ids of one writer; writers never share a source."""
    return [source_id(writer * sources + n) for n in range(sources)]


def writer_deltas(writer: int, sources: int, *, complete: bool) -> list[Delta]:
    """Four deltas per source, as a NeMo Curator pipeline fires them.

    The source stage reads the partition (+1), a stage fans it out to two (+1 for the fan-out), and
    the sink writes both halves (-1, -1): with ``complete`` the count reaches zero at the fourth
    delta and the source is completed. Without it every delta is +1 (nothing completes): the cost
    of counting alone.
    """
    tail = (-1, -1) if complete else (1, 1)
    out: list[Delta] = []
    for sid in writer_sources(writer, sources):
        root = f"0_{sid}"
        out += [
            (root, sid, 1),
            (f"{root}_0", sid, 1),
            (f"{root}_0_0", sid, tail[0]),
            (f"{root}_0_1", sid, tail[1]),
        ]
    return out


def batches(items: list[Delta], size: int = BATCH) -> list[list[Delta]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def loaded_ids(count: int) -> list[str]:
    """The completed ids of a pre-built checkpoint of ``count`` ids."""
    return [source_id(LOAD_BASE + i) for i in range(count)]


def file_ids(count: int, files: int, index: int) -> list[str]:
    """The ids pre-built file ``index`` of ``files`` holds (every id in exactly one file)."""
    return [source_id(LOAD_BASE + i) for i in range(index, count, files)]


def query_ids(count: int, total: int) -> list[str]:
    """``total`` ids to ask a checkpoint of ``count`` ids about: half completed, half not, mixed."""
    out = []
    for k in range(total):
        if k % 2:
            out.append(source_id(LOAD_BASE + count + k))  # never completed
        else:
            out.append(source_id(LOAD_BASE + (k * 7919) % count))
    return out


def percentile(samples: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``samples``, nearest rank."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]
