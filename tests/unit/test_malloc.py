"""``tally serve`` fixes glibc's mmap threshold, unless the operator set it (tally_server.malloc)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = "from tally_server import malloc; print(malloc.fix_mmap_threshold())"


def run(env: dict[str, str]) -> str:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_threshold_is_fixed_on_glibc() -> None:
    assert run({}) == "True"


def test_an_operators_own_threshold_is_left_alone() -> None:
    assert run({"MALLOC_MMAP_THRESHOLD_": "262144"}) == "False"
