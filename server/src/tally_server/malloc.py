"""Keep glibc's allocator from holding freed memory as resident memory the server never uses.

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

What the heaps hold once freed anyway (a load's keys, the sessions of writers that closed) goes
back to the system with ``release_freed_memory``. Both calls are glibc's own (``mallopt``,
``malloc_trim``), made through one handle on the C library, and do nothing elsewhere.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

log = logging.getLogger(__name__)

# mallopt(3)'s parameter number (glibc's malloc.h) and the value set.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (loaded once, its functions typed); None for any other."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        # glibc only (musl has no such functions).
        version, mallopt, malloc_trim = libc.gnu_get_libc_version, libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    version.argtypes, version.restype = [], ctypes.c_char_p
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at 1 MiB (no dynamic rise); returns whether it was set here.

    Left alone where the allocator is not glibc's, or where ``MALLOC_MMAP_THRESHOLD_`` is set (the
    operator's own choice, read by glibc at start).
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _glibc()
    if libc is None:
        return False
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        log.warning("could not fix glibc %s's mmap threshold", libc.gnu_get_libc_version().decode())
        return False
    return True


def release_freed_memory() -> None:
    """Give the memory glibc's heaps hold free back to the system (nothing where it is not glibc).

    glibc keeps it otherwise: the keys a load read while hashing would stay resident, several
    times the index itself. ``malloc_trim`` walks every heap (a few milliseconds): call it off the
    event loop.
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
