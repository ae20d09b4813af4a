"""Host memory behaviour of the engine's process: big tensors without page-fault storms.

Every request allocates its KV cache and reads chunk files into fresh buffers (hundreds
of MB), and every layer makes temporaries of a few MB. Left to glibc's defaults, blocks
over its mmap threshold (32 MB at most) are mapped fresh and unmapped on free, so each
request pays a page fault per 4 KiB of its cache again; with torch's transparent huge
pages on (THP_MEM_ALLOC_ENABLE) the faults are per 2 MiB, but then even a 4 MB
temporary is mapped, faulted and unmapped every layer (silu*up on [633, 1536]: 0.45 ms
without, 2.2 ms with). Keeping freed memory in the heap (no mmap for big blocks, no
trimming) makes a block that is freed and allocated again cost nothing, and huge pages
then only lower the first touch: the same product takes 0.65 ms, and a 202 MB cache is
allocated and filled in 13 ms instead of 46 (python bench/host_memory_bench.py). One
arena for every thread, so the buffer a reader thread frees is the one the next reader
gets (with an arena per thread each kept its own and faulted in fresh pages: 8 chunk
files of 8 x 512 tokens took 0.10 s to read from the page cache, now 0.04 s).

The price is that the heap keeps its free pages: with requests of different sizes in
flight together, holes open in it and RSS creeps up to the largest mix ever seen (17.5%
over a 10-minute soak with 4 clients). `trim_host_heap()` hands the free pages back
(glibc's malloc_trim, under a millisecond); the scheduler calls it when it goes idle and
every few seconds under load, so only the pages freed since are faulted in again.
`RAGKV_HOST_ALLOCATOR=default` leaves glibc as it is; an explicit THP_MEM_ALLOC_ENABLE wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_KEEP_BLOCKS_UP_TO = 1 << 30  # bytes: blocks up to this size come from (and return to) the heap


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "gnu_get_libc_version"):  # glibc's parameters only
        return None
    return libc


_LIBC = _glibc()


def tune_host_allocator() -> bool:
    """Huge pages for torch's big CPU blocks, and glibc keeping freed blocks for reuse.

    Call before torch's first large allocation. Returns whether glibc was tuned (False on
    other C libraries, or when RAGKV_HOST_ALLOCATOR=default).
    """
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if os.environ.get("RAGKV_HOST_ALLOCATOR", "tuned") == "default":
        return False
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is None:
        return False
    return (bool(mallopt(_M_ARENA_MAX, 1)) and bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BLOCKS_UP_TO))
            and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)))


def trim_host_heap() -> bool:
    """Give the heap's free pages back to the OS; True if any were (False off glibc).

    Blocks in use stay where they are; a freed page is faulted in again on its next use.
    """
    trim = getattr(_LIBC, "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False
