"""A small real filesystem for the tests that fill a disk or turn it read-only: a private tmpfs.

Mounting needs root: without it (or where the kernel refuses the mount) the test is skipped,
saying so.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def mount(*args: str) -> None:
    """Run ``mount`` with ``args``; skip the test, saying why, if it cannot."""
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); this test needs root")


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (as mount takes it: ``512k``, ``8m``) at ``where``, unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    where.mkdir()
    mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where))
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


class Filler:
    """Takes every free block of a volume but ``leave`` bytes, and gives them back on demand."""

    def __init__(self, volume: Path) -> None:
        self.path = volume / "filler"

    def fill(self, leave: int = 0) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * 4096)
        finally:
            os.close(fd)
        if leave:
            os.truncate(self.path, os.path.getsize(self.path) - leave)
        free = os.statvfs(self.path.parent)
        assert free.f_bavail * free.f_frsize == leave

    def free(self) -> None:
        self.path.unlink()
