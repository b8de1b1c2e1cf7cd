"""Disk full: the data dir on an 8 MB tmpfs (root only), filled by a file this scenario owns.

1. Writers complete sources while there is room (acknowledged by flush()).
2. The disk is filled; writers keep completing sources until a commit fails (LMDB reuses its own
   free pages for a while). Then, while commits fail: writers keep trying (flush must fail
   UNAVAILABLE, never INTERNAL, saying the disk is full), a new writer opens (UNAVAILABLE, not
   INTERNAL), /readyz is asked (503 while commits fail), and the log's growth is measured (a
   failing commit must not log a line every 50 ms, and a full disk no traceback at all: its
   message says what is wrong and what to do).
3. The filler is deleted: time until each writer's flush() succeeds again.
4. The disk is filled but for 4 KB while a writer that has completed nothing yet completes its
   first source, so its completion file is created on a nearly full disk; space returns; that
   writer must be able to complete, and the others must not be blocked by its file.
5. Every acknowledged completion is completed (live view and the NeMo files read independently).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import tally
from tests.integration.workload import tree
from tests.nemo_format import nemo_read

from .common import Row, is_root, scratch, serve, traceback_ends

CHECKPOINT = "fault/disk"
TMPFS_SIZE = "8m"
ROUND = 40
RECOVERY_TIMEOUT_S = 20.0
FULL_PHASE_S = 6.0  # how long writers keep failing before space returns (the log is measured over it)
FILL_TIMEOUT_S = 60.0  # writers complete sources on the full disk until a commit fails, at most this long


@dataclass
class DiskFullResult:
    acknowledged: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)
    codes: dict[str, int] = field(default_factory=dict)  # "flush UNAVAILABLE" -> count
    messages_while_full: list[str] = field(default_factory=list)  # refusals of open and flush
    open_while_full: str = ""
    readyz_while_full: int = 0
    log_bytes_per_s: float = 0.0
    tracebacks_per_s: float = 0.0
    traceback_ends: dict[str, int] = field(default_factory=dict)  # exception line -> count, while full
    recovery_s: dict[str, float | None] = field(default_factory=dict)  # writer -> seconds, None = never
    others_after_late: dict[str, str] = field(default_factory=dict)

    def count(self, what: str) -> None:
        self.codes[what] = self.codes.get(what, 0) + 1

    @property
    def internal(self) -> int:
        return sum(n for what, n in self.codes.items() if what.endswith(("INTERNAL", "UNKNOWN")))


def says_disk_full(message: str) -> bool:
    text = message.lower()
    return "disk" in text or "space" in text


def fill(path: Path, leave: int = 0) -> None:
    """Append zeros to ``path`` until the file system is full, then give back ``leave`` bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            block = b"\0" * size
            try:
                while True:
                    os.write(fd, block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
        if leave:
            os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    finally:
        os.close(fd)


class _Writers:
    """SDK writers of the checkpoint, each completing rounds of fresh sources."""

    def __init__(self, client: tally.Client, result: DiskFullResult, recovery_s: float) -> None:
        self.client = client
        self.recovery_s = recovery_s
        self.result = result
        self.writers: dict[str, tally.Writer] = {}
        self.counter = 0
        self.refusals: list[str] = []

    def open(self, writer_id: str) -> str:
        try:
            w = self.client.writer(CHECKPOINT, writer_id=writer_id)
            w.open()
        except tally.TallyError as err:
            self.refusals.append(err.message)
            return err.code.value
        self.writers[writer_id] = w
        return "OK"

    def round(self, writer_id: str, n: int = ROUND, timeout: float = 10) -> str:
        """Complete ``n`` new sources and flush; returns "OK" or the error code."""
        w = self.writers[writer_id]
        sources = [f"{writer_id}-s{self.counter + i}" for i in range(n)]
        self.counter += n
        for sid in sources:
            w.apply_deltas(tree(sid))
        try:
            w.flush(timeout=timeout)
        except tally.TallyError as err:
            self.refusals.append(err.message)
            return err.code.value
        self.result.acknowledged.update(sources)
        return "OK"

    def flushes_while_full(self) -> list[str]:
        """One round of each of w0 and w1; returns their outcomes (also counted)."""
        codes = [self.round(writer_id, timeout=2) for writer_id in ("w0", "w1")]
        for code in codes:
            self.result.count(f"flush {code}")
        return codes

    def recover(self, writer_id: str, since: float) -> float | None:
        """Seconds from ``since`` until a flush() of the writer succeeds, or None within the timeout."""
        if writer_id not in self.writers:
            return None
        while time.monotonic() - since < self.recovery_s:
            try:
                self.writers[writer_id].flush(timeout=5)
            except tally.LeaseLost:
                return None
            except tally.TallyError:
                continue  # still failing: flush again, as the error says
            return time.monotonic() - since
        return None

    def close(self) -> None:
        for w in self.writers.values():
            try:
                w.close(timeout=10)
            except tally.TallyError:
                pass  # what it left open is not acknowledged, so not counted


def measure(
    base: Path, tmpfs: Path, full_phase_s: float = FULL_PHASE_S, recovery_s: float = RECOVERY_TIMEOUT_S
) -> DiskFullResult:
    """Run the phases; ``tmpfs`` is mounted, ``base/data/checkpoints`` is bound to ``tmpfs/checkpoints``.

    The completion files and the registry share the small file system; the server's log stays in
    ``base/data`` on the ordinary disk, so it can be read (and cannot fill the tmpfs itself).
    """
    result = DiskFullResult()
    data = base / "data"
    filler = tmpfs / "filler"
    registry = f"sqlite:///{tmpfs / 'registry.sqlite3'}"
    with (
        serve(data, lease_ttl_s=30, registry_url=registry) as server,
        tally.Client(server.grpc_address, timeout=10) as client,
    ):
        writers = _Writers(client, result, recovery_s)
        for writer_id in ("w0", "w1", "late"):
            writers.open(writer_id)
        for _ in range(3):
            for writer_id in ("w0", "w1"):
                writers.round(writer_id)

        # Full. LMDB reuses its own free pages, so a few commits may still fit: write until one fails.
        fill(filler)
        writers.refusals.clear()
        deadline = time.monotonic() + FILL_TIMEOUT_S
        while not any(code != "OK" for code in writers.flushes_while_full()) and time.monotonic() < deadline:
            pass
        # Now completions are failing: ask everything else, and measure the log meanwhile.
        log_start, started = len(server.log()), time.monotonic()
        result.open_while_full = writers.open("during")
        if result.open_while_full != "OK":
            result.count(f"OpenWriter {result.open_while_full}")
        with httpx.Client(base_url=server.http_url, timeout=30) as http:
            result.readyz_while_full = http.get("/readyz").status_code
        while time.monotonic() - started < full_phase_s:
            writers.flushes_while_full()
        result.messages_while_full = list(writers.refusals)
        full_log = server.log()[log_start:]
        elapsed = time.monotonic() - started
        result.log_bytes_per_s = len(full_log.encode()) / elapsed
        result.traceback_ends = traceback_ends(full_log)
        result.tracebacks_per_s = sum(result.traceback_ends.values()) / elapsed

        # Space returns: how long until flush() succeeds again.
        filler.unlink()
        freed = time.monotonic()
        for writer_id in ("w0", "w1"):
            result.recovery_s[writer_id] = writers.recover(writer_id, freed)
            writers.round(writer_id)

        # 4 KB free while a writer's completion file is created; then space returns.
        fill(filler, leave=4096)
        result.count(f"first completion on 4 KB free: {writers.round('late', n=1, timeout=5)}")
        filler.unlink()
        freed = time.monotonic()
        result.recovery_s["late (file created on 4 KB)"] = writers.recover("late", freed)
        # A broken file of one writer must not block the others' commits.
        result.others_after_late = {w: writers.round(w, timeout=min(recovery_s, 5)) for w in ("w0", "w1")}

        acknowledged = sorted(result.acknowledged)
        answer = client.are_completed(CHECKPOINT, acknowledged)
        live = {sid for sid, done in zip(acknowledged, answer, strict=True) if done}
        writers.close()
    files = nemo_read(data / "checkpoints" / CHECKPOINT)
    result.lost = result.acknowledged - (live & files)
    return result


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True)


@contextlib.contextmanager
def mounted(base: Path) -> Iterator[Path]:
    """Mount the tmpfs at ``base/tmpfs`` and bind its ``checkpoints`` into ``base/data``; always undone."""
    tmpfs, bound = base / "tmpfs", base / "data" / "checkpoints"
    tmpfs.mkdir()
    bound.mkdir(parents=True)
    mounts: list[Path] = []
    try:
        _run("mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tally-fault", str(tmpfs))
        mounts.append(tmpfs)
        (tmpfs / "checkpoints").mkdir()
        _run("mount", "--bind", str(tmpfs / "checkpoints"), str(bound))
        mounts.append(bound)
        yield tmpfs
    finally:
        for mount in reversed(mounts):
            _unmount(mount)


def _unmount(mount: Path) -> None:
    for args in (["umount", str(mount)], ["umount", "-l", str(mount)]):
        if subprocess.run(args, capture_output=True).returncode == 0:
            return


def unavailable_reason() -> str | None:
    """Why the scenario cannot run here, or None."""
    if not is_root():
        return "needs root (mounts a tmpfs)"
    if not shutil.which("mount") or not shutil.which("umount"):
        return "mount/umount not installed"
    return None


def run(full_phase_s: float = FULL_PHASE_S, recovery_s: float = RECOVERY_TIMEOUT_S) -> Row:
    row = Row("disk_full")
    reason = unavailable_reason()
    if reason:
        row.skipped = reason
        return row
    with scratch("diskfull") as base:
        try:
            with mounted(base) as tmpfs:
                result = measure(base, tmpfs, full_phase_s, recovery_s)
        except subprocess.CalledProcessError as exc:
            row.skipped = f"cannot mount a tmpfs: {exc.stderr.strip()}"
            return row
    row.lost = len(result.lost)
    row.errors = result.internal
    codes = ", ".join(f"{what} x{n}" for what, n in sorted(result.codes.items()))
    recovery = ", ".join(f"{w} {'never' if s is None else f'{s:.1f}s'}" for w, s in result.recovery_s.items())
    blocked = sorted(w for w, code in result.others_after_late.items() if code != "OK")
    row.notes += [
        f"{len(result.acknowledged):,} acked; {codes}",
        f"/readyz while full: {result.readyz_while_full}",
        f"log while full: {result.log_bytes_per_s / 1024:.1f} KB/s, "
        f"{result.tracebacks_per_s:.1f} tracebacks/s",
        f"recovery after space returned: {recovery}",
    ]
    if blocked:
        row.notes.append(f"after late's file broke, commits of {', '.join(blocked)} failed too")
    for end, n in sorted(result.traceback_ends.items(), key=lambda item: -item[1]):
        row.notes.append(f"traceback while full (x{n}): {end}")
    if result.messages_while_full:
        row.notes.append(f"first refusal while full: {result.messages_while_full[0][:200]}")
    unexplained = [m for m in result.messages_while_full if not says_disk_full(m)]
    row.check(not unexplained, f"{len(unexplained)} refusals while full do not say the disk is full")
    row.check(
        result.readyz_while_full == 503, f"/readyz answered {result.readyz_while_full} while commits failed"
    )
    never = [w for w, s in result.recovery_s.items() if s is None]
    row.check(not never, f"never recovered after space returned: {', '.join(never)}")
    row.check(not blocked, f"one writer's broken file blocked the commits of {', '.join(blocked)}")
    row.check(
        not result.traceback_ends,
        f"{sum(result.traceback_ends.values())} tracebacks in the log while full (a full disk is logged "
        "by its reason alone)",
    )
    row.figures["result"] = result
    return row
