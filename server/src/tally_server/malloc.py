"""Keep glibc's allocator from holding large freed blocks as resident memory the server never uses.

glibc serves an allocation of ``M_MMAP_THRESHOLD`` bytes or more with a mapping of its own (its
pages resident only once touched, given back whole when freed), and anything smaller from its
heaps. The threshold starts at 128 KiB but rises to the size of each mapped block freed (up to
32 MiB): after the coordinator's first large temporaries (a batch's columns, a merge of a
checkpoint's index) it is several MiB, and blocks below it come from the heaps, where freed
memory stays resident. LMDB allocates about 3 MiB of page lists for every environment opened for
writing and touches a few KiB of them: from a fresh mapping that is a few KiB of resident memory;
from a heap, recycled memory that is resident already and now pinned while the file stays open.
Measured with ``tally serve`` (bench/README.md, "Memory per checkpoint"): 64 checkpoints with one
completion each added 123 MB of anonymous memory, 2 MB with the threshold fixed at 1 MiB, and
throughput did not move.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

# mallopt(3)'s parameter number (glibc's malloc.h) and the value set.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at 1 MiB (no dynamic rise); returns whether it was set here.

    Left alone where the allocator is not glibc's, or where ``MALLOC_MMAP_THRESHOLD_`` is set (the
    operator's own choice, read by glibc at start).
    """
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        gnu_get_libc_version = libc.gnu_get_libc_version  # glibc only (musl has no such function)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    gnu_get_libc_version.restype = ctypes.c_char_p
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        log.warning("could not fix glibc %s's mmap threshold", gnu_get_libc_version().decode())
        return False
    return True
