"""DataDirLock on a real directory: exclusive, names its holder, survives a stale lock file."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tally_server.store.datadir_lock import DataDirInUse, DataDirLock

# Holds the lock in another process until its stdin closes.
HOLDER = """
import sys
from tally_server.store.datadir_lock import DataDirLock
lock = DataDirLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
sys.stdin.read()
"""


def test_a_second_lock_is_refused_naming_the_holder(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with DataDirLock(data_dir):
        holder = json.loads((data_dir / ".tally.lock").read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()

        with pytest.raises(DataDirInUse) as refused:
            DataDirLock(data_dir).acquire()

    message = str(refused.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
    assert str(data_dir) in message and "--data-dir" in message
    assert "\n" not in message
    DataDirLock(data_dir).acquire()  # released on exit


def test_a_lock_held_by_another_process_is_refused_until_it_ends(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    command = [sys.executable, "-c", HOLDER, str(data_dir)]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            with pytest.raises(DataDirInUse, match=f"pid {holder.pid} "):
                DataDirLock(data_dir).acquire()
        finally:
            holder.kill()  # no clean-up in the holder: the kernel releases the lock
            holder.wait(30)

    # The lock file is still there with the dead holder's details; it does not block.
    assert json.loads((data_dir / ".tally.lock").read_text())["pid"] == holder.pid
    with DataDirLock(data_dir):
        assert json.loads((data_dir / ".tally.lock").read_text())["pid"] == os.getpid()


def test_a_link_at_the_lock_name_is_refused(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / ".tally.lock").symlink_to(tmp_path / "elsewhere")

    with pytest.raises(OSError):
        DataDirLock(data_dir).acquire()

    assert not (tmp_path / "elsewhere").exists()
