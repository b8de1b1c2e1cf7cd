"""glibc's allocator, tuned and trimmed through one handle on the C library (tally_server.malloc).

``tally serve`` fixes glibc's mmap threshold, unless the operator set it, and gives freed heap
memory back after loads and merges; neither does anything where the C library is not glibc.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from tally_server import malloc

SCRIPT = "from tally_server import malloc; print(malloc.fix_mmap_threshold())"

# Fills a heap with ~64 MB of 1 KB blocks (malloc's, not pymalloc's: over 512 bytes), keeps one
# block allocated after them so that glibc cannot trim the heap's top by itself on free, frees
# the rest and prints RssAnon (kB) before and after release_freed_memory().
TRIM_SCRIPT = """
from pathlib import Path
from tally_server import malloc

def anon_kb():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

blocks = [bytes(1000) + bytes([i % 256]) for i in range(64_000)]
pin = bytes(1000) + b"pin"
del blocks
before = anon_kb()
malloc.release_freed_memory()
print(before, anon_kb())
"""


def run(env: dict[str, str], script: str = SCRIPT) -> str:
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_threshold_is_fixed_on_glibc() -> None:
    assert run({}) == "True"


def test_an_operators_own_threshold_is_left_alone() -> None:
    assert run({"MALLOC_MMAP_THRESHOLD_": "262144"}) == "False"


def test_freed_heap_memory_goes_back_to_the_system() -> None:
    before_kb, after_kb = map(int, run({}, TRIM_SCRIPT).split())
    assert before_kb - after_kb > 32_000, f"RssAnon {before_kb} kB -> {after_kb} kB"


@pytest.fixture
def not_linux(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    malloc._glibc.cache_clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    yield
    malloc._glibc.cache_clear()


@pytest.mark.usefixtures("not_linux")
def test_nothing_is_called_where_the_c_library_is_not_glibc() -> None:
    assert malloc._glibc() is None
    assert malloc.fix_mmap_threshold() is False
    malloc.release_freed_memory()  # a no-op, and no error


def test_the_c_library_is_loaded_once() -> None:
    assert malloc._glibc() is not None
    assert malloc._glibc() is malloc._glibc()
