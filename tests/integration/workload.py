"""Delta streams shaped like NeMo Curator's, shared by the integration and fault tests."""

from __future__ import annotations

from pathlib import Path

import lmdb


def nemo_read(checkpoint_dir: Path) -> set[str]:
    """Read a checkpoint folder exactly as NeMo Curator 1.4.0's actor does on startup."""
    done: set[str] = set()
    for mdb in sorted((checkpoint_dir / ".nemo_curator_metadata").glob("*.mdb")):
        try:
            env = lmdb.open(str(mdb), subdir=False, readonly=True, lock=False, max_dbs=1)
        except lmdb.Error:
            continue  # NeMo skips an unreadable file with a warning
        try:
            try:
                db = env.open_db(b"completed_sources")
            except lmdb.Error:
                continue  # no completions database yet: empty
            with env.begin() as txn, txn.cursor(db=db) as cur:
                done |= {k.decode() for k, _ in cur}
        finally:
            env.close()
    return done


def tree(source: str) -> list[tuple[str, str, int]]:
    """One partition: read (+1), 1:1 stage (0), fan-out to 3 (+2), one child filtered (-1),
    two children written at the sink (-1 each)."""
    root = f"0_{source}"
    return [
        (root, source, 1),
        (f"{root}_0", source, 0),
        (f"{root}_0_0", source, 2),
        (f"{root}_0_0_0", source, -1),  # filtered slot
        (f"{root}_0_0_1", source, -1),  # sink
        (f"{root}_0_0_2", source, -1),  # sink
    ]
