"""A checkpoint folder with valid files and damaged ones, served by a real coordinator.

Damaged: a truncated file, garbage bytes, an LMDB file whose main tree root page has the wrong
type (LMDB opens it, then ``open_db`` fails with MDB_CORRUPTED), an LMDB file with a leaf page of
the wrong type (LMDB's cursor walk aborts the whole process on it: the coordinator must find it
in the pages and never walk it), a symlink to a valid file outside the data dir, a dangling
symlink pointing outside. The promise: each is skipped AND reported
unreadable (never silently counted as empty), and the server never creates or writes a file
outside its data dir, even when a writer whose id names a symlink completes sources.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import httpx
import lmdb

import tally
from tests import lmdb_damage
from tests.nemo_format import METADATA_DIRNAME, nemo_write

from .common import Row, events, scratch, serve

CHECKPOINT = "fault/damaged"
GOOD = {"good-a": 500, "good-b": 500}
DAMAGED = ("truncated", "garbage", "corrupted", "bad-leaf", "outside-link", "dangling")


@dataclass
class DamagedResult:
    damaged: int
    reported: set[str]  # damaged file stems the coordinator reported unreadable
    silently_lost: set[str]  # ids of damaged files that vanished without their file being reported
    good_missing: set[str]
    created_outside: list[str]
    modified_outside: list[str]
    unreadable_count: int  # the checkpoint status's unreadable_files
    writers_blocked: dict[str, str]  # writer id named after a symlink -> why it could not complete


def ids(stem: str, n: int) -> list[str]:
    return [f"{stem}-{i}" for i in range(n)]


def corrupt_main_root(path: Path) -> None:
    """Give the main tree's root page a wrong type: the env opens, ``open_db`` fails MDB_CORRUPTED.

    Meta pages 0 and 1 hold, after the 16-byte page header, magic, version, address and map size
    (24 bytes), then two 48-byte MDB_db records (free list, main); ``md_root`` is the last field of
    a record and the meta's txnid follows ``mm_last_pg``. The newer meta page is the live one.
    """
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, max_dbs=1)
    page = env.stat()["psize"]
    env.close()
    data = bytearray(path.read_bytes())

    def meta(n: int) -> tuple[int, int]:
        base = n * page + 16 + 24
        root = struct.unpack_from("<Q", data, base + 48 + 40)[0]
        txnid = struct.unpack_from("<Q", data, base + 96 + 8)[0]
        return txnid, root

    _, root = max(meta(0), meta(1))
    struct.pack_into("<H", data, root * page + 10, 0x08)  # mp_flags: P_META, not branch or leaf
    path.write_bytes(bytes(data))


def build(data: Path, outside: Path) -> dict[str, list[str]]:
    """Write the folder; returns the ids each file holds (the dangling link holds none)."""
    folder = data / "checkpoints" / CHECKPOINT / METADATA_DIRNAME
    folder.mkdir(parents=True)
    outside.mkdir(parents=True)
    held: dict[str, list[str]] = {}
    for stem, n in GOOD.items():
        held[stem] = ids(stem, n)
        nemo_write(folder / f"{stem}.mdb", held[stem])

    held["truncated"] = ids("truncated", 2000)
    nemo_write(folder / "truncated.mdb", held["truncated"])
    with open(folder / "truncated.mdb", "r+b") as f:
        f.truncate(os.path.getsize(folder / "truncated.mdb") // 2)

    held["garbage"] = []
    (folder / "garbage.mdb").write_bytes(hashlib.sha256(b"tally").digest() * 2048)

    held["corrupted"] = ids("corrupted", 3000)
    nemo_write(folder / "corrupted.mdb", held["corrupted"])
    corrupt_main_root(folder / "corrupted.mdb")

    held["bad-leaf"] = ids("bad-leaf", 3000)
    nemo_write(folder / "bad-leaf.mdb", held["bad-leaf"])
    lmdb_damage.damage(folder / "bad-leaf.mdb", "leaf")

    held["outside-link"] = ids("outside", 100)
    nemo_write(outside / "target.mdb", held["outside-link"])
    (folder / "outside-link.mdb").symlink_to(outside / "target.mdb")

    held["dangling"] = []
    (folder / "dangling.mdb").symlink_to(outside / "dangling-target.mdb")
    return held


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def measure(base: Path) -> DamagedResult:
    data, outside = base / "data", base / "outside"
    held = build(data, outside)
    before = {p.name: _digest(p) for p in outside.iterdir()}
    with serve(data, settle_ms=0) as server:
        with httpx.Client(base_url=server.http_url, timeout=60) as http:
            status = http.get(f"/v1/checkpoints/{CHECKPOINT}").json()
        reported_paths = [
            e["data"].get("path", "") for e in events(server.http_url, CHECKPOINT, "unreadable_file")
        ]
        reported = {Path(p).stem for p in reported_paths}
        all_ids = [sid for stem_ids in held.values() for sid in stem_ids]
        with tally.Client(server.grpc_address, timeout=60) as client:
            answer = dict(zip(all_ids, client.are_completed(CHECKPOINT, all_ids), strict=True))
            # Writers whose ids name the symlinks complete a source each: their files are the links.
            # So does the writer of the file with a bad leaf (its file is moved aside, not walked).
            blocked = {}
            for writer_id in ("outside-link", "dangling", "bad-leaf"):
                try:
                    with client.writer(CHECKPOINT, writer_id=writer_id) as w:
                        w.apply_deltas([(f"0_{writer_id}-new", f"{writer_id}-new", 1)])
                        w.apply_deltas([(f"0_{writer_id}-new_0", f"{writer_id}-new", -1)])
                        w.flush(timeout=10)
                except tally.TallyError as err:
                    blocked[writer_id] = err.code.value
    silently_lost = {sid for stem in DAMAGED if stem not in reported for sid in held[stem] if not answer[sid]}
    good_missing = {sid for stem in GOOD for sid in held[stem] if not answer[sid]}
    after = {p.name: _digest(p) for p in outside.iterdir() if p.is_file()}
    return DamagedResult(
        damaged=len(DAMAGED),
        reported=reported & set(DAMAGED),
        silently_lost=silently_lost,
        good_missing=good_missing,
        created_outside=sorted(set(after) - set(before)),
        modified_outside=sorted(n for n in before if n in after and after[n] != before[n]),
        unreadable_count=int(status["unreadable_files"]),
        writers_blocked=blocked,
    )


def run() -> Row:
    row = Row("damaged_files")
    with scratch("damaged") as base:
        result = measure(base)
    row.lost = len(result.silently_lost) + len(result.good_missing)
    row.outside = len(result.created_outside) + len(result.modified_outside)
    row.notes.append(
        f"reported unreadable {len(result.reported)}/{result.damaged} "
        f"(status unreadable_files={result.unreadable_count})"
    )
    unreported = sorted(set(DAMAGED) - result.reported)
    if unreported:
        row.notes.append("not reported: " + ", ".join(unreported))
    if result.silently_lost:
        row.notes.append(f"{len(result.silently_lost):,} ids silently lost")
    if result.created_outside:
        row.notes.append("created outside: " + ", ".join(result.created_outside))
    if result.modified_outside:
        row.notes.append("written outside: " + ", ".join(result.modified_outside))
    row.check(not unreported, f"{len(unreported)} damaged files not reported unreadable")
    row.check(
        not result.writers_blocked,
        "writers whose file is a symlink could not complete: "
        + ", ".join(f"{w} ({code})" for w, code in result.writers_blocked.items()),
    )
    row.figures.update(
        reported=sorted(result.reported),
        silently_lost=len(result.silently_lost),
        good_missing=len(result.good_missing),
        created_outside=result.created_outside,
        modified_outside=result.modified_outside,
    )
    return row
